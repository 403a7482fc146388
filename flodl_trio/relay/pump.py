"""Relay phase 3 (SPEC §5): the pump.

One reader per local rank feeds a bounded queue drained by the single upstream writer; one
upstream reader routes DATA records to a rank and FANOUT records to each listed local rank.
Every end is graceful: what was verified and queued is delivered before a link closes.

The rank side (readers, writers, the queue) lives as long as the pump; the upstream writer and
reader form a *leg* over one connection. With a durable coordinator (issue 22) a leg lost
without a ``Goodbye`` is replaced: :mod:`.resume` rides the gap out and the next leg runs on the
resumed connection. With any other coordinator there is one leg, and losing it ends the pump.
"""

from __future__ import annotations

import logging
from functools import partial

import trio

from .._config import RelayConfig
from .._errors import FlodlError
from ..events import RelayDroppedRank
from ..net._ratelimit import JunkCounter
from ..net._socket_io import Reader, next_event, plain_socket, write_now
from ..net._transport import STREAM_GONE
from ..timeline import Timeline
from ..wire import (
    NEED_DATA,
    READ_SIZE,
    Cadence,
    Deliver,
    EndOfStream,
    FenceRank,
    Goodbye,
    Invalid,
    RankDropped,
    RankExit,
    RankFrame,
    RankHeartbeat,
    Record,
    RecordOpener,
    RecordSealer,
    UpstreamSession,
)
from ._link import RankLink, RelayExit
from ._liveness import Heartbeats
from .ranks import LocalRanks
from .resume import Reconnector, Upstream

log = logging.getLogger("flodl_trio.relay")

# The rank readers queue Upstream items (resume.Upstream: a rank's frame (rank, blob), the
# notice that its link ended, or the ranks' coalesced heartbeats) for the upstream writer. The
# queue holds queue_size items; a rank reader waits when it is full, so a slow upstream slows the
# ranks' sends down (TCP backpressure, end to end).
_FROM_RANK = (RankFrame, RankHeartbeat)


