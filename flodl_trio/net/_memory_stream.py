"""The streams of :class:`~flodl_trio.testing.MemoryNetwork`: one connection, two bounded pipes.

Each direction of a :class:`MemoryConnection` is a :class:`Pipe` of ``buffer_size`` bytes, so a
writer whose peer stops reading blocks in ``send_all`` exactly as on a full TCP window. The public
names are re-exported by :mod:`flodl_trio.testing`, where users find them.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from contextlib import contextmanager

import trio

__all__ = ["ConflictGuard", "MemoryConnection", "MemoryStream", "Pipe"]


class ConflictGuard:
    """Raises :class:`trio.BusyResourceError` when two tasks use one half of a stream at once."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._held = False

    @contextmanager
    def hold(self) -> Iterator[None]:
        if self._held:
            raise trio.BusyResourceError(f"another task is already in {self._what} on this stream")
        self._held = True
        try:
            yield
        finally:
            self._held = False


class Pipe:
    """One direction of a connection: a bounded byte buffer and the state of both its ends."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.buffer = bytearray()
        # The writer sent EOF (send_eof or aclose): the reader drains, then sees b"".
        self.eof = False
        # The reader closed: the writer's send_all raises BrokenResourceError, like EPIPE.
        self.reader_gone = False
        self.changed = trio.lowlevel.ParkingLot()

    def wake(self) -> None:
        self.changed.unpark_all()

    def write(self, chunk: bytes) -> None:
        """Buffer ``chunk`` for the reader (the writer checked there is room) and wake it."""
        self.buffer += chunk
        self.wake()

    def end_writing(self) -> None:
        """The writer sent EOF: the reader drains what is buffered, then sees ``b""``."""
        self.eof = True
        self.wake()

    def end_reading(self) -> None:
        """The reader closed: what is buffered is dropped, and what the writer sends from now
        on has nowhere to go."""
        self.reader_gone = True
        self.buffer.clear()
        self.wake()


class MemoryConnection:
    """The record of one connection made through a :class:`MemoryNetwork`.

    Attributes:
        name: the listener name that was dialled.
        index: the per-network connection number (1, 2, ...), also the server end's
            ``remote_address[1]``.
        client: the dialer's end.
        server: the end returned by :meth:`MemoryListener.accept`.
        bytes_to_server: bytes the client's ``send_all`` put into the client→server buffer.
        bytes_to_client: bytes the server's ``send_all`` put into the server→client buffer.
        was_reset: whether either end called :meth:`MemoryStream.reset`.
    """

    def __init__(self, name: str, index: int, buffer_size: int) -> None:
        self.name = name
        self.index = index
        self.bytes_to_server = 0
        self.bytes_to_client = 0
        self.was_reset = False
        self._to_server = Pipe(buffer_size)
        self._to_client = Pipe(buffer_size)
        self.client = MemoryStream(self, is_client=True)
        self.server = MemoryStream(self, is_client=False)

    def count_sent(self, count: int, *, by_client: bool) -> None:
        """``count`` more bytes put into the buffer towards the server (or the client)."""
        if by_client:
            self.bytes_to_server += count
        else:
            self.bytes_to_client += count

    def pipes(self, *, is_client: bool) -> tuple[Pipe, Pipe]:
        """The (outgoing, incoming) buffers of one end."""
        if is_client:
            return self._to_server, self._to_client
        return self._to_client, self._to_server

    def _reset(self) -> None:
        self.was_reset = True
        for pipe in (self._to_server, self._to_client):
            pipe.buffer.clear()
            pipe.wake()

    def __repr__(self) -> str:
        return (
            f"<MemoryConnection mem:{self.name} #{self.index} up={self.bytes_to_server}B "
            f"down={self.bytes_to_client}B{' reset' if self.was_reset else ''}>"
        )


class MemoryStream(trio.abc.HalfCloseableStream):
    """One end of an in-memory connection, with TCP-like semantics.

    Attributes:
        connection: the :class:`MemoryConnection` this end belongs to.
        is_client: True for the dialer's end, False for the accepted end.
        local_address: ``("mem:<name>", n)`` for a client end, ``("mem:<name>", 0)`` for a server.
        remote_address: the peer's ``local_address``.
    """

    def __init__(self, connection: MemoryConnection, *, is_client: bool) -> None:
        self.connection = connection
        self.is_client = is_client
        host = f"mem:{connection.name}"
        client_address, server_address = (host, connection.index), (host, 0)
        self.local_address = client_address if is_client else server_address
        self.remote_address = server_address if is_client else client_address
        self._outgoing, self._incoming = connection.pipes(is_client=is_client)
        self._closed = False  # our own aclose() ran: our calls raise ClosedResourceError
        self._released = False  # closed or reset by us: no longer counted as open
        self._eof_sent = False
        self._send_guard = ConflictGuard("send_all/send_eof")
        self._receive_guard = ConflictGuard("receive_some")

    @property
    def peer(self) -> MemoryStream:
        """The other end of this connection."""
        return self.connection.server if self.is_client else self.connection.client

    @property
    def peer_name(self) -> str:
        """The peer's address as one readable string, e.g. ``"mem:coord:3"``."""
        host, number = self.remote_address
        return f"{host}:{number}"

    @property
    def is_open(self) -> bool:
        """Whether this end has been neither closed nor reset by its owner."""
        return not self._released

    def _check_usable(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError(f"this end of {self.peer_name} was closed")
        if self.connection.was_reset:
            raise trio.BrokenResourceError(f"connection {self.peer_name} was reset")

    def _check_can_send(self) -> None:
        self._check_usable()
        if self._eof_sent:
            raise trio.ClosedResourceError(f"send_eof() was already called on {self.peer_name}")
        if self._outgoing.reader_gone:
            raise trio.BrokenResourceError(f"peer {self.peer_name} closed the connection")

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Write all of ``data``, blocking while the peer's receive buffer is full.

        Args:
            data: the bytes to send.

        Raises:
            trio.BusyResourceError: another task is already sending on this end.
            trio.ClosedResourceError: this end was closed, or ``send_eof`` was called.
            trio.BrokenResourceError: the peer closed its end, or the connection was reset.
        """
        with self._send_guard.hold():
            self._check_can_send()
            # Copy first: the caller may reuse its buffer once we return, and a partial write
            # must not see later mutations.
            payload = bytes(data)
            await trio.lowlevel.checkpoint()
            pipe, sent = self._outgoing, 0
            while True:
                self._check_can_send()
                if sent >= len(payload):
                    return
                room = pipe.capacity - len(pipe.buffer)
                if room > 0:
                    chunk = payload[sent : sent + room]
                    pipe.write(chunk)
                    sent += len(chunk)
                    self.connection.count_sent(len(chunk), by_client=self.is_client)
                    continue
                await pipe.changed.park()

    async def wait_send_all_might_not_block(self) -> None:
        """Block until the peer's receive buffer has room (or sending would fail at once)."""
        with self._send_guard.hold():
            await trio.lowlevel.checkpoint()
            while True:
                self._check_can_send()
                if len(self._outgoing.buffer) < self._outgoing.capacity:
                    return
                await self._outgoing.changed.park()

    async def send_eof(self) -> None:
        """Half-close: the peer reads what was sent, then EOF; this end can still receive.

        Idempotent, like ``shutdown(SHUT_WR)``.

        Raises:
            trio.BusyResourceError: another task is sending on this end.
            trio.ClosedResourceError: this end was closed.
            trio.BrokenResourceError: the connection was reset.
        """
        with self._send_guard.hold():
            self._check_usable()
            await trio.lowlevel.checkpoint()
            self._check_usable()
            self._eof_sent = True
            self._outgoing.end_writing()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """Return the bytes available (at most ``max_bytes``), blocking while there are none.

        Args:
            max_bytes: the most bytes to return; None means everything buffered.

        Returns:
            Some bytes, or ``b""`` once the peer sent EOF and the buffer is drained.

        Raises:
            ValueError: ``max_bytes`` is less than 1.
            trio.BusyResourceError: another task is already receiving on this end.
            trio.ClosedResourceError: this end was closed.
            trio.BrokenResourceError: the connection was reset.
        """
        if max_bytes is not None:
            max_bytes = operator.index(max_bytes)
            if max_bytes < 1:
                raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        with self._receive_guard.hold():
            self._check_usable()
            await trio.lowlevel.checkpoint()
            pipe = self._incoming
            while True:
                self._check_usable()
                if pipe.buffer:
                    count = len(pipe.buffer) if max_bytes is None else max_bytes
                    chunk = bytes(pipe.buffer[:count])
                    del pipe.buffer[:count]
                    pipe.wake()
                    return chunk
                if pipe.eof:
                    return b""
                await pipe.changed.park()

    def close_now(self) -> None:
        """Close this end at once, without checkpointing (idempotent): :meth:`aclose` minus its
        checkpoint, for synchronous cleanup such as a listener closing the connections nobody
        accepted.

        The peer's reads drain what this end already sent, then return ``b""``; the peer's
        ``send_all`` raises :class:`trio.BrokenResourceError`; calls on this end raise
        :class:`trio.ClosedResourceError`, including ones blocked in other tasks.
        """
        if self._closed:
            return
        self._closed = True
        self._released = True
        # The peer drains what we already sent, then sees EOF.
        self._outgoing.end_writing()
        # Whatever the peer sends from now on has nowhere to go.
        self._incoming.end_reading()

    async def aclose(self) -> None:
        """Close this end (idempotent; always checkpoints, closes even when cancelled).

        The peer's reads drain buffered data then return ``b""``; the peer's ``send_all`` raises
        :class:`trio.BrokenResourceError`; calls on this end raise
        :class:`trio.ClosedResourceError`, including ones blocked in other tasks.
        """
        self.close_now()
        await trio.lowlevel.checkpoint()

    def reset(self) -> None:
        """Simulate a TCP RST: every pending and future call on *both* ends raises.

        Buffered data in both directions is dropped; the peer's ``receive_some`` raises
        :class:`trio.BrokenResourceError` instead of returning EOF. This end counts as closed for
        :meth:`MemoryNetwork.assert_all_closed`; the peer still has to be closed by its owner.
        """
        self._released = True
        self.connection._reset()

    abort = reset

    def __repr__(self) -> str:
        side = "client" if self.is_client else "server"
        state = "open" if self.is_open else "closed"
        return (
            f"<MemoryStream {side} of mem:{self.connection.name} #{self.connection.index} {state}>"
        )

