"""MemoryNetwork behaves like loopback TCP: EOF, bounded buffers, refusals, resets, leak checks."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from flodl_trio._errors import ConfigError
from flodl_trio.testing import MemoryNetwork, MemoryStream

from helpers.streams import read_exactly


async def _pair(net: MemoryNetwork, name: str = "coord") -> tuple[MemoryStream, MemoryStream]:
    listener = net._listeners.get(name) or net.listener(name)
    client = await net.connect(name)
    server = await listener.accept()
    return client, server


async def test_bytes_flow_both_ways_and_close_gives_eof_after_draining() -> None:
    net = MemoryNetwork()
    async with net.listener("coord"):
        client, server = await _pair(net)
        await client.send_all(b"hello")
        await server.send_all(b"world")
        await client.aclose()
        assert await server.receive_some() == b"hello"
        assert await server.receive_some() == b""
        assert await server.receive_some() == b""  # EOF is sticky
        with pytest.raises(trio.BrokenResourceError):
            await server.send_all(b"late")
        with pytest.raises(trio.ClosedResourceError):
            await client.receive_some()
        await server.aclose()
    net.assert_all_closed()


async def test_receive_some_respects_max_bytes() -> None:
    net = MemoryNetwork()
    async with net.listener("coord"):
        client, server = await _pair(net)
        await client.send_all(b"abcdef")
        assert await server.receive_some(4) == b"abcd"
        assert await server.receive_some(4) == b"ef"
        with pytest.raises(ValueError, match="max_bytes"):
            await server.receive_some(0)
        await client.aclose()
        await server.aclose()


async def test_full_buffer_blocks_writer_until_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork(buffer_size=10)
    async with net.listener("coord"):
        client, server = await _pair(net)
        start = trio.current_time()
        with trio.move_on_after(30) as scope:
            await client.send_all(b"x" * 25)
        assert scope.cancelled_caught
        assert trio.current_time() - start == pytest.approx(30)
        # A stalled TCP write delivers what fit in the window, nothing more.
        assert net.connections[0].bytes_to_server == 10
        assert await server.receive_some() == b"x" * 10
        await client.aclose()
        await server.aclose()


async def test_blocked_writer_resumes_when_reader_drains(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork(buffer_size=4)
    payload = bytes(range(100))
    async with net.listener("coord"):
        client, server = await _pair(net)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.send_all, payload)
            await trio.sleep(5)  # writer is parked on a full buffer meanwhile
            assert net.connections[0].bytes_to_server == 4
            assert await read_exactly(server, len(payload)) == payload
        await client.aclose()
        await server.aclose()


async def test_peer_close_unblocks_stalled_writer_with_broken_resource() -> None:
    net = MemoryNetwork(buffer_size=4)
    async with net.listener("coord"):
        client, server = await _pair(net)
        async with trio.open_nursery() as nursery:

            async def close_soon() -> None:
                await trio.testing.wait_all_tasks_blocked()
                await server.aclose()

            nursery.start_soon(close_soon)
            with pytest.raises(trio.BrokenResourceError, match="closed the connection"):
                await client.send_all(b"y" * 20)
        await client.aclose()
    net.assert_all_closed()


async def test_wait_send_all_might_not_block_waits_for_room() -> None:
    net = MemoryNetwork(buffer_size=3)
    async with net.listener("coord"):
        client, server = await _pair(net)
        await client.send_all(b"abc")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.wait_send_all_might_not_block)
            await trio.testing.wait_all_tasks_blocked()
            assert await server.receive_some(1) == b"a"
        await client.aclose()
        await server.aclose()


async def test_connect_without_listener_is_refused_like_tcp() -> None:
    net = MemoryNetwork()
    with pytest.raises(ConnectionRefusedError, match="mem:nowhere") as info:
        await net.connect("nowhere")
    assert isinstance(info.value, OSError)
    listener = net.listener("coord")
    await listener.aclose()
    with pytest.raises(ConnectionRefusedError):
        await net.connect("coord")


async def test_second_listener_for_same_name_is_refused_until_first_closes() -> None:
    net = MemoryNetwork()
    first = net.listener("coord")
    with pytest.raises(ConfigError, match="already open"):
        net.listener("coord")
    await first.aclose()
    async with net.listener("coord"):
        pass
    net.assert_all_closed()


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ConfigError, match="buffer_size"):
        MemoryNetwork(buffer_size=0)
    with pytest.raises(ConfigError, match="name"):
        MemoryNetwork().listener("")


async def test_closing_listener_closes_backlog_connections_nobody_accepted() -> None:
    net = MemoryNetwork()
    listener = net.listener("coord")
    accepted_client = await net.connect("coord")
    accepted_server = await listener.accept()
    queued = await net.connect("coord")  # returns at once, like TCP connect into the backlog
    await queued.send_all(b"hello?")
    await listener.aclose()
    assert await queued.receive_some() == b""
    with pytest.raises(trio.BrokenResourceError):
        await queued.send_all(b"anyone?")
    with pytest.raises(trio.ClosedResourceError):
        await listener.accept()
    # Accepted connections outlive the listener, as on TCP.
    await accepted_client.send_all(b"still here")
    assert await accepted_server.receive_some() == b"still here"
    assert set(net.open_streams()) == {accepted_client, accepted_server, queued}
    for end in (accepted_client, accepted_server, queued):
        await end.aclose()
    net.assert_all_closed()


async def test_blocked_accept_raises_closed_when_listener_closes() -> None:
    net = MemoryNetwork()
    listener = net.listener("coord")
    async with trio.open_nursery() as nursery:

        async def close_soon() -> None:
            await trio.testing.wait_all_tasks_blocked()
            await listener.aclose()

        nursery.start_soon(close_soon)
        with pytest.raises(trio.ClosedResourceError, match="mem:coord"):
            await listener.accept()


async def test_serve_listeners_accepts_memory_connections() -> None:
    net = MemoryNetwork()
    listener = net.listener("echo")

    async def echo(stream: MemoryStream) -> None:
        async with stream:
            for _ in range(100):
                data = await stream.receive_some()
                if not data:
                    return
                await stream.send_all(data)

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, echo, [listener])
        async with await net.connect("echo") as client:
            await client.send_all(b"ping")
            assert await read_exactly(client, 4) == b"ping"
        nursery.cancel_scope.cancel()
    net.assert_all_closed()


async def test_addresses_name_the_listener_and_number_the_connection() -> None:
    net = MemoryNetwork()
    async with net.listener("relay-a"):
        client1, server1 = await _pair(net, "relay-a")
        client2, server2 = await _pair(net, "relay-a")
        assert client1.remote_address == ("mem:relay-a", 0)
        assert server1.remote_address == ("mem:relay-a", 1)
        assert server2.remote_address == ("mem:relay-a", 2)
        assert server2.peer_name == "mem:relay-a:2"
        assert client2.peer is server2
        for end in (client1, server1, client2, server2):
            await end.aclose()


async def test_leak_bookkeeping_names_every_open_end() -> None:
    net = MemoryNetwork()
    listener = net.listener("coord")
    client, server = await _pair(net)
    await client.send_all(b"12345")
    await server.send_all(b"ab")
    record = net.connections[0]
    assert (record.name, record.bytes_to_server, record.bytes_to_client) == ("coord", 5, 2)
    assert record.client is client and record.server is server
    assert set(net.open_streams()) == {client, server}
    assert net.open_listeners() == [listener]
    await client.aclose()
    await client.aclose()  # idempotent
    with pytest.raises(AssertionError, match=r"2 still open.*server.*MemoryListener mem:coord"):
        net.assert_all_closed()
    await server.aclose()
    await listener.aclose()
    assert net.open_streams() == [] and net.open_listeners() == []
    net.assert_all_closed()


async def test_aclose_checkpoints_and_closes_even_when_cancelled() -> None:
    net = MemoryNetwork()
    async with net.listener("coord"):
        client, server = await _pair(net)
        with trio.CancelScope() as scope:
            scope.cancel()
            with pytest.raises(trio.Cancelled):
                await client.aclose()
        assert not client.is_open
        assert await server.receive_some() == b""
        await server.aclose()


async def test_close_now_closes_synchronously_and_is_idempotent() -> None:
    net = MemoryNetwork()
    async with net.listener("coord"):
        client, server = await _pair(net)
        await client.send_all(b"last words")
        client.close_now()  # synchronous: nothing to await, so nothing can cancel it halfway
        client.close_now()
        assert not client.is_open
        assert await server.receive_some() == b"last words"
        assert await server.receive_some() == b""
        with pytest.raises(trio.BrokenResourceError):
            await server.send_all(b"late")
        with pytest.raises(trio.ClosedResourceError):
            await client.send_all(b"more")
        await client.aclose()  # still idempotent after close_now()
        await server.aclose()
    net.assert_all_closed()


async def test_concurrent_send_or_receive_on_one_end_is_busy() -> None:
    net = MemoryNetwork(buffer_size=1)
    async with net.listener("coord"):
        client, server = await _pair(net)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.send_all, b"ab")  # blocks: buffer holds 1 byte
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(trio.BusyResourceError):
                await client.send_all(b"c")
            with pytest.raises(trio.BusyResourceError):
                await client.send_eof()
            nursery.cancel_scope.cancel()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.receive_some)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(trio.BusyResourceError):
                await client.receive_some()
            nursery.cancel_scope.cancel()
        await client.aclose()
        await server.aclose()


async def test_send_eof_half_closes_one_direction() -> None:
    net = MemoryNetwork()
    async with net.listener("coord"):
        client, server = await _pair(net)
        await client.send_all(b"request")
        await client.send_eof()
        await client.send_eof()  # idempotent, like shutdown(SHUT_WR)
        with pytest.raises(trio.ClosedResourceError):
            await client.send_all(b"more")
        assert await read_exactly(server, 7) == b"request"
        assert await server.receive_some() == b""
        await server.send_all(b"response")
        assert await read_exactly(client, 8) == b"response"
        await client.aclose()
        await server.aclose()


async def test_reset_breaks_pending_and_future_operations_on_both_ends() -> None:
    net = MemoryNetwork()
    async with net.listener("coord"):
        client, server = await _pair(net)
        await client.send_all(b"dropped by the RST")
        async with trio.open_nursery() as nursery:

            async def reset_soon() -> None:
                await trio.testing.wait_all_tasks_blocked()
                server.reset()

            nursery.start_soon(reset_soon)
            with pytest.raises(trio.BrokenResourceError, match="reset"):
                await client.receive_some()  # pending on the peer: raises, not EOF
        assert net.connections[0].was_reset
        for end in (client, server):
            with pytest.raises(trio.BrokenResourceError):
                await end.receive_some()
            with pytest.raises(trio.BrokenResourceError):
                await end.send_all(b"x")
        # The resetting end is released; the peer still owes an aclose().
        assert net.open_streams() == [client]
        await client.aclose()
        with pytest.raises(trio.ClosedResourceError):
            await client.receive_some()
    net.assert_all_closed()


async def test_closing_own_end_fails_own_pending_receive_with_closed() -> None:
    net = MemoryNetwork()
    async with net.listener("coord"):
        client, server = await _pair(net)
        async with trio.open_nursery() as nursery:

            async def close_soon() -> None:
                await trio.testing.wait_all_tasks_blocked()
                await client.aclose()

            nursery.start_soon(close_soon)
            with pytest.raises(trio.ClosedResourceError):
                await client.receive_some()
        await server.aclose()
    net.assert_all_closed()


async def test_two_networks_are_independent() -> None:
    first, second = MemoryNetwork(), MemoryNetwork()
    async with first.listener("coord"):
        with pytest.raises(ConnectionRefusedError):
            await second.connect("coord")
        async with second.listener("coord"):
            pass
