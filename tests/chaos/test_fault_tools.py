"""The chaos proxy (real loopback TCP) and FaultyStream (in memory) inject exactly the faults."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio
import trio.testing

from flodl_trio._errors import ConfigError
from flodl_trio.chaos import ChaosProxy, FaultPlan, FaultyStream, open_chaos_proxy
from flodl_trio.testing import MemoryNetwork, MemoryStream

from helpers.streams import read_exactly

Handler = Callable[[trio.SocketStream], Awaitable[None]]


@asynccontextmanager
async def _tcp_server(handler: Handler) -> AsyncIterator[tuple[str, int]]:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
        yield ("127.0.0.1", listeners[0].socket.getsockname()[1])
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def _proxy_to(handler: Handler) -> AsyncIterator[ChaosProxy]:
    """The chaos proxy in front of a loopback TCP server that runs ``handler`` per connection."""
    async with _tcp_server(handler) as target, open_chaos_proxy(target) as proxy:
        yield proxy


async def _echo(stream: trio.SocketStream) -> None:
    with trio.move_on_after(5):
        for _ in range(10_000):
            try:
                data = await stream.receive_some()
                if not data:
                    return
                await stream.send_all(data)
            except trio.BrokenResourceError:
                return


class _Sink:
    """Records, per connection, every byte received and whether it ended with EOF."""

    def __init__(self, greeting: bytes = b"") -> None:
        self.greeting = greeting
        self.received: list[bytearray] = []
        self.saw_eof: list[trio.Event] = []

    async def handler(self, stream: trio.SocketStream) -> None:
        data, eof = bytearray(), trio.Event()
        self.received.append(data)
        self.saw_eof.append(eof)
        with trio.move_on_after(5):
            if self.greeting:
                await stream.send_all(self.greeting)
            for _ in range(10_000):
                chunk = await stream.receive_some()
                if not chunk:
                    eof.set()
                    return
                data += chunk


async def _read(stream: trio.abc.ReceiveStream, count: int, *, patience: float = 2) -> bytes:
    """Read until ``count`` bytes, EOF or ``patience`` seconds; returns what arrived."""
    return await read_exactly(stream, count, patience=patience)


async def _until(condition: Callable[[], bool], *, patience: float = 2) -> None:
    with trio.fail_after(patience):
        for _ in range(10_000):
            if condition():
                return
            await trio.sleep(0.005)


async def _dial(proxy: ChaosProxy) -> trio.SocketStream:
    return await trio.open_tcp_stream(*proxy.address)


async def test_cut_up_delivers_exactly_k_bytes_then_eof_to_both_sides() -> None:
    sink = _Sink()
    async with _proxy_to(sink.handler) as proxy:
        proxy.plan(FaultPlan().cut(7, "up"))
        async with await _dial(proxy) as client:
            await client.send_all(b"0123456789abcdef")
            assert await _read(client, 1) == b""  # the client sees FIN, not RST
            await _until(lambda: len(sink.saw_eof) == 1 and sink.saw_eof[0].is_set())
        assert bytes(sink.received[0]) == b"0123456"
        await _until(lambda: proxy.connections[0].closed)
        record = proxy.connections[0]
        assert (record.ended_by, record.bytes_up) == ("cut", 7)


async def test_cut_down_delivers_exactly_k_echoed_bytes_then_eof() -> None:
    async with _proxy_to(_echo) as proxy:
        proxy.plan(FaultPlan().cut(5, "down"))
        async with await _dial(proxy) as client:
            await client.send_all(b"hello world")
            assert await _read(client, 100) == b"hello"


async def test_corrupt_flips_exactly_the_chosen_byte_in_each_direction() -> None:
    payload = bytes(range(32))
    async with _proxy_to(_echo) as proxy:
        proxy.plan(FaultPlan().corrupt(3, "up").corrupt(20, "down", xor=0x01))
        async with await _dial(proxy) as client:
            await client.send_all(payload)
            echoed = await _read(client, len(payload))
    expected = bytearray(payload)
    expected[3] ^= 0xFF
    expected[20] ^= 0x01
    assert echoed == bytes(expected)


async def test_stall_up_holds_data_while_down_still_flows() -> None:
    sink = _Sink(greeting=b"welcome")
    async with _proxy_to(sink.handler) as proxy:
        proxy.plan(FaultPlan().stall(2, "up"))
        async with await _dial(proxy) as client:
            await client.send_all(b"abcdef")
            assert await _read(client, 7) == b"welcome"
            with trio.move_on_after(0.3) as waited:
                await _until(lambda: len(sink.received[0]) > 2, patience=10)
            assert waited.cancelled_caught
            assert bytes(sink.received[0]) == b"ab"
            assert not proxy.connections[0].closed  # a stall keeps the connection open


async def test_reset_makes_the_client_see_connection_reset() -> None:
    async with _proxy_to(_echo) as proxy:
        proxy.plan(FaultPlan().reset())
        async with await _dial(proxy) as client:
            with pytest.raises(trio.BrokenResourceError) as info:
                for _ in range(50):  # the RST may land after a first write succeeds
                    await client.send_all(b"x")
                    await client.receive_some()
            assert isinstance(info.value.__cause__, ConnectionResetError)
        assert proxy.connections[0].ended_by == "reset"


async def test_reset_after_bytes_forwards_them_first() -> None:
    sink = _Sink()
    async with _proxy_to(sink.handler) as proxy:
        proxy.plan(FaultPlan().reset(4, "up"))
        async with await _dial(proxy) as client:
            await client.send_all(b"12345678")
            with pytest.raises(trio.BrokenResourceError):
                await client.receive_some()
        await _until(lambda: proxy.connections[0].closed)
        assert proxy.connections[0].bytes_up == 4


async def test_kill_all_and_reset_all_end_every_live_connection() -> None:
    async with _proxy_to(_echo) as proxy:
        clients = [await _dial(proxy) for _ in range(3)]
        for client in clients:
            await client.send_all(b"hi")
            assert await _read(client, 2) == b"hi"
        await proxy.kill_all()
        assert [c.ended_by for c in proxy.connections] == ["kill"] * 3
        for client in clients:
            assert await _read(client, 1) == b""
            await client.aclose()
        late = await _dial(proxy)  # the proxy still accepts after kill_all
        await late.send_all(b"yo")
        assert await _read(late, 2) == b"yo"
        await proxy.reset_all()
        with pytest.raises(trio.BrokenResourceError):
            await late.receive_some()
        await late.aclose()
        assert proxy.connections[3].ended_by == "reset"


async def test_counters_track_bytes_per_connection() -> None:
    async with _proxy_to(_echo) as proxy:
        async with await _dial(proxy) as first, await _dial(proxy) as second:
            await first.send_all(b"a" * 1000)
            assert len(await _read(first, 1000)) == 1000
            await second.send_all(b"b" * 10)
            assert await _read(second, 10) == b"b" * 10
        counts = [(c.index, c.bytes_up, c.bytes_down) for c in proxy.connections]
        assert counts == [(0, 1000, 1000), (1, 10, 10)]
        await _until(lambda: all(c.closed for c in proxy.connections))
        assert [c.ended_by for c in proxy.connections] == ["eof", "eof"]


async def test_plan_for_nth_connection_leaves_the_others_alone() -> None:
    async with _proxy_to(_echo) as proxy:
        proxy.plan(FaultPlan().cut(0, "both"), connection=1)
        replies = []
        for _ in range(3):
            async with await _dial(proxy) as client:
                await client.send_all(b"ping")
                replies.append(await _read(client, 4))
        assert replies == [b"ping", b"", b"ping"]


async def test_plan_set_on_a_live_connection_applies_to_its_next_bytes() -> None:
    async with _proxy_to(_echo) as proxy:
        async with await _dial(proxy) as client:
            await client.send_all(b"ping")
            assert await _read(client, 4) == b"ping"
            proxy.plan(FaultPlan().cut(4, "down"), connection=0)
            await client.send_all(b"pong")
            assert await _read(client, 4) == b""
        assert proxy.connections[0].bytes_down == 4


async def test_delay_and_drip_slow_the_stream_down() -> None:
    async with _proxy_to(_echo) as proxy:
        proxy.plan(FaultPlan().delay(0.2, "up").drip(200, "down"))
        async with await _dial(proxy) as client:
            start = trio.current_time()
            await client.send_all(b"x" * 30)
            assert await _read(client, 30) == b"x" * 30
            assert trio.current_time() - start >= 0.2 + 30 / 200 - 0.02


async def test_unreachable_target_closes_the_client() -> None:
    async with _tcp_server(_echo) as target:
        pass  # the port is free again: connecting to it is refused
    async with open_chaos_proxy(target) as proxy, await _dial(proxy) as client:
        assert await _read(client, 1) == b""
        await _until(lambda: proxy.connections[0].closed)
        assert proxy.connections[0].ended_by == "target refused"


async def test_leaving_the_block_closes_every_connection() -> None:
    async with _tcp_server(_echo) as target:
        async with open_chaos_proxy(target) as proxy:
            client = await _dial(proxy)
            await client.send_all(b"hi")
            assert await _read(client, 2) == b"hi"
        assert await _read(client, 1) == b""
        assert [(c.closed, c.ended_by) for c in proxy.connections] == [(True, "proxy closed")]
        with pytest.raises(OSError):
            await _dial(proxy)
        await client.aclose()


async def test_errors_in_the_block_propagate_unwrapped() -> None:
    async with _tcp_server(_echo) as target:
        with pytest.raises(KeyError):
            async with open_chaos_proxy(target):
                raise KeyError("mine")


@pytest.mark.parametrize(
    ("target", "listen"),
    [
        (("10.0.0.1", 80), ("127.0.0.1", 0)),
        (("127.0.0.1", 80), ("0.0.0.0", 0)),
        (("example.com", 80), ("127.0.0.1", 0)),
        (("127.0.0.1", 0), ("127.0.0.1", 0)),
    ],
)
async def test_non_loopback_or_bad_addresses_are_refused(
    target: tuple[str, int], listen: tuple[str, int]
) -> None:
    with pytest.raises(ConfigError):
        async with open_chaos_proxy(target, listen=listen):
            pass


def test_fault_plan_rejects_nonsense() -> None:
    with pytest.raises(ConfigError, match="direction"):
        FaultPlan().cut(1, "sideways")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="offset"):
        FaultPlan().stall(-1, "up")
    with pytest.raises(ConfigError, match="xor"):
        FaultPlan().corrupt(0, "up", xor=0)
    with pytest.raises(ConfigError, match="bytes_per_second"):
        FaultPlan().drip(0, "down")


# FaultyStream over MemoryNetwork, under MockClock: no sockets, no real time.


async def _memory_pair(net: MemoryNetwork) -> tuple[MemoryStream, MemoryStream]:
    listener = net.listener(f"svc{len(net.connections)}")
    client = await net.connect(listener.name)
    server = await listener.accept()
    await listener.aclose()
    return client, server


async def test_faulty_stream_cut_on_send_delivers_k_bytes_then_eof() -> None:
    net = MemoryNetwork()
    client, server = await _memory_pair(net)
    faulty = FaultyStream(client, FaultPlan().cut(3, "up"))
    with pytest.raises(trio.BrokenResourceError, match="unsent"):
        await faulty.send_all(b"abcdef")
    assert await _read(server, 10) == b"abc"
    with pytest.raises(trio.BrokenResourceError):
        await faulty.send_all(b"more")
    assert await faulty.receive_some() == b""
    await faulty.aclose()
    await server.aclose()
    net.assert_all_closed()


async def test_faulty_stream_cut_on_receive_closes_once_k_bytes_arrived() -> None:
    net = MemoryNetwork()
    client, server = await _memory_pair(net)
    faulty = FaultyStream(server, FaultPlan().cut(4, "up"), direction_of_send="down")
    await client.send_all(b"12345678")
    assert await _read(faulty, 10) == b"1234"
    with pytest.raises(trio.BrokenResourceError):
        await client.send_all(b"x")  # the wrapped end was closed at the cut
    await client.aclose()
    await faulty.aclose()
    net.assert_all_closed()


async def test_faulty_stream_stall_blocks_until_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork()
    client, server = await _memory_pair(net)
    faulty = FaultyStream(client, FaultPlan().stall(2, "up").stall(1, "down"))
    with trio.move_on_after(30) as scope:
        await faulty.send_all(b"abcd")
    assert scope.cancelled_caught
    assert await server.receive_some() == b"ab"
    await server.send_all(b"xyz")
    assert await faulty.receive_some() == b"x"
    with trio.move_on_after(30) as scope:
        await faulty.receive_some()
    assert scope.cancelled_caught
    await faulty.aclose()
    await server.aclose()


async def test_faulty_stream_corrupt_delay_and_drip_under_mock_clock(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork()
    client, server = await _memory_pair(net)
    plan = FaultPlan().corrupt(1, "up", xor=0x20).delay(2.5, "up").drip(10, "down")
    faulty = FaultyStream(client, plan)
    start = trio.current_time()
    await faulty.send_all(b"abc")
    assert trio.current_time() - start == pytest.approx(2.5)
    assert await server.receive_some() == b"aBc"
    await server.send_all(b"0123456789")
    start = trio.current_time()
    assert await _read(faulty, 10, patience=60) == b"0123456789"
    assert trio.current_time() - start == pytest.approx(1.0)
    assert (faulty.bytes_sent, faulty.bytes_received) == (3, 10)
    await faulty.aclose()
    await server.aclose()


async def test_faulty_stream_reset_breaks_both_ends() -> None:
    net = MemoryNetwork()
    client, server = await _memory_pair(net)
    faulty = FaultyStream(client, FaultPlan().reset())
    with pytest.raises(trio.BrokenResourceError):
        await faulty.send_all(b"hello")
    with pytest.raises(trio.BrokenResourceError, match="reset"):
        await server.receive_some()
    assert net.connections[0].was_reset
    await server.aclose()
    await faulty.aclose()
    net.assert_all_closed()
