"""One authenticated relay connection, as the coordinator sees it."""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Callable, Iterator
from typing import Literal, NamedTuple, TypeVar

import trio

from ..net._transport import STREAM_GONE
from ..port_mux import PrefixedStream
from ..wire import (
    CoordinatorSession,
    FenceRank,
    FrameCodec,
    Goodbye,
    RecordOpener,
    RecordSealer,
)
from ._roster import ranks_text

_T = TypeVar("_T")
_Item = tuple[bytes, int, "Delivery | None"]
_RECORD = 0  # queue item: sealed bytes (a whole record, or the rest of a direct write)
_EOF = -1  # queue marker: half-close after everything queued before it
_RETIRE = -2  # queue marker: half-close, give the relay a grace to close first, then close
_BATCH = 64
# Records queued for one relay's writer, at most: far beyond any burst a healthy relay sees
# (the writer takes 64 at a time), so a queue this full is a relay that does not read.
QUEUE_LIMIT = 65536


class _Queue(NamedTuple):
    send: trio.MemorySendChannel[_Item]
    receive: trio.MemoryReceiveChannel[_Item]


class Lifecycle(enum.Enum):
    """Where a relay connection is in its life. Only the connection advances it, forward only:
    ``AWAITING`` or ``ADMITTED`` -> ``JOINED`` -> ``ENDED`` (a connection may end from any of
    them). Whether its stream is closed yet is apart (``RelayConn.closed``): the end comes
    first, the close when the writer is done."""

    AWAITING = "awaiting its resume"  # a relay of an adopted session: no connection yet
    ADMITTED = "admitted"  # its Hello was accepted; its Ready has not verified yet
    JOINED = "joined"  # its Ready verified: its session is open, records may be written
    ENDED = "ended"  # lost, stalled or retired: ``close_reason`` says which and why


OnLost = Callable[["RelayConn", str, bool], None]


def _unheard(conn: RelayConn, cause: str, stalled: bool) -> None:
    """The default ``on_lost``: nobody is told (a connection that never joined)."""


class CloseReason(NamedTuple):
    """Why a relay connection ended, the first time it did: ``lost`` (its stream broke or
    ended, or it was superseded), ``stalled`` (the writer made no progress for
    ``write_stall_timeout``) or ``retired`` (the coordinator closed it on purpose)."""

    kind: Literal["lost", "stalled", "retired"]
    text: str


class Delivery:
    """Completion of one send or one broadcast: how many relays are still to write it."""

    __slots__ = ("done", "failures", "on_done", "pending")

    def __init__(self, pending: int,
                 on_done: Callable[[Delivery], None] | None = None) -> None:
        self.pending = pending
        self.done = trio.Event()
        self.failures: dict[RelayConn, str] = {}
        self.on_done = on_done  # called once every relay has written it or failed
        if pending == 0:
            self._finish()

    def settle(self, conn: RelayConn, failure: str | None) -> None:
        if failure is not None:
            self.failures[conn] = failure
        self.pending -= 1
        if self.pending == 0:
            self._finish()

    def _finish(self) -> None:
        self.done.set()
        if self.on_done is not None:
            self.on_done(self)


def direct_socket(stream: trio.abc.Stream) -> trio.socket.SocketType | None:
    """The TCP socket a record may be written to directly: under a plain (port-mux routed)
    ``SocketStream``; None for TLS, in-memory and any other stream."""
    if isinstance(stream, PrefixedStream):
        stream = stream.transport_stream
    return stream.socket if isinstance(stream, trio.SocketStream) else None