class Pump:
    """Phase 3 over one authenticated upstream connection.

    Attributes:
        error: the coordinator broke the protocol, or refused our resume (the relay fails with
            it), else None.
        resume: set for a durable coordinator (one that sent ``Generation``); see
            :mod:`.resume`.
    """

    def __init__(self, local: LocalRanks, stream: trio.abc.Stream, sealer: RecordSealer,
                 opener: RecordOpener, timeline: Timeline | None = None, *,
                 first: tuple[Record, ...] = (), resume: Reconnector | None = None) -> None:
        self.local = local
        self.host = local.host
        self.config: RelayConfig = local.config
        self.stream = stream
        self.reader = Reader(stream)  # the upstream reader's (one per leg)
        self.session = UpstreamSession(opener, sealer, host=local.host, ranks=local.ranks)
        self.session.feed_opened(first)  # opened with the handshake (the welcome)
        self.error: FlodlError | None = None
        self.resume = resume
        self.timeline = timeline
        self.dropped = 0  # local ranks dropped for not draining their queue
        self._nursery: trio.Nursery | None = None
        self._outcome: list[RelayExit] = []
        self._scope = trio.CancelScope()
        self._no_ranks_left = trio.Event()
        self._upstream_done = trio.Event()
        self._dropped = JunkCounter()
        # One leg: the upstream writer and reader over the current connection.
        self._leg_scope = trio.CancelScope()
        self._leg_lost: str | None = None
        self._in_flight: list[Upstream] = []  # the batch being written upstream
        # The direct path (see send_up): the leg's plain TCP socket (None: TLS, in-memory), the
        # writer parked on an empty queue (its wait is ``_park``), and a record the kernel took
        # only part of (the item and its sealed rest), which the writer finishes first.
        self._up_sock: trio.socket.SocketType | None = None
        self._park: trio.CancelScope | None = None
        self._rest: tuple[Upstream, bytes] | None = None
        self._heard = 0.0  # when the durable coordinator's last record arrived
        # The local ranks' verified Heartbeats, one Liveness record per interval (issue 23).
        self.heartbeats = Heartbeats(self.config.heartbeat_interval)
        self._readers = 0
        self._readers_gone = trio.Event()

    def finish(self, reason: str, clean: bool = True, *, now: bool = True) -> None:
        if not self._outcome:
            self._outcome.append(RelayExit(reason, clean))
            log.info("relay %r ending: %s", self.host, reason)
        if now:
            self._scope.cancel()

    async def run(self) -> RelayExit:
        up_send, up_recv = trio.open_memory_channel[Upstream](self.config.queue_size)
        with self._scope:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self.run_upstream, up_recv)
                # One queue clone per rank reader: the queue ends (and the writer with it) only
                # once every reader has queued its last frame and its RankExit.
                with up_send:
                    for link in self.local.links():
                        self._readers += 1
                        nursery.start_soon(self.rank_reader, link, up_send.clone())
                        link.attach_writer(partial(self.start_rank_writer, nursery, link))
                    if not self._readers:
                        self._readers_gone.set()
                    nursery.start_soon(self.heartbeats.ticker, self.config.heartbeat_interval,
                                       up_send.clone(), self._readers_gone, self.send_up)
        return self._outcome[0] if self._outcome else RelayExit("stopped", True)

    @property
    def goodbye(self) -> str | None:
        """The coordinator's Goodbye reason (FT/2), once it came."""
        return self.session.goodbye

    async def run_upstream(self, up_recv: trio.MemoryReceiveChannel[Upstream]) -> None:
        """One leg after the other: a leg lost to a durable coordinator is ridden out and
        replaced by one on the resumed connection; any other end of a leg ends the pump."""
        while True:
            self._leg_lost = None
            self._upstream_done = trio.Event()
            self._heard = trio.current_time()
            self._up_sock = plain_socket(self.stream)
            with trio.CancelScope() as self._leg_scope:
                async with trio.open_nursery() as leg:
                    leg.start_soon(self.upstream_writer, up_recv)
                    leg.start_soon(self.upstream_reader)
            self._up_sock = None
            lost = self._leg_lost
            if lost is None or self.resume is None:
                return
            await trio.aclose_forcefully(self.stream)  # nothing from it is delivered again
            in_flight, self._in_flight = self._in_flight, []
            if self._rest is not None:  # sealed for the lost connection: sent again, resealed
                in_flight.insert(0, self._rest[0])
                self._rest = None
            joined = await self.resume.ride_out(lost, up_recv, in_flight)
            if joined is None:
                why, self.error = self.resume.gave_up
                self.finish(why, False, now=False)
                await self.flush_ranks()
                self._scope.cancel()
                return
            self.stream, established = joined
            self.reader = Reader(self.stream)
            self.session = UpstreamSession(established.opener, established.sealer,
                                           host=self.host, ranks=self.local.ranks)
            self.session.feed_opened(established.records)
            self.heartbeats.follow(0.0)  # a Cadence was the old connection's

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
        return self.resume is not None and self.resume.enabled and not self._outcome

    def lose_leg(self, reason: str) -> None:
        """The durable coordinator's connection is lost: end this leg; the pump rides it out."""
        if self._leg_lost is None:
            self._leg_lost = reason
        self._leg_scope.cancel()

    async def send_up(self, up_send: trio.MemorySendChannel[Upstream], item: Upstream) -> None:
        """Send ``item`` upstream: queued for the writer, or, while the writer is parked on an
        empty queue over plain TCP, sealed and handed to the kernel at once with one ``write``
        (no task switch: most of a relay's upstream records find the writer idle). What the
        kernel did not take goes to the writer, which finishes it before anything else, so
        records still leave whole and in sealing order, and only the writer ever waits on the
        socket (its stall deadline applies). Records queued before are never overtaken: the
        writer parks only on an empty queue, and only while it is parked do records skip it.

        Raises:
            trio.ClosedResourceError / trio.BrokenResourceError: the queue is closed.
        """
        park, sock = self._park, self._up_sock
        if park is None or sock is None:
            # The writer is busy or the queue holds records: queue behind them (the writer
            # takes every queued record, a blocked sender's included, before it parks again).
            await up_send.send(item)
            return
        data = self.seal(item)
        written = write_now(sock, data)
        if written == len(data):
            return
        # The rest (all of it when the socket is full or failed: the writer meets the error).
        self._rest = (item, data[written:])
        self._park = None
        park.cancel()

    def seal(self, item: Upstream) -> bytes:
        """The record of ``item`` on the current connection (the next sequence number)."""
        if isinstance(item, tuple):
            return self.session.send_frame(*item)
        return self.session.send(item)

    async def next_upstream(self, up_recv: trio.MemoryReceiveChannel[Upstream]
                            ) -> tuple[list[Upstream], bytes] | None:
        """The next batch to write and its sealed bytes: the rest of a record the direct path
        began, what was queued while reconnecting, then a burst of the ranks' queue (each
        record stays whole); None once every rank reader is done."""
        backlog = self.resume.backlog if self.resume is not None else None
        batch: list[Upstream] = []
        if self._rest is None and backlog:
            batch.extend(backlog.popleft() for _ in range(min(64, len(backlog))))
            return batch, b"".join(self.seal(item) for item in batch)
        if self._rest is None:
            try:
                batch.append(up_recv.receive_nowait())
            except trio.WouldBlock:
                # Parked: send_up may write directly meanwhile (and un-park us with a rest).
                with trio.CancelScope() as self._park:
                    try:
                        batch.append(await up_recv.receive())
                    except trio.EndOfChannel:
                        if self._rest is None:
                            return None
                    finally:
                        self._park = None
            except trio.EndOfChannel:
                return None
        head = b""
        if self._rest is not None:
            item, head = self._rest
            self._rest = None
            batch.insert(0, item)
        while len(batch) < 64:  # coalesce a burst into one write
            try:
                batch.append(up_recv.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        start = 1 if head else 0
        return batch, head + b"".join(self.seal(item) for item in batch[start:])

    async def upstream_writer(self, up_recv: trio.MemoryReceiveChannel[Upstream]) -> None:
        send_all, stall = self.stream.send_all, self.config.write_stall_timeout
        while (taken := await self.next_upstream(up_recv)) is not None:
            batch, data = taken
            self._in_flight = batch
            try:
                # A bare CancelScope: fail_after costs a generator-based context manager more
                # per batch.
                with trio.CancelScope(deadline=trio.current_time() + stall) as scope:
                    await send_all(data)
                if scope.cancelled_caught:
                    await self.upstream_lost(f"upstream write stall: no progress for "
                                             f"{stall:g}s")
                    return
            except STREAM_GONE as exc:
                await self.upstream_lost(f"upstream connection lost while writing "
                                         f"({type(exc).__name__})")
                return
            self._in_flight = []
        # Every rank reader closed its queue clone: the last local rank is gone, and what the
        # ranks queued before leaving (Exiting, RankExit) is written. Ending before this point
        # cancelled the writer with the last rank's records still queued.
        self._no_ranks_left.set()
        self.finish("all ranks exited", now=False)
        # Half-close and let the coordinator close first: closing a socket with unread data
        # in it sends a reset, which can destroy the records we just wrote before they are read.
        with trio.move_on_after(self.config.shutdown_grace):
            try:
                if isinstance(self.stream, trio.abc.HalfCloseableStream):
                    await self.stream.send_eof()
                    await self._upstream_done.wait()
            except (trio.BusyResourceError, *STREAM_GONE):
                pass
        self.finish("all ranks exited")

    async def upstream_reader(self) -> None:
        try:
            await self.read_upstream()
        finally:
            self._upstream_done.set()

    async def upstream_lost(self, reason: str) -> None:
        """The upstream write failed: what was already read from the coordinator (a Shutdown
        just before it closed) still reaches the ranks, then the pump ends (or, with a durable
        coordinator, rides it out)."""
        if self.resumable():
            self.lose_leg(self.session.close(reason))
            return
        self.finish(self.session.close(reason), False, now=False)
        await self.flush_ranks()
        self._scope.cancel()

    async def read_upstream(self) -> None:
        session = self.session
        reader = self.reader
        durable = self.resume is not None
        try:
            while True:
                event = session.next_event()
                if event is NEED_DATA:
                    if durable:
                        data = await self.receive_while_alive()
                        if data is None:
                            return
                        session.receive_data(data)
                    else:
                        session.receive_data(await reader.receive_some(READ_SIZE))
                    continue
                if durable:
                    self._heard = trio.current_time()
                if type(event) is Deliver:
                    await trio.lowlevel.checkpoint_if_cancelled()
                    self.deliver(event)
                elif type(event) is Invalid:
                    self.drop(event.category, event.detail)
                elif type(event) is FenceRank:
                    self.fence(event)
                elif type(event) is Cadence:
                    self.heartbeats.follow(event.interval)  # Liveness at the coordinator's pace
                elif type(event) is Goodbye:
                    log.info("relay %r: the coordinator is shutting down: %s", self.host,
                             event.reason)
                else:
                    break
        except STREAM_GONE as exc:
            if self.resumable():
                self.lose_leg(session.close(f"upstream connection lost ({type(exc).__name__})"))
                return
            await self.flush_ranks()
            self.finish(session.close(f"upstream connection lost ({type(exc).__name__})"),
                        False)
            return
        assert isinstance(event, EndOfStream)
        if not event.clean and self.resumable():
            if event.error is not None:
                log.warning("relay %r: %s", self.host, event.reason)
            self.lose_leg(event.reason)
            return
        if event.error is not None:
            # Events before the bad record were delivered; then it ends.
            self.error = event.error
            await self.flush_ranks()
            self.finish(event.reason, False)
            return
        # The coordinator closed: deliver what is queued to the ranks, let them say goodbye
        # (their Exiting still flows upstream), then end. Only a Goodbye before the EOF makes
        # it a clean end (FT/2). The outcome is decided now: the ranks leaving because of it is
        # not "all ranks exited".
        self.finish(event.reason, event.clean, now=False)
        for link in self.local.links():
            link.end_queue()
        with trio.move_on_after(self.config.shutdown_grace):
            await self._no_ranks_left.wait()
        self._scope.cancel()  # the outcome was recorded at the EOF

    async def receive_while_alive(self) -> bytes | bytearray | None:
        """The next bytes from a durable coordinator; None (the leg lost, or the pump ending)
        after ``coord_liveness_timeout`` without a record from it."""
        timeout = self.config.coord_liveness_timeout
        with trio.move_on_at(self._heard + timeout):
            return await self.reader.receive_some(READ_SIZE)
        reason = self.session.close(f"no record from the coordinator within "
                                    f"coord_liveness_timeout={timeout:g}s")
        if self.resumable():
            self.lose_leg(reason)
        else:
            self.finish(reason, False, now=False)
            await self.flush_ranks()
            self._scope.cancel()
        return None

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
        if link.gone or link.dropped is not None:
            return
        link.dropped = reason
        link.gone = True
        link.end_queue()
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
                link.writing = True
                await link.writer.send(batch[0] if len(batch) == 1 else b"".join(batch))
                link.writing = False
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
                session.receive_data(bytes(link.early))
                link.early.clear()
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
                else:
                    await send_up(up_send, (event.rank, event.blob))
        except STREAM_GONE:
            pass
        if isinstance(event, EndOfStream) and event.error is not None:
            log.warning("relay %r: %s; closing it", self.host, event.reason)
        link.gone = True
        link.reader_done.set()
        link.end_queue()
        await trio.aclose_forcefully(link.stream)
        gone: RankExit | RankDropped = RankExit(rank=link.rank)
        if link.dropped is not None:
            gone = RankDropped(rank=link.rank, reason=link.dropped)
        with up_send:  # closing this reader's clone; the writer ends after the last one
            try:
                if beats.pending(rank) and (liveness := beats.take(clock())) is not None:
                    await send_up(up_send, liveness)  # its last heartbeat before its RankExit
                await send_up(up_send, gone)
            except STREAM_GONE:
                pass
            finally:
                self._readers -= 1
                if not self._readers:
                    self._readers_gone.set()
