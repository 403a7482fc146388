"""Readers (SPEC §4.3): one task per relay connection turns records into messages.

TIMING goes to ``coord.timing`` (refreshing the sender's liveness clock first), METRICS to
``coord.metrics``; a message that speaks for a rank its relay does not carry is dropped. A
relay's ``Liveness`` record (its ranks' verified heartbeats, coalesced) refreshes each listed
rank's clock and step count as their ``Heartbeat`` frames would have, and delivers a
``Heartbeat`` for each (unless ``deliver_heartbeats`` is off); it is also the relay's report,
the evidence the staleness watch may be waiting for (SPEC §4.5), and each read that brings a
record tells the roster the relay is not silent. When a channel is full the reader waits, and
that time does not count towards heartbeat staleness.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, cast

import attrs
import trio

from ..events import InvalidFrame, RankExited
from ..net._socket_io import Reader
from ..net._transport import STREAM_GONE
from ..timeline import Timeline
from ..wire import (
    NEED_DATA,
    CoordinatorSession,
    Draining,
    EndOfStream,
    Exiting,
    FrameCodec,
    Heartbeat,
    Invalid,
    Liveness as LivenessRecord,
    Metrics,
    NeedData,
    RankDropped,
    RankExit,
    TimingMsg,
    liveness_heartbeat,
)
from ._board import Board
from ._relayconn import RelayConn
from ._retire import Retirement
from ._roster import Roster
from .liveness import Liveness

log = logging.getLogger("flodl_trio.coordinator")


def _idle_event() -> trio.Event:
    event = trio.Event()
    event.set()  # no reader is running yet
    return event


@attrs.define(kw_only=True, eq=False)
class Readers:
    """The relay connections' readers, and whether any of them is still reading."""

    _roster: Roster[RelayConn]
    _liveness: Liveness
    _codec: FrameCodec
    _timeline: Timeline
    _timing: trio.MemorySendChannel[TimingMsg]
    _metrics: trio.MemorySendChannel[Metrics]
    _board: Board
    _retirement: Retirement
    _deliver_heartbeats: bool = True
    # A drained relay ended its side: confirm its end once durable (Retirement.confirm_left).
    _confirm_left: Callable[[RelayConn], Awaitable[None]] | None = None
    _active: int = attrs.field(default=0, init=False)
    _beats: dict[int, Heartbeat] = attrs.field(factory=dict, init=False)  # last delivered
    _idle: trio.Event = attrs.field(factory=_idle_event, init=False)

    async def wait_idle(self) -> None:
        """Return once no reader is running (every relay connection reached its end)."""
        await self._idle.wait()

    async def read_relay(self, conn: RelayConn) -> None:
        self._active += 1
        self._idle = trio.Event() if self._active == 1 else self._idle
        # The session the writer seals with (opened when it started): one per connection.
        session = conn.open_session(self._codec)
        self._liveness.joined(conn)  # its welcome is written: the heartbeat period, if paced
        cause: str | None = None
        try:
            # One recv per wake-up (most reads bring one Liveness record; see Reader).
            receive_some = Reader(conn.stream, drained=True).receive_some
            while not isinstance(end := await self.act_on(conn, session), EndOfStream):
                session.receive_data(await receive_some())
            cause = end.reason
            if (end.error is None and self._confirm_left is not None
                    and self._retirement.left(conn)):
                await self._confirm_left(conn)
        except trio.BrokenResourceError as exc:
            cause = session.close(f"connection reset ({exc.__cause__!r})" if exc.__cause__
                                  else "connection reset")
        except trio.ClosedResourceError:
            cause = session.close("connection closed")
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()
        self._liveness.relay_lost(conn, cause)  # its first end only counts

    async def act_on(self, conn: RelayConn,
                     session: CoordinatorSession) -> EndOfStream | NeedData:
        """Deliver every event of the bytes read so far; returns NEED_DATA or the end.

        Plain calls per event; the reader checkpoints only where a channel is full (a
        coroutine per record per layer cost more than the decode). Records of one read
        arrived together, so they share one clock reading, taken again after a wait.
        """
        now = trio.current_time()
        next_event = session.next_event
        roster = self._roster
        records = False  # this read brought a record: the relay is not silent (SPEC §4.5)
        while True:
            event = next_event()
            kind = type(event)
            if kind is Invalid:
                records = True
                self.invalid(conn, event.rank, event.detail, category=event.category)
                continue
            if event is NEED_DATA or kind is EndOfStream:
                if records:
                    roster.heard(conn, now)
                return cast(EndOfStream | NeedData, event)
            records = True
            if kind is RankExit or kind is RankDropped:
                self.rank_gone(conn, event)
                continue
            if kind is LivenessRecord:
                now = await self.apply_liveness(conn, event, now)
                continue
            if kind is Draining:  # the relay's host leaves on purpose (issue 37)
                self._retirement.draining(conn, event.reason)
                continue
            rank = event.rank
            if roster.is_dead(rank) or not roster.carries(conn, rank):
                log.debug("rank %d was declared dead (or rejoined on another relay); its late "
                          "%s from %s is dropped", rank, kind.__name__, conn.describe())
                continue
            self._board.on_message(event)
            send: trio.MemorySendChannel[Any]
            if kind is Metrics:
                send = self._metrics
            else:
                send = self._timing
                roster.seen(rank, now)
                if kind is Exiting and roster.mark_exited(rank):
                    self._timeline.event(RankExited(rank=rank))
                    self._retirement.exited(conn, rank)
            try:
                send.send_nowait(event)
            except trio.WouldBlock:
                if not roster.shutting_down:
                    await self.deliver_when_room(conn, send, event)
                    now = trio.current_time()
                # else: nobody is reading any more; never block shutdown on it
            except STREAM_GONE:
                pass

    async def apply_liveness(self, conn: RelayConn, msg: LivenessRecord, now: float) -> float:
        """A relay's coalesced heartbeats: each listed rank is seen when the relay verified its
        heartbeat (``now`` less its age), its step count goes on the board and
        (``deliver_heartbeats``) its ``Heartbeat`` to ``coord.timing``, as if its frame had
        come in this read. Returns the clock reading to go on with (taken again after waiting
        for room in the channel)."""
        roster, ranks, steps = self._roster, msg.ranks, msg.steps
        if roster.awaits(conn):  # the staleness watch waits for this report (SPEC §4.5)
            self._liveness.wake()
        if roster.seen_by(conn, ranks, msg.ages, now):
            self._board.steps.update(zip(ranks, steps, strict=True))
            pairs: Iterable[tuple[int, int]] = zip(ranks, steps, strict=True)
        else:  # a rank declared dead (or rejoined elsewhere) since the relay heard it
            pairs = [(rank, step) for rank, step in zip(ranks, steps, strict=True)
                     if not roster.is_dead(rank) and roster.carries(conn, rank)]
            self._board.steps.update(pairs)
        if not self._deliver_heartbeats:
            return now
        send_nowait, beats = self._timing.send_nowait, self._beats
        for rank, step in pairs:
            # A rank's Heartbeat (frozen) is built again only when its step count moved: an
            # idle cluster reports the same one every period.
            beat = beats.get(rank)
            if beat is None or beat.step_count != step:
                beat = beats[rank] = liveness_heartbeat(rank, step)
            try:
                send_nowait(beat)
            except trio.WouldBlock:
                if not roster.shutting_down:
                    await self.deliver_when_room(conn, self._timing, beat)
                    now = trio.current_time()
            except STREAM_GONE:
                pass
        return now

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

    async def deliver_when_room(self, conn: RelayConn, send: trio.MemorySendChannel[Any],
                                msg: Any) -> None:
        """Wait until ``send`` takes ``msg``; that time is not the ranks' silence."""
        paused_at = trio.current_time()
        try:
            with conn.reading_paused():
                await send.send(msg)  # shutdown cancels this wait: nobody will read any more
        except STREAM_GONE:
            return
        finally:
            # The coordinator was not reading this relay; that time is not the ranks' silence.
            self._roster.credit_pause(conn, trio.current_time() - paused_at)

    def rank_gone(self, conn: RelayConn, msg: RankExit | RankDropped) -> None:
        """The relay says a rank's link ended (``RankExit``) or that it dropped the rank."""
        rank = int(msg.rank)
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
