"""Issue 13 under MockClock: a host or rank that stops reading hurts nobody else, and a rank
declared dead is told so and cut off (SPEC §4.5 fencing, §5 per-rank queues)."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

import flodl_trio as ft
from flodl_trio.events import (
    RankDeclaredDead,
    RankFenced,
    RelayLost,
    RelayRetired,
    RelayStalled,
)
from flodl_trio.relay._link import RankLink
from flodl_trio.testing import EventLog, MemoryNetwork, open_local_cluster
from flodl_trio.wire import DeclareDead, SetGlobalStep

from helpers import COORD, Recorder, formed_at, start_host, upstream_of, wait_until as poll_until
from helpers.raw import RawRank, RawRelay, raw_relay_handshake

TWO_HOSTS = {"host-0": [0, 1], "host-1": [2, 3]}


def filler_for(salt: ft.SessionSalt, record_len: int) -> ft.wire.NewNcclSession:
    """A control message whose DATA record is exactly ``record_len`` bytes long."""
    for n in range(record_len - 200, record_len):
        msg = ft.wire.NewNcclSession(uid=b"u" * n, new_rank=1, new_world_size=4)
        if ft.wire.RECORD_HEADER_LEN + len(ft.wire.encode_frame(salt, msg)) == record_len:
            return msg
    raise AssertionError(f"no NewNcclSession fills exactly {record_len} bytes")


async def wait_until(predicate: Any, limit: float = 60.0) -> None:
    await poll_until(predicate, limit=limit, step=0.001)


@pytest.mark.parametrize(("write_stall", "liveness"), [(6.0, 3.0), (30.0, 30.0)],
                         ids=["stall-6s-liveness-3s", "defaults"])
async def test_a_relay_that_stops_reading_is_lost_after_write_stall_and_nobody_else_notices(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, write_stall: float,
    liveness: float,
) -> None:
    """Issue 13 finding 1: the heartbeat loop waited on the stalled relay, so with a 6 s stall
    timeout and a 3 s liveness deadline every healthy rank lost its coordinator."""
    salt = ft.SessionSalt.generate()
    # The stuck relay's ranks are silent raw peers: keep staleness out of the picture.
    cfg = ft.CoordinatorConfig(world_size=4, write_stall_timeout=write_stall,
                               heartbeat_interval=1.0, heartbeat_timeout=100)
    rank_cfg = ft.RankConfig(coord_liveness_timeout=liveness)
    log = EventLog()
    stuck: list[RawRelay] = []
    async with trio.open_nursery() as nursery:
        host_a = await start_host(nursery, memory_network, "host-a", [0, 1], salt=salt, world=4,
                                  rank_config=rank_cfg)

        async def stuck_relay() -> None:  # joins, then never reads again (its socket alive)
            stuck.append(await raw_relay_handshake(await memory_network.connect(COORD), salt,
                                                   "host-stuck", [2, 3], world_size=4))

        nursery.start_soon(stuck_relay)
        async with ft.open_coordinator(memory_network.listener(COORD), salt=salt, config=cfg,
                                       timeline=log) as coord:
            await wait_until(lambda: bool(stuck))
            # Exactly its buffer: written, and nothing more fits until it reads.
            await coord.send_control(2, filler_for(salt, memory_network.buffer_size))
            started = trio.current_time()
            steps = int(write_stall) + 6
            late: list[tuple[int, int, float]] = []
            async with trio.open_nursery() as broadcasts:

                async def arrives(rank: int, step: int, sent: float) -> None:
                    msg = SetGlobalStep(global_step=step)
                    await wait_until(lambda: msg in host_a.ranks[rank].received, limit=1)
                    if trio.current_time() - sent > 0.01:
                        late.append((rank, step, trio.current_time() - sent))

                async def broadcast(step: int) -> None:
                    for rank in (0, 1):  # the write to host-a's relay happens at once
                        broadcasts.start_soon(arrives, rank, step, trio.current_time())
                    try:
                        result = await coord.broadcast_control(SetGlobalStep(global_step=step))
                    except ft.BroadcastError as exc:  # queued behind the stall: lost with it
                        result = exc.result
                    assert result.delivered >= {0, 1} and set(result.failed) <= {2, 3}

                for step in range(1, steps + 1):
                    await trio.sleep(1.0)
                    broadcasts.start_soon(broadcast, step)
            assert late == []
            (stalled_at, stalled), = log.of(RelayStalled)
            assert stalled == RelayStalled(host="host-stuck", ranks=(2, 3),
                                           stalled_s=write_stall)
            # Its writer blocked on the first record after the filler (the first broadcast).
            assert stalled_at == pytest.approx(started + 1 + write_stall, abs=0.01)
            assert coord.dead_ranks == {2, 3} and coord.live_ranks == {0, 1}
            assert all("write stall" in coord.dead_reason(r) for r in (2, 3))  # type: ignore
            # The healthy ranks heard of the deaths, and never lost the coordinator.
            for rank in (0, 1):
                assert host_a.ranks[rank].outcome is None
                assert DeclareDead(rank=2) in host_a.ranks[rank].received
            state = coord.state()
            assert state["relay_write_stalls"] == 1
            assert state["lost_broadcasts"] >= 1
        await stuck[0].stream.aclose()
    assert [run.outcome for run in host_a.ranks.values()] == ["ended", "ended"]


async def test_a_rank_that_stops_reading_is_dropped_by_its_relay_and_its_sibling_never_waits(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork,
) -> None:
    """Issue 13 finding 2: the relay's upstream reader waited on the full queue of one rank."""
    salt = ft.SessionSalt.generate()
    relay_cfg = ft.RelayConfig(write_stall_timeout=5.0)
    cfg = ft.CoordinatorConfig(world_size=2, heartbeat_interval=1.0)
    log = EventLog()
    async with trio.open_nursery() as nursery:
        host = await start_host(nursery, memory_network, "host-a", [0, 1], salt=salt, world=2,
                                relay_config=relay_cfg, start_ranks=[0])
        # Rank 1 completes its handshake and then never reads (its process is wedged).
        silent = await RawRank.connect(lambda: memory_network.connect("relay:host-a"),
                                       salt=salt, rank=1, world_size=2, interval=None)
        async with ft.open_coordinator(memory_network.listener(COORD), salt=salt, config=cfg,
                                       timeline=log) as coord:
            await coord.send_control(1, filler_for(salt, memory_network.buffer_size))
            started = trio.current_time()
            for step in range(1, 13):
                await coord.broadcast_control(SetGlobalStep(global_step=step))
                sent = trio.current_time()
                await wait_until(lambda s=step: SetGlobalStep(global_step=s)
                                 in host.ranks[0].received, limit=1)
                assert trio.current_time() - sent < 0.01  # the sibling never waits
                await trio.sleep(1.0)
            assert coord.dead_ranks == {1}
            reason = coord.dead_reason(1)
            assert reason == ("relay 'host-a' dropped rank 1: it read nothing for "
                              "write_stall_timeout=5s")
            ((died_at, _),) = log.of(RankDeclaredDead)
            # Blocked on the first broadcast after the filler, dropped write_stall later.
            assert died_at == pytest.approx(started + 5, abs=0.01)
            assert coord.live_ranks == {0} and host.ranks[0].outcome is None
        await silent.stream.aclose()
    assert host.ranks[0].outcome == "ended"


