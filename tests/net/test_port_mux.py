"""The port mux routes each connection by its first 4 bytes, replays them, and drops the rest."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from flodl_trio._errors import ConfigError
from flodl_trio.port_mux import (
    CHANNEL_MAGIC_CONTROL,
    CHANNEL_MAGIC_DATA,
    CHANNEL_MAGIC_JOIN,
    CHANNEL_MAGIC_RENDEZVOUS,
    LEG_NAMES,
    PortMux,
    PrefixedStream,
    open_port_mux,
)
from flodl_trio.testing import MemoryNetwork

from helpers.streams import read_exactly

MAGIC_BY_LEG = {
    "control": CHANNEL_MAGIC_CONTROL,
    "data": CHANNEL_MAGIC_DATA,
    "rendezvous": CHANNEL_MAGIC_RENDEZVOUS,
    "join": CHANNEL_MAGIC_JOIN,
}


@asynccontextmanager
async def tcp_mux(
    *, legs: Sequence[str] = ("control", "status"), peek_timeout: float = 5.0
) -> AsyncIterator[tuple[PortMux, int]]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with open_port_mux(listeners, peek_timeout=peek_timeout, legs=legs) as mux:
        yield mux, port


async def assert_closed_by_server(client: trio.abc.Stream) -> None:
    with trio.fail_after(5):
        try:
            assert await client.receive_some() == b""
        except trio.BrokenResourceError:  # an RST is also "closed by the server"
            pass


async def test_each_magic_reaches_its_leg_with_bytes_intact_and_the_stream_stays_usable() -> None:
    async with tcp_mux(legs=LEG_NAMES) as (mux, port):
        for leg_name, magic in MAGIC_BY_LEG.items():
            first = magic + f"hello {leg_name}".encode()
            with trio.fail_after(5):
                client = await trio.open_tcp_stream("127.0.0.1", port)
                await client.send_all(first)
                server = await getattr(mux, leg_name).accept()
                assert isinstance(server, PrefixedStream)
                assert await read_exactly(server, len(first)) == first
                await client.send_all(b"later bytes")
                assert await read_exactly(server, 11) == b"later bytes"
                await server.send_all(b"reply")
                assert await read_exactly(client, 5) == b"reply"
            # Numeric peer address, exactly the client's own socket name.
            assert server.remote_address == client.socket.getsockname()[:2]
            assert isinstance(server.transport_stream, trio.SocketStream)
            await client.aclose()
            assert await server.receive_some() == b""
            await server.aclose()
    assert mux.stats.routed == {**dict.fromkeys(MAGIC_BY_LEG, 1), "status": 0}
    assert mux.stats.accepted == 4
    assert sum(mux.stats.dropped.values()) == 0


async def test_magic_dribbled_one_byte_at_a_time_still_routes() -> None:
    async with tcp_mux() as (mux, port), await trio.open_tcp_stream("127.0.0.1", port) as client:
        for byte in CHANNEL_MAGIC_CONTROL + b"!":
            await client.send_all(bytes([byte]))
            await trio.sleep(0.01)
        with trio.fail_after(5):
            server = await mux.control.accept()
            assert await read_exactly(server, 5) == CHANNEL_MAGIC_CONTROL + b"!"
        await server.aclose()


@pytest.mark.parametrize("method", [b"GET ", b"POST ", b"HEAD ", b"PUT ", b"OPTIONS ",
                                    b"DELETE ", b"PATCH "])
async def test_http_requests_reach_the_status_leg_intact(method: bytes) -> None:
    request = method + b"/state.json HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
    async with tcp_mux() as (mux, port), await trio.open_tcp_stream("127.0.0.1", port) as client:
        await client.send_all(request)
        with trio.fail_after(5):
            server = await mux.status.accept()
            assert await read_exactly(server, len(request)) == request
        await server.aclose()
    assert mux.stats.routed["status"] == 1


async def test_unknown_magic_and_eof_before_magic_are_dropped_and_the_next_dial_routes() -> None:
    async with tcp_mux() as (mux, port):
        async with await trio.open_tcp_stream("127.0.0.1", port) as scanner:
            await scanner.send_all(b"SSH-2.0-OpenSSH\r\n")
            await assert_closed_by_server(scanner)
        async with await trio.open_tcp_stream("127.0.0.1", port) as quitter:
            await quitter.send_all(CHANNEL_MAGIC_CONTROL[:3])
            await quitter.send_eof()
            await assert_closed_by_server(quitter)
        async with await trio.open_tcp_stream("127.0.0.1", port) as relay:
            await relay.send_all(CHANNEL_MAGIC_CONTROL)
            with trio.fail_after(5):
                server = await mux.control.accept()
                assert await read_exactly(server, 4) == CHANNEL_MAGIC_CONTROL
            await server.aclose()
    assert mux.stats.dropped["unknown_magic"] == 1
    assert mux.stats.dropped["eof_before_magic"] == 1
    assert mux.stats.routed["control"] == 1
    assert mux.stats.accepted == 3


async def test_silent_dialer_is_dropped_at_peek_timeout_without_delaying_an_honest_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork()
    async with open_port_mux(net.listener("coord"), peek_timeout=5.0) as mux:
        start = trio.current_time()
        silent = await net.connect("coord")
        honest = await net.connect("coord")
        await honest.send_all(CHANNEL_MAGIC_CONTROL + b"hi")
        server = await mux.control.accept()
        assert trio.current_time() - start < 0.001  # not queued behind the silent peer
        assert await read_exactly(server, 6) == CHANNEL_MAGIC_CONTROL + b"hi"
        assert server.remote_address == ("mem:coord", 2)
        assert await silent.receive_some() == b""  # the mux closed it...
        assert trio.current_time() - start == pytest.approx(5.0)  # ...at peek_timeout
        assert mux.stats.dropped["peek_timeout"] == 1
        await server.aclose()
        await silent.aclose()
        await honest.aclose()
    net.assert_all_closed()


async def test_a_leg_nobody_serves_drops_until_someone_accepts_on_it() -> None:
    async with tcp_mux() as (mux, port):  # default legs: control and status
        async with await trio.open_tcp_stream("127.0.0.1", port) as stray:
            await stray.send_all(CHANNEL_MAGIC_DATA + b"x")
            await assert_closed_by_server(stray)
        assert mux.stats.dropped["no_listener"] == 1
        async with trio.open_nursery() as nursery:
            accepted: list[PrefixedStream] = []

            async def take() -> None:
                accepted.append(await mux.data.accept())

            nursery.start_soon(take)
            await trio.testing.wait_all_tasks_blocked()
            async with await trio.open_tcp_stream("127.0.0.1", port) as wanted:
                await wanted.send_all(CHANNEL_MAGIC_DATA + b"y")
                with trio.fail_after(5):
                    while not accepted:  # noqa: ASYNC110 -- polls a list, bounded by fail_after
                        await trio.sleep(0.01)
                assert await read_exactly(accepted[0], 5) == CHANNEL_MAGIC_DATA + b"y"
                await accepted[0].aclose()
    assert mux.stats.routed["data"] == 1


async def test_full_leg_queue_drops_the_connection() -> None:
    net = MemoryNetwork()
    async with open_port_mux(net.listener("coord"), peek_timeout=5.0, queue_size=1) as mux:
        first, second = await net.connect("coord"), await net.connect("coord")
        await first.send_all(CHANNEL_MAGIC_CONTROL)
        await trio.testing.wait_all_tasks_blocked()
        await second.send_all(CHANNEL_MAGIC_CONTROL)
        assert await second.receive_some() == b""
        assert mux.stats.dropped["queue_full"] == 1
        server = await mux.control.accept()
        await server.aclose()
        await first.aclose()
        await second.aclose()
    net.assert_all_closed()


async def test_abort_stops_the_mux_and_closes_queued_streams_and_listeners() -> None:
    net = MemoryNetwork()
    abort = trio.Event()
    async with open_port_mux(net.listener("coord"), peek_timeout=5.0, abort=abort) as mux:
        queued = await net.connect("coord")
        await queued.send_all(CHANNEL_MAGIC_CONTROL)
        peeking = await net.connect("coord")  # still inside its peek when abort arrives
        await trio.testing.wait_all_tasks_blocked()
        abort.set()
        await mux.wait_closed()
        assert await queued.receive_some() == b""
        assert await peeking.receive_some() == b""
        for leg_name in LEG_NAMES:
            with pytest.raises(trio.ClosedResourceError, match=leg_name):
                await getattr(mux, leg_name).accept()
        with pytest.raises(ConnectionRefusedError):
            await net.connect("coord")
        await queued.aclose()
        await peeking.aclose()
    net.assert_all_closed()


async def test_leaving_the_block_wakes_a_blocked_accept_and_closes_the_tcp_listener() -> None:
    async with tcp_mux() as (mux, port):
        async with trio.open_nursery() as nursery:
            outcome: list[BaseException] = []

            async def blocked_accept() -> None:
                try:
                    await mux.control.accept()
                except trio.ClosedResourceError as exc:
                    outcome.append(exc)

            nursery.start_soon(blocked_accept)
            await trio.testing.wait_all_tasks_blocked()
            await mux.aclose()
        assert len(outcome) == 1
    with pytest.raises(OSError):
        await trio.open_tcp_stream("127.0.0.1", port)


async def test_closing_one_leg_drops_its_connections_and_keeps_the_others_routing() -> None:
    net = MemoryNetwork()
    async with open_port_mux(net.listener("coord"), peek_timeout=5.0) as mux:
        queued = await net.connect("coord")
        await queued.send_all(CHANNEL_MAGIC_CONTROL)
        await trio.testing.wait_all_tasks_blocked()
        await mux.control.aclose()
        assert await queued.receive_some() == b""
        with pytest.raises(trio.ClosedResourceError):
            await mux.control.accept()
        late = await net.connect("coord")
        await late.send_all(CHANNEL_MAGIC_CONTROL)
        assert await late.receive_some() == b""
        http = await net.connect("coord")
        await http.send_all(b"GET / HTTP/1.1\r\n\r\n")
        server = await mux.status.accept()
        await server.aclose()
        for client in (queued, late, http):
            await client.aclose()
    assert mux.stats.dropped["no_listener"] == 1
    net.assert_all_closed()


async def test_the_block_exception_propagates_unwrapped() -> None:
    net = MemoryNetwork()
    with pytest.raises(KeyError, match="boom"):
        async with open_port_mux(net.listener("coord"), peek_timeout=5.0):
            raise KeyError("boom")
    net.assert_all_closed()


async def test_prefixed_stream_replays_in_pieces_then_delegates_and_closes() -> None:
    net = MemoryNetwork()
    async with net.listener("coord") as listener:
        client = await net.connect("coord")
        inner = await listener.accept()
        stream = PrefixedStream(inner, b"abcdef", remote_address=inner.remote_address)
        await client.send_all(b"gh")
        assert await stream.receive_some(4) == b"abcd"
        assert await stream.receive_some() == b"ef"
        assert await stream.receive_some() == b"gh"
        with pytest.raises(ValueError, match="max_bytes"):
            await stream.receive_some(0)
        await stream.send_eof()
        assert await client.receive_some() == b""
        await stream.aclose()
        with pytest.raises(trio.ClosedResourceError):
            await stream.receive_some()
        assert not inner.is_open
        await client.aclose()
    net.assert_all_closed()


async def test_bad_arguments_are_config_errors() -> None:
    net = MemoryNetwork()
    with pytest.raises(ConfigError, match="unknown port mux leg"):
        async with open_port_mux(net.listener("a"), peek_timeout=1.0, legs=("control", "ctrl")):
            pass
    with pytest.raises(ConfigError, match="peek_timeout"):
        async with open_port_mux(net.listener("b"), peek_timeout=-1.0):
            pass
    net.assert_all_closed()  # the mux was handed the listeners, so it closed them
