"""One upstream connection of a relay: a *leg* (SPEC §5 phase 3).

A :class:`Leg` owns one connection to the coordinator for its whole life: the stream, its
:class:`~flodl_trio.wire.UpstreamSession`, the reader's buffer, the plain socket of the direct
write path, what the writer has in flight or was handed half-written, and the cancel scope of
its two tasks (the writer of the ranks' queue, the reader of the coordinator's records). It
ends through :meth:`Leg.end`, with one :class:`LegEnd`; the pump (:mod:`.pump`) says once what
that end means (:class:`Verdict`): ride the loss out on a new leg, finish, or fail.
"""

from __future__ import annotations

import enum
import logging
from typing import Protocol

import attrs
import trio

from .._config import RelayConfig
from .._errors import FlodlError
from ..net._socket_io import Reader, plain_socket, write_now
from ..net._transport import STREAM_GONE
from ..wire import (
    NEED_DATA,
    READ_SIZE,
    Cadence,
    Deliver,
    EndOfStream,
    FenceRank,
    Goodbye,
    Invalid,
    UpstreamSession,
)
from .resume import Backlog, Upstream

log = logging.getLogger("flodl_trio.relay")

# Records coalesced into one write (each stays whole).
BATCH = 64


class Ending(enum.Enum):
    """Why a leg ended."""

    LOST = "lost"  # the connection broke: a reset, a write stall, silence, a newer leader
    CLOSED = "closed"  # the coordinator closed it (clean only after its Goodbye)
    FAILED = "failed"  # the coordinator broke the protocol
    RANKS_GONE = "ranks gone"  # every local rank left, and what they queued was written


@attrs.frozen
class LegEnd:
    """How one leg ended: the cause, the reason the relay gives, whether the end was clean
    (FT/2: a ``Goodbye`` before the EOF, or our own ranks all gone), and the protocol error."""

    ending: Ending
    reason: str
    clean: bool = False
    error: FlodlError | None = None

    @classmethod
    def lost(cls, reason: str) -> LegEnd:
        return cls(Ending.LOST, reason)

    @classmethod
    def ranks_gone(cls) -> LegEnd:
        return cls(Ending.RANKS_GONE, "all ranks exited", True)

    @classmethod
    def of_eof(cls, event: EndOfStream) -> LegEnd:
        """The end the session read: a protocol error, or the coordinator's close."""
        if event.error is not None:
            return cls(Ending.FAILED, event.reason, False, event.error)
        return cls(Ending.CLOSED, event.reason, event.clean)

    @property
    def breaks(self) -> bool:
        """The connection can carry nothing more (not a close that lets the ranks leave)."""
        return self.ending in (Ending.LOST, Ending.FAILED)


class Verdict(enum.Enum):
    """What the pump makes of a leg's end."""

    RIDE_OUT = "ride out"  # keep the ranks, re-dial the durable coordinator, run a new leg
    FINISH = "finish"  # the ranks leave, what they queue is still written, for shutdown_grace
    FAIL = "fail"  # deliver what the ranks were sent, then stop
    REJOIN = "rejoin"  # every rank left was fenced: keep them, join again with a fresh Hello


def verdict(end: LegEnd, *, resumable: bool) -> Verdict:
    """What a leg's end means for the pump. ``resumable``: a durable coordinator, a
    ``coordinator_grace`` > 0, and the pump not ending already.

    The ranks all gone, or a ``Goodbye`` then EOF, finish (the ranks leave; what they queue is
    still written). A durable coordinator lost in any other way is ridden out. Otherwise a
    coordinator that closed without a ``Goodbye`` finishes too (not clean), and a connection
    that broke (a reset, a stall, silence, a protocol error) fails the pump.
    """
    if end.ending is Ending.RANKS_GONE or (end.ending is Ending.CLOSED and end.clean):
        return Verdict.FINISH
    if resumable:
        return Verdict.RIDE_OUT
    return Verdict.FINISH if end.ending is Ending.CLOSED else Verdict.FAIL


class Downstream(Protocol):
    """What a leg needs of the pump: the ranks' side, and the one decision."""

    def deliver(self, event: Deliver) -> None: ...

    def drop(self, category: str, detail: str) -> None: ...

    def fence(self, msg: FenceRank) -> None: ...

    def pace(self, interval: float) -> None: ...

    def leg_ended(self, end: LegEnd) -> Verdict: ...


