"""The pre-auth bound sheds only the stale and queues the fresh (issue 23, SPEC §4.2 FT/2): a
burst of honest relays beyond ``max_pending_handshakes`` waits in the backlog instead of being
shed and re-dialing; silent connections are still shed, once ``min_shed_age`` old."""

from __future__ import annotations

from functools import partial

import pytest
import trio
import trio.testing

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.net._listen import serve_each
from flodl_trio.net._pending import PendingHandshakes, min_shed_age
from flodl_trio.port_mux import PortMux, open_port_mux
from flodl_trio.testing import MemoryNetwork

from helpers import COORD

LINK_DELAY = 0.03  # each write of a relay on a slow link arrives this late


async def slow_relay(stream: trio.abc.Stream, salt: ft.SessionSalt, host: str, rank: int,
                     world: int, joined: list[str]) -> None:
    """A relay on a slow link: the real handshake, every write LINK_DELAY late; holds the
    connection open once joined (until the coordinator closes it)."""
    machine = wire.RelayHandshake(salt, host=host, ranks=(rank,), world_size=world,
                                  coordinator=COORD)
    try:
        for _ in range(10):  # a handshake is 4 steps
            event = machine.next_event()
            if out := machine.data_to_send():
                await trio.sleep(LINK_DELAY)
                await stream.send_all(out)
            if not isinstance(event, wire.NeedData):
                break
            machine.receive_data(bytes(await stream.receive_some(65536)))
        assert isinstance(event, wire.Established), event
        joined.append(host)
        with trio.move_on_after(30):
            while await stream.receive_some(65536):
                pass
    except (ft.WireError, trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # shed (the rule before issue 23): counted by the coordinator's rejects
    finally:
        await trio.aclose_forcefully(stream)


@pytest.mark.parametrize("limit", [4, 10])
async def test_a_burst_of_honest_relays_beyond_max_pending_forms_without_a_shed(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, limit: int
) -> None:
    world = 30
    salt = ft.SessionSalt.generate()
    cfg = ft.CoordinatorConfig(world_size=world, formation_timeout=60, handshake_timeout=10,
                               max_pending_handshakes=limit)
    joined: list[str] = []
    listener = memory_network.listener(COORD)
    async with trio.open_nursery() as nursery:
        for rank in range(world):  # all at once: 3 to 7 times the bound
            stream = await memory_network.connect(COORD)
            nursery.start_soon(slow_relay, stream, salt, f"host-{rank}", rank, world, joined)
        started = trio.current_time()
        async with ft.open_coordinator(listener, salt=salt,
                                       config=cfg) as coord:
            formed_after = trio.current_time() - started
            state = coord.state()
    assert state["rejected_handshakes"] == {}  # no shed, no other reject
    assert sorted(joined) == sorted(f"host-{r}" for r in range(world))
    # Waves of `limit` relays, each two link delays long: no re-dial (0.5 s) in it.
    assert formed_after < 0.5


async def test_silent_connections_hold_a_slot_for_the_minimum_age_then_a_relay_gets_in(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    cfg = ft.CoordinatorConfig(world_size=1, formation_timeout=60, handshake_timeout=10,
                               max_pending_handshakes=5)
    min_age = min_shed_age(cfg.handshake_timeout)
    closed_at: list[float] = []
    joined: list[str] = []
    listener = memory_network.listener(COORD)
    async with trio.open_nursery() as nursery:

        async def silent(stream: trio.abc.Stream) -> None:
            await stream.send_all(wire.CHANNEL_MAGIC_CONTROL)  # then nothing
            with trio.move_on_after(5):
                while await stream.receive_some(65536):
                    pass
                closed_at.append(trio.current_time())
            await stream.aclose()

        for _ in range(5):
            nursery.start_soon(silent, await memory_network.connect(COORD))
        await trio.sleep(0.01)
        nursery.start_soon(slow_relay, await memory_network.connect(COORD), salt, "host-a", 0,
                           1, joined)
        async with ft.open_coordinator(listener, salt=salt,
                                       config=cfg) as coord:
            formed_at = trio.current_time()
            rejects = coord.state()["rejected_handshakes"]
            await trio.sleep(6)
    assert joined == ["host-a"]
    assert rejects == {"shed": 1}  # the oldest silent one, for the relay
    # Not before it was min_age old, and the relay was in soon after.
    assert len(closed_at) == 1 and min_age <= closed_at[0] < min_age + 0.05
    assert formed_at < min_age + 4 * LINK_DELAY


async def test_the_pending_bound_waits_for_a_free_slot_and_sheds_only_the_stale(
    autojump_clock: trio.abc.Clock,
) -> None:
    pending = PendingHandshakes(2, min_age=1.0)
    admitted: list[float] = []
    shed: list[int] = []

    async def connection(index: int, hold: float) -> None:
        with pending.slot() as slot, slot.scope:
            await trio.sleep(hold)
        if slot.scope.cancelled_caught:
            shed.append(index)

    async with trio.open_nursery() as nursery:
        for index, hold in enumerate([0.3, 100.0, 100.0, 100.0]):
            await pending.room()  # what an acceptor does (serve_each's room and on_accept)
            admitted.append(trio.current_time())
            pending.admit()
            nursery.start_soon(connection, index, hold)
            await trio.testing.wait_all_tasks_blocked()
        # The third waited for the first to finish (0.3 s), the fourth for the second to be
        # stale (1 s after it was admitted), which it then shed.
        assert admitted == pytest.approx([0.0, 0.0, 0.3, 1.0])
        await trio.testing.wait_all_tasks_blocked()
        assert shed == [1]
        assert pending.waits == 2 and pending.shed == 1 and len(pending) == 2
        assert pending.max_age == pytest.approx(0.3)  # the first, which finished
        nursery.cancel_scope.cancel()


async def test_the_port_mux_queues_a_burst_beyond_max_peeking_without_a_shed(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    routed: list[trio.abc.Stream] = []
    clients: list[trio.abc.Stream] = []
    async with open_port_mux(memory_network.listener("mux"), peek_timeout=5,
                             max_peeking=4) as mux, trio.open_nursery() as nursery:

        async def late_magic(stream: trio.abc.Stream) -> None:
            await trio.sleep(LINK_DELAY)  # a relay on a slow link
            await stream.send_all(wire.CHANNEL_MAGIC_CONTROL)

        for _ in range(20):  # five times the bound, all at once
            clients.append(await memory_network.connect("mux"))
            nursery.start_soon(late_magic, clients[-1])
        with trio.fail_after(1):
            while len(routed) < 20:
                routed.append(await mux.control.accept())
        assert mux.stats.dropped["shed"] == 0
        assert mux.stats.routed["control"] == 20
    for stream in [*routed, *clients]:
        await stream.aclose()


async def test_a_full_leg_queue_stops_the_port_mux_accepting_instead_of_dropping(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    clients: list[trio.abc.Stream] = []
    routed: list[trio.abc.Stream] = []
    async with open_port_mux(memory_network.listener("mux"), peek_timeout=5,
                             queue_size=2) as mux:
        for _ in range(10):
            clients.append(await memory_network.connect("mux"))
            await clients[-1].send_all(wire.CHANNEL_MAGIC_CONTROL)
        await trio.sleep(1)  # nobody takes the control leg's connections yet
        # The queue holds two; a few more wait for room; the rest are still in the backlog.
        assert mux.stats.routed["control"] == 2
        assert mux.stats.accepted < 10
        with trio.fail_after(1):
            while len(routed) < 10:
                routed.append(await mux.control.accept())
        assert mux.stats.dropped["queue_full"] == 0
        assert mux.stats.accepted == 10
    for stream in [*routed, *clients]:
        await stream.aclose()


async def test_a_stale_connection_whose_answer_waits_unread_is_not_shed(
    autojump_clock: trio.abc.Clock,
) -> None:
    # The coordinator is behind, not the peer: its bytes wait in the kernel (FIONREAD), or
    # the coordinator wrote to it only now (touch: the peer's turn starts then).
    pending = PendingHandshakes(3, min_age=1.0)
    answered = {0: True, 1: False, 2: False}
    shed: list[int] = []

    async def connection(index: int) -> None:
        with pending.slot(unread=lambda: answered[index]) as slot, slot.scope:
            await trio.sleep(0.5)
            if index == 1:
                slot.touch()  # e.g. its Challenge written half a second late
            await trio.sleep(100)
        if slot.scope.cancelled_caught:
            shed.append(index)

    async with trio.open_nursery() as nursery:
        for index in range(3):
            await pending.room()
            pending.admit()
            nursery.start_soon(connection, index)
        await trio.testing.wait_all_tasks_blocked()
        await pending.room()  # full: waits until one is stale and silent
        # 0 is stale at 1.0 but its answer waits unread; 1 was touched at 0.5, so it is stale
        # at 1.5; 2 (silent since 0.0) is the one shed, at 1.0.
        assert trio.current_time() == pytest.approx(1.0)
        pending.admit()
        await trio.testing.wait_all_tasks_blocked()
        assert shed == [2]
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("first", [b"", b"\xe2\x17", wire.CHANNEL_MAGIC_CONTROL + b"hello"])
async def test_a_tcp_connection_is_routed_whole_whether_its_magic_came_with_it_or_later(
    first: bytes,
) -> None:
    # The mux routes a connection whose magic is already here without a task of its own, and
    # gives one the rest of the bytes it read; the leg sees exactly what the peer sent.
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with open_port_mux(listeners, peek_timeout=5) as mux:
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await client.send_all(first)
        for _ in range(100):  # until the mux accepted it (bounded)
            if mux.stats.accepted:
                break
            await trio.testing.wait_all_tasks_blocked(0.01)
        sent = first
        if len(first) < len(wire.CHANNEL_MAGIC_CONTROL):
            rest = wire.CHANNEL_MAGIC_CONTROL[len(first):] + b"hello"
            await client.send_all(rest)
            sent += rest
        with trio.fail_after(5):
            routed = await mux.control.accept()
            got = b""
            while len(got) < len(sent):
                got += await routed.receive_some(65536)
        assert got == sent
        assert mux.stats.routed["control"] == 1
        await routed.aclose()
        await client.aclose()


async def route_controls(net: MemoryNetwork, mux: PortMux, clients: list[trio.abc.Stream],
                         count: int) -> None:
    """Dial ``count`` connections that send the control magic; the mux routed them all."""
    for _ in range(count):
        clients.append(await net.connect("mux"))
        await clients[-1].send_all(wire.CHANNEL_MAGIC_CONTROL)
    await trio.testing.wait_all_tasks_blocked()
    assert mux.stats.routed["control"] == count


async def test_an_accept_loop_takes_every_queued_routed_connection_without_waiting(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    clients: list[trio.abc.Stream] = []
    async with open_port_mux(memory_network.listener("mux"), peek_timeout=5) as mux:
        await route_controls(memory_network, mux, clients, 3)
        taken = [mux.control.accept_nowait() for _ in range(4)]
        assert all(stream is not None for stream in taken[:3]) and taken[3] is None
        for stream in taken[:3]:
            assert stream is not None
            assert await stream.receive_some(4) == wire.CHANNEL_MAGIC_CONTROL
            await stream.aclose()
    for client in clients:
        await client.aclose()


async def test_formation_s_accept_loop_takes_a_queued_burst_of_routed_connections_in_one_pass(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    # serve_each over a port mux leg drains its queue with accept_nowait (issue 23): a burst
    # the mux routed costs one pass through the scheduler, not one per connection.
    clients: list[trio.abc.Stream] = []
    ticks = 0
    seen: list[int] = []
    taken: list[trio.abc.Stream] = []

    async def ticker() -> None:
        nonlocal ticks
        for _ in range(10_000):  # bounded: cancelled long before
            ticks += 1
            await trio.lowlevel.checkpoint()

    all_taken = trio.Event()

    def dispatch(stream: trio.abc.Stream) -> None:
        seen.append(ticks)
        taken.append(stream)
        if len(taken) == 5:
            all_taken.set()

    async def never(stream: trio.abc.Stream) -> None:  # dispatch keeps every stream
        raise AssertionError("no handler task expected")

    async with open_port_mux(memory_network.listener("mux"), peek_timeout=5) as mux:
        await route_controls(memory_network, mux, clients, 5)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            await nursery.start(partial(serve_each, mux.control, never, what="test",
                                        dispatch=dispatch, drain_while=lambda: True))
            with trio.fail_after(5):
                await all_taken.wait()
            nursery.cancel_scope.cancel()
        assert len(set(seen)) == 1, f"expected one pass for the 5 queued, got ticks {seen}"
        for stream in taken:
            await stream.aclose()
    for client in clients:
        await client.aclose()
