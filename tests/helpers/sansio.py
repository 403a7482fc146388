"""The sans-IO side of :mod:`flodl_trio.wire` driven by hand, without sockets: the handshake
machines (one step is what one end has to send, fed to the other, and the other's next event),
decoders fed a stream in pieces, and the errors a decoder must raise."""

from __future__ import annotations

import itertools
from typing import Any

import cbor2
import pytest
from hypothesis import strategies as st

import flodl_trio as ft
from flodl_trio import wire

# Where a stream is cut in pieces (each position taken modulo the stream's length + 1).
CUTS = st.lists(st.integers(0, 10_000), max_size=12)


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


def chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    """``data`` cut at ``cuts`` (see :data:`CUTS`): the pieces, in order, joining to it."""
    points = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


def fed_in_pieces(decoder: Any, data: bytes, cuts: list[int]) -> list[Any]:
    """Everything ``decoder.feed`` returned for ``data`` fed in :func:`chunks`."""
    got: list[Any] = []
    for piece in chunks(data, cuts):
        got += decoder.feed(piece)
    return got


def assert_refused_naming(decode: Any, value: Any, words: list[str]) -> None:
    """``decode`` of ``value``'s CBOR raises a ``WireError`` whose message holds each word."""
    with pytest.raises(ft.WireError) as err:
        decode(cbor2.dumps(value))
    for word in words:
        assert word in str(err.value), str(err.value)
