"""A small JSON-over-HTTP/1.1 client for etcd v3's gRPC gateway (``POST /v3/kv/range`` ...),
on Trio streams with ``h11`` (already a dependency of flodl-trio), plain or TLS.

Why not a gRPC client: the maintained Python etcd clients are thread-bound (grpcio) and would
put every lease renewal on a worker thread; the gateway speaks plain JSON over HTTP/1.1 and
needs nothing but a socket, so the leader's renewals run in its Trio nursery, cancellable and
bounded by Trio deadlines like everything else.

Failover, as etcd's own client balances: a call starts at the endpoint that answered last; each
attempt is bounded by ``attempt_timeout`` (a member that was SIGSTOPped accepts connections but
never answers), then the next endpoint is tried, round and round while some member stalls or
says etcd has no leader (an election), until the call's ``timeout``. A pass on which every
endpoint failed at once (nothing listens) ends the call there. Failures raise
:class:`~flodl_trio.StoreUnavailable` naming each endpoint and why; an error that etcd itself
answered raises :class:`EtcdCallError` (its gRPC code and message); a certificate or a user
either side refuses raises :class:`~flodl_trio.StoreAuthError` at once.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import trio

from .._errors import ConfigError, StoreAuthError, StoreUnavailable
from ._etcd_config import EtcdAccess
from ._etcd_wire import UNAUTHENTICATED, Conn, Failed, answer_problem, exchange, tls_problem

MAX_IDLE = 4  # keep-alive connections kept for reuse, per endpoint
PASS_PAUSE = 0.05  # between two passes over the endpoints while etcd elects a leader
T = TypeVar("T")


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


def endpoint_text(endpoint: tuple[str, int]) -> str:
    host, port = endpoint
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class EtcdHttp:
    """HTTP/1.1 to the endpoints of one etcd cluster, failing over between them, with a small
    pool of keep-alive connections per endpoint so that concurrent calls (a lease renewal and a
    save) never wait for each other.

    Args:
        endpoints: the cluster's client endpoints, (host, port).
        timeout: the bound of a whole call (every attempt on every endpoint).
        attempt_timeout: the bound of one attempt on one endpoint (with one endpoint, attempts
            are bounded by ``timeout``: there is nothing to fail over to).
        access: TLS and the etcd user, if any.
        key_prefix: the keys the caller uses (named when etcd denies a permission).
    """

    def __init__(self, endpoints: Sequence[tuple[str, int]], *, timeout: float,
                 attempt_timeout: float | None = None, access: EtcdAccess | None = None,
                 key_prefix: str = "") -> None:
        if not endpoints:
            raise ConfigError("etcd store: expected at least one endpoint, got none")
        self.endpoints = tuple(endpoints)
        self.timeout = timeout
        self.attempt_timeout = timeout if attempt_timeout is None or len(endpoints) == 1 \
            else min(attempt_timeout, timeout)
        self.access = access if access is not None else EtcdAccess()
        self.key_prefix = key_prefix
        self._current = 0
        self._idle: dict[tuple[str, int], list[Conn]] = {}
        self._token: str | None = None
        self._failures: dict[str, tuple[float, str]] = {}  # endpoint -> (when, why), the latest

    @property
    def current(self) -> str:
        """The endpoint the next call starts at (the one that answered last)."""
        return endpoint_text(self.endpoints[self._current])

    def failures_since(self, since: float) -> str:
        """What went wrong on each endpoint since ``since`` (Trio clock), or ``""``."""
        recent = [f"{where}: {why}" for where, (when, why) in self._failures.items()
                  if when >= since]
        return "etcd " + "; ".join(recent) if recent else ""

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` as JSON to ``path`` and return the decoded answer."""
        data = json.dumps(body).encode()

        async def attempt(endpoint: tuple[str, int]) -> dict[str, Any]:
            return await self._authorised(endpoint, path, data)

        return await self._failover(attempt, path, head="etcd ")

    async def health(self) -> None:
        """Raise :class:`StoreUnavailable` unless some endpoint says it is healthy (it has a
        leader and answers reads); the message names every endpoint and why."""
        async def attempt(endpoint: tuple[str, int]) -> None:
            status, data = await self._exchange(endpoint, "GET", "/health", b"", {})
            try:
                healthy = json.loads(data).get("health") == "true"
            except (ValueError, AttributeError):
                healthy = False
            if status != 200 or not healthy:
                problem = answer_problem(endpoint_text(endpoint), "/health", status, data,
                                         self.access, self.key_prefix)
                if isinstance(problem, StoreAuthError):
                    raise problem
                # no leader (electing, or no quorum): worth another pass
                raise Failed(f"unhealthy (HTTP {status}: {data[:120]!r})", transient=True)

        await self._failover(attempt, "/health", head="expected a healthy etcd, got ")

    async def aclose(self) -> None:
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                await trio.aclose_forcefully(conn.stream)

    # -- internals ----------------------------------------------------------------------------

    async def _failover(self, attempt: Callable[[tuple[str, int]], Awaitable[T]], path: str, *,
                        head: str) -> T:
        """``attempt`` on the endpoint that answered last, then on each next one, round and round
        while a failure may pass (a stall, etcd without a leader), until ``timeout``."""
        end = trio.current_time() + self.timeout
        problems: dict[str, str] = {}
        while True:
            transient = False
            for _ in self.endpoints:
                index = self._current
                endpoint = self.endpoints[index]
                where = endpoint_text(endpoint)
                bound = min(self.attempt_timeout, end - trio.current_time())
                if bound <= 0:
                    break
                try:
                    with trio.fail_after(bound):
                        result = await attempt(endpoint)
                except trio.TooSlowError:
                    why, transient = f"no answer to {path} within {bound:.3g} s", True
                except Failed as exc:
                    why, transient = f"{path} failed: {exc}", transient or exc.transient
                else:
                    self._failures.pop(where, None)
                    self._current = index
                    return result
                problems[where] = why
                self._failures[where] = (trio.current_time(), why)
                if self._current == index:  # another call may have moved on already
                    self._current = (index + 1) % len(self.endpoints)
            left = end - trio.current_time()
            if not transient or left <= 0:
                found = "; ".join(f"{w}: {p}" for w, p in problems.items())
                raise StoreUnavailable(head + (found or f"no answer to {path} within "
                                               f"{self.timeout:g} s"))
            await trio.sleep(min(PASS_PAUSE, left))

    async def _authorised(self, endpoint: tuple[str, int], path: str,
                          data: bytes) -> dict[str, Any]:
        """One call on one endpoint, authenticated when a user is configured: an expired or
        unknown token (simple tokens expire after 5 idle minutes) is renewed and the call sent
        once more (etcd checks the token before it proposes anything: nothing was applied)."""
        for retry in (False, True):
            headers = {}
            if self.access.user is not None:
                if self._token is None:
                    self._token = await self._authenticate(endpoint)
                headers["Authorization"] = self._token
            status, doc = await self._json(endpoint, path, data, headers)
            if not retry and int(doc.get("code", 0) or 0) == UNAUTHENTICATED \
                    and self.access.user is not None:
                self._token = None
                continue
            return self._result(endpoint, path, status, doc)
        raise AssertionError("unreachable")

    async def _authenticate(self, endpoint: tuple[str, int]) -> str:
        body = json.dumps({"name": self.access.user, "password": self.access.password}).encode()
        status, doc = await self._json(endpoint, "/v3/auth/authenticate", body, {})
        token = self._result(endpoint, "/v3/auth/authenticate", status, doc).get("token")
        if not isinstance(token, str) or not token:
            raise StoreAuthError(f"etcd {endpoint_text(endpoint)}: expected a token from "
                                 f"/v3/auth/authenticate for user {self.access.user!r}, got "
                                 f"{str(doc)[:120]}")
        return token

    async def _json(self, endpoint: tuple[str, int], path: str, data: bytes,
                    headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
        status, raw = await self._exchange(endpoint, "POST", path, data, headers)
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            problem = answer_problem(endpoint_text(endpoint), path, status, raw, self.access,
                                     self.key_prefix)
            raise problem if problem is not None else StoreUnavailable(
                f"etcd {endpoint_text(endpoint)}: expected a JSON object from {path}, got "
                f"HTTP {status} with {raw[:80]!r}")
        return status, doc

    def _result(self, endpoint: tuple[str, int], path: str, status: int,
                doc: dict[str, Any]) -> dict[str, Any]:
        if status != 200 or "error" in doc:
            raise answer_problem(endpoint_text(endpoint), path, status, doc, self.access,
                                 self.key_prefix) or EtcdCallError(
                f"etcd {endpoint_text(endpoint)}: {path} failed: "
                f"{doc.get('message') or doc.get('error') or f'HTTP {status}'}",
                code=int(doc.get("code", 0) or 0))
        result = doc.get("result", doc)  # streaming calls (lease keepalive) wrap their answer
        return result if isinstance(result, dict) else {}

    async def _exchange(self, endpoint: tuple[str, int], method: str, path: str, body: bytes,
                        headers: dict[str, str]) -> tuple[int, bytes]:
        """One request on a pooled connection to ``endpoint``, or a new one."""
        pool = self._idle.setdefault(endpoint, [])
        if pool:
            conn = pool.pop()
            try:
                return await self._round_trip(conn, method, path, body, headers)
            except Failed as exc:
                if not exc.unsent:
                    raise
                # the server closed an idle keep-alive connection before reading our request:
                # it was not processed, so send it again on a fresh connection
        return await self._round_trip(await self._connect(endpoint), method, path, body, headers)

    async def _connect(self, endpoint: tuple[str, int]) -> Conn:
        where = endpoint_text(endpoint)
        try:
            stream: trio.abc.Stream = await trio.open_tcp_stream(*endpoint)
        except OSError as exc:
            raise Failed.of(exc) from None
        context = self.access.ssl_context
        if context is not None:
            tls = trio.SSLStream(stream, context, server_hostname=endpoint[0],
                                 https_compatible=True)
            try:
                await tls.do_handshake()
            except trio.BrokenResourceError as exc:
                await trio.aclose_forcefully(tls)
                raise tls_problem(where, exc, self.access) from None
            stream = tls
        return Conn(endpoint, stream)

    async def _round_trip(self, conn: Conn, method: str, path: str, body: bytes,
                          headers: dict[str, str]) -> tuple[int, bytes]:
        ok = False
        try:
            status, data = await exchange(conn, method, path, body, headers,
                                          self.access)
            ok = True
            return status, data
        finally:
            if ok and conn.reusable():
                pool = self._idle.setdefault(conn.endpoint, [])
                pool.append(conn)
                if len(pool) > MAX_IDLE:
                    await trio.aclose_forcefully(pool.pop(0).stream)
            else:
                await trio.aclose_forcefully(conn.stream)
