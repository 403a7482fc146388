"""Readers (SPEC §4.3): one task per relay connection turns records into messages.

TIMING goes to ``coord.timing`` (refreshing the sender's liveness clock first), METRICS to
``coord.metrics``; a message that speaks for a rank its relay does not carry is dropped. When a
channel is full the reader waits, and that time does not count towards heartbeat staleness.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from .._errors import AuthError, WireError
from .._transport import STREAM_GONE
from ..events import InvalidFrame, RankExited
from ..timeline import Timeline
from ..wire import (
    Exiting,
    FrameCodec,
    Metrics,
    MsgKind,
    RankDropped,
    RankExit,
    Record,
    RecordKind,
    TimingMsg,
    decode_metrics,
    decode_relay,
    decode_timing,
    frames_before,
)
from ._relayconn import RelayConn
from ._roster import Roster, ranks_text
from .liveness import Liveness

log = logging.getLogger("flodl_trio.coordinator")

# One read takes what a relay sent since the last one, up to this; every record in it is
# decoded and delivered before the next read.
RECEIVE_SIZE = 65536
_DATA = int(RecordKind.DATA)
_CONTROL = int(RecordKind.CONTROL)
_TIMING = int(MsgKind.TIMING)
_METRICS = int(MsgKind.METRICS)


class Readers:
    """The relay connections' readers, and whether any of them is still reading."""

    def __init__(
        self,
        *,
        roster: Roster[RelayConn],
        liveness: Liveness,
        codec: FrameCodec,
        timeline: Timeline,
        timing: trio.MemorySendChannel[TimingMsg],
        metrics: trio.MemorySendChannel[Metrics],
    ) -> None:
        self._roster = roster
        self._liveness = liveness
        self._codec = codec
        self._timeline = timeline
        self._timing = timing
        self._metrics = metrics
        self._active = 0
        self._idle = trio.Event()
        self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no reader is running (every relay connection reached its end)."""
        await self._idle.wait()

    async def read_relay(self, conn: RelayConn) -> None:
        self._active += 1
        self._idle = trio.Event() if self._active == 1 else self._idle
        cause: str | None = None
        try:
            # Records that came in the same read as the relay's Ready are in the opener already.
            first = conn.opener.feed(b"")
            if first:
                await self.act_on(conn, first)
            while cause is None:
                data = await conn.stream.receive_some(RECEIVE_SIZE)
                if not data:
                    err = conn.opener.eof_error(f"relay {conn.host!r}")
                    cause = (str(err) if err is not None
                             else "connection closed by the relay (EOF)")
                    break
                try:
                    records = conn.opener.feed(data)
                except WireError as exc:
                    # Records authenticated before the bad one are acted on; then it ends.
                    await self.act_on(conn, frames_before(exc))
                    raise
                await self.act_on(conn, records)
        except AuthError as exc:
            cause = f"authentication failure: {exc}"
        except WireError as exc:
            cause = f"protocol error: {exc}"
        except trio.BrokenResourceError as exc:
            cause = (f"connection reset ({exc.__cause__!r})" if exc.__cause__
                     else "connection reset")
        except trio.ClosedResourceError:
            cause = "connection closed"
        finally:
            conn.reader_done.set()
            self._active -= 1
            if self._active == 0:
                self._idle.set()
        if cause is not None and conn.lost_reason is None:
            self._liveness.relay_lost(conn, cause)

    async def act_on(self, conn: RelayConn, records: list[Record]) -> None:
        """Decode and deliver every record of one read before reading again.

        Plain calls per record; the reader checkpoints only where a channel is full (a
        coroutine per record per layer cost more than the decode). Records of one read
        arrived together, so they share one clock reading, taken again after a wait.
        """
        now = trio.current_time()
        for rec in records:
            if rec.kind == _DATA:
                item = self.on_frame(conn, rec, now)
                if item is None:
                    continue
                send, msg = item
                try:
                    send.send_nowait(msg)
                except trio.WouldBlock:
                    if not self._roster.shutting_down:
                        await self.deliver_when_room(conn, send, msg)
                        now = trio.current_time()
                    # else: nobody is reading any more; never block shutdown on it
                except STREAM_GONE:
                    pass
            elif rec.kind == _CONTROL:
                self.on_relay_control(conn, rec.payload)
            else:
                self.invalid(conn, rec.rank, f"record of kind {rec.kind}, which only flows "
                             "coordinator→relay", category="wrong direction")

    def invalid(self, conn: RelayConn, rank: int, reason: str, *, category: str) -> None:
        """Count a dropped frame; only a rate-limited few become a WARNING and an event (one
        each let a relay with the salt turn 100k forged frames into 19.6 MB of log, and evict
        the real events from the bounded timeline)."""
        report = self._roster.invalid_frame(
            category, f"{conn.describe()}, rank {rank}: {reason}", trio.current_time())
        if report is None:
            return
        log.warning("frame dropped: %s", report.text())
        self._timeline.event(InvalidFrame(rank=rank, host=conn.host, reason=report.text()))

    def on_frame(self, conn: RelayConn, rec: Record,
                 now: float) -> tuple[trio.MemorySendChannel[Any], TimingMsg | Metrics] | None:
        """The channel and message a DATA record goes to, or None when it is dropped."""
        try:
            frame = self._codec.open(rec.payload)
        except AuthError as exc:
            self.invalid(conn, rec.rank, str(exc), category="bad mac")
            return None
        except WireError as exc:
            self.invalid(conn, rec.rank, str(exc), category="malformed")
            return None
        msg: TimingMsg | Metrics
        try:
            if frame.kind == _TIMING:
                msg = decode_timing(frame.payload)
            elif frame.kind == _METRICS:
                msg = decode_metrics(frame.payload)
            else:
                if frame.kind not in (MsgKind.RESERVED_4, MsgKind.RESERVED_5):
                    self.invalid(conn, rec.rank, f"frame of kind {frame.kind} is not for this "
                                 "direction", category="wrong direction")
                return None
        except WireError as exc:
            self.invalid(conn, rec.rank, str(exc), category="undecodable")
            return None
        rank = msg.rank
        if rank not in conn.rank_set:
            self.invalid(conn, rank, f"{type(msg).__name__} speaks for rank {rank}, which "
                         f"relay {conn.host!r} does not carry {ranks_text(conn.ranks)}",
                         category="foreign rank")
            return None
        if self._roster.is_dead(rank) or not self._roster.carries(conn, rank):
            log.debug("rank %d was declared dead (or rejoined on another relay); its late %s "
                      "from %s is dropped", rank, type(msg).__name__, conn.describe())
            return None
        if frame.kind == _TIMING:
            self._roster.seen(rank, now)
            if type(msg) is Exiting and self._roster.mark_exited(rank):
                self._timeline.event(RankExited(rank=rank))
            return self._timing, msg
        return self._metrics, msg

    async def deliver_when_room(self, conn: RelayConn, send: trio.MemorySendChannel[Any],
                                msg: Any) -> None:
        """Wait until ``send`` takes ``msg``; that time is not the ranks' silence."""
        paused_at = trio.current_time()
        conn.paused_since = paused_at
        try:
            with trio.CancelScope() as conn.delivery_scope:
                await send.send(msg)  # shutdown cancels this wait: nobody will read any more
        except STREAM_GONE:
            return
        finally:
            conn.delivery_scope = None
            conn.paused_since = None
            # The coordinator was not reading this relay; that time is not the ranks' silence.
            self._roster.credit_pause(conn, trio.current_time() - paused_at)

    def on_relay_control(self, conn: RelayConn, payload: bytes) -> None:
        try:
            msg = decode_relay(payload)
        except WireError as exc:
            self.invalid(conn, 0, f"relay control record: {exc}", category="undecodable")
            return
        if not isinstance(msg, RankExit | RankDropped):
            self.invalid(conn, 0, f"{type(msg).__name__} after the handshake",
                         category="unexpected control")
            return
        rank = int(msg.rank)
        if rank not in conn.rank_set:
            self.invalid(conn, rank, f"{type(msg).__name__} for rank {rank}, which relay "
                         f"{conn.host!r} does not carry", category="foreign rank")
            return
        if self._roster.has_exited(rank):
            log.info("rank %d disconnected after Exiting", rank)
            return
        if not self._roster.carries(conn, rank):
            log.info("%s for rank %d from %s ignored: the rank rejoined on another relay",
                     type(msg).__name__, rank, conn.describe())
            return
        if isinstance(msg, RankDropped):
            self._liveness.mark_dead(rank, f"relay {conn.host!r} dropped rank {rank}: "
                                     f"{msg.reason}")
            return
        self._liveness.mark_dead(rank, f"relay {conn.host!r} reported that rank {rank}'s "
                                 "connection ended without Exiting")
