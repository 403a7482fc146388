"""trio's own stream conformance checks on the library's streams: the in-memory transport, the
fault-injecting ``FaultyStream`` (with an empty plan) and TCP through the chaos proxy."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import pytest
import trio
from trio.testing import check_half_closeable_stream, check_two_way_stream

from flodl_trio.chaos import FaultPlan, FaultyStream, open_chaos_proxy
from flodl_trio.testing import MemoryNetwork, MemoryStream

_names = itertools.count()


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


@pytest.fixture
async def proxied_tcp() -> AsyncIterator[object]:
    async with AsyncExitStack() as stack:
        target = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        stack.push_async_callback(target.aclose)
        port = target.socket.getsockname()[1]
        proxy = await stack.enter_async_context(open_chaos_proxy(("127.0.0.1", port)))

        async def maker() -> tuple[trio.SocketStream, trio.SocketStream]:
            client = await trio.open_tcp_stream(*proxy.address)
            server = await target.accept()
            return client, server

        yield maker


async def test_tcp_through_the_chaos_proxy_passes_trios_two_way_stream_checks(
    proxied_tcp: object,
) -> None:
    await check_two_way_stream(proxied_tcp, None)  # type: ignore[arg-type]
