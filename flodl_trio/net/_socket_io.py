"""Reads and writes that skip Trio's generic stream machinery on a plain TCP socket.

The relay and the rank endpoint read one connection from one task, and most of their writes find
the socket idle. For those, Trio's ``SocketStream`` does more than the wire needs: its
``receive_some`` first tries ``recv`` on a socket that the last read drained (the system call
fails with ``EAGAIN``, Python raises and catches ``BlockingIOError``), then waits, then calls
``recv`` again; its ``send_all`` takes a conflict detector and two checkpoints per frame. At
hundreds of connections per process those were a large share of the relay's CPU (issue 23).

:class:`Reader` waits for readability *before* reading once a read found the socket drained,
so a read is one ``read`` system call; :func:`write_now` hands bytes to the kernel without
waiting and says how many it took (the caller queues the rest for its writer). The
coordinator's reader of each relay and its handshakes use them too, through the port mux's
:class:`~._prefixed_stream.PrefixedStream` once its peeked bytes were read back. Anything that
is not plain TCP (TLS, in-memory, a user's wrapper) goes through the stream's own methods,
unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import trio

from ..wire import NEED_DATA, READ_SIZE
from ._handshake_io import HANDSHAKE_READ, Event, HandshakeMachine, Session, run_handshake
from ._prefixed_stream import PrefixedStream


def plain_socket(stream: object) -> trio.socket.SocketType | None:
    """The socket under a plain ``trio.SocketStream`` (exactly that type), directly or under a
    port mux's ``PrefixedStream`` whose peeked bytes were all read back; else None."""
    if type(stream) is PrefixedStream:
        if stream.replaying:
            return None
        stream = stream.transport_stream
    return stream.socket if type(stream) is trio.SocketStream else None


def write_now(sock: trio.socket.SocketType, data: bytes) -> int:
    """Write ``data`` without waiting; how many bytes the kernel took (0 when the socket is
    full, closed or broken: the caller's writer then writes them, and meets the error if there
    is one). Only for a caller with nothing queued and no write in flight on ``sock``."""
    fd = sock.fileno()
    if fd < 0:  # closed: never write to a number the OS may have reused
        return 0
    try:
        return os.write(fd, data)
    except OSError:
        return 0


class Reader:
    """The reads of one stream by its single reader task.

    On a plain TCP socket, once a read returned less than it asked for (the socket is drained)
    the next read waits for readability first and then reads once; a read that filled its
    buffer reads again at once (more may be waiting). Every read is a checkpoint. With
    ``drained`` the first read waits too (the caller just wrote a request and nothing can have
    come yet). A ``PrefixedStream`` still giving back what the port mux peeked is read through
    its own ``receive_some`` until those bytes are read back, then through its socket.
    """

    __slots__ = ("_drained", "_sock", "_unwrap", "stream")

    def __init__(self, stream: trio.abc.ReceiveStream, *, drained: bool = False) -> None:
        self.stream = stream
        self._sock = plain_socket(stream)
        self._unwrap = self._sock is None and type(stream) is PrefixedStream
        self._drained = drained

    async def receive_some(self, max_bytes: int = READ_SIZE) -> bytes:
        """Up to ``max_bytes`` bytes; ``b""`` at the end of the stream.

        Raises:
            trio.BrokenResourceError: the connection broke (reset).
            trio.ClosedResourceError: the stream was closed (by another task too).
        """
        sock = self._sock
        if sock is None:
            data = bytes(await self.stream.receive_some(max_bytes))
            if self._unwrap and (sock := plain_socket(self.stream)) is not None:
                self._sock, self._unwrap = sock, False  # the peeked bytes are read back
            return data
        wait = self._drained
        while True:
            fd = sock.fileno()
            if fd < 0:
                raise trio.ClosedResourceError("the stream was closed")
            if wait:
                # Raises ClosedResourceError when another task closes the stream meanwhile
                # (trio's close notifies the waiters of its descriptor).
                await trio.lowlevel.wait_readable(fd)
            else:
                await trio.lowlevel.checkpoint()
            fd = sock.fileno()  # again: it may have been closed while this task was waking
            if fd < 0:
                raise trio.ClosedResourceError("the stream was closed")
            try:
                data = os.read(fd, max_bytes)
            except BlockingIOError:
                wait = True
                continue
            except OSError as exc:  # as trio's SocketStream: any error is a broken stream
                raise trio.BrokenResourceError(f"reading: {exc}") from exc
            self._drained = len(data) < max_bytes
            return data


async def send_direct(stream: trio.abc.SendStream, data: bytes) -> None:
    """``stream.send_all(data)``, but on a plain TCP socket what the kernel takes at once is
    written without the stream's machinery (only for a caller that is the stream's one writer
    and has no write in flight). The caller bounds the time.

    Raises:
        trio.BrokenResourceError / trio.ClosedResourceError: the stream is gone.
    """
    sock = plain_socket(stream)
    if sock is not None:
        written = write_now(sock, data)
        if written == len(data):
            return
        data = data[written:]
    await stream.send_all(data)


async def run_handshake_on(stream: trio.abc.Stream, reader: Reader,
                           machine: HandshakeMachine[Event], *,
                           on_sent: Callable[[], None] | None = None) -> Event:
    """:func:`~._handshake_io.run_handshake` with ``reader`` for the reads and
    :func:`send_direct` for the writes (one system call each on a plain TCP socket);
    ``on_sent`` is called after each write.

    Raises:
        WireError / HandshakeError: from the machine.
        trio.BrokenResourceError / trio.ClosedResourceError: the stream is gone.
    """
    async def receive() -> bytes:
        return await reader.receive_some(HANDSHAKE_READ)

    async def send(data: bytes) -> None:
        await send_direct(stream, data)

    return await run_handshake(stream, machine, receive=receive, send=send, on_sent=on_sent)


async def next_event(reader: Reader, session: Session) -> Any:
    """:func:`~._handshake_io.receive_event` through ``reader``: ``session``'s next event,
    reading only when it needs more bytes (an end of stream is its ``EndOfStream``).

    Raises:
        trio.BrokenResourceError / trio.ClosedResourceError: the stream is gone.
    """
    while (event := session.next_event()) is NEED_DATA:
        session.receive_data(await reader.receive_some(READ_SIZE))
    return event
