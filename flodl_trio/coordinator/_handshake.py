"""The coordinator's end of the upstream handshake (SPEC §2.6), as IO around the sans-IO
``wire.CoordinatorHandshake``: no protocol check lives here."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TypeVar

import trio

from .._errors import FlodlError
from ..net._handshake_io import HandshakeMachine
from ..net._socket_io import Reader, run_handshake_on
from ..net._transport import STREAM_GONE
from ..wire import (
    Cadence,
    CoordinatorHandshake,
    Established,
    HelloReceived,
    SessionSalt,
)

Event = TypeVar("Event")


class Rejected(Exception):
    """A connection failed before authenticating. ``category`` groups rejects in reports;
    ``wrong_salt``: it looks like a relay whose session salt differs."""

    def __init__(self, category: str, detail: str, *, wrong_salt: bool = False) -> None:
        super().__init__(detail)
        self.category = category
        self.detail = detail
        self.wrong_salt = wrong_salt


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
        event = await drive(stream, machine, on_sent=on_sent)
    except FlodlError as exc:
        raise Rejected(machine.failure_category or "malformed", str(exc),
                       wrong_salt=machine.salt_suspect) from None
    except STREAM_GONE as exc:
        raise Rejected("connection error", f"{peer}: {exc!r}") from None
    assert isinstance(event, HelloReceived)
    return machine, event


async def finish_handshake(stream: trio.abc.Stream, machine: CoordinatorHandshake, *,
                           cadence: Cadence | None = None) -> Established:
    """Accept the Hello: write ``HelloAck`` (both directions then use ``conn_key``), wait for
    the relay's ``Ready`` and write the welcome (FT/2), with ``cadence`` after it in the same
    write. The caller bounds it.

    Raises:
        FlodlError: the relay broke the protocol before its Ready verified.
        trio.BrokenResourceError / trio.ClosedResourceError: the stream is gone.
    """
    machine.accept(cadence=cadence)
    event = await drive(stream, machine)
    assert isinstance(event, Established)
    return event


async def drive(stream: trio.abc.Stream, machine: HandshakeMachine[Event], *,
                on_sent: Callable[[], None] | None = None) -> Event:
    """Run the coordinator's end of a handshake until its next event that is not NEED_DATA.

    A formation of thousands of relays runs this once per relay, so on plain TCP (the port
    mux's stream once its peeked magic is read back) each write is one ``write`` and each read
    one ``recv`` once the socket is readable (:mod:`..net._socket_io`); every read follows a
    write of ours, so it waits first. ``on_sent`` is called after each write.

    Raises:
        WireError / HandshakeError: from the machine.
        trio.BrokenResourceError / trio.ClosedResourceError: the stream is gone.
    """
    return await run_handshake_on(stream, Reader(stream, drained=True), machine,
                                  on_sent=on_sent)


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
