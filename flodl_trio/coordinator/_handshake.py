"""The coordinator's end of the upstream handshake (SPEC §2.6), as IO around the sans-IO
``wire.CoordinatorHandshake``: no protocol check lives here."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from typing import TypeVar

import trio

from .._errors import FlodlError
from ..net._handshake_io import HandshakeMachine, run_handshake
from ..net._transport import STREAM_GONE
from ..port_mux import PrefixedStream
from ..wire import (
    READ_SIZE,
    CoordinatorHandshake,
    Established,
    HelloReceived,
    NeedData,
    SessionSalt,
)

Event = TypeVar("Event")
# Errnos of a write that would block: the rest goes through the stream's own send_all.
_WOULD_BLOCK = frozenset({errno.EAGAIN, errno.EWOULDBLOCK})


class Rejected(Exception):
    """A connection failed before authenticating. ``category`` groups rejects in reports."""

    def __init__(self, category: str, detail: str) -> None:
        super().__init__(detail)
        self.category = category
        self.detail = detail


async def coordinator_handshake(
    stream: trio.abc.Stream, salt: SessionSalt, peer: str, *, max_hello: int,
    generation: int | None = None, on_sent: Callable[[], None] | None = None,
) -> tuple[CoordinatorHandshake, HelloReceived]:
    """Magic, Challenge, then an authenticated Hello (or Resume). The caller bounds it by
    handshake_timeout. With ``generation`` (a coordinator with a session store) the machine
    sends ``Generation`` before the welcome. ``on_sent`` is called once the Challenge is
    written (the relay's turn begins: ``PendingSlot.touch``).

    Raises:
        Rejected: anything that goes wrong before the Hello's MAC verified.
    """
    # The Hello ceiling is fitted to the largest legal Hello (wire.max_hello_payload): a
    # stranger cannot make us buffer more than that before the MAC.
    machine = CoordinatorHandshake(salt, peer=peer, max_hello=max_hello, generation=generation)
    try:
        event = await drive(stream, machine, replayed=True, on_sent=on_sent)
    except FlodlError as exc:
        raise Rejected(machine.failure_category or "malformed", str(exc)) from None
    except STREAM_GONE as exc:
        raise Rejected("connection error", f"{peer}: {exc!r}") from None
    assert isinstance(event, HelloReceived)
    return machine, event


async def finish_handshake(stream: trio.abc.Stream,
                           machine: CoordinatorHandshake) -> Established:
    """Accept the Hello: write ``HelloAck`` (both directions then use ``conn_key``), wait for
    the relay's ``Ready`` and write the welcome (FT/2). The caller bounds it.

    Raises:
        FlodlError: the relay broke the protocol before its Ready verified.
        trio.BrokenResourceError / trio.ClosedResourceError: the stream is gone.
    """
    machine.accept()
    event = await drive(stream, machine)
    assert isinstance(event, Established)
    return event


def tcp_socket(stream: trio.abc.Stream) -> trio.socket.SocketType | None:
    """The TCP socket under a plain (port-mux routed) ``SocketStream``, else None (TLS,
    in-memory)."""
    if isinstance(stream, PrefixedStream):
        stream = stream.transport_stream
    return stream.socket if isinstance(stream, trio.SocketStream) else None


async def drive(stream: trio.abc.Stream, machine: HandshakeMachine[Event], *,
                replayed: bool = False, on_sent: Callable[[], None] | None = None) -> Event:
    """``run_handshake`` for the coordinator's end, with the socket's system calls made
    directly on a plain TCP stream.

    A formation of thousands of relays runs this once per relay: through ``SocketStream``,
    each write and read is a tried call plus a checkpoint (a pass through the scheduler) and
    each read first tries the ``recv`` that cannot succeed yet. Here a write is one
    ``os.write`` (its rest, if the kernel took part of it, through ``send_all``) and a read
    waits for the socket to be readable, then makes one ``recv``. With ``replayed`` the first
    read goes through the stream (the port mux's replayed magic and what came with it, all in
    one read). ``on_sent`` is called after each write. TLS and in-memory streams use
    ``run_handshake`` (and ``on_sent`` is not called).

    Raises:
        WireError / HandshakeError: from the machine.
        trio.BrokenResourceError / trio.ClosedResourceError: the stream is gone.
    """
    sock = tcp_socket(stream)
    if sock is None:
        return await run_handshake(stream, machine)
    first = replayed and isinstance(stream, PrefixedStream)
    while True:
        try:
            event = machine.next_event()
        except FlodlError:
            # What the machine queued before it failed was due (see run_handshake).
            with contextlib.suppress(*STREAM_GONE):
                if out := machine.data_to_send():
                    await _write(stream, sock, out)
            raise
        if out := machine.data_to_send():
            await _write(stream, sock, out)
            if on_sent is not None:
                on_sent()
        if not isinstance(event, NeedData):
            return event
        if first:
            first = False
            machine.receive_data(bytes(await stream.receive_some(READ_SIZE)))
            continue
        machine.receive_data(await _read(sock))


async def _write(stream: trio.abc.Stream, sock: trio.socket.SocketType, data: bytes) -> None:
    fd = sock.fileno()
    if fd < 0:  # closed (shed or superseded): never write to a number the OS may reuse
        raise trio.ClosedResourceError("the connection was closed")
    try:
        written = os.write(fd, data)
    except OSError as exc:
        if exc.errno not in _WOULD_BLOCK:
            raise trio.BrokenResourceError(f"write failed: {exc!r}") from exc
        written = 0
    if written < len(data):
        await stream.send_all(data[written:])


async def _read(sock: trio.socket.SocketType) -> bytes:
    # Bounded: a wakeup without data (rare) waits again; EOF returns b"".
    while True:
        await trio.lowlevel.wait_readable(sock)
        fd = sock.fileno()
        if fd < 0:
            raise trio.ClosedResourceError("the connection was closed")
        try:
            return os.read(fd, READ_SIZE)
        except BlockingIOError:
            continue
        except OSError as exc:
            raise trio.BrokenResourceError(f"read failed: {exc!r}") from exc


async def refuse(stream: trio.abc.Stream, machine: CoordinatorHandshake, reason: str, *,
                 write_within: float) -> None:
    """Refuse an authenticated Hello: write ``Refused{nonce, reason}`` where ``HelloAck`` would
    go, then close the stream. The relay gives up at once with ``JoinRefused(reason)``.

    The one place a refusal is sent (formation, and any later Hello the coordinator turns
    down). The write is shielded, so a coordinator that is shutting down still says why, and
    bounded by ``write_within`` seconds; a stream that is already gone is simply closed.
    """
    machine.refuse(reason)
    with trio.CancelScope(shield=True, deadline=trio.current_time() + write_within):
        with contextlib.suppress(*STREAM_GONE):
            await stream.send_all(machine.data_to_send())
    await trio.aclose_forcefully(stream)
