"""The IO loops of the sans-IO machines: feed the machine, write what it wants sent.

The protocol lives in ``wire``: the handshakes (``CoordinatorHandshake``, ``RelayHandshake``,
``RankDialHandshake``, ``RankAcceptHandshake``) and the sessions after the join
(``CoordinatorSession``, ``UpstreamSession``, ``RankLinkSession``, ``RankSession``); these
loops only move bytes. The caller bounds them with its deadline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import trio

from .._errors import FlodlError
from ..wire import NEED_DATA, READ_SIZE, NeedData
from ._transport import STREAM_GONE

# A Hello is read in pieces this big at most; the machine's ceiling bounds what it buffers.
HANDSHAKE_READ = READ_SIZE

Event = TypeVar("Event", covariant=True)


class HandshakeMachine(Protocol[Event]):
    def receive_data(self, data: bytes) -> None: ...

    def next_event(self) -> Event | NeedData: ...

    def data_to_send(self) -> bytes: ...


async def run_handshake(
    stream: trio.abc.Stream, machine: HandshakeMachine[Event], *,
    receive: Callable[[], Awaitable[bytes | bytearray]] | None = None,
    send: Callable[[bytes], Awaitable[None]] | None = None,
    on_sent: Callable[[], None] | None = None,
) -> Event:
    """Drive ``machine`` over ``stream`` until it has an event other than NEED_DATA.

    Whatever the machine queued is written first, the event's answer included (the relay's
    Ready goes out before its Established is returned). ``receive`` and ``send`` replace the
    stream's own ``receive_some`` and ``send_all`` (:mod:`._socket_io`'s one-system-call
    versions); ``on_sent`` is called after each write.

    Raises:
        WireError / HandshakeError: from the machine.
        trio.BrokenResourceError / trio.ClosedResourceError: the stream is gone.
    """
    if receive is None:
        async def receive() -> bytes | bytearray:
            return await stream.receive_some(HANDSHAKE_READ)
    send = stream.send_all if send is None else send
    while True:
        try:
            event = machine.next_event()
        except FlodlError:
            # What the machine queued before it failed was due (the coordinator's Challenge
            # ahead of a replayed Hello that arrived in the same chunk): the peer sees it.
            with contextlib.suppress(*STREAM_GONE):
                if out := machine.data_to_send():
                    await send(out)
            raise
        out = machine.data_to_send()
        if out:
            await send(out)
            if on_sent is not None:
                on_sent()
        if not isinstance(event, NeedData):
            return event
        machine.receive_data(bytes(await receive()))


class Session(Protocol):
    def receive_data(self, data: bytes | bytearray) -> None: ...

    def next_event(self) -> Any: ...


async def receive_event(stream: trio.abc.ReceiveStream, session: Session) -> Any:
    """``session``'s next event, reading from ``stream`` only when it needs more bytes (an
    end of stream is its ``EndOfStream``).

    Raises:
        trio.BrokenResourceError / trio.ClosedResourceError: the stream is gone.
    """
    while (event := session.next_event()) is NEED_DATA:
        session.receive_data(await stream.receive_some(READ_SIZE))
    return event