async def test_rank_declared_dead_by_staleness_is_told_why_and_its_endpoint_ends_evicted(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork,
) -> None:
    silent = ft.RankConfig(heartbeat_interval=1e6)
    cfg = ft.CoordinatorConfig(world_size=4, heartbeat_timeout=7)
    log, rec = EventLog(), Recorder()
    async with open_local_cluster(TWO_HOSTS, network=memory_network, rank_configs={1: silent},
                                  coord_config=cfg, timeline=log, rank_main=rec) as c:
        await wait_until(lambda: rec[1].ended.is_set(), limit=8)
        ((declared_at, _),) = log.of(RankDeclaredDead)
        assert declared_at == pytest.approx(formed_at(log) + 7, abs=1e-9)
        assert rec[1].ended_at == pytest.approx(declared_at, abs=0.01)
        lost = rec[1].lost
        assert isinstance(lost, ft.RankEvicted) and isinstance(lost, ft.CoordinatorLost)
        assert lost.reason == "heartbeat stale (>7s)"
        assert "the coordinator declared rank 1 dead (heartbeat stale (>7s)) and cut it off" in (
            str(lost))
        assert log.events(RankFenced) == [
            RankFenced(rank=1, host="host-0", reason="heartbeat stale (>7s)")]
        # Its sibling and the relay go on; the relay is not disconnected for one dead rank.
        await trio.sleep(10)
        assert rec[0].lost is None and c.coord.live_ranks == {0, 2, 3}
        assert log.of(RelayRetired) == [] and log.of(RelayLost) == []
        assert c.coord.state()["fenced_ranks"] == 1


