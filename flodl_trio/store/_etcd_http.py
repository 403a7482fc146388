"""A small JSON-over-HTTP/1.1 client for etcd v3's gRPC gateway (``POST /v3/kv/range`` ...),
on Trio streams with ``h11`` (already a dependency of flodl-trio).

Why not a gRPC client: the maintained Python etcd clients are thread-bound (grpcio) and would
put every lease renewal on a worker thread; the gateway speaks plain JSON over HTTP/1.1 and
needs nothing but a socket, so the leader's renewals run in its Trio nursery, cancellable and
bounded by Trio deadlines like everything else.

Every call is bounded by ``timeout``; a call that fails on one endpoint moves to the next.
Failures raise :class:`~flodl_trio.StoreUnavailable` naming the endpoint and the cause; an
error that etcd itself answered raises :class:`EtcdCallError` (its gRPC code and message).
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Sequence
from typing import Any

import attrs
import h11
import trio

from .._errors import ConfigError, StoreUnavailable

MAX_IDLE = 4  # keep-alive connections kept for reuse
MAX_RESPONSE = 16 * 1024 * 1024  # a state is at most etcd's 1.5 MiB request limit, base64'd


class EtcdCallError(StoreUnavailable):
    """etcd answered a request with an error (``code`` is its gRPC status code; 5 = not found,
    e.g. a lease that expired)."""

    def __init__(self, message: str, *, code: int) -> None:
        super().__init__(message)
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_call_error, (str(self), self.code))


def _rebuild_call_error(message: str, code: int) -> EtcdCallError:
    return EtcdCallError(message, code=code)


def b64(data: bytes | str) -> str:
    """etcd's gateway carries keys and values as base64 text."""
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode("ascii")


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text or "")


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT`` or ``http://HOST:PORT`` -> (host, port)."""
    spec = text.strip()
    if spec.startswith("http://"):
        spec = spec[len("http://"):].rstrip("/")
    elif "://" in spec:
        raise ConfigError(f"etcd endpoint {text!r}: expected HOST:PORT or http://HOST:PORT "
                          f"(TLS endpoints are not supported)")
    host, sep, port = spec.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"etcd endpoint {text!r}: expected HOST:PORT with a port in 1..65535")
    return host, int(port)


def endpoint_text(endpoint: tuple[str, int]) -> str:
    host, port = endpoint
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@attrs.define(eq=False)
class _Conn:
    endpoint: tuple[str, int]
    stream: trio.abc.Stream
    h11: h11.Connection = attrs.field(factory=lambda: h11.Connection(h11.CLIENT))
    used: bool = False


