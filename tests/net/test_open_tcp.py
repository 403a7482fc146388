"""``open_tcp``, the relay's and the rank's dial of a numeric address: a connection the kernel
makes within ``connect`` is used at once; a refusal is the OSError trio's dial raises."""

from __future__ import annotations

import errno
import socket

import pytest
import trio

from flodl_trio.net._transport import open_tcp


async def test_a_loopback_dial_is_connected_nodelay_and_carries_bytes() -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    async with listener:
        stream = await open_tcp("127.0.0.1", port)
        async with stream, await listener.accept() as server:
            assert stream.socket.getpeername() == ("127.0.0.1", port)
            assert stream.socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            await stream.send_all(b"hello")
            assert await server.receive_some(5) == b"hello"


async def test_a_port_nobody_listens_on_is_refused_with_its_address() -> None:
    with socket.socket() as probe:  # a port that was free a moment ago, now closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(OSError) as info:
        await open_tcp("127.0.0.1", port)
    assert info.value.errno == errno.ECONNREFUSED
    assert f"('127.0.0.1', {port})" in str(info.value)


async def test_a_cancelled_dial_raises_cancelled_before_connecting() -> None:
    with trio.CancelScope() as scope:
        scope.cancel()
        await open_tcp("127.0.0.1", 9)
        pytest.fail("the dial went on under a cancelled scope")
    assert scope.cancelled_caught