class Leg:
    """One upstream connection: its writer and reader, until :meth:`end`.

    Attributes:
        stream: the connection.
        session: its FT/2 session (sealing, opening, the close reason).
        outcome: how it ended (the first :class:`LegEnd`), once it has.
        verdict: what the pump made of it.
        cut_short: a finish was cut short by the connection breaking (the ranks' queues are
            then flushed).
    """

    def __init__(self, stream: trio.abc.Stream, session: UpstreamSession, *,
                 config: RelayConfig, downstream: Downstream,
                 first: Backlog | None = None) -> None:
        self.stream = stream
        self.session = session
        self.outcome: LegEnd | None = None
        self.verdict: Verdict | None = None
        self.cut_short = False
        # The coordinator closed its end (an EOF, or a reset) before the leg ended: it was
        # running and read what the relay wrote (a frozen coordinator never closes).
        self.peer_closed = False
        self.goodbye = False  # the coordinator said Goodbye: it ends the run itself
        self._config = config
        self._down = downstream
        self._durable = False  # a silent coordinator is lost after coord_liveness_timeout
        # Fresh from a handshake that read up to its last record: the first read waits first.
        self._reader = Reader(stream, drained=True)
        self._first = first  # queued while the coordinator was away: written first
        self._scope = trio.CancelScope()
        self._in_flight: list[Upstream] = []  # the batch being written
        # The direct path (see write_direct): the plain TCP socket (None: TLS, in-memory), the
        # writer parked on an empty queue (its wait is ``_park``), and a record the kernel took
        # only part of (the item and its sealed rest), which the writer finishes first.
        self._sock: trio.socket.SocketType | None = None
        self._park: trio.CancelScope | None = None
        self._rest: tuple[Upstream, bytes] | None = None
        self._heard = 0.0  # when the durable coordinator's last record arrived
        # Each half's own end (the queue drained, the coordinator's close read), for a finish.
        self._written = trio.Event()
        self._read = trio.Event()

    async def run(self, up_recv: trio.MemoryReceiveChannel[Upstream], *,
                  durable: bool = False) -> LegEnd:
        """Write the ranks' queue and read the coordinator until the leg ends; how it did.
        ``durable``: the coordinator is lost after ``coord_liveness_timeout`` of silence."""
        self._durable = durable
        self._heard = trio.current_time()
        self._sock = plain_socket(self.stream)
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self.writer, up_recv)
                    await self.reader()  # in the nursery's own task: one task less per leg
        finally:
            self._sock = None
        # Each task ends the leg before it returns; only end() cancels the scope.
        assert self.outcome is not None
        return self.outcome

    def end(self, end: LegEnd) -> None:
        """The leg ends for ``end`` (the first one given counts), as the pump's verdict on it
        says: a finish leaves the other half ``shutdown_grace`` to complete (the writer the
        ranks' last records, the reader the coordinator's close: see :meth:`wind_down`); any
        other verdict stops the leg now. A break during a finish stops it too."""
        if self.outcome is not None:
            if end.breaks and self.verdict is Verdict.FINISH:
                self.cut_short = True
                self._stop()
            return
        self.outcome = end
        self.verdict = self._down.leg_ended(end)
        if self.verdict is not Verdict.FINISH:
            self._stop()

    def _stop(self) -> None:
        # No record is written directly on a connection that is over, even before its writer
        # next runs: one sent now waits in the queue for the next leg (or the ride-out).
        self._sock = None
        self._scope.cancel()

    async def wind_down(self, other: trio.Event) -> None:
        """After a finish, give the ``other`` half ``shutdown_grace`` to end too; then the
        leg is over. (Any other verdict cancelled the leg already.)"""
        with trio.move_on_after(self._config.shutdown_grace):
            await other.wait()
        self._stop()

    def lose(self, reason: str) -> None:
        """The connection is lost (``reason``, unless the session closed for another first)."""
        self.end(LegEnd.lost(self.session.close(reason)))

    def unsent(self) -> list[Upstream]:
        """What the leg did not get onto the wire, in order: the record the kernel took part
        of (resealed on the next connection), the batch in flight, the rest of its backlog."""
        items = [] if self._rest is None else [self._rest[0]]
        self._rest = None
        items += self._in_flight
        self._in_flight = []
        if self._first is not None:
            items += self._first.take(len(self._first))
        return items

    # ------------------------------------------------------------------ writing

    def write_direct(self, item: Upstream) -> bool:
        """Seal ``item`` and hand it to the kernel at once with one ``write``, while the
        writer is parked on an empty queue over plain TCP; False (nothing done) otherwise.
        What the kernel did not take goes to the writer, which finishes it before anything
        else, so records leave whole and in sealing order, and only the writer waits on the
        socket (its stall deadline applies)."""
        park, sock = self._park, self._sock
        if park is None or sock is None:
            return False
        data = self.seal(item)
        written = write_now(sock, data)
        if written != len(data):
            # The rest (all of it when the socket is full or failed: the writer meets the error).
            self._rest = (item, data[written:])
            self._park = None
            park.cancel()
        return True

    def seal(self, item: Upstream) -> bytes:
        """The record of ``item`` on this connection (the next sequence number)."""
        if isinstance(item, tuple):
            return self.session.send_frame(*item)
        return self.session.send(item)

    async def next_batch(self, up_recv: trio.MemoryReceiveChannel[Upstream]
                         ) -> tuple[list[Upstream], bytes] | None:
        """The next batch to write and its sealed bytes: the rest of a record the direct path
        began, what was queued while reconnecting, then a burst of the ranks' queue (each
        record stays whole); None once every rank reader is done."""
        first = self._first
        if self._rest is None and first:
            backlog = first.take(BATCH)
            return backlog, b"".join(self.seal(item) for item in backlog)
        batch: list[Upstream] = []
        if self._rest is None:
            try:
                batch.append(up_recv.receive_nowait())
            except trio.WouldBlock:
                # Parked: write_direct may write meanwhile (and un-park us with a rest).
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
        while len(batch) < BATCH:  # coalesce a burst into one write
            try:
                batch.append(up_recv.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        start = 1 if head else 0
        return batch, head + b"".join(self.seal(item) for item in batch[start:])

    async def writer(self, up_recv: trio.MemoryReceiveChannel[Upstream]) -> None:
        send_all, stall = self.stream.send_all, self._config.write_stall_timeout
        while (taken := await self.next_batch(up_recv)) is not None:
            batch, data = taken
            self._in_flight = batch
            try:
                # A bare CancelScope: fail_after costs a generator-based context manager more
                # per batch.
                with trio.CancelScope(deadline=trio.current_time() + stall) as scope:
                    await send_all(data)
                if scope.cancelled_caught:
                    self.lose(f"upstream write stall: no progress for {stall:g}s")
                    return
            except STREAM_GONE as exc:
                self.lose(f"upstream connection lost while writing ({type(exc).__name__})")
                return
            self._in_flight = []
        # Every rank reader closed its queue clone: the last local rank is gone, and what the
        # ranks queued before leaving (Exiting, RankExit) is written. Ending before this point
        # cancelled the writer with the last rank's records still queued.
        self.end(LegEnd.ranks_gone())
        # Half-close and let the coordinator close first (the reader sees it, within the
        # finish's grace): closing a socket with unread data in it sends a reset, which can
        # destroy the records we just wrote before they are read.
        if isinstance(self.stream, trio.abc.HalfCloseableStream):
            try:
                await self.stream.send_eof()
            except (trio.BusyResourceError, *STREAM_GONE):
                pass
        self._written.set()
        await self.wind_down(self._read)

    # ------------------------------------------------------------------ reading

    async def reader(self) -> None:
        try:
            end = await self.read_until_end()
            self.peer_closed = end.ending is Ending.CLOSED
        except STREAM_GONE as exc:
            end = LegEnd.lost(self.session.close(f"upstream connection lost "
                                                 f"({type(exc).__name__})"))
            self.peer_closed = True  # reset by a coordinator that closed with bytes unread
        self.end(end)
        self._read.set()
        await self.wind_down(self._written)

    async def read_until_end(self) -> LegEnd:
        """Route the coordinator's records to the ranks until the connection ends."""
        session, down, durable = self.session, self._down, self._durable
        receive_some = self._reader.receive_some
        while True:
            event = session.next_event()
            if event is NEED_DATA:
                if not durable:
                    session.receive_data(await receive_some(READ_SIZE))
                    continue
                data = await self.receive_while_alive()
                if data is None:
                    timeout = self._config.coord_liveness_timeout
                    return LegEnd.lost(session.close(f"no record from the coordinator within "
                                                     f"coord_liveness_timeout={timeout:g}s"))
                session.receive_data(data)
                continue
            if durable:
                self._heard = trio.current_time()
            if type(event) is Deliver:
                await trio.lowlevel.checkpoint_if_cancelled()
                down.deliver(event)
            elif type(event) is Invalid:
                down.drop(event.category, event.detail)
            elif type(event) is FenceRank:
                down.fence(event)
            elif type(event) is Cadence:
                down.pace(event.interval)  # Liveness at the coordinator's pace
            elif type(event) is Goodbye:
                self.goodbye = True
                log.info("relay %r: the coordinator is shutting down: %s", session.host,
                         event.reason)
            else:
                assert isinstance(event, EndOfStream)
                return LegEnd.of_eof(event)

    async def receive_while_alive(self) -> bytes | bytearray | None:
        """The next bytes from a durable coordinator; None after ``coord_liveness_timeout``
        without a record from it."""
        with trio.move_on_at(self._heard + self._config.coord_liveness_timeout):
            return await self._reader.receive_some(READ_SIZE)
        return None


__all__ = ["BATCH", "Downstream", "Ending", "Leg", "LegEnd", "Verdict", "verdict"]
