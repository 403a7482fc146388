"""The HTTP/1.1 status responder of the coordinator port, and a client for it.

Routes: ``GET /state.json`` (the status document as JSON), ``GET /healthz`` (200 ``ok`` while the
phase is ``running``, else 503) and ``GET /metrics`` (Prometheus text exposition); with a
``board_fn``, also the live status page: ``GET /`` (one self-contained HTML page),
``GET /board.json`` (its document) and ``GET /events`` (that document as Server-Sent Events, see
:mod:`flodl_trio.status._board_feed`, the one route whose connection outlives
``request_timeout``, and only after its request head arrived within it); ``HEAD`` answers
like ``GET`` without the body, every other method gets 405 with ``Allow: GET, HEAD``, an unknown
path 404. Every connection
gets exactly one response, then closes; the whole exchange is bounded by ``request_timeout`` and
the request head by ``max_request_bytes``, so a slow or hostile client costs one task for a bounded
time and a bounded amount of memory. ``/metrics`` is written by :mod:`._prometheus`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from functools import partial
from http import HTTPStatus
from typing import Any, Final

import h11
import trio

from .._errors import ConfigError, FlodlError
from ..net._keepalive import KeepAlive, enable_keepalive
from ..net._listen import serve_each
from ..net._transport import STREAM_GONE
from ._board_feed import BoardFeed, BoardFn
from ._prometheus import PROMETHEUS_CONTENT_TYPE, render_prometheus

logger = logging.getLogger("flodl_trio.status")

StateFn = Callable[[], Mapping[str, Any]]

ROUTES: Final = ("/state.json", "/healthz", "/metrics")
BOARD_ROUTES: Final = ("/", "/board.json", "/events")
_RECEIVE_CHUNK: Final = 4096
# After the response, read and discard what the client still sends for at most this long (or
# until request_timeout): closing with unread bytes makes the kernel send RST, and a client that
# is still uploading (a 1 MB header, a POST body) would then lose the response it was sent.
_LINGER_SECONDS: Final = 1.0


async def serve_status(
    listener: trio.abc.Listener[trio.abc.Stream],
    state_fn: StateFn,
    *,
    request_timeout: float,
    max_request_bytes: int = 16384,
    board_fn: BoardFn | None = None,
    board_tick: float = 1.0,
    max_viewers: int = 8,
    stream_seconds: float = 300.0,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer status requests on ``listener`` until it is closed.

    Args:
        listener: usually the port mux's ``status`` leg; any listener of streams works.
        state_fn: returns the status document (``Coordinator.state()``); called once per request.
        request_timeout: seconds one connection may take, from accept to close.
        max_request_bytes: the largest request head accepted; a bigger one gets 431.
        board_fn: returns the status page's document (``Coordinator.board``); without it,
            ``/``, ``/board.json`` and ``/events`` are 404.
        board_tick: seconds between two ``/events`` messages (one document built per tick for
            every viewer, none while nobody watches).
        max_viewers: concurrent ``/events`` streams; the next gets 503 (the page then polls).
        stream_seconds: how long one ``/events`` stream lasts; the browser then reconnects.
        task_status: ``started()`` is called once the accept loop runs.

    Returns:
        Once the listener is closed and the connections in flight are done (each is bounded by
        ``request_timeout``).
    """
    feed = None if board_fn is None else BoardFeed(
        board_fn, tick=board_tick, max_viewers=max_viewers, stream_seconds=stream_seconds,
        write_timeout=request_timeout)
    async with trio.open_nursery() as nursery:
        if feed is not None:
            nursery.start_soon(feed.run_ticker)
        await serve_each(
            listener, partial(_serve_connection, state_fn=state_fn, feed=feed,
                              request_timeout=request_timeout,
                              max_request_bytes=max_request_bytes),
            what="status", task_status=task_status, keepalive=KeepAlive.within(request_timeout),
            handler_nursery=nursery,
        )
        # The listener is closed: one-shot answers finish (each within request_timeout), the
        # /events streams end now, each with a clean end of its body.
        if feed is not None:
            feed.close()


