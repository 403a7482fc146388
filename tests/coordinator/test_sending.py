"""Sending (SPEC §4.4): one rank, every rank in order, and what a failed send looks like."""

from __future__ import annotations

import pytest
import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.events import LostBroadcast, RankDeclaredDead, RelayLost
from flodl_trio.testing import MemoryNetwork
from flodl_trio.wire import DeclareDead, SetGlobalStep, Shutdown, SyncNow, Throttle

from helpers import COORD, events_of, recorded, start_host, wait_until
from helpers.raw import RawRelay, raw_relay_handshake

HOSTS = {"host-a": [0, 1], "host-b": [2, 3]}


async def test_send_control_reaches_exactly_the_addressed_rank(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with recorded(memory_network) as (c, rec):
        for rank in range(4):
            await c.coord.send_control(rank, SetGlobalStep(global_step=1000 + rank))
    for rank, run in rec.ranks.items():
        assert run.received == [SetGlobalStep(global_step=1000 + rank), Shutdown()]
        assert c.outcomes[rank] == "ended"


async def test_broadcast_control_reaches_every_rank_in_order_and_nothing_else(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with recorded(memory_network) as (c, rec):
        for i in range(20):
            result = await c.coord.broadcast_control(SetGlobalStep(global_step=i))
            assert result.delivered == frozenset(range(4))
            assert result.failed == {}
        # Interleaved with a unicast on the same link, the order is still the order of the calls.
        await c.coord.send_control(3, SyncNow())
        await c.coord.broadcast_control(Throttle())
        assert c.coord.lost_broadcasts == 0
    expected = [SetGlobalStep(global_step=i) for i in range(20)]
    for rank, run in rec.ranks.items():
        tail = [SyncNow(), Throttle()] if rank == 3 else [Throttle()]
        assert run.received == [*expected, *tail, Shutdown()]


async def test_send_control_to_rank_out_of_range_raises_send_error(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with recorded(memory_network) as (c, rec):
        for bad in (4, -1, 100):
            with pytest.raises(ft.SendError, match=r"expected a rank in \[0, 4\)"):
                await c.coord.send_control(bad, SyncNow())
        with pytest.raises(ft.SendError, match="expected a rank"):
            await c.coord.send_control(True, SyncNow())  # type: ignore[arg-type]
    assert all(rec[rank].received == [Shutdown()] for rank in range(4))


async def test_send_control_to_a_dead_rank_raises_send_error(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with recorded(memory_network) as (c, rec):
        await c.coord.declare_dead(1, "GPU fell off the bus")
        assert c.coord.dead_ranks == frozenset({1})
        with pytest.raises(ft.SendError) as excinfo:
            await c.coord.send_control(1, SyncNow())
        assert "rank 1 was declared dead" in str(excinfo.value)
        assert "GPU fell off the bus" in str(excinfo.value)
        (dead,) = events_of(c.coord.timeline, RankDeclaredDead)
        assert dead.rank == 1 and dead.host == "host-a"
        # Survivors were told, and a broadcast no longer attempts the dead rank.
        result = await c.coord.broadcast_control(Throttle())
        assert result.delivered == frozenset({0, 2, 3})
    for rank in (0, 2, 3):
        assert rec[rank].received == [DeclareDead(rank=1), Throttle(), Shutdown()]
    assert Throttle() not in rec[1].received


async def test_send_control_to_a_rank_that_exited_cleanly_raises_send_error(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with recorded(memory_network) as (c, rec):
        leaver = rec[2]
        leaver.leave()
        await wait_until(lambda: 2 in c.coord.exited_ranks)
        await wait_until(lambda: 2 in c.outcomes)  # its open_rank block was left
        assert c.outcomes[2] == "left"
        with pytest.raises(ft.SendError, match="rank 2 exited cleanly"):
            await c.coord.send_control(2, SyncNow())
        # Its relay reported the closed connection, but an exited rank is never declared dead.
        await trio.sleep(1)
        assert c.coord.dead_ranks == frozenset()
        assert c.coord.live_ranks == frozenset({0, 1, 3})
        result = await c.coord.broadcast_control(Throttle())
        assert result.delivered == frozenset({0, 1, 3})
        await c.coord.send_control(3, SyncNow())  # the exited rank's relay still carries rank 3
    assert rec[3].received == [Throttle(), SyncNow(), Shutdown()]
    assert leaver.received == []


async def test_broadcast_with_a_lost_relay_reports_exactly_its_ranks_when_not_declared_dead(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    # No CoordHeartbeat during the test, so the only lost broadcast is ours.
    cfg = ft.CoordinatorConfig(world_size=4, declare_dead_on_relay_loss=False,
                               heartbeat_interval=3600)
    async with recorded(memory_network, coord_config=cfg) as (c, rec):
        c.kill_relay("host-b")
        await wait_until(lambda: bool(events_of(c.coord.timeline, RelayLost)))
        assert c.coord.live_ranks == frozenset(range(4))  # not declared dead by config
        with pytest.raises(ft.BroadcastError) as excinfo:
            await c.coord.broadcast_control(SetGlobalStep(global_step=7))
        err = excinfo.value
        assert err.result.delivered == frozenset({0, 1})
        assert set(err.result.failed) == {2, 3}
        assert err.failed_ranks == frozenset({2, 3})
        assert all("host-b" in why for why in err.result.failed.values())
        assert "ranks [2, 3]" in str(err)
        assert "SetGlobalStep" in str(err)
        assert c.coord.lost_broadcasts == 1
        (lost,) = events_of(c.coord.timeline, LostBroadcast)
        assert lost.control == "SetGlobalStep"
        assert set(lost.failures) == {2, 3}
        with pytest.raises(ft.SendError, match="host-b"):
            await c.coord.send_control(2, SyncNow())
    assert rec[0].received == [SetGlobalStep(global_step=7), Shutdown()]
    assert rec[1].received == [SetGlobalStep(global_step=7), Shutdown()]
    for rank in (2, 3):
        assert isinstance(c.outcomes[rank], ft.CoordinatorLost)


async def test_broadcast_after_relay_loss_skips_its_dead_ranks_and_succeeds_for_the_rest(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with recorded(memory_network) as (c, rec):
        c.kill_relay("host-b")
        await wait_until(lambda: c.coord.dead_ranks == frozenset({2, 3}))
        dead = events_of(c.coord.timeline, RankDeclaredDead)
        assert sorted(ev.rank for ev in dead) == [2, 3]
        assert all("host-b" in ev.reason for ev in dead)
        result = await c.coord.broadcast_control(SetGlobalStep(global_step=7))
        assert result.delivered == frozenset({0, 1})
        assert result.failed == {}
        assert c.coord.lost_broadcasts == 0
        assert not events_of(c.coord.timeline, LostBroadcast)
    for rank in (0, 1):
        received = rec[rank].received
        assert sorted(m.rank for m in received if isinstance(m, DeclareDead)) == [2, 3]
        assert [m for m in received if not isinstance(m, DeclareDead)] == [
            SetGlobalStep(global_step=7), Shutdown()]


async def test_one_stalled_relay_does_not_delay_a_broadcast_to_the_others(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    """A relay that stopped reading (its upstream buffer full) fails after write_stall_timeout,
    while the other relay's ranks get the frame at once."""
    salt = ft.SessionSalt.generate()
    cfg = ft.CoordinatorConfig(world_size=4, write_stall_timeout=5, heartbeat_interval=3600)
    listener = memory_network.listener(COORD)
    async with trio.open_nursery() as nursery:
        host_a = await start_host(nursery, memory_network, "host-a", [0, 1], salt=salt, world=4)

        stuck: list[RawRelay] = []

        async def stuck_relay() -> None:
            stuck.append(await raw_relay_handshake(await memory_network.connect(COORD), salt,
                                                   "host-stuck", [2, 3], world_size=4))

        nursery.start_soon(stuck_relay)
        async with ft.open_coordinator(listener, salt=salt, config=cfg) as coord:
            await wait_until(lambda: bool(stuck))
            # One unicast whose record is exactly the size of the connection's buffer: it is
            # written, and nothing more fits until the (never reading) relay reads.
            await coord.send_control(2, filler_for(salt, memory_network.buffer_size))
            arrived: dict[int, float] = {}
            started = trio.current_time()
            async with trio.open_nursery() as watchers:

                async def watch(rank: int) -> None:
                    run = host_a.ranks[rank]
                    await wait_until(lambda: SetGlobalStep(global_step=99) in run.received,
                                     step=0.001)
                    arrived[rank] = trio.current_time() - started

                for rank in (0, 1):
                    watchers.start_soon(watch, rank)
                with pytest.raises(ft.BroadcastError) as excinfo:
                    await coord.broadcast_control(SetGlobalStep(global_step=99))
            assert trio.current_time() - started == pytest.approx(5, abs=0.01)
            assert max(arrived.values()) < 0.01
            result = excinfo.value.result
            assert result.delivered == frozenset({0, 1})
            assert set(result.failed) == {2, 3}
            assert all("write stall" in why for why in result.failed.values())
            # A stalled connection is treated as lost (SPEC §4.5).
            await wait_until(lambda: coord.dead_ranks == frozenset({2, 3}))
            assert coord.lost_broadcasts == 1
        await stuck[0].stream.aclose()


def filler_for(salt: ft.SessionSalt, record_len: int) -> wire.NewNcclSession:
    """A control message whose DATA record is exactly ``record_len`` bytes long."""
    for n in range(record_len - 200, record_len):
        msg = wire.NewNcclSession(uid=b"u" * n, new_rank=2, new_world_size=4)
        if wire.RECORD_HEADER_LEN + len(wire.encode_frame(salt, msg)) == record_len:
            return msg
    raise AssertionError(f"no NewNcclSession fills exactly {record_len} bytes")
