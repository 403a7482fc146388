"""trio's own stream conformance checks on the library's streams: the in-memory transport, the
fault-injecting ``FaultyStream`` (with an empty plan) and TCP through the chaos proxy, clogged
too, next to a plain TCP pair as the control."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack

import pytest
import trio
import trio.testing
from trio.testing import check_half_closeable_stream, check_one_way_stream

from flodl_trio.chaos import FaultPlan, FaultyStream, open_chaos_proxy
from flodl_trio.testing import MemoryNetwork, MemoryStream

_names = itertools.count()
PATIENCE = 10  # real seconds; each TCP check takes well under one


async def memory_pair(net: MemoryNetwork) -> tuple[MemoryStream, MemoryStream]:
    name = f"conformance-{next(_names)}"
    listener = net.listener(name)
    client = await net.connect(name)
    server = await listener.accept()
    await listener.aclose()
    return client, server


async def test_memory_stream_passes_trios_half_closeable_stream_checks() -> None:
    net = MemoryNetwork()

    async def maker() -> tuple[MemoryStream, MemoryStream]:
        return await memory_pair(net)

    async def clogged() -> tuple[MemoryStream, MemoryStream]:
        # One byte fills a one-byte buffer each way: the next send blocks until the peer reads.
        client, server = await memory_pair(tiny)
        await client.send_all(b"x")
        await server.send_all(b"x")
        return client, server

    tiny = MemoryNetwork(buffer_size=1)
    await check_half_closeable_stream(maker, clogged)
    net.assert_all_closed()
    tiny.assert_all_closed()


async def test_faulty_stream_with_no_faults_passes_trios_half_closeable_stream_checks() -> None:
    net = MemoryNetwork()

    async def maker() -> tuple[FaultyStream, FaultyStream]:
        client, server = await memory_pair(net)
        return (FaultyStream(client, FaultPlan(), direction_of_send="up"),
                FaultyStream(server, FaultPlan(), direction_of_send="down"))

    async def clogged() -> tuple[FaultyStream, FaultyStream]:
        client, server = await memory_pair(tiny)
        await client.send_all(b"x")
        await server.send_all(b"x")
        return (FaultyStream(client, FaultPlan(), direction_of_send="up"),
                FaultyStream(server, FaultPlan(), direction_of_send="down"))

    tiny = MemoryNetwork(buffer_size=1)
    await check_half_closeable_stream(maker, clogged)
    net.assert_all_closed()
    tiny.assert_all_closed()


TcpPair = tuple[trio.SocketStream, trio.SocketStream]


async def _clog(stream: trio.SocketStream) -> None:
    """Write until every task is blocked, the proxy's included: the path is full to the reader.

    trio's own tests clog a SocketStream the same way."""

    async def write_forever() -> None:
        for _ in range(100_000):  # 1 GB at most; the kernel buffers fill long before
            await stream.send_all(b"x" * 10_000)
        raise AssertionError("a clogged TCP stream never blocked")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(write_forever)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()


@pytest.fixture(params=["plain tcp", "chaos proxy"])
async def tcp_pair_maker(
    request: pytest.FixtureRequest,
) -> AsyncIterator[Callable[[], Awaitable[TcpPair]]]:
    """Makes (dialer, acceptor) pairs over loopback TCP, directly (the control) or through an
    ``open_chaos_proxy`` with an empty plan."""
    async with AsyncExitStack() as stack:
        target = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        stack.push_async_callback(target.aclose)
        address = ("127.0.0.1", target.socket.getsockname()[1])
        if request.param == "chaos proxy":
            address = (await stack.enter_async_context(open_chaos_proxy(address))).address

        async def maker() -> TcpPair:
            client = await trio.open_tcp_stream(*address)
            return client, await target.accept()

        yield maker


def _clogging(maker: Callable[[], Awaitable[TcpPair]], *, flip: bool = False) -> tuple[
    Callable[[], Awaitable[TcpPair]], Callable[[], Awaitable[TcpPair]]
]:
    """The (stream maker, clogged stream maker) pair of trio's checks, optionally reversed so
    the acceptor is the sending side."""

    async def plain() -> TcpPair:
        client, server = await maker()
        return (server, client) if flip else (client, server)

    async def clogged() -> TcpPair:
        client, server = await maker()
        await _clog(client)
        await _clog(server)
        return (server, client) if flip else (client, server)

    return plain, clogged


@pytest.mark.parametrize("clogged", [False, True], ids=["free", "clogged"])
@pytest.mark.parametrize("sender", ["dialer", "acceptor"])
async def test_tcp_passes_trios_one_way_stream_checks_in_each_direction(
    tcp_pair_maker: Callable[[], Awaitable[TcpPair]], sender: str, clogged: bool,
) -> None:
    plain, clogged_maker = _clogging(tcp_pair_maker, flip=sender == "acceptor")
    with trio.fail_after(PATIENCE):
        await check_one_way_stream(plain, clogged_maker if clogged else None)


@pytest.mark.parametrize("clogged", [False, True], ids=["free", "clogged"])
async def test_tcp_passes_trios_half_closeable_stream_checks(
    tcp_pair_maker: Callable[[], Awaitable[TcpPair]], clogged: bool,
) -> None:
    plain, clogged_maker = _clogging(tcp_pair_maker)
    with trio.fail_after(PATIENCE):
        await check_half_closeable_stream(plain, clogged_maker if clogged else None)