async def _serve_connection(
    stream: trio.abc.Stream, state_fn: StateFn, feed: BoardFeed | None, request_timeout: float,
    max_request_bytes: int
) -> None:
    peer = getattr(stream, "remote_address", None)
    events = False
    try:
        with trio.move_on_after(request_timeout) as scope:
            conn = h11.Connection(h11.SERVER, max_incomplete_event_size=max_request_bytes)
            try:
                request = await _receive_request(stream, conn)
            except h11.RemoteProtocolError as exc:
                status = exc.error_status_hint
                await _send_response(stream, conn, status, HTTPStatus(status).phrase + "\n")
            else:
                if request is None:  # the client closed without sending a request
                    return
                refusal = None
                if feed is not None and request.method == b"GET" and _path(request) == "/events":
                    refusal = feed.refuse()
                    events = refusal is None
                if events:
                    pass  # streamed below, outside request_timeout
                elif refusal is not None:
                    await _send_response(stream, conn, 503, refusal + "\n", [("Retry-After", "5")])
                else:
                    status, body, headers = _answer(request, state_fn, feed)
                    await _send_response(stream, conn, status, body, headers,
                                         head_only=request.method == b"HEAD")
            if not events:
                with trio.move_on_after(_LINGER_SECONDS):
                    await _linger(stream)
        if events and feed is not None:
            await feed.stream(stream, conn, str(peer))
        elif scope.cancelled_caught:
            logger.debug("status: dropped %s after request_timeout=%ss", peer, request_timeout)
    except STREAM_GONE as exc:
        logger.debug("status: connection from %s broke: %s", peer, exc)
    finally:
        await trio.aclose_forcefully(stream)


async def _receive_request(stream: trio.abc.Stream, conn: h11.Connection) -> h11.Request | None:
    while True:  # each round feeds <= _RECEIVE_CHUNK bytes; h11 caps the buffered head
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(bytes(await stream.receive_some(_RECEIVE_CHUNK)))
        elif isinstance(event, h11.Request):
            return event
        else:  # ConnectionClosed before a request
            return None


async def _linger(stream: trio.abc.Stream) -> None:
    if isinstance(stream, trio.abc.HalfCloseableStream):
        await stream.send_eof()
    while await stream.receive_some(_RECEIVE_CHUNK):  # discarded; ends at EOF or deadline
        pass


def _path(request: h11.Request) -> str:
    return request.target.decode("ascii", errors="replace").split("?", 1)[0]


def _answer(
    request: h11.Request, state_fn: StateFn, feed: BoardFeed | None
) -> tuple[int, bytes | str, list[tuple[str, str]]]:
    path = _path(request)
    if path not in ROUTES and (feed is None or path not in BOARD_ROUTES):
        return 404, "not found\n", []
    if request.method not in (b"GET", b"HEAD"):
        method = request.method.decode("ascii", errors="replace")
        return 405, f"method {method} not allowed: GET or HEAD\n", [("Allow", "GET, HEAD")]
    try:
        if feed is not None and path in BOARD_ROUTES:
            return feed.answer(path)
        state = state_fn()
        if path == "/state.json":
            body = json.dumps(state, sort_keys=True, default=_json_default) + "\n"
            return 200, body, [("Content-Type", "application/json")]
        if path == "/metrics":
            return 200, render_prometheus(state), [("Content-Type", PROMETHEUS_CONTENT_TYPE)]
        if state.get("phase") == "running":
            return 200, "ok\n", []
        return 503, f"{state.get('phase', 'unknown')}\n", []
    except Exception:  # a broken state_fn must not take the coordinator down with it
        logger.exception("status: building the response to %s failed", path)
        return 500, "internal error\n", []


def _json_default(value: object) -> object:
    if isinstance(value, set | frozenset):
        return sorted(value)
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