async def test_relay_whose_ranks_are_all_declared_dead_is_disconnected_and_its_ranks_evicted(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork,
) -> None:
    silent = ft.RankConfig(heartbeat_interval=1e6)
    cfg = ft.CoordinatorConfig(world_size=4, heartbeat_timeout=5)
    log, rec = EventLog(), Recorder()
    async with open_local_cluster(TWO_HOSTS, network=memory_network,
                                  rank_configs={2: silent, 3: silent}, coord_config=cfg,
                                  timeline=log, rank_main=rec) as c:
        upstream = upstream_of(c, "host-1")
        await wait_until(lambda: not upstream.server.is_open, limit=6)
        assert trio.current_time() == pytest.approx(formed_at(log) + 5, abs=0.01)
        assert log.events(RelayRetired) == [RelayRetired(host="host-1", ranks=(2, 3))]
        assert log.of(RelayLost) == []  # closed on purpose: nothing was lost
        await wait_until(lambda: "host-1" in c.relay_exits, limit=1)
        # Its evicted ranks leave, then the coordinator's EOF arrives: either ends it, cleanly.
        relay_exit = c.relay_exits["host-1"]
        assert (relay_exit.reason == "all ranks exited"
                or relay_exit.reason.startswith("coordinator said Goodbye: ")), relay_exit
        assert relay_exit.clean
        for rank in (2, 3):
            lost = rec[rank].lost
            assert isinstance(lost, ft.RankEvicted), lost
            assert lost.reason == "heartbeat stale (>5s)"
        assert c.coord.state()["relays_disconnected"] == 1
        assert c.coord.live_ranks == {0, 1} and rec[0].lost is None


async def test_frames_of_a_fenced_rank_are_ignored(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork,
) -> None:
    cfg = ft.CoordinatorConfig(world_size=4)
    rec = Recorder(raw={3: None})
    async with open_local_cluster(TWO_HOSTS, network=memory_network, coord_config=cfg,
                                  rank_main=rec, raw_ranks=rec.raw_mains) as c:
        await c.coord.declare_dead(3, "the orchestrator saw it hang")
        raw = rec.raw[3]
        await wait_until(lambda: raw.count(ft.wire.Fenced) == 1, limit=1)
        (fenced,) = [m for m in raw.received if isinstance(m, ft.wire.Fenced)]
        assert fenced == ft.wire.Fenced(rank=3, reason="declared by the orchestrator: the "
                                        "orchestrator saw it hang")
        # The relay half-closed the link after the Fenced frame.
        await wait_until(lambda: raw.eof.is_set(), limit=1)
        with pytest.raises((trio.BrokenResourceError, trio.ClosedResourceError)):
            await raw.send(ft.wire.Heartbeat(rank=3, step_count=1))
        assert c.coord.dead_ranks == {3}


async def test_rank_queue_holds_a_burst_and_signals_a_drop_only_after_write_stall() -> None:
    stream, _ = trio.testing.memory_stream_pair()
    link = RankLink(0, stream, ft.RelayConfig(queue_size=2, write_stall_timeout=5.0))
    assert all(link.offer(b"x", 0.0) for _ in range(2))
    assert link.full_since is None
    assert link.offer(b"y", 1.0) and link.full_since == 1.0  # over capacity: the clock starts
    assert link.offer(b"z", 5.9)
    assert await link.next_batch(limit=1) == [b"x"]
    assert link.full_since == 1.0  # still over
    assert await link.next_batch(limit=1) == [b"x"]
    assert link.full_since is None  # drained back to capacity: the clock stops
    assert link.offer(b"w", 7.0) and link.full_since == 7.0
    assert not link.offer(b"v", 12.0)  # over capacity for write_stall_timeout: drop it
    link.end_queue()
    assert await link.next_batch() == [b"y", b"z", b"w", b"v"]
    assert await link.next_batch() is None


def test_metrics_expose_the_fencing_and_stall_counters() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from flodl_trio.status import render_prometheus

    text = render_prometheus({"fenced_ranks": 3, "relay_write_stalls": 1,
                              "relays_disconnected": 2})
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, value in (("fenced_ranks", 3), ("relay_write_stalls", 1),
                        ("relays_disconnected", 2)):
        family = families[f"flodl_trio_{name}"]
        assert family.type == "counter"
        assert [s.value for s in family.samples] == [value]
