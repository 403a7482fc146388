"""Many handshakes advanced by one task, from one readiness wait (issue 23).

A formation of thousands of relays is CPU-bound in the coordinator, and with one Trio task per
connection most of that CPU was Trio's bookkeeping, not the handshake: a task spawn, a cancel
scope, and a park, an ``epoll`` re-arm and a reschedule for every read (about 0.35 ms of a
relay's 0.55 ms on the bare-Trio floor). :class:`HandshakeHub` instead registers every pending
connection's socket in a private ``epoll`` and waits, in one task, for *that* descriptor to
become readable (an ``epoll`` descriptor is readable while any socket in it is). One wake-up
then reads each ready socket once, feeds its sans-IO machine, and writes what the machine
queued with one ``write``; a deadline heap ends the connections whose peer is too slow. Only
the protocol's outcome leaves the hub, through the callbacks of :class:`HubConn`.

Only plain TCP sockets can be driven this way (:func:`hub_socket`); TLS, in-memory and
user-wrapped streams keep the one-task path. The hub owns a connection's socket while it holds
it: nobody else reads or writes it, and whoever closes it from outside is noticed (its
descriptor is checked before every use, never reused blindly).
"""

from __future__ import annotations

import heapq
import itertools
import os
import select
from collections.abc import Callable
from typing import Any

import trio

from .._errors import FlodlError
from ..wire import NEED_DATA
from ._handshake_io import HANDSHAKE_READ, HandshakeMachine
from ._prefixed_stream import PrefixedStream

# Sockets handled per wake-up at most (then the scheduler's turn again).
POLL_MAX = 512

_EPOLL = getattr(select, "epoll", None)
_IN = getattr(select, "EPOLLIN", 1)
_OUT = getattr(select, "EPOLLOUT", 4)


def hub_socket(stream: object) -> trio.socket.SocketType | None:
    """The socket under ``stream`` when a hub can drive it: a plain ``trio.SocketStream``
    (exactly that type), directly or under the port mux's ``PrefixedStream``; else None (and
    always None where ``select.epoll`` does not exist)."""
    if _EPOLL is None:
        return None
    if type(stream) is PrefixedStream:
        stream = stream.transport_stream
    if type(stream) is not trio.SocketStream:
        return None
    return stream.socket if stream.socket.fileno() >= 0 else None


class HubConn:
    """One connection's handshake in a :class:`HandshakeHub`.

    The hub calls exactly one of ``on_event(event)`` (the machine's next event other than
    NEED_DATA, once everything the machine queued before it is written) and
    ``on_error(exc)``, then forgets the connection; either callback may give it back to the
    hub (:meth:`HandshakeHub.add`) for its next step, with a new ``deadline`` and callbacks.
    Errors: the machine's ``FlodlError`` (what it queued first is written, best effort),
    ``trio.BrokenResourceError`` (the socket failed), ``trio.TooSlowError`` (``deadline``
    passed) and ``trio.ClosedResourceError`` (its socket was closed from outside).

    Attributes:
        stream: the connection (closed by its owner; by the hub only when :meth:`~HandshakeHub.run`
            is cancelled while it holds it).
        machine: its sans-IO handshake.
        deadline: Trio time by which the machine's next event must come.
        on_sent: called after each complete write (the peer's turn begins).
        owner: whatever the callbacks need (the hub never looks at it).
        sock: the socket under ``stream``; the hub's alone to read and write while it holds
            the connection.
        fd: the descriptor the hub registered it under (-1 when not held).
        unsent: bytes the socket did not take yet (the hub writes them when it can).
        held: an event held until ``unsent`` is written.
    """

    __slots__ = ("deadline", "fd", "held", "machine", "on_error", "on_event", "on_sent",
                 "owner", "sock", "stream", "unsent")

    def __init__(self, stream: trio.abc.Stream, sock: trio.socket.SocketType,
                 machine: HandshakeMachine[Any], *, deadline: float,
                 on_event: Callable[[Any], None], on_error: Callable[[BaseException], None],
                 on_sent: Callable[[], None] | None = None, owner: Any = None) -> None:
        self.stream = stream
        self.machine = machine
        self.deadline = deadline
        self.on_event = on_event
        self.on_error = on_error
        self.on_sent = on_sent
        self.owner = owner
        self.sock = sock
        self.fd = -1  # registered under this descriptor while the hub holds it
        self.unsent = bytearray()  # queued bytes the socket did not take yet
        self.held: Any = None  # an event held until ``unsent`` is written

    def held_under(self, fd: int) -> None:
        """The hub holds it, its socket registered under ``fd``."""
        self.fd = fd

    def hold(self, event: Any) -> None:
        """Keep ``event`` until the socket took every byte of :attr:`unsent`."""
        self.held = event

    def take_held(self) -> Any:
        """The event held (None if none), no longer held."""
        event, self.held = self.held, None
        return event

    def let_go(self) -> None:
        """The hub no longer holds it: no descriptor, nothing held, nothing unsent."""
        self.fd = -1
        self.held = None
        self.unsent.clear()

    def then(self, *, deadline: float, on_event: Callable[[Any], None],
             on_error: Callable[[BaseException], None],
             on_sent: Callable[[], None] | None = None) -> None:
        """Its next step (to give it back to the hub with :meth:`HandshakeHub.add`): the
        machine's next event is due by ``deadline`` and goes to ``on_event``."""
        self.deadline = deadline
        self.on_event = on_event
        self.on_error = on_error
        self.on_sent = on_sent


