"""The failure policy (SPEC §4.5): when deaths stop the run, what the ranks are told, and what
``open_coordinator`` raises. ``MockClock`` over ``MemoryNetwork``.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import trio

import flodl_trio as ft
from flodl_trio import SaveReason
from flodl_trio.events import ClusterFailed, RankDeclaredDead
from flodl_trio.testing import EventLog, LocalCluster, MemoryNetwork, open_local_cluster
from flodl_trio.wire import DeclareDead, ShutdownWithSave

from helpers import Recorder, live_task_names, upstream_of, wait_until

TWO_HOSTS = {"host-0": [0, 1], "host-1": [2, 3]}


def config(max_failure: ft.MaxFailure | None, world: int = 4) -> ft.CoordinatorConfig:
    return ft.CoordinatorConfig(world_size=world, formation_timeout=10, max_failure=max_failure)


async def kill(c: LocalCluster, ranks: list[int]) -> None:
    for rank in ranks:
        await c.coord.declare_dead(rank, "killed by the test")


async def stays_running(c: LocalCluster, seconds: float = 5) -> None:
    await trio.sleep(seconds)
    assert c.coord.phase == "running"
    assert isinstance(c.coord.timeline, EventLog)
    assert c.coord.timeline.of(ClusterFailed) == []


async def run_until_failure(net: MemoryNetwork, hosts: dict[str, list[int]],
                            cfg: ft.CoordinatorConfig, act: Any,
                            raw: dict[int, float | None] | None = None,
                            ) -> tuple[ft.ClusterFailure, Recorder, EventLog, list[str]]:
    """Run ``act(cluster)`` in the body, then wait; returns the ClusterFailure that ended it,
    the ranks' records and the event log."""
    body: list[str] = []
    log = EventLog()
    rec = Recorder(raw=raw)
    with pytest.raises(ft.ClusterFailure) as info:
        async with open_local_cluster(hosts, network=net, coord_config=cfg, timeline=log,
                                      rank_main=rec, raw_ranks=rec.raw_mains) as c:
            try:
                await act(c)
                await trio.sleep(60)
                body.append("finished")
            except trio.Cancelled:
                body.append("cancelled")
                raise
    return info.value, rec, log, body


@pytest.mark.parametrize(("policy", "deaths_tolerated"), [
    (ft.MaxFailure.absolute(2), 1),
    (ft.MaxFailure.absolute(0), 0),
    (ft.MaxFailure.percent(0), 0),
    (ft.MaxFailure.percent(50), 1),
    (ft.MaxFailure.fraction(0.3), 1),  # ceil(0.3 * 4) = 2
    (ft.MaxFailure.percent(100), 3),   # only all four dead fails
])
async def test_max_failure_stops_the_run_at_its_limit_and_not_before(
        policy: ft.MaxFailure, deaths_tolerated: int, autojump_clock: trio.abc.Clock,
        memory_network: MemoryNetwork) -> None:
    async def act(c: LocalCluster) -> None:
        await kill(c, list(range(deaths_tolerated)))
        await stays_running(c)
        await kill(c, [deaths_tolerated])

    failure, rec, log, body = await run_until_failure(memory_network, TWO_HOSTS, config(policy),
                                                      act)
    dead = frozenset(range(deaths_tolerated + 1))
    assert failure.reason == SaveReason.MAX_FAILURE_EXCEEDED
    assert failure.dead == dead
    assert "MAX_FAILURE_EXCEEDED" in str(failure)
    assert body == ["cancelled"]
    assert log.events(ClusterFailed) == [ClusterFailed(reason="MAX_FAILURE_EXCEEDED",
                                                         dead=tuple(sorted(dead)))]
    for probe in rec.survivors(sorted(dead)):
        assert probe.received[-1] == ShutdownWithSave(reason=SaveReason.MAX_FAILURE_EXCEEDED)
        assert probe.lost is None  # a clean end of iteration