class RelayConn:
    """An authenticated upstream connection: its ranks, its sealed directions, its writer.

    Every record is sealed by the connection's :class:`~flodl_trio.wire.CoordinatorSession`
    (``session``, opened once the join is confirmed and before the writer starts; the reader
    reads through the same object), which alone decides what may go to a relay. Records go
    through one writer task (``run_writer``, started the first time it is needed: see the fast
    path) fed by a queue of at most ``queue_limit`` records, so a broadcast costs one
    ``send_nowait`` per relay, a burst is coalesced into one write, records are sealed when
    submitted, in the order they are written, and a stalled relay delays nobody but itself:
    its writer gives up after ``write_stall_timeout`` and the connection is lost. A queue that
    fills up is a stall too (its relay is not reading at the pace it is sent to): the record
    that does not fit is settled as lost and the connection is lost with ``queue full``, as
    after a write stall.

    Its life is one :class:`Lifecycle` (``lifecycle``) that only its own methods advance: made
    ``ADMITTED`` (or ``AWAITING`` its resume), ``JOINED`` by :meth:`open_session`, ``ENDED`` by
    :meth:`abandon` or :meth:`retire`. Its end is one :class:`CloseReason` (``close_reason``, the
    first wins); ``lost_reason``, ``retired`` and ``stalled`` are read from it. ``closed`` says
    whether the stream itself is closed yet (``/state.json``'s ``closed``; ``connected`` turns
    false first). While its reader waits for room in a full channel (:meth:`reading_paused`)
    the coordinator is not reading it, so its ranks' silence does not count (``paused``).

    Fast path: when the writer is idle with nothing queued and the stream is plain TCP, the
    record is sealed and handed to the kernel at once with one non-blocking ``write``; whatever
    the socket did not take goes to the writer as the first thing it writes. So records still
    leave whole, in sealing order, one writer at a time, and a full socket still only waits in
    the writer -- but a broadcast to an idle cluster costs no task switch per relay (on a
    shared core those switches were most of its latency).
    """

    def __init__(
        self,
        *,
        host: str,
        ranks: tuple[int, ...],
        peer: str,
        stream: trio.abc.Stream | None,
        sealer: RecordSealer | None,
        opener: RecordOpener | None,
        write_stall_timeout: float,
        index: int,
        model_sigs: dict[str, bytes] | None = None,
        queue_limit: int = QUEUE_LIMIT,
        on_lost: OnLost = _unheard,
    ) -> None:
        self.host = host
        self.model_sigs: dict[str, bytes] = dict(model_sigs or {})
        self.ranks = ranks
        self.rank_set = frozenset(ranks)
        self.peer = peer
        # None: a relay of an adopted session that has not resumed yet (``awaiting_resume``).
        self._stream = stream
        self._sealer = sealer
        self._opener = opener
        self.session: CoordinatorSession | None = None  # once joined: see open_session
        # The heartbeat period this connection was told (Cadence), None: none yet.
        self.cadence: float | None = None
        self.write_stall_timeout = write_stall_timeout
        self.index = index
        # Told when its writer finds the connection lost (liveness.relay_lost); ``stalled`` for
        # a write stall. Nothing is written before it joined, so nothing calls it before.
        self.on_lost: OnLost = on_lost
        self._lifecycle = Lifecycle.AWAITING if stream is None else Lifecycle.ADMITTED
        self.queue_limit = queue_limit
        # The writer's queue and task, made on the first record the kernel did not take at
        # once (most relays never need either: see the class doc's fast path).
        self._queue: _Queue | None = None
        self._writers: trio.Nursery | None = None  # where the writer runs (start_writer)
        self._writer_started = False
        self.close_reason: CloseReason | None = None
        # Backpressure bookkeeping: while the reader waits on a full channel the coordinator is
        # not reading this connection, so that time must not count towards heartbeat staleness.
        # A relay awaiting its resume is not read either: its silence never counts.
        self._paused_since: float | None = None if stream is not None else trio.current_time()
        self._delivery_scope: trio.CancelScope | None = None
        self._write_scope: trio.CancelScope | None = None
        self.closed = False  # the stream is closed (after the end, at the writer's exit)
        self._retire_grace = 0.0
        # Set once the connection is abandoned (lost, or its reader ended): nothing more is
        # written, whatever its close reason (a retired connection is abandoned at its end).
        self._ended = trio.Event()
        self._socket = None if stream is None else direct_socket(stream)
        self._queued = 0  # items in the queue the writer has not taken yet
        self._writing = False  # the writer holds a batch

    @classmethod
    def awaiting(cls, *, host: str, ranks: tuple[int, ...], model_sigs: dict[str, bytes],
                 index: int, write_stall_timeout: float) -> RelayConn:
        """A relay of an adopted session (SPEC §4.7) that has not resumed yet: it carries its
        ranks in the roster, but has no connection; nothing can be written to it (its ranks'
        silence is not counted: it is ``paused``) until a connection of the relay
        resumes and takes its ranks over."""
        return cls(host=host, ranks=ranks, peer="(not resumed)", stream=None, sealer=None,
                   opener=None, write_stall_timeout=write_stall_timeout, index=index,
                   model_sigs=model_sigs)

    @property
    def lifecycle(self) -> Lifecycle:
        return self._lifecycle

    @property
    def awaiting_resume(self) -> bool:
        """A relay of an adopted session that has not resumed (nor been given up on) yet."""
        return self._lifecycle is Lifecycle.AWAITING

    @property
    def paused(self) -> bool:
        """Its ranks' silence does not count now: its reader waits for room in a full channel,
        or it is a relay awaiting its resume."""
        return self._paused_since is not None

    @contextlib.contextmanager
    def reading_paused(self) -> Iterator[None]:
        """Around the reader's wait for room in a full channel: the coordinator is not reading
        this connection meanwhile (:attr:`paused`), and :meth:`stop_delivery` ends the wait."""
        self._paused_since = trio.current_time()
        try:
            with trio.CancelScope() as scope:
                self._delivery_scope = scope
                yield
        finally:
            self._delivery_scope = None
            self._paused_since = None

    def stop_delivery(self) -> None:
        """Shutdown: nobody reads the channels any more; the reader's wait for room ends."""
        if self._delivery_scope is not None:
            self._delivery_scope.cancel()

    def told_cadence(self, period: float) -> None:
        """The relay was told (or is being told) to pace its heartbeats to ``period``."""
        self.cadence = period

    @property
    def stream(self) -> trio.abc.Stream:
        """The connection's stream (``trio.ClosedResourceError`` while awaiting a resume)."""
        return self._connected(self._stream)

    @property
    def sealer(self) -> RecordSealer:
        return self._connected(self._sealer)

    @property
    def opener(self) -> RecordOpener:
        return self._connected(self._opener)

    def _connected(self, part: _T | None) -> _T:
        if part is None:
            raise trio.ClosedResourceError(f"{self.describe()}: no connection (awaiting its "
                                           "resume)")
        return part

    @property
    def alive(self) -> bool:
        """Connected and not ended (a relay awaiting its resume is not connected yet)."""
        return (self._lifecycle is Lifecycle.ADMITTED or self._lifecycle is Lifecycle.JOINED
                ) and not self.closed

    @property
    def lost_reason(self) -> str | None:
        """Why the connection was lost (a stall included), or None."""
        end = self.close_reason
        return None if end is None or end.kind == "retired" else end.text

    @property
    def retired(self) -> str | None:
        """Why the coordinator closed it on purpose, or None."""
        end = self.close_reason
        return end.text if end is not None and end.kind == "retired" else None

    @property
    def stalled(self) -> bool:
        """The writer gave up: no progress for ``write_stall_timeout`` (or its queue filled)."""
        end = self.close_reason
        return end is not None and end.kind == "stalled"

    @property
    def idle(self) -> bool:
        """Nothing queued and no write in progress: the relay takes what it is given."""
        return self._write_scope is None and not self._queued

    def open_session(self, codec: FrameCodec) -> CoordinatorSession:
        """The connection's one session, opened once its join is confirmed (its ``Ready``
        verified) and before its writer starts: the connection is ``JOINED``. Later calls
        return the same object."""
        if self.session is None:
            # Records that came in the same read as the relay's Ready are in the opener already.
            self.session = CoordinatorSession(self.opener, self.sealer, codec, host=self.host,
                                              ranks=self.ranks)
            if self._lifecycle is Lifecycle.ADMITTED:
                self._lifecycle = Lifecycle.JOINED
        return self.session

    def submit_frame(self, rank: int, frame: bytes, delivery: Delivery | None) -> None:
        """Queue the DATA record of a ``ControlMsg`` frame for ``rank``; ``delivery`` is settled
        once it is written or lost.

        Raises:
            WireError: the session refused it (a frame that only flows towards the
                coordinator, or a rank this relay does not carry); nothing was queued.
        """
        session = self._writable(delivery)
        if session is not None:
            self._put(session.send_frame(rank, frame), delivery)

    def submit_fanout(self, ranks: list[int], frame: bytes, delivery: Delivery | None) -> None:
        """Queue the FANOUT record of a ``ControlMsg`` frame for ``ranks`` (see
        :meth:`submit_frame`)."""
        session = self._writable(delivery)
        if session is not None:
            self._put(session.send_fanout(ranks, frame), delivery)

    def submit_control(self, msg: Goodbye | FenceRank, delivery: Delivery | None) -> None:
        """Queue the CONTROL record of ``msg`` for the relay itself (see :meth:`submit_frame`;
        only ``Goodbye`` and ``FenceRank`` go this way)."""
        session = self._writable(delivery)
        if session is not None:
            self._put(session.send(msg), delivery)

    def _writable(self, delivery: Delivery | None) -> CoordinatorSession | None:
        """The session to seal with, or None (``delivery`` settled as failed): the connection
        ended, or it has not joined yet (the handshake still owns the stream)."""
        session = self.session
        if self._lifecycle is Lifecycle.JOINED and not self.closed:
            return session
        if delivery is not None:
            delivery.settle(self, f"connection lost ({self._end_text()})" if session is not None
                            else "not resumed yet" if self._stream is None
                            else "not joined yet (its Ready has not verified)")
        return None

    def _put(self, record: bytes, delivery: Delivery | None) -> None:
        if self._socket is not None and not self._queued and not self._writing:
            self._write_now(self._socket, record, delivery)
            return
        self._enqueue(record, _RECORD, delivery)

    def _mark(self, mark: int, delivery: Delivery | None) -> None:
        """Queue a half-close marker behind everything queued so far."""
        if self._writable(delivery) is not None:
            self._enqueue(b"", mark, delivery)

    def _enqueue(self, data: bytes, mark: int, delivery: Delivery | None) -> None:
        try:
            self._open_queue().send.send_nowait((data, mark, delivery))
        except trio.WouldBlock:
            # Never wait on one relay: a queue this full is a relay that does not read.
            failure = (f"queue full: {self.queue_limit} records not yet written (the relay "
                       "reads slower than it is sent to)")
            if delivery is not None:
                delivery.settle(self, failure)
            self.on_lost(self, failure, True)
            return
        except STREAM_GONE:
            if delivery is not None:
                delivery.settle(self, "connection closed")
            return
        self._queued += 1
        self._spawn_writer()

    def _open_queue(self) -> _Queue:
        if self._queue is None:
            send, receive = trio.open_memory_channel[_Item](self.queue_limit)
            self._queue = _Queue(send, receive)
            if self.closed or self._ended.is_set():
                send.close()
        return self._queue

    def start_writer(self, nursery: trio.Nursery) -> None:
        """Run this connection's writer (:meth:`run_writer`) in ``nursery`` once it has
        something to write that the kernel did not take at once, or to close the stream once
        the connection is abandoned; until then it costs no task."""
        self._writers = nursery
        if self._queued or self._ended.is_set():
            self._spawn_writer()

    def _spawn_writer(self) -> None:
        if self._writer_started or self._writers is None:
            return
        self._writer_started = True
        try:
            self._writers.start_soon(self.run_writer)
        except RuntimeError:  # the writers' nursery closed (after shutdown): nothing to write
            pass

    def _write_now(self, sock: trio.socket.SocketType, record: bytes,
                   delivery: Delivery | None) -> None:
        """The fast path: the writer is idle and nothing is queued (see the class doc)."""
        fd = sock.fileno()
        written = 0
        if fd >= 0:  # -1 once closed: never write to a number the OS may have reused
            try:
                written = os.write(fd, record)
            except BlockingIOError:
                written = 0  # full: the writer writes it
            except OSError as exc:
                # The socket's error (ETIMEDOUT from TCP_USER_TIMEOUT, a reset, EHOSTUNREACH)
                # is reported once, to whichever call asks first: say it now, or the reader's
                # end of stream that follows would be taken for the relay closing.
                failure = f"connection reset ({exc!r})"
                if delivery is not None:
                    delivery.settle(self, failure)
                self.on_lost(self, failure, False)
                return
        if written == len(record):
            if delivery is not None:
                delivery.settle(self, None)
            return
        self._enqueue(record[written:], _RECORD, delivery)

    def submit_eof(self, delivery: Delivery | None, *, goodbye: str) -> None:
        """Say ``Goodbye{goodbye}`` (FT/2: the relay tells a clean end from a coordinator that
        died), then half-close, once everything queued so far is written."""
        self.submit_control(Goodbye(reason=goodbye), None)
        self._mark(_EOF, delivery)

    def retire(self, reason: str, grace: float) -> None:
        """Close on purpose once everything queued so far is written: half-close, wait up to
        ``grace`` for the relay to close its side (so nothing in flight turns into a reset),
        then close. Nothing more can be submitted. A ``Goodbye`` with the reason goes first
        (FT/2), so the relay ends knowing it was closed on purpose."""
        self.submit_control(Goodbye(reason=reason), None)
        self._mark(_RETIRE, None)
        if self.close_reason is None:
            self.close_reason = CloseReason("retired", reason)
            self._lifecycle = Lifecycle.ENDED
        self._retire_grace = grace

    async def run_writer(self) -> None:
        """The single writer of this connection (runs in the coordinator's nursery)."""
        self._writer_started = True
        try:
            receive = self._open_queue().receive
            async for item in receive:
                batch = [item]
                while len(batch) < _BATCH:
                    try:
                        batch.append(receive.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                self._queued -= len(batch)
                self._writing = True
                abandoned = self._ended.is_set()
                stalled = False
                if abandoned:
                    failure: str | None = f"connection lost ({self._end_text()})"
                else:
                    failure, stalled = await self._write(batch)
                self._writing = False
                for _, _, delivery in batch:
                    if delivery is not None:
                        delivery.settle(self, failure)
                if failure is not None and not abandoned:
                    self.on_lost(self, failure, stalled)
                elif failure is None and any(mark == _RETIRE for _, mark, _ in batch):
                    with trio.move_on_after(self._retire_grace):
                        await self._ended.wait()  # the relay closed its side: the reader ended
                    break
        finally:
            # Lost, shut down, or cancelled before it wrote anything (the writers stopped
            # while a step-down had just started it): the stream is closed all the same, and
            # the reader must stop too.
            with trio.CancelScope(shield=True):
                await self.close()

    async def _write(self, batch: list[tuple[bytes, int, Delivery | None]]
                     ) -> tuple[str | None, bool]:
        """Write one batch: (None, False), or the failure and whether it was a stall."""
        data = b"".join([record for record, _, _ in batch])
        half_close = any(mark != _RECORD for _, mark, _ in batch)
        try:
            with trio.CancelScope(deadline=trio.current_time() + self.write_stall_timeout) as cs:
                self._write_scope = cs
                if data:
                    await self.stream.send_all(data)
                if half_close:
                    if isinstance(self.stream, trio.abc.HalfCloseableStream):
                        await self.stream.send_eof()
                    else:
                        await self.close()
        except STREAM_GONE as exc:
            return f"connection closed while writing ({type(exc).__name__})", False
        finally:
            self._write_scope = None
        if self._ended.is_set():  # abandoned while writing: the write was cancelled
            return f"connection lost ({self._end_text()})", False
        if cs.cancelled_caught:
            return f"write stall: no progress for {self.write_stall_timeout:g}s", True
        return None, False

    def _end_text(self) -> str:
        return "closed" if self.close_reason is None else self.close_reason.text

    def abandon(self, reason: str, *, stalled: bool = False) -> bool:
        """The connection is lost: the writer stops writing at once, settles what is queued as
        lost and closes the stream (which ends the reader too). True when this call ended it
        (its ``close_reason`` is ``reason``); False when it had ended already (lost, or
        retired: then this is the end of its retirement)."""
        first = self.close_reason is None
        if first:
            self.close_reason = CloseReason("stalled" if stalled else "lost", reason)
            self._lifecycle = Lifecycle.ENDED
        self._ended.set()
        if self._queue is not None:
            self._queue.send.close()
        if self._write_scope is not None:
            self._write_scope.cancel()
        self._spawn_writer()  # its end closes the stream
        return first

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self._queue is not None:
                self._queue.send.close()
            if self._stream is not None:
                await trio.aclose_forcefully(self._stream)
            else:
                await trio.lowlevel.checkpoint()

    def describe(self) -> str:
        return f"relay {self.host!r} at {self.peer} (ranks {ranks_text(self.ranks)})"