async def _send_response(
    stream: trio.abc.Stream,
    conn: h11.Connection,
    status: int,
    body: bytes | str,
    headers: list[tuple[str, str]] | None = None,
    *,
    head_only: bool = False,
) -> None:
    payload = body.encode() if isinstance(body, str) else body
    all_headers = list(headers or [])
    if not any(name == "Content-Type" for name, _ in all_headers):
        all_headers.append(("Content-Type", "text/plain; charset=utf-8"))
    all_headers += [("Content-Length", str(len(payload))), ("Connection", "close")]
    reason = HTTPStatus(status).phrase.encode()
    data = conn.send(h11.Response(status_code=status, headers=all_headers, reason=reason))
    if not head_only:  # a HEAD answer carries the headers of the GET answer, no body
        data = (data or b"") + (conn.send(h11.Data(data=payload)) or b"")
    data = (data or b"") + (conn.send(h11.EndOfMessage()) or b"")
    await stream.send_all(data)


def _parse_address(address: str | tuple[str, int]) -> tuple[str, int]:
    if isinstance(address, tuple):
        return str(address[0]), int(address[1])
    text = address.strip().removeprefix("http://").rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(f"status address {address!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


# A `timeout` argument (not a caller's cancel scope) on purpose: this is the CLI's one-shot query,
# and its error must name the deadline that passed.
async def fetch_state(
    address: str | tuple[str, int],
    *,
    timeout: float,  # noqa: ASYNC109
    max_response_bytes: int = 16 * 2**20,
) -> dict[str, Any]:
    """GET ``/state.json`` from a coordinator's port and return the decoded document.

    Args:
        address: ``(host, port)`` or ``"host:port"`` (``"[::1]:port"`` for IPv6).
        timeout: seconds for the whole exchange, connect included.
        max_response_bytes: the largest response body accepted.

    Returns:
        The status document.

    Raises:
        ConfigError: ``address`` is not ``HOST:PORT``.
        FlodlError: connecting failed, the deadline passed, the response was not a 200 with a
            JSON object, or it was malformed; the message names the address and what happened.
    """
    host, port = _parse_address(address)
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        with trio.fail_after(timeout):
            stream = await trio.open_tcp_stream(host, port)
            enable_keepalive(stream, KeepAlive.within(timeout))
            async with stream:
                status, body = await _get(stream, where, max_response_bytes)
    except trio.TooSlowError:
        raise FlodlError(f"status {where}: no complete response within {timeout}s") from None
    except (OSError, trio.BrokenResourceError) as exc:
        tried = exc.__cause__.exceptions if isinstance(exc.__cause__, BaseExceptionGroup) \
            else (exc,)
        if all(isinstance(e, ConnectionRefusedError) for e in tried):
            raise FlodlError(f"connection refused: is a coordinator running at {where}?") from exc
        raise FlodlError(f"status {where}: connection failed: {exc}") from exc
    except h11.ProtocolError as exc:
        raise FlodlError(f"status {where}: malformed HTTP response: {exc}") from exc
    if status != 200:
        snippet = body[:200].decode(errors="replace").strip()
        raise FlodlError(f"status {where}: expected 200 from /state.json, got {status} {snippet!r}")
    try:
        document = json.loads(body)
    except ValueError as exc:
        raise FlodlError(f"status {where}: /state.json is not valid JSON: {exc}") from exc
    if not isinstance(document, dict):
        kind = type(document).__name__
        raise FlodlError(f"status {where}: expected a JSON object, got a JSON {kind}")
    return document


async def _get(stream: trio.abc.Stream, where: str, max_body: int) -> tuple[int, bytes]:
    conn = h11.Connection(h11.CLIENT)
    request = h11.Request(
        method="GET",
        target="/state.json",
        headers=[("Host", where), ("Accept", "application/json"), ("Connection", "close")],
    )
    await stream.send_all((conn.send(request) or b"") + (conn.send(h11.EndOfMessage()) or b""))
    status, body, closed = 0, bytearray(), False
    while True:  # bounded by the caller's deadline and by max_body
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            if not closed:
                raise
            event = h11.ConnectionClosed()  # h11's way of saying "EOF mid-response"
        if event is h11.NEED_DATA:
            chunk = bytes(await stream.receive_some(_RECEIVE_CHUNK))
            closed = not chunk
            conn.receive_data(chunk)
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > max_body:
                raise FlodlError(f"status {where}: response body over {max_body} bytes")
        elif isinstance(event, h11.EndOfMessage):
            return status, bytes(body)
        else:
            raise FlodlError(f"status {where}: connection closed before a complete response")