async def test_losing_every_rank_without_max_failure_is_all_ranks_lost(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    async def act(c: LocalCluster) -> None:
        c.kill_relay("host-0")
        await wait_until(lambda: c.coord.dead_ranks == {0, 1}, limit=1)
        await stays_running(c)
        c.kill_relay("host-1")

    failure, _, log, body = await run_until_failure(memory_network, TWO_HOSTS, config(None), act)
    assert failure.reason == SaveReason.ALL_RANKS_LOST
    assert failure.dead == {0, 1, 2, 3}
    assert body == ["cancelled"]
    assert [ev.reason for ev in log.events(ClusterFailed)] == ["ALL_RANKS_LOST"]
    # The message says why each rank died, the ranks of one lost relay together.
    assert set(failure.why) == {0, 1, 2, 3}
    assert failure.why[0] == failure.why[1] != failure.why[2] == failure.why[3]
    assert "relay 'host-0'" in failure.why[0] and "relay 'host-1'" in failure.why[2]
    text = str(failure)
    assert f"ranks [0, 1]: {failure.why[0]}" in text
    assert f"ranks [2, 3]: {failure.why[2]}" in text


def test_a_cluster_failure_of_a_large_world_stays_one_readable_line() -> None:
    # 65,536 dead ranks: rank 5 went stale first, then every relay of 8 was lost for its own
    # reason. The message names the rank range, the first reasons in the order they happened
    # (the root cause first) and a count of the rest, not 8,192 reasons.
    why = {5: "heartbeat stale (>30s)"}
    why.update((rank, f"relay 'host-{rank // 8}' lost: EOF") for rank in range(65_536)
               if rank != 5)
    failure = ft.ClusterFailure(SaveReason.ALL_RANKS_LOST, why, "no live rank is left", why=why)
    text = str(failure)
    assert len(text) < 600, text
    assert text.startswith("cluster failure: ALL_RANKS_LOST; dead ranks [0..65535, 65536 ranks] "
                           "(no live rank is left); why: rank 5: heartbeat stale (>30s); "
                           "ranks [0, 1, 2, 3, 4, 6, 7]: relay 'host-0' lost: EOF; "
                           "ranks [8, 9, 10, 11, 12, 13, 14, 15]: relay 'host-1' lost: EOF; ")
    assert text.endswith("8189 more reasons (65512 ranks)")
    again = pickle.loads(pickle.dumps(failure))
    assert (str(again), again.why, again.dead) == (text, why, frozenset(why))


async def test_shutdown_with_save_is_sent_once_when_a_relay_with_three_ranks_dies(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    hosts = {"host-0": [0, 1, 2], "host-1": [3, 4]}

    async def act(c: LocalCluster) -> None:
        upstream_of(c, "host-0").client.reset()

    failure, rec, log, body = await run_until_failure(
        memory_network, hosts, config(ft.MaxFailure.absolute(2), world=5), act,
        raw={3: 1.0, 4: 1.0})
    assert body == ["cancelled"]
    assert failure.reason == SaveReason.MAX_FAILURE_EXCEEDED
    assert failure.dead == {0, 1, 2}  # the three died together: one decision
    assert len(log.events(ClusterFailed)) == 1
    assert sorted(ev.rank for ev in log.events(RankDeclaredDead)) == [0, 1, 2]
    for rank in (3, 4):
        raw = rec.raw[rank]  # raw ranks record every frame, even after ShutdownWithSave
        assert raw.count(ShutdownWithSave) == 1
        assert raw.labels() == ["DeclareDead"] * 3 + ["ShutdownWithSave"]
        assert sorted(int(m.rank) for m in raw.received if isinstance(m, DeclareDead)) == [0, 1, 2]


async def test_cluster_failure_leaves_no_task_and_no_open_stream(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    async def act(c: LocalCluster) -> None:
        await kill(c, [3])

    failure, _, _, _ = await run_until_failure(memory_network, TWO_HOSTS,
                                            config(ft.MaxFailure.absolute(1)), act)
    assert failure.dead == {3}
    # No coordinator, relay or rank task is left in the run; every stream and listener closed.
    assert [n for n in live_task_names() if "flodl_trio" in n or "helpers" in n] == []
    assert memory_network.open_streams() == []
    assert memory_network.open_listeners() == []


async def test_explicit_shutdown_with_save_reaches_every_live_rank_once(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    hosts = {"host-0": [0, 1], "host-1": [2, 3]}
    log = EventLog()
    rec = Recorder(raw={1: 1.0, 3: 1.0})
    async with open_local_cluster(hosts, network=memory_network, coord_config=config(None),
                                  timeline=log, rank_main=rec, raw_ranks=rec.raw_mains) as c:
        await c.coord.declare_dead(2, "gone")
        await c.coord.shutdown_with_save(SaveReason.REDUCE_STALL)
        await c.coord.shutdown_with_save(SaveReason.GRACEFUL_SHUTDOWN)  # latched: not sent
        await wait_until(lambda: all(p.ended.is_set() for r, p in rec.ranks.items() if r != 2),
                       limit=1)
        await trio.sleep(2)
    for rank in (1, 3):
        assert rec.raw[rank].count(ShutdownWithSave) == 1
        assert ShutdownWithSave(reason=SaveReason.REDUCE_STALL) in rec.raw[rank].received
    assert rec[0].received == [DeclareDead(rank=2),
                                    ShutdownWithSave(reason=SaveReason.REDUCE_STALL)]
    assert rec[0].lost is None
    assert rec[2].received == []  # the dead rank is not addressed
    assert log.of(ClusterFailed) == []  # a requested save is not a failure


async def test_deaths_after_an_explicit_shutdown_with_save_still_raise_cluster_failure(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    async def act(c: LocalCluster) -> None:
        await c.coord.shutdown_with_save(SaveReason.GRACEFUL_SHUTDOWN)
        await kill(c, [0, 1])

    failure, rec, _, body = await run_until_failure(
        memory_network, TWO_HOSTS, config(ft.MaxFailure.absolute(2)), act,
        raw={2: 1.0, 3: 1.0})
    assert failure.reason == SaveReason.MAX_FAILURE_EXCEEDED
    assert failure.dead == {0, 1}
    assert body == ["cancelled"]
    # ShutdownWithSave is latched: the ranks already told to save are not told twice.
    assert [rec.raw[r].count(ShutdownWithSave) for r in (2, 3)] == [1, 1]
