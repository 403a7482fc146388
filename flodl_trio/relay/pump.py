"""Relay phase 3 (SPEC §5): the pump.

One reader per local rank feeds a bounded queue drained by the single upstream writer; one
upstream reader routes DATA records to a rank and FANOUT records to each listed local rank.
Every end is graceful: what was verified and queued is delivered before a link closes.

The rank side (readers, writers, the queue) lives as long as the pump; the upstream writer and
reader form a *leg* over one connection (:class:`~._leg.Leg`). A leg ends with one
:class:`~._leg.LegEnd`, and :meth:`Pump.leg_ended` says, in one place, what it means
(:func:`verdict`): with a durable coordinator (issue 22) a leg lost without a ``Goodbye`` is
ridden out (:mod:`.resume`) and the next leg runs on the resumed connection; with
``rejoin_when_fenced`` (issue 37) the end of a connection that fenced every rank the relay still
carries is a wake-up (:mod:`._wakeup`): the next leg runs on a fresh join; a close lets the
ranks leave and finishes; anything else fails the pump.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import trio

from .._config import RelayConfig
from .._errors import FlodlError
from ..events import RelayDroppedRank
from ..net._ratelimit import JunkCounter
from ..net._socket_io import next_event
from ..net._transport import STREAM_GONE
from ..timeline import Timeline
from ..wire import (
    Deliver,
    Draining,
    EndOfStream,
    FenceRank,
    RankDropped,
    RankExit,
    RankFrame,
    RankHeartbeat,
    Record,
    RecordOpener,
    RecordSealer,
    UpstreamSession,
)
from ._leg import Ending, Leg, LegEnd, Verdict, verdict
from ._link import RankLink, RelayExit
from ._liveness import Heartbeats
from ._wakeup import Rejoin, Wakeup
from .ranks import LocalRanks
from .resume import Backlog, Durable, Reconnector, Upstream

log = logging.getLogger("flodl_trio.relay")

# The rank readers queue Upstream items (resume.Upstream: a rank's frame (rank, blob), the
# notice that its link ended, or the ranks' coalesced heartbeats) for the upstream writer. The
# queue holds queue_size items; a rank reader waits when it is full, so a slow upstream slows the
# ranks' sends down (TCP backpressure, end to end).
_FROM_RANK = (RankFrame, RankHeartbeat)


class Pump:
    """Phase 3 over the authenticated upstream connection, one leg after the other.

    Attributes:
        leg: the current upstream connection (:class:`~._leg.Leg`).
        error: the coordinator broke the protocol, or refused our resume (the relay fails with
            it), else None.
        resume: set for a durable coordinator (one that sent ``Generation``); see
            :mod:`.resume`.
        wakeup: set with ``rejoin_when_fenced``; see :mod:`._wakeup`.
    """

    def __init__(self, local: LocalRanks, stream: trio.abc.Stream, sealer: RecordSealer,
                 opener: RecordOpener, timeline: Timeline | None = None, *,
                 first: tuple[Record, ...] = (), durable: Durable | None = None,
                 rejoin: Rejoin | None = None) -> None:
        self.local = local
        self.host = local.host
        self.config: RelayConfig = local.config
        self.error: FlodlError | None = None
        self.resume = (Reconnector(local, durable, drop_rank=self.drop_rank)
                       if durable is not None else None)
        self.wakeup = (Wakeup(local, rejoin)
                       if rejoin is not None and self.config.rejoin_when_fenced else None)
        self.timeline = timeline
        self.dropped = 0  # local ranks dropped for not draining their queue
        self._nursery: trio.Nursery | None = None
        self._outcome: RelayExit | None = None
        self._scope = trio.CancelScope()
        self._dropped = JunkCounter()
        # The local ranks' verified Heartbeats, one Liveness record per interval (issue 23).
        self.heartbeats = Heartbeats(self.config.heartbeat_interval)
        self._readers = 0
        self._readers_gone = trio.Event()
        # Issue 37: the host leaves on purpose (drain), and why; Draining goes up once.
        self.draining: str | None = None
        self._drain_send: trio.MemorySendChannel[Upstream] | None = None
        self._draining_queued = False
        # What went up as each rank left (its Exiting frame, then RankExit or RankDropped), to
        # tell a coordinator again when the one they were written to never confirmed them
        # (see _told_again).
        self._farewells: list[Upstream] = []
        self._retold = False
        self.leg = self._new_leg(stream, opener, sealer, first)

    def _new_leg(self, stream: trio.abc.Stream, opener: RecordOpener, sealer: RecordSealer,
                 opened: tuple[Record, ...], backlog: Backlog | None = None,
                 ranks: tuple[int, ...] | None = None) -> Leg:
        session = UpstreamSession(opener, sealer, host=self.host,
                                  ranks=self.local.ranks if ranks is None else ranks)
        session.feed_opened(opened)  # opened with the handshake (the welcome)
        return Leg(stream, session, config=self.config, downstream=self, first=backlog)

    def finish(self, reason: str, clean: bool = True, *, now: bool = True) -> None:
        """The relay ends for ``reason`` (the first one given counts); ``now``: stop the pump
        at once."""
        if self._outcome is None:
            self._outcome = RelayExit(reason, clean)
            log.info("relay %r ending: %s", self.host, reason)
        if now:
            self._scope.cancel()

    async def run(self, running: Callable[[], None] | None = None) -> RelayExit:
        """Phase 3 until the relay ends; ``running`` is called once every task of the pump
        was started (the relay's join is over)."""
        up_send, up_recv = trio.open_memory_channel[Upstream](self.config.queue_size)
        with self._scope:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self.wakeup is not None:
                    self.wakeup.attach(nursery)
                # One queue clone per rank reader: the queue ends (and the writer with it) only
                # once every reader has queued its last frame and its RankExit.
                with up_send:
                    for link in self.local.links():
                        self._readers += 1
                        nursery.start_soon(self.rank_reader, link, up_send.clone())
                        link.attach_writer(partial(self.start_rank_writer, nursery, link))
                    nursery.start_soon(self.heartbeats.ticker, self.config.heartbeat_interval,
                                       up_send.clone(), self._readers_gone, self.send_up)
                    # Draining's clone, handed to a task only if the host drains (most never
                    # do: no task waits for it); closed once every reader is gone.
                    self._drain_send = up_send.clone()
                    if not self._readers:
                        self._all_readers_gone()
                    self._queue_draining()  # drain() may have come first
                if running is not None:
                    running()
                await self.run_upstream(up_recv)  # in the nursery's own task
        return self._outcome if self._outcome is not None else RelayExit("stopped", True)

    def drain(self, reason: str, frame: bytes) -> None:
        """The host leaves (issue 37): ``frame`` (a ``Drain`` sealed for the ranks) goes to
        every local rank after what is queued for it, and ``Draining`` to the coordinator."""
        self.draining = reason
        now = trio.current_time()
        for link in self.local.links():
            if not link.gone and not link.offer(link.session.send(frame), now):
                self.drop_rank(link, "it did not drain its queue within write_stall_timeout")
        self._queue_draining()

    def _queue_draining(self) -> None:
        """Once the host drains and the pump runs: queue ``Draining`` upstream from a task of
        its own, unless every rank left first (its queue clone is closed then)."""
        send, nursery = self._drain_send, self._nursery
        if self.draining is None or send is None or nursery is None:
            return
        self._drain_send = None
        nursery.start_soon(self._send_draining, send, Draining(reason=self.draining))

    async def _send_draining(self, up_send: trio.MemorySendChannel[Upstream],
                             draining: Draining) -> None:
        with up_send:  # the writer ends once this clone is closed too
            try:
                await self.send_up(up_send, draining)
                self._draining_queued = True
            except STREAM_GONE:
                pass

    def _all_readers_gone(self) -> None:
        self._readers_gone.set()
        send, self._drain_send = self._drain_send, None
        if send is not None:  # no Draining to send any more: the writer need not wait for it
            send.close()

    @property
    def stream(self) -> trio.abc.Stream:
        """The current upstream connection."""
        return self.leg.stream

    async def run_upstream(self, up_recv: trio.MemoryReceiveChannel[Upstream]) -> None:
        """One leg after the other, each ended as :meth:`leg_ended` decided: a lost leg is
        ridden out and replaced by one on the resumed connection; a finish ends the pump once
        the ranks left (or ``shutdown_grace`` passed); a failure first lets the rank writers
        deliver what they were sent."""
        while True:
            leg = self.leg
            end = await leg.run(up_recv, durable=self.resume is not None)
            if leg.verdict is Verdict.RIDE_OUT and await self._ride_out(leg, end, up_recv):
                continue
            if leg.verdict is Verdict.REJOIN and await self._wake_up(leg, up_recv):
                continue
            if self._unconfirmed(leg) and await self._tell_again(leg, up_recv):
                continue
            if leg.verdict is not Verdict.FINISH or leg.cut_short:
                await self.flush_ranks()
            self._scope.cancel()
            return

    async def _ride_out(self, leg: Leg, end: LegEnd,
                        up_recv: trio.MemoryReceiveChannel[Upstream]) -> bool:
        """Ride the lost ``leg`` out; True once a new leg runs on the resumed connection, else
        the pump fails (the grace ran out, or the resume was refused)."""
        assert self.resume is not None
        await trio.aclose_forcefully(leg.stream)  # nothing from it is delivered again
        resumed = await self.resume.ride_out(end.reason, up_recv, self._told_again(leg.unsent()))
        if resumed is None:
            why, self.error = self.resume.gave_up
            self.finish(why, False, now=False)
            return False
        established = resumed.established
        self.leg = self._new_leg(resumed.stream, established.opener, established.sealer,
                                 established.records, resumed.backlog)
        self.heartbeats.follow(0.0)  # a Cadence was the old connection's
        return True

    def _unconfirmed(self, leg: Leg) -> bool:
        """The last rank left and its records were written, but the durable coordinator said
        no ``Goodbye`` and (unless the host drained) did not close its end within
        ``shutdown_grace``: it may be frozen (a stopped process takes the bytes into its
        socket and reads none), and the coordinator that takes over would adopt a session in
        which these ranks never left. A drained host's end needs the ``Goodbye``: the
        coordinator says it once its retirements are durable, and a leader deposed before
        that (its store lost its quorum) closes as it exits, saying nothing."""
        return (leg.verdict is Verdict.FINISH and leg.outcome is not None
                and leg.outcome.ending is Ending.RANKS_GONE
                and (not leg.peer_closed or self.draining is not None)
                and not leg.goodbye and not leg.cut_short
                and self.resume is not None and self.resume.enabled
                and not self._retold and bool(self._farewells))

    async def _tell_again(self, leg: Leg, up_recv: trio.MemoryReceiveChannel[Upstream]) -> bool:
        """Ride the unconfirmed finish out like a loss and tell the coordinator that leads
        then, on the resumed connection, that the host leaves (``Draining``) and its ranks
        left; True once that connection runs. When no coordinator answers within
        ``coordinator_grace`` (or it refuses the resume: it knows already), the relay ends as
        it would have."""
        assert self.resume is not None
        self._retold = True
        reason = ("the coordinator closed without the Goodbye that says the host's "
                  "retirement is recorded (deposed?)" if leg.peer_closed else
                  f"no close from the coordinator within shutdown_grace="
                  f"{self.config.shutdown_grace:g}s after the last rank left (frozen?)")
        log.warning("relay %r: %s; telling the coordinator that leads next", self.host, reason)
        await trio.aclose_forcefully(leg.stream)
        resumed = await self.resume.ride_out(reason, up_recv, self._told_again(leg.unsent()))
        if resumed is None:
            log.warning("relay %r: %s; it ends as it was", self.host, self.resume.gave_up[0])
            return False
        established = resumed.established
        self.leg = self._new_leg(resumed.stream, established.opener, established.sealer,
                                 established.records, resumed.backlog)
        return True

    def _told_again(self, unsent: list[Upstream]) -> list[Upstream]:
        """What a resumed connection carries first: ``unsent`` (what the lost one did not
        write), after what the lost one wrote and the next coordinator may never have heard,
        since a frozen or killed leader reads nothing and its successor adopts the session as
        the store had it -- that the host leaves (``Draining``, once queued) and each rank
        that left (its ``Exiting``, then its ``RankExit`` or ``RankDropped``). Told twice,
        they change nothing: the coordinator ignores a second ``Draining`` and the end of a
        rank that left already."""
        again: list[Upstream] = []
        if self._draining_queued and not any(isinstance(u, Draining) for u in unsent):
            assert self.draining is not None
            again.append(Draining(reason=self.draining))
        again += [item for item in self._farewells if item not in unsent]
        return again + unsent

    async def _wake_up(self, leg: Leg, up_recv: trio.MemoryReceiveChannel[Upstream]) -> bool:
        """Join again with the fenced ranks (:mod:`._wakeup`); True once a new leg runs on the
        new connection, else the pump fails with why."""
        assert self.wakeup is not None
        await trio.aclose_forcefully(leg.stream)
        leg.unsent()  # void: the coordinator ignores what a fenced rank sent
        if not await self.wakeup.settle(up_recv):  # every rank left: end as without it
            assert leg.outcome is not None
            self.finish(leg.outcome.reason, leg.outcome.clean, now=False)
            return False
        woken = await self.wakeup.wake_up(up_recv)
        if woken is None:
            why, self.error = self.wakeup.gave_up
            self.finish(why, False, now=False)
            return False
        stream, established = woken.joined
        self.leg = self._new_leg(stream, established.opener, established.sealer,
                                 established.records, woken.backlog, ranks=woken.ranks)
        self.heartbeats.forget()
        return True

    def leg_ended(self, end: LegEnd) -> Verdict:
        """The one place that says what a leg's end means (:func:`verdict`), and records how
        the relay ends unless the loss is ridden out or the relay wakes up."""
        if (self.wakeup is not None and end.ending in (Ending.CLOSED, Ending.LOST)
                and self._outcome is None and self.draining is None and self.wakeup.armed()):
            return Verdict.REJOIN
        said = verdict(end, resumable=self.resumable())
        if said is Verdict.RIDE_OUT:
            if end.error is not None:
                log.warning("relay %r: %s", self.host, end.reason)
            return said
        if said is Verdict.FAIL and end.error is not None:
            self.error = end.error  # events before the bad record were delivered
        self.finish(end.reason, end.clean, now=False)
        if said is Verdict.FINISH:
            # Deliver what is queued to the ranks and let them say goodbye (their Exiting
            # still flows upstream). The outcome is decided now: the ranks leaving because of
            # it is not "all ranks exited".
            for link in self.local.links():
                link.end_queue()
        return said

    def lose_leg(self, reason: str) -> None:
        """The durable coordinator's connection is lost (``reason``): end this leg."""
        self.leg.lose(reason)

    def pace(self, interval: float) -> None:
        """The coordinator's ``Cadence``: one ``Liveness`` per ``interval`` seconds."""
        self.heartbeats.follow(interval)

    @property
    def period(self) -> float:
        """Seconds between two ``Liveness`` records on this connection: the relay's
        ``heartbeat_interval``, or the coordinator's slower ``Cadence``."""
        return max(self.config.heartbeat_interval, self.heartbeats.cadence)

    @property
    def generation(self) -> int:
        """The highest coordinator generation seen (0: not a durable coordinator)."""
        return self.resume.generation if self.resume is not None else 0

    def connected(self) -> bool:
        """Connected to a durable coordinator whose loss would be ridden out (not riding one
        out now, not ending)."""
        return self.resumable() and self.resume is not None and self.resume.away is None

    def resumable(self) -> bool:
        """A lost upstream connection is ridden out (a durable coordinator, a grace > 0, the
        pump not ending already), rather than ending the relay."""
        return self.resume is not None and self.resume.enabled and self._outcome is None

    async def send_up(self, up_send: trio.MemorySendChannel[Upstream], item: Upstream) -> None:
        """Send ``item`` upstream: written at once while the leg's writer is parked on an empty
        queue over plain TCP (:meth:`~._leg.Leg.write_direct`: no task switch, and most of a
        relay's upstream records find the writer idle), else queued for the writer. Records
        queued before are never overtaken: the writer parks only on an empty queue, and only
        while it is parked do records skip it.

        Raises:
            trio.ClosedResourceError / trio.BrokenResourceError: the queue is closed.
        """
        if not self.leg.write_direct(item):
            # The writer is busy or the queue holds records: queue behind them (the writer
            # takes every queued record, a blocked sender's included, before it parks again).
            await up_send.send(item)

    async def flush_ranks(self) -> None:
        """Let the rank writers deliver what was verified and queued before the link broke."""
        links = list(self.local.links())
        for link in links:
            link.end_queue()
        with trio.move_on_after(min(1.0, self.config.shutdown_grace)):
            for link in links:
                await link.writer_done.wait()

    def drop(self, category: str, detail: str) -> None:
        """Count a record dropped on the way to the ranks; log a rate-limited few."""
        report = self._dropped.add(category, detail, trio.current_time())
        if report is not None:
            log.warning("relay %r: dropped: %s", self.host, report.text())

    def deliver(self, event: Deliver) -> None:
        now = trio.current_time()
        for rank in event.ranks:
            link = self.local.link(rank)
            if link is None:
                self.drop("not connected", f"frame for rank {rank}, which is not connected")
                continue
            # Never waits: a rank that is behind delays nobody; one that stays behind is dropped.
            if not link.offer(event.blob, now):
                self.drop_rank(link, f"it did not drain its queue of {link.queue_size} frames "
                               f"within write_stall_timeout={self.config.write_stall_timeout:g}s")

    def drop_rank(self, link: RankLink, reason: str) -> None:
        """Cut a local rank off (its reader then reports ``RankDropped`` upstream)."""
        if not link.drop(reason):
            return
        self.dropped += 1
        log.warning("relay %r: dropping rank %d: %s", self.host, link.rank, reason)
        if self.timeline is not None:
            self.timeline.event(RelayDroppedRank(rank=link.rank, host=self.host, reason=reason))
        assert self._nursery is not None
        self._nursery.start_soon(trio.aclose_forcefully, link.stream)

    def fence(self, msg: FenceRank) -> None:
        link = self.local.link(int(msg.rank))
        if link is None or link.gone or link.fenced is not None:
            return
        # Everything queued before (the Fenced frame last) is delivered, then the link is
        # half-closed and, after shutdown_grace at the latest, closed.
        link.session.fence(msg.reason)
        if self.wakeup is not None and self.draining is None:
            leg = self.leg
            self.wakeup.hold(link, msg.reason, lambda: leg.outcome is not None)
            return
        link.end_queue()
        log.warning("relay %r: the coordinator fenced rank %d: %s", self.host, link.rank,
                    msg.reason)

    def start_rank_writer(self, nursery: trio.Nursery, link: RankLink) -> None:
        """Run ``link``'s writer (the link calls this once it has something the kernel did not
        take at once, or its queue ended: a rank that keeps up costs no writer task)."""
        try:
            nursery.start_soon(self.rank_writer, link)
        except RuntimeError:  # the pump ended: nothing will be written to the rank any more
            link.writer_done.set()

    async def rank_writer(self, link: RankLink) -> None:
        try:
            await self.write_to_rank(link)
        finally:
            link.writer_done.set()

    async def write_to_rank(self, link: RankLink) -> None:
        try:
            # One write for a burst of frames (each stays whole).
            while (batch := await link.next_batch()) is not None:
                await link.write(batch)
            await link.writer.send_eof()
            if link.fenced is not None:
                with trio.move_on_after(self.config.shutdown_grace):
                    await link.reader_done.wait()  # the rank read it all and closed
                await trio.aclose_forcefully(link.stream)
        except trio.TooSlowError:
            self.drop_rank(link, f"it read nothing for write_stall_timeout="
                            f"{self.config.write_stall_timeout:g}s")
        except STREAM_GONE:
            await trio.aclose_forcefully(link.stream)

    async def rank_reader(self, link: RankLink,
                          up_send: trio.MemorySendChannel[Upstream]) -> None:
        session = link.session
        event = None
        beats, rank, clock = self.heartbeats, link.rank, trio.current_time
        send_up = self.send_up
        try:
            if link.early:  # read while accepting ranks
                session.receive_data(link.take_early())
            if link.early_eof:
                session.receive_data(b"")
            while type(event := await next_event(link.reader, session)) in _FROM_RANK:
                # The rank's pending heartbeat goes first: never after its later frames, and a
                # rank beating faster than heartbeat_interval is reported at its own pace
                # (unless the coordinator paced the Liveness records: see Heartbeats).
                if (beats.due_before(rank, heartbeat=type(event) is RankHeartbeat)
                        and (liveness := beats.take(clock())) is not None):
                    await send_up(up_send, liveness)
                if type(event) is RankHeartbeat:
                    beats.record(rank, event.step_count, clock())  # in the next Liveness
                elif not self.leg.write_direct(frame := (event.rank, event.blob)):
                    await up_send.send(frame)  # send_up, without a coroutine per frame
        except STREAM_GONE:
            pass
        if isinstance(event, EndOfStream) and event.error is not None:
            log.warning("relay %r: %s; closing it", self.host, event.reason)
        link.reader_ended()
        await trio.aclose_forcefully(link.stream)
        gone: RankExit | RankDropped = RankExit(rank=link.rank)
        if link.dropped is not None:
            gone = RankDropped(rank=link.rank, reason=link.dropped)
        with up_send:  # closing this reader's clone; the writer ends after the last one
            try:
                if beats.pending(rank) and (liveness := beats.take(clock())) is not None:
                    await send_up(up_send, liveness)  # its last heartbeat before its RankExit
                if session.exiting_frame is not None:  # its Exiting, then its end
                    self._farewells.append((rank, session.exiting_frame))
                self._farewells.append(gone)
                await send_up(up_send, gone)
            except STREAM_GONE:
                pass
            finally:
                self._readers -= 1
                if not self._readers:
                    self._all_readers_gone()