class HandshakeHub:
    """Runs the handshakes of every :class:`HubConn` it is given, in :meth:`run`'s one task.

    Attributes:
        peak: the most connections held at once.
    """

    def __init__(self) -> None:
        if _EPOLL is None:  # pragma: no cover - non-Linux
            raise RuntimeError("HandshakeHub needs select.epoll (Linux); check hub_socket()")
        self._epoll = _EPOLL()
        self._conns: dict[int, HubConn] = {}
        self._deadlines: list[tuple[float, int, HubConn]] = []
        self._seq = itertools.count()
        self._wait_scope: trio.CancelScope | None = None
        self._changed: trio.Event | None = None
        self._draining = False
        self._stopped = False
        # Descriptors still registered while their connection's event is delivered: a
        # callback that gives the connection back for its next step keeps the registration
        # (no epoll_ctl pair per step); the rest are unregistered once the callback returns.
        self._kept: dict[int, trio.socket.SocketType] = {}
        self.peak = 0

    def __len__(self) -> int:
        return len(self._conns)

    @staticmethod
    def supported() -> bool:
        """True where a hub can run (``select.epoll``: Linux)."""
        return _EPOLL is not None

    def add(self, conn: HubConn, data: bytes = b"") -> None:
        """Hold ``conn``: feed it ``data`` (bytes already read for it, such as the port mux's
        peek), write what its machine queued, and wait for its socket. Its callbacks may run
        before this returns (a machine that fails on ``data``).

        Raises:
            trio.ClosedResourceError: the hub stopped.
        """
        if self._stopped:
            raise trio.ClosedResourceError("the handshake hub stopped")
        fd = conn.sock.fileno()
        if fd < 0:
            conn.on_error(trio.ClosedResourceError("the connection was closed"))
            return
        stale = self._conns.get(fd)
        if stale is not None:  # its socket was closed from outside and the number reused
            self._drop(stale)
            stale.on_error(trio.ClosedResourceError("the connection was closed"))
        conn.held_under(fd)
        self._conns[fd] = conn
        if self._kept.get(fd) is conn.sock:  # back for its next step: still registered
            del self._kept[fd]
        else:
            self._epoll.register(fd, _IN)
        self.peak = max(self.peak, len(self._conns))
        heapq.heappush(self._deadlines, (conn.deadline, next(self._seq), conn))
        if self._changed is not None:
            self._changed.set()
        scope = self._wait_scope
        if scope is not None and conn.deadline < scope.deadline:
            scope.deadline = conn.deadline
        if data:
            self._feed(conn, data)
        else:
            self._step(conn)

    def drop(self, conn: HubConn) -> bool:
        """Forget ``conn`` without a callback (its owner ends it); True if the hub held it."""
        if self._conns.get(conn.fd) is not conn:
            return False
        self._drop(conn)
        return True

    def drain(self) -> None:
        """:meth:`run` returns once it holds no connection (nobody will add more)."""
        self._draining = True
        if self._changed is not None:
            self._changed.set()

    async def run(self) -> None:
        """Advance the held handshakes until :meth:`drain` and none is left, or cancelled;
        when cancelled, every connection still held is closed without a callback (as a
        handshake task's connection is when its task is cancelled)."""
        try:
            while not (self._draining and not self._conns):
                if not self._conns:
                    self._changed = trio.Event()
                    await self._changed.wait()
                    self._changed = None
                    continue
                with trio.CancelScope(deadline=self._next_deadline()) as scope:
                    self._wait_scope = scope
                    await trio.lowlevel.wait_readable(self._epoll.fileno())
                self._wait_scope = None
                self._poll()
                self._expire(trio.current_time())
        finally:
            self._wait_scope = None
            self._stopped = True
            held = list(self._conns.values())
            for conn in held:
                self._drop(conn)
            for conn in held:
                if conn.sock.fileno() >= 0:
                    conn.sock.close()
            self._epoll.close()

    # ------------------------------------------------------------------ inside run()

    def _next_deadline(self) -> float:
        heap = self._deadlines
        while heap:
            deadline, _, conn = heap[0]
            if self._conns.get(conn.fd) is conn and conn.deadline == deadline:
                return deadline
            heapq.heappop(heap)  # ended, or moved to a later step
        return float("inf")

    def _poll(self) -> None:
        for fd, mask in self._epoll.poll(0, POLL_MAX):
            conn = self._conns.get(fd)
            if conn is None:  # pragma: no cover - unregistered before it was polled
                continue
            if conn.sock.fileno() != fd:  # closed from outside since the wait
                self._drop(conn)
                conn.on_error(trio.ClosedResourceError("the connection was closed"))
                continue
            if conn.unsent and mask & _OUT:
                self._flush(conn)
                if self._conns.get(fd) is not conn:
                    continue
            if mask & ~_OUT:  # readable, or an error / hang-up the read meets
                self._read(conn)

    def _expire(self, now: float) -> None:
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, _, conn = heapq.heappop(heap)
            if self._conns.get(conn.fd) is conn and conn.deadline == deadline:
                self._drop(conn)
                conn.on_error(trio.TooSlowError())

    def _read(self, conn: HubConn) -> None:
        try:
            data = os.read(conn.fd, HANDSHAKE_READ)
        except BlockingIOError:
            return
        except OSError as exc:  # as trio's SocketStream: any error is a broken stream
            self._fail(conn, trio.BrokenResourceError(f"reading: {exc!r}"))
            return
        self._feed(conn, data)

    def _feed(self, conn: HubConn, data: bytes) -> None:
        try:
            conn.machine.receive_data(data)
        except FlodlError as exc:
            self._fail(conn, exc)
            return
        self._step(conn)

    def _step(self, conn: HubConn) -> None:
        machine = conn.machine
        try:
            event = machine.next_event()
        except FlodlError as exc:
            # What it queued before failing was due (a Challenge ahead of a replayed Hello in
            # the same read): the peer sees it, if the socket takes it now.
            if (out := machine.data_to_send()) and not conn.unsent:
                self._write_some(conn, out)
            self._fail(conn, exc)
            return
        if out := machine.data_to_send():
            if conn.unsent:
                conn.unsent.extend(out)
            else:
                written = self._write_some(conn, out)
                if written < 0:
                    self._fail(conn, trio.BrokenResourceError(f"writing: {os.strerror(-written)}"))
                    return
                if written < len(out):
                    conn.unsent.extend(out[written:])
                    self._epoll.modify(conn.fd, _IN | _OUT)
                elif conn.on_sent is not None:
                    conn.on_sent()
        if event is NEED_DATA:
            return
        if conn.unsent:
            conn.hold(event)  # delivered once the socket took everything before it
            return
        self._deliver(conn, event)

    def _deliver(self, conn: HubConn, event: Any) -> None:
        """Forget ``conn`` and call its ``on_event``; its descriptor stays registered for
        the callback to give it back (:meth:`add`), else it is unregistered afterwards."""
        fd, sock = conn.fd, conn.sock
        self._kept[fd] = sock
        self._forget(conn)
        try:
            conn.on_event(event)
        finally:
            if self._kept.get(fd) is sock:
                del self._kept[fd]
                self._unregister(fd, sock)

    def _flush(self, conn: HubConn) -> None:
        written = self._write_some(conn, conn.unsent)
        if written < 0:
            self._fail(conn, trio.BrokenResourceError(f"writing: {os.strerror(-written)}"))
            return
        del conn.unsent[:written]
        if conn.unsent:
            return
        self._epoll.modify(conn.fd, _IN)
        if conn.on_sent is not None:
            conn.on_sent()
        event = conn.take_held()
        if event is not None:
            self._deliver(conn, event)

    @staticmethod
    def _write_some(conn: HubConn, data: bytes | bytearray) -> int:
        """How many bytes the socket took without waiting; minus the errno when it failed."""
        try:
            return os.write(conn.fd, data)
        except BlockingIOError:
            return 0
        except OSError as exc:
            return -(exc.errno or 1)

    def _fail(self, conn: HubConn, exc: BaseException) -> None:
        if self._conns.get(conn.fd) is conn:
            self._drop(conn)
        conn.on_error(exc)

    def _drop(self, conn: HubConn) -> None:
        fd = conn.fd
        held = self._conns.get(fd) is conn
        self._forget(conn)
        if held:
            self._unregister(fd, conn.sock)

    def _forget(self, conn: HubConn) -> None:
        if self._conns.get(conn.fd) is conn:
            del self._conns[conn.fd]
        conn.let_go()

    def _unregister(self, fd: int, sock: trio.socket.SocketType) -> None:
        if sock.fileno() == fd:  # closed (from outside, or by a callback): the kernel removed it
            try:
                self._epoll.unregister(fd)
            except OSError:  # pragma: no cover - already gone
                pass
