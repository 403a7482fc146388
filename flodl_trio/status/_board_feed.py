"""The status page's live feed: ``GET /events`` as Server-Sent Events, one stream per viewer.

One ticker computes the page's document once per ``tick`` for every viewer (and not at all while
nobody watches; less often when one document costs more than :data:`MAX_CPU_SHARE` of a tick)
and offers the encoded message to each viewer's queue of
:data:`VIEWER_QUEUE` messages without waiting. A viewer whose queue is full (its socket does not
take the messages as fast as they come) is dropped and counted: the coordinator never waits on a
viewer. Viewers are capped (``max_viewers``; the next one gets 503 and the page falls back to
polling ``/board.json``), and each stream ends after ``stream_seconds`` (the browser's
``EventSource`` reconnects by itself), so one connection's life stays bounded like every other
request on the status port.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

import h11
import trio

from ..net._transport import STREAM_GONE
from ._board_page import page

log = logging.getLogger("flodl_trio.status")

BoardFn = Callable[[], Mapping[str, Any]]
VIEWER_QUEUE: Final = 2
# The ticker's share of a core at most: when one document takes more CPU time to build than this
# share of the tick (a 16k-rank world on a slow machine), the next tick waits longer instead.
MAX_CPU_SHARE: Final = 0.05
# The browser waits this long before reconnecting after a stream ends.
RETRY_MS: Final = 1000


def encode_document(document: Mapping[str, Any]) -> bytes:
    """The document as compact JSON (no spaces; one line, so one SSE ``data:`` field)."""
    return json.dumps(document, separators=(",", ":"), default=_json_default).encode()


def _json_default(value: object) -> object:
    if isinstance(value, set | frozenset):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


class _Viewer:
    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.send, self.receive = trio.open_memory_channel[bytes](VIEWER_QUEUE)
        self.scope = trio.CancelScope()


class BoardFeed:
    """The viewers of ``/events`` and the ticker that feeds them.

    Args:
        board_fn: builds the page's document (``Coordinator.board``).
        tick: seconds between two documents.
        max_viewers: concurrent ``/events`` streams; the next one is refused with 503.
        stream_seconds: how long one stream lasts before it ends (the browser reconnects).
        write_timeout: the longest a viewer's socket may block one write before it is dropped.
    """

    def __init__(self, board_fn: BoardFn, *, tick: float = 1.0, max_viewers: int = 8,
                 stream_seconds: float = 300.0, write_timeout: float = 5.0) -> None:
        self.board_fn = board_fn
        self.tick = tick
        self.max_viewers = max_viewers
        self.stream_seconds = stream_seconds
        self.write_timeout = write_timeout
        self._viewers: dict[_Viewer, None] = {}
        self._wake = trio.Event()
        self._latest: tuple[float, bytes] | None = None
        self._ticker_scope = trio.CancelScope()
        self.dropped_viewers = 0
        self.refused_viewers = 0
        self.documents = 0

    @property
    def viewers(self) -> int:
        return len(self._viewers)

    def document(self) -> bytes:
        """The current document, encoded: the ticker's if it is younger than a tick (so a
        poller costs nothing more while viewers are connected), else built now."""
        now = trio.current_time()
        if self._latest is not None and now - self._latest[0] < self.tick:
            return self._latest[1]
        return self._build(now)

    def _build(self, now: float) -> bytes:
        payload = encode_document({**self.board_fn(), "viewers": self.viewers,
                                   "dropped_viewers": self.dropped_viewers})
        self.documents += 1
        self._latest = (now, payload)
        return payload

    def close(self) -> None:
        """Stop the ticker and end every stream (each writes the end of its body, then closes)."""
        self._ticker_scope.cancel()
        for viewer in self._viewers:
            viewer.send.close()

    async def run_ticker(self) -> None:
        """Build one document per tick while anyone watches, and offer it to every viewer,
        until :meth:`close`."""
        with self._ticker_scope:
            await self._tick_forever()

    async def _tick_forever(self) -> None:
        while True:
            if not self._viewers:
                self._wake = trio.Event()
                await self._wake.wait()
            began = time.thread_time()
            try:
                payload = self._build(trio.current_time())
            except Exception:  # a broken board_fn must not take the coordinator down
                log.exception("status: building the page's document failed")
                payload = b'{"error":"building the document failed; see the coordinator log"}'
            message = b"data: " + payload + b"\n\n"
            for viewer in list(self._viewers):
                try:
                    viewer.send.send_nowait(message)
                except trio.WouldBlock:
                    self._drop(viewer, f"it did not read its last {VIEWER_QUEUE} messages")
            spent = time.thread_time() - began
            await trio.sleep(max(self.tick, spent / MAX_CPU_SHARE))

    def _drop(self, viewer: _Viewer, why: str) -> None:
        if self._viewers.pop(viewer, 0) is None:
            self.dropped_viewers += 1
            log.info("status: dropped /events viewer %s: %s", viewer.peer, why)
            viewer.scope.cancel()

    def answer(self, path: str) -> tuple[int, bytes, list[tuple[str, str]]]:
        """The one-shot answer to ``GET`` (or ``HEAD``) of ``/``, ``/board.json`` or a ``HEAD``
        of ``/events``."""
        if path == "/":
            body, headers = page()
            return 200, body, headers
        if path == "/board.json":
            return 200, self.document(), [("Content-Type", "application/json"),
                                          ("Cache-Control", "no-store")]
        return 200, b"", [("Content-Type", "text/event-stream; charset=utf-8")]

    def refuse(self) -> str | None:
        """Why a new viewer is refused now (the cap), or None; a refusal is counted."""
        if len(self._viewers) < self.max_viewers:
            return None
        self.refused_viewers += 1
        return (f"expected at most {self.max_viewers} /events viewers, "
                f"{len(self._viewers)} are connected; poll /board.json instead")

    async def stream(self, stream: trio.abc.Stream, conn: h11.Connection, peer: str) -> None:
        """Answer one ``GET /events`` (after :meth:`refuse` said yes) until the stream's time
        is up, the viewer goes away, or it is dropped for being slow."""
        viewer = _Viewer(peer)
        self._viewers[viewer] = None
        self._wake.set()
        try:
            with viewer.scope, trio.move_on_after(self.stream_seconds):
                head = conn.send(h11.Response(status_code=200, reason=b"OK", headers=[
                    ("Content-Type", "text/event-stream; charset=utf-8"),
                    ("Cache-Control", "no-store"), ("X-Content-Type-Options", "nosniff"),
                    ("Connection", "close")])) or b""
                first = b"retry: %d\n\n" % RETRY_MS
                latest = self._latest
                if latest is not None and trio.current_time() - latest[0] < self.tick:
                    first += b"data: " + latest[1] + b"\n\n"  # at once, not after a tick
                await self._write(stream, viewer, head + (conn.send(h11.Data(data=first)) or b""))
                async for message in viewer.receive:
                    await self._write(stream, viewer, conn.send(h11.Data(data=message)) or b"")
            if viewer in self._viewers:  # its time is up: end the body cleanly, then close
                await self._write(stream, viewer, conn.send(h11.EndOfMessage()) or b"")
        except STREAM_GONE as exc:
            log.debug("status: /events viewer %s went away: %s", peer, exc)
        finally:
            self._viewers.pop(viewer, None)

    async def _write(self, stream: trio.abc.Stream, viewer: _Viewer, data: bytes) -> None:
        with trio.move_on_after(self.write_timeout) as scope:
            await stream.send_all(data)
        if scope.cancelled_caught:
            self._drop(viewer, f"one write took over {self.write_timeout}s")
