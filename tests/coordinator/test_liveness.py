"""Coordinator liveness (SPEC §4.5): who is declared dead, when, why, and who is told.

Every test runs on ``MockClock`` over ``MemoryNetwork``; times are asserted to the mock instant.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.events import LostBroadcast, RankDeclaredDead, RankExited, RelayLost
from flodl_trio.testing import EventLog, MemoryNetwork, open_local_cluster
from flodl_trio.wire import CoordHeartbeat, Heartbeat, SyncNow

from helpers import COORD, Recorder, formed_at, start_host, upstream_of, wait_until

TWO_HOSTS = {"host-0": [0, 1], "host-1": [2, 3]}


def config(world: int = 4, **kw: object) -> ft.CoordinatorConfig:
    kw.setdefault("formation_timeout", 10)
    return ft.CoordinatorConfig(world_size=world, **kw)  # type: ignore[arg-type]


async def test_rank_that_stops_heartbeating_is_alive_until_heartbeat_timeout_then_declared_stale(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    log = EventLog()
    rec = Recorder(raw={3: 1.0})
    async with open_local_cluster(TWO_HOSTS, network=memory_network, timeline=log, rank_main=rec,
                                  raw_ranks=rec.raw_mains,
                                  coord_config=config(heartbeat_timeout=5)) as c:
        await trio.sleep(3.5)
        silent_since = rec.raw[3].go_silent()

        await trio.sleep_until(silent_since + 5 - 0.01)
        assert 3 in c.coord.live_ranks
        assert log.of(RankDeclaredDead) == []

        await wait_until(lambda: 3 in c.coord.dead_ranks, limit=1)
        ((declared_at, event),) = log.of(RankDeclaredDead)
        assert declared_at == pytest.approx(silent_since + 5, abs=1e-9)
        assert event == RankDeclaredDead(rank=3, host="host-1", reason="heartbeat stale (>5s)")
        assert c.coord.dead_reason(3) == "heartbeat stale (>5s)"
        assert c.coord.live_ranks == {0, 1, 2}


async def test_endpoint_that_never_heartbeats_is_declared_dead_heartbeat_timeout_after_formation(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    silent = ft.RankConfig(heartbeat_interval=1e6)
    log = EventLog()
    rec = Recorder()
    async with open_local_cluster(TWO_HOSTS, network=memory_network, timeline=log, rank_main=rec,
                                  rank_configs={1: silent},
                                  coord_config=config(heartbeat_timeout=7)) as c:
        await trio.sleep_until(formed_at(log) + 7 - 0.01)
        assert c.coord.live_ranks == {0, 1, 2, 3}
        await wait_until(lambda: 1 in c.coord.dead_ranks, limit=1)
        ((declared_at, event),) = log.of(RankDeclaredDead)
        assert declared_at == pytest.approx(formed_at(log) + 7, abs=1e-9)
        assert event.reason == "heartbeat stale (>7s)"
        # The heartbeating ranks are fine, long after the timeout.
        await trio.sleep(20)
        assert c.coord.dead_ranks == {1}


async def test_slow_timing_consumer_does_not_make_healthy_ranks_stale(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    cfg = config(heartbeat_timeout=3, timing_buffer=4)
    log = EventLog()
    rec = Recorder()
    async with open_local_cluster(TWO_HOSTS, network=memory_network, timeline=log, rank_main=rec,
                                  coord_config=cfg) as c:
        # Nobody reads coord.timing for ten times the heartbeat timeout: the readers block.
        await trio.sleep(30)
        assert c.coord.timing.statistics().current_buffer_used == 4
        assert c.coord.timing.statistics().tasks_waiting_send >= 1
        assert c.coord.dead_ranks == frozenset()
        assert log.of(RankDeclaredDead) == []

        heartbeats = {r: 0 for r in range(4)}
        with trio.move_on_after(5):
            async for msg in c.coord.timing:
                assert isinstance(msg, Heartbeat)
                heartbeats[int(msg.rank)] += 1
        # Nothing was lost while nobody read: every rank's ~35 heartbeats arrive.
        assert all(n >= 34 for n in heartbeats.values()), heartbeats
        assert c.coord.dead_ranks == frozenset()
        assert all(p.lost is None for p in rec.ranks.values())


async def test_rank_silent_after_a_consumer_pause_is_declared_at_its_timeout(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    # Nothing wakes the staleness watch when a reader's wait on a full channel ends; the
    # watch looks again by itself, so a rank that falls silent afterwards is declared on time.
    cfg = config(heartbeat_timeout=3, timing_buffer=4)
    log = EventLog()
    rec = Recorder(raw={3: 1.0})
    async with open_local_cluster(TWO_HOSTS, network=memory_network, timeline=log, rank_main=rec,
                                  raw_ranks=rec.raw_mains, coord_config=cfg) as c:
        await trio.sleep(10)  # nobody reads: the readers wait on the full channel
        assert c.coord.timing.statistics().tasks_waiting_send >= 1

        async def drain() -> None:
            async for _ in c.coord.timing:
                pass

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain)
            await trio.sleep(2.5)
            silent_since = rec.raw[3].go_silent()
            await wait_until(lambda: 3 in c.coord.dead_ranks, limit=5)
            nursery.cancel_scope.cancel()
        ((declared_at, event),) = log.of(RankDeclaredDead)
        assert event.rank == 3
        assert declared_at == pytest.approx(silent_since + 3, abs=1e-9)
        assert c.coord.dead_ranks == {3}


async def test_rank_that_exited_cleanly_is_never_declared_dead(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    log = EventLog()
    rec = Recorder()
    async with open_local_cluster(TWO_HOSTS, network=memory_network, timeline=log, rank_main=rec,
                                  coord_config=config(heartbeat_timeout=3)) as c:
        leaver = rec[1]
        leaver.leave()
        await c.wait_rank_finished(1)
        await wait_until(lambda: 1 in c.coord.exited_ranks, limit=1)
        await trio.sleep(3 * 3)

        assert c.coord.exited_ranks == {1}
        assert c.coord.dead_ranks == frozenset()
        assert c.coord.live_ranks == {0, 2, 3}
        assert log.events(RankExited) == [RankExited(rank=1)]
        assert log.of(RankDeclaredDead) == []
        with pytest.raises(ft.SendError, match="exited cleanly"):
            await c.coord.send_control(1, SyncNow())
        result = await c.coord.broadcast_control(SyncNow())
        assert result.delivered == {0, 2, 3}
        assert c.coord.lost_broadcasts == 0


@pytest.mark.parametrize("how", ["reset", "relay cancelled"])
async def test_relay_upstream_loss_declares_all_its_ranks_dead_in_one_scheduler_pass(
        how: str, autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    hosts = {"host-0": [0, 1, 2], "host-1": [3, 4]}
    log = EventLog()
    rec = Recorder()
    async with open_local_cluster(hosts, network=memory_network, timeline=log, rank_main=rec,
                                  coord_config=config(5)) as c:
        upstream = upstream_of(c, "host-0")
        lost_at = trio.current_time()
        if how == "reset":
            upstream.client.reset()
            cause = "connection reset"
        else:
            c.kill_relay("host-0")
            cause = "connection closed by the relay (EOF)"
        await trio.testing.wait_all_tasks_blocked()

        assert c.coord.dead_ranks == {0, 1, 2}
        for rank in (0, 1, 2):
            reason = c.coord.dead_reason(rank)
            assert reason is not None and "'host-0'" in reason and cause in reason, reason
        assert log.events(RelayLost) == [RelayLost(host="host-0", ranks=(0, 1, 2), reason=cause)]
        deaths = log.of(RankDeclaredDead)
        assert sorted(ev.rank for _, ev in deaths) == [0, 1, 2]
        assert all(t == lost_at and ev.host == "host-0" for t, ev in deaths)

        with pytest.raises(ft.SendError, match="rank 0 was declared dead"):
            await c.coord.send_control(0, SyncNow())

        survivors = [rec[3], rec[4]]
        await wait_until(lambda: all(len(p.declared_dead()) == 3 for p in survivors), limit=1)
        for probe in survivors:
            assert sorted(probe.declared_dead()) == [0, 1, 2]
            assert probe.ep is not None and probe.ep.dead_peers == {0, 1, 2}
        assert c.coord.live_ranks == {3, 4}


async def test_rank_link_that_ends_without_exiting_is_declared_dead_from_relay_rank_exit(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    log = EventLog()
    rec = Recorder(raw={2: 1.0})
    async with open_local_cluster(TWO_HOSTS, network=memory_network, timeline=log, rank_main=rec,
                                  raw_ranks=rec.raw_mains, coord_config=config()) as c:
        await trio.sleep(2)
        crashed_at = trio.current_time()
        await rec.raw[2].stream.aclose()  # the rank process died: no Exiting, its socket closes
        await wait_until(lambda: 2 in c.coord.dead_ranks, limit=1)
        ((declared_at, event),) = log.of(RankDeclaredDead)
        assert declared_at == crashed_at
        assert event.host == "host-1"
        assert "ended without Exiting" in event.reason
        await wait_until(lambda: all(p.declared_dead() == [2] for p in rec.ranks.values()), limit=1)


async def test_declare_dead_records_the_reason_and_tells_every_survivor(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    log = EventLog()
    rec = Recorder()
    async with open_local_cluster(TWO_HOSTS, network=memory_network, timeline=log, rank_main=rec,
                                  coord_config=config()) as c:
        await c.coord.declare_dead(1, "GPU 1 fell off the bus")
        assert c.coord.dead_ranks == {1}
        ((event),) = log.events(RankDeclaredDead)
        assert event.rank == 1 and event.host == "host-0"
        assert "GPU 1 fell off the bus" in event.reason
        assert c.coord.dead_reason(1) == event.reason

        survivors = rec.survivors([1])
        await wait_until(lambda: all(p.declared_dead() == [1] for p in survivors), limit=1)
        assert all(p.ep is not None and p.ep.dead_peers == {1} for p in survivors)
        assert rec[1].declared_dead() == []  # the dead rank itself is not addressed

        await c.coord.declare_dead(1, "reported twice")  # already dead: nothing new
        assert len(log.events(RankDeclaredDead)) == 1
        with pytest.raises(ft.ConfigError, match="expected a rank in"):
            await c.coord.declare_dead(4, "out of range")
        result = await c.coord.broadcast_control(SyncNow())
        assert result.delivered == {0, 2, 3}


async def test_coord_heartbeats_feed_rank_watchdogs_while_the_coordinator_is_idle(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    watchful = ft.RankConfig(coord_liveness_timeout=3)
    log = EventLog()
    rec = Recorder(raw={3: 1.0})
    async with open_local_cluster(TWO_HOSTS, network=memory_network, timeline=log, rank_main=rec,
                                  raw_ranks=rec.raw_mains, rank_config=watchful,
                                  coord_config=config()) as c:
        await trio.sleep(30)
        for probe in rec.ranks.values():
            assert probe.lost is None
            assert probe.ep is not None and probe.ep.coordinator_lost is None
            assert probe.received == []  # CoordHeartbeat is absorbed by the endpoint
        # On the wire they are there, one per heartbeat_interval.
        assert 29 <= rec.raw[3].count(CoordHeartbeat) <= 31
        assert c.coord.lost_broadcasts == 0
        assert c.coord.dead_ranks == frozenset()


async def test_lost_relay_falls_back_to_heartbeat_staleness_without_declare_dead_on_relay_loss(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    cfg = config(heartbeat_timeout=5, declare_dead_on_relay_loss=False)
    log = EventLog()
    rec = Recorder()
    async with open_local_cluster(TWO_HOSTS, network=memory_network, timeline=log, rank_main=rec,
                                  coord_config=cfg) as c:
        await trio.sleep(2.5)
        lost_at = trio.current_time()
        upstream_of(c, "host-0").client.reset()
        await trio.testing.wait_all_tasks_blocked()
        assert [ev.host for ev in log.events(RelayLost)] == ["host-0"]
        assert c.coord.dead_ranks == frozenset()

        # The last heartbeats got through less than two heartbeat_intervals before the reset: the
        # relay reports its ranks' heartbeats once per interval (Liveness), and those it held
        # when the connection broke never arrived.
        await trio.sleep_until(lost_at + 5 - 2 - 0.01)
        assert c.coord.dead_ranks == frozenset()
        # Meanwhile every CoordHeartbeat missed ranks 0 and 1: counted as lost broadcasts.
        lost = log.events(LostBroadcast)
        assert len(lost) == c.coord.lost_broadcasts >= 3
        assert all(ev.control == "CoordHeartbeat" and set(ev.failures) == {0, 1} for ev in lost)
        await trio.sleep_until(lost_at + 5)
        await trio.testing.wait_all_tasks_blocked()
        assert c.coord.dead_ranks == {0, 1}
        assert {c.coord.dead_reason(r) for r in (0, 1)} == {"heartbeat stale (>5s)"}
        await wait_until(lambda: sorted(rec[2].declared_dead()) == [0, 1], limit=1)


async def test_relay_lost_while_its_hello_ack_is_in_flight_never_counts_as_formed(
        autojump_clock: trio.abc.Clock) -> None:
    # 40-byte buffers: a HelloAck record (44 bytes) does not fit, so the coordinator's write of it
    # waits until the relay reads, and this relay never does.
    net = MemoryNetwork(buffer_size=40)
    salt = ft.SessionSalt.generate()
    listener = net.listener(COORD)
    entered: list[frozenset[int]] = []

    async def relay_that_dies_before_reading_its_ack() -> None:
        stream = await net.connect(COORD)
        machine = wire.RelayHandshake(salt, host="host-0", ranks=(0, 1), world_size=4,
                                     coordinator=COORD)
        await stream.send_all(machine.data_to_send())  # the magic
        hello = b""
        for _ in range(20):  # feed the Challenge until the machine answers with its Hello
            machine.receive_data(bytes(await stream.receive_some(4096)))
            assert machine.next_event() is wire.NEED_DATA
            hello = machine.data_to_send()
            if hello:
                break
        await stream.send_all(hello)
        await trio.sleep(2)
        stream.reset()

    async with trio.open_nursery() as nursery:
        await start_host(nursery, net, "host-1", [2, 3], salt=salt, world=4)
        nursery.start_soon(relay_that_dies_before_reading_its_ack)
        with pytest.raises(ft.FormationTimeout, match="2/4 ranks covered"):
            async with ft.open_coordinator(listener, salt=salt, config=config(formation_timeout=5)
                                           ) as coord:
                # Never reached: ranks 0 and 1 would be "live" here, then vanish (neither live
                # nor dead) when the HelloAck write fails.
                entered.append(coord.live_ranks)
    assert entered == []
    net.assert_all_closed()
