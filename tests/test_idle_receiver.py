"""``IdleReceiver``: the coordinator's reader of a relay reads one ``recv`` per wake-up on plain
TCP, and behaves exactly like ``receive_some`` otherwise: the same bytes, ``b""`` at EOF, a
reset as ``BrokenResourceError``, a close (even while it waits) as ``ClosedResourceError``.
Real loopback sockets: the point is the OS's behaviour."""

from __future__ import annotations

import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from flodl_trio.net._prefixed_stream import IdleReceiver, PrefixedStream


@asynccontextmanager
async def tcp_pair() -> AsyncIterator[tuple[trio.SocketStream, trio.SocketStream]]:
    """A connected loopback pair: (the reader's end, the peer's end)."""
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener.socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        accepted: list[trio.SocketStream] = []

        async def accept() -> None:
            accepted.append(await listener.accept())

        nursery.start_soon(accept)
        peer = await trio.open_tcp_stream("127.0.0.1", port)
    await listener.aclose()
    try:
        yield accepted[0], peer
    finally:
        await trio.aclose_forcefully(accepted[0])
        await trio.aclose_forcefully(peer)


async def test_it_returns_what_the_peer_sent_in_order_then_eof() -> None:
    async with tcp_pair() as (mine, peer):
        receiver = IdleReceiver(PrefixedStream(mine, b""), 4)
        got = b""
        with trio.fail_after(5):
            await peer.send_all(b"0123456789")  # more than one read of 4 bytes: reads first
            await peer.send_eof()
            while chunk := await receiver.receive_some():
                assert len(chunk) <= 4
                got += chunk
        assert got == b"0123456789"
        assert await receiver.receive_some() == b""  # EOF again


async def test_a_reset_is_a_broken_resource_naming_the_os_error() -> None:
    async with tcp_pair() as (mine, peer):
        receiver = IdleReceiver(mine, 65536)
        # SO_LINGER 0: closing sends a reset instead of a FIN.
        peer.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await peer.aclose()
        with trio.fail_after(5), pytest.raises(trio.BrokenResourceError) as err:
            await receiver.receive_some()
        assert isinstance(err.value.__cause__, ConnectionResetError)


async def test_closing_the_stream_wakes_a_waiting_read_with_closed_resource() -> None:
    async with tcp_pair() as (mine, _peer):
        receiver = IdleReceiver(PrefixedStream(mine, b""), 65536)
        async with trio.open_nursery() as nursery:
            outcome: list[BaseException] = []

            async def read() -> None:
                try:
                    await receiver.receive_some()
                except trio.ClosedResourceError as exc:
                    outcome.append(exc)

            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            await trio.aclose_forcefully(receiver.stream)
        assert len(outcome) == 1
        with pytest.raises(trio.ClosedResourceError):
            await receiver.receive_some()  # and every read after the close


async def test_a_stream_that_is_not_plain_tcp_is_read_with_its_own_receive_some() -> None:
    # The peeked prefix first (a PrefixedStream still replaying), then an in-memory stream.
    async with tcp_pair() as (mine, peer):
        receiver = IdleReceiver(PrefixedStream(mine, b"MAGIC"), 3)
        await peer.send_all(b"after")
        with trio.fail_after(5):
            assert await receiver.receive_some() == b"MAG"
            assert await receiver.receive_some() == b"IC"
            assert await receiver.receive_some() == b"aft"
    send, recv = trio.testing.memory_stream_pair()
    await send.send_all(b"memory")
    assert await IdleReceiver(recv, 65536).receive_some() == b"memory"


async def test_a_cancelled_wait_reads_nothing_and_the_bytes_come_with_the_next_read() -> None:
    async with tcp_pair() as (mine, peer):
        receiver = IdleReceiver(mine, 65536)
        with trio.move_on_after(0.05) as scope:
            await receiver.receive_some()
        assert scope.cancelled_caught
        await peer.send_all(b"late")
        with trio.fail_after(5):
            assert await receiver.receive_some() == b"late"
