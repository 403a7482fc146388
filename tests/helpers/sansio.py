"""The handshake machines of :mod:`flodl_trio.wire` driven by hand, without sockets: one step
is what one end has to send, fed to the other, and the other's next event."""

from __future__ import annotations

from typing import Any

from flodl_trio import wire


def step(sender: Any, receiver: Any) -> Any:
    """``sender``'s pending bytes fed to ``receiver``; ``receiver``'s next event."""
    receiver.receive_data(sender.data_to_send())
    return receiver.next_event()


def to_hello(relay: Any, coord: Any) -> wire.HelloReceived:
    """Both ends of an upstream handshake driven until the coordinator holds the relay's
    authenticated Hello (or Resume); that event."""
    assert step(relay, coord) is wire.NEED_DATA  # the magic: the Challenge is queued
    assert step(coord, relay) is wire.NEED_DATA  # the Challenge: the Hello is queued
    event = step(relay, coord)
    assert isinstance(event, wire.HelloReceived)
    return event


def to_ready(relay: Any, coord: Any) -> None:
    """Both ends driven until the coordinator accepted and the relay's Ready is queued."""
    to_hello(relay, coord)
    coord.accept()
    assert step(coord, relay) is wire.NEED_DATA