class EtcdHttp:
    """HTTP/1.1 to one of ``endpoints`` (the first that answers; a failure moves to the next),
    with a small pool of keep-alive connections so that concurrent calls (a lease renewal and a
    save) never wait for each other."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], *, timeout: float) -> None:
        if not endpoints:
            raise ConfigError("etcd store: expected at least one endpoint, got none")
        self.endpoints = tuple(endpoints)
        self.timeout = timeout
        self._current = 0
        self._idle: list[_Conn] = []

    @property
    def current(self) -> str:
        return endpoint_text(self.endpoints[self._current])

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` as JSON to ``path`` and return the decoded answer."""
        status, data, where = await self._request("POST", path, json.dumps(body).encode())
        try:
            doc = json.loads(data)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            raise StoreUnavailable(f"etcd {where}: expected a JSON object from {path}, got "
                                   f"HTTP {status} with {data[:80]!r}")
        if status != 200 or "error" in doc:
            message = doc.get("message") or doc.get("error") or f"HTTP {status}"
            raise EtcdCallError(f"etcd {where}: {path} failed: {message}",
                                code=int(doc.get("code", 0) or 0))
        result = doc.get("result", doc)  # streaming calls (lease keepalive) wrap their answer
        return result if isinstance(result, dict) else {}

    async def health(self) -> None:
        """Raise :class:`StoreUnavailable` unless some endpoint says it is healthy (it has a
        leader and answers reads); the message names every endpoint and why."""
        problems = []
        for _ in self.endpoints:
            try:
                status, data, where = await self._request("GET", "/health", b"", rotate=False)
            except StoreUnavailable as exc:
                problems.append(str(exc).removeprefix("etcd "))
                continue  # _request moved to the next endpoint
            try:
                healthy = json.loads(data).get("health") == "true"
            except (ValueError, AttributeError):
                healthy = False
            if status == 200 and healthy:
                return
            problems.append(f"{where}: unhealthy (HTTP {status}: {data[:120]!r})")
            self._current = (self._current + 1) % len(self.endpoints)
        raise StoreUnavailable("expected a healthy etcd, got " + "; ".join(problems))

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await trio.aclose_forcefully(conn.stream)

    # -- internals ----------------------------------------------------------------------------

    async def _request(self, method: str, path: str, body: bytes, *,
                       rotate: bool = True) -> tuple[int, bytes, str]:
        last: StoreUnavailable | None = None
        for _ in range(len(self.endpoints) if rotate else 1):
            endpoint = self.endpoints[self._current]
            where = endpoint_text(endpoint)
            try:
                with trio.fail_after(self.timeout):
                    status, data = await self._exchange(endpoint, method, path, body)
                return status, data, where
            except trio.TooSlowError:
                last = StoreUnavailable(f"etcd {where}: no answer to {path} within "
                                        f"{self.timeout:g} s")
            except (OSError, trio.BrokenResourceError, h11.ProtocolError,
                    _Truncated) as exc:
                last = StoreUnavailable(f"etcd {where}: {path} failed: {_cause(exc)}")
            self._current = (self._current + 1) % len(self.endpoints)
        assert last is not None
        raise last

    async def _exchange(self, endpoint: tuple[str, int], method: str, path: str,
                        body: bytes) -> tuple[int, bytes]:
        conn = self._take(endpoint)
        if conn is not None:
            try:
                return await self._round_trip(conn, method, path, body)
            except _Truncated as exc:
                if exc.partial:
                    raise
                # the server closed an idle keep-alive connection before reading our request:
                # it was not processed, so send it again on a fresh connection
        stream = await trio.open_tcp_stream(*endpoint)
        return await self._round_trip(_Conn(endpoint, stream), method, path, body)

    def _take(self, endpoint: tuple[str, int]) -> _Conn | None:
        for i, conn in enumerate(self._idle):
            if conn.endpoint == endpoint:
                return self._idle.pop(i)
        return None

    async def _round_trip(self, conn: _Conn, method: str, path: str,
                          body: bytes) -> tuple[int, bytes]:
        ok = False
        try:
            status, data = await self._send_and_read(conn, method, path, body)
            ok = True
            return status, data
        finally:
            if (ok and conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE):
                conn.h11.start_next_cycle()
                conn.used = True
                self._idle.append(conn)
                if len(self._idle) > MAX_IDLE:
                    await trio.aclose_forcefully(self._idle.pop(0).stream)
            else:
                await trio.aclose_forcefully(conn.stream)

    async def _send_and_read(self, conn: _Conn, method: str, path: str,
                             body: bytes) -> tuple[int, bytes]:
        host = endpoint_text(conn.endpoint)
        headers = [("Host", host), ("Content-Length", str(len(body)))]
        if method == "POST":
            headers.append(("Content-Type", "application/json"))
        h = conn.h11
        out = h.send(h11.Request(method=method, target=path, headers=headers)) or b""
        if body:
            out += h.send(h11.Data(data=body)) or b""
        out += h.send(h11.EndOfMessage()) or b""
        await conn.stream.send_all(out)
        status = 0
        chunks: list[bytes] = []
        size = 0
        received = False
        while True:
            event = h.next_event()
            if event is h11.NEED_DATA:
                data = await conn.stream.receive_some(65536)
                if data:
                    received = True
                elif not received and conn.used:
                    raise _Truncated("connection closed before any answer", partial=False)
                h.receive_data(bytes(data))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                size += len(event.data)
                if size > MAX_RESPONSE:
                    raise _Truncated(f"answer over {MAX_RESPONSE} bytes", partial=True)
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return status, b"".join(chunks)
            elif isinstance(event, h11.ConnectionClosed):
                raise _Truncated("connection closed mid-answer", partial=True)


def _cause(exc: BaseException) -> str:
    """The first OS error's text (trio's "all attempts to connect failed" hides it)."""
    seen = exc
    while True:
        if isinstance(seen, OSError) and seen.errno:
            return os.strerror(seen.errno).lower()
        inner = seen.__cause__
        if isinstance(inner, BaseExceptionGroup) and inner.exceptions:
            inner = inner.exceptions[0]
        if inner is None:
            return f"{type(exc).__name__}: {exc}"
        seen = inner


class _Truncated(Exception):
    def __init__(self, message: str, *, partial: bool) -> None:
        super().__init__(message)
        self.partial = partial
