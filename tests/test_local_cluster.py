"""The public local-cluster tools: every part in one Trio run, memory or TCP."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from flodl_trio import ConfigError, SendError
from flodl_trio.local_cluster import layout
from flodl_trio.pytest_plugin import LocalClusterFactory
from flodl_trio.testing import wait_until
from flodl_trio.wire import DeclareDead, Heartbeat, SyncNow


async def test_local_cluster_factory_forms_and_delivers_over_memory(
    autojump_clock: trio.abc.Clock, local_cluster_factory: LocalClusterFactory
) -> None:
    async with local_cluster_factory(layout(2, 2)) as cluster:
        assert cluster.coord.live_ranks == frozenset(range(4))
        await cluster.coord.send_control(3, SyncNow())
        assert isinstance(await cluster.ranks[3].receive(), SyncNow)


async def test_killed_relay_in_local_cluster_is_declared_dead_and_survivors_told(
    autojump_clock: trio.abc.Clock, local_cluster_factory: LocalClusterFactory
) -> None:
    async with local_cluster_factory(layout(2, 2)) as cluster:
        cluster.kill_relay("host-1")
        await trio.sleep(0.1)
        assert cluster.coord.dead_ranks == frozenset({2, 3})
        told = {(await cluster.ranks[0].receive()).rank for _ in range(2)}
        assert told == {2, 3}
        assert all(isinstance(e, DeclareDead) for e in [])


def test_the_testing_module_exports_the_local_cluster_builder() -> None:
    import flodl_trio.local_cluster
    import flodl_trio.testing

    assert flodl_trio.testing.open_local_cluster is flodl_trio.local_cluster.open_local_cluster
    assert flodl_trio.testing.LocalCluster is flodl_trio.local_cluster.LocalCluster
    assert {"open_local_cluster", "LocalCluster"} <= set(flodl_trio.testing.__all__)


async def test_local_cluster_over_real_tcp() -> None:
    from flodl_trio.testing import open_local_cluster

    with trio.fail_after(10):
        async with open_local_cluster(layout(2, 1), transport="tcp") as cluster:
            assert cluster.coord.address[0] == "127.0.0.1"
            await cluster.coord.broadcast_control(SyncNow())
            for r in (0, 1):
                assert isinstance(await cluster.ranks[r].receive(), SyncNow)


async def test_addresses_of_parts_given_listeners_are_config_errors_not_none(
    autojump_clock: trio.abc.Clock, local_cluster_factory: LocalClusterFactory
) -> None:
    async with local_cluster_factory(layout(1, 1)) as cluster:
        with pytest.raises(ConfigError, match=r"coord\.address: expected a coordinator that bound"):
            _ = cluster.coord.address
        with pytest.raises(ConfigError, match="relay 'host-0': rank_address: expected a relay"):
            _ = cluster.relays["host-0"].rank_address


async def test_sending_a_message_the_wrong_way_is_refused_before_anything_is_written(
    autojump_clock: trio.abc.Clock, local_cluster_factory: LocalClusterFactory
) -> None:
    async with local_cluster_factory(layout(1, 2)) as cluster:
        wrong_way: Any = Heartbeat(rank=0, step_count=1)  # a TimingMsg: rank → coordinator only
        with pytest.raises(SendError, match=r"send_control\(Heartbeat\) to rank 0: expected a "
                           r"ControlMsg \(coordinator → rank\), got Heartbeat"):
            await cluster.coord.send_control(0, wrong_way)
        with pytest.raises(SendError, match="broadcast of Heartbeat: expected a ControlMsg"):
            await cluster.coord.broadcast_control(wrong_way)
        upstream: Any = SyncNow()  # a ControlMsg: coordinator → rank only
        with pytest.raises(ConfigError, match="send expects a TimingMsg or Metrics, got SyncNow"):
            await cluster.ranks[1].send(upstream)
        # Nothing was sent: the links still carry a broadcast, in order, to both ranks.
        await cluster.coord.broadcast_control(SyncNow())
        for r in (0, 1):
            assert isinstance(await cluster.ranks[r].receive(), SyncNow)


async def test_rank_main_runs_each_rank_and_its_errors_end_only_that_rank(
    autojump_clock: trio.abc.Clock, local_cluster_factory: LocalClusterFactory
) -> None:
    async def rank_main(ep: Any) -> list[str]:
        if ep.rank == 1:
            await trio.sleep(1)
            raise RuntimeError("rank 1 simulated a crash")
        return [type(msg).__name__ async for msg in ep]

    async with local_cluster_factory(layout(1, 3), rank_main=rank_main,
                                     rank_errors=(RuntimeError,)) as cluster:
        await wait_until(lambda: 1 in cluster.coord.dead_ranks, limit=5)
        reason = cluster.coord.dead_reason(1) or ""
        assert "without Exiting" in reason  # the crash left its block: no Exiting was sent
        await cluster.coord.send_control(2, SyncNow())
    outcomes = cluster.outcomes
    assert isinstance(outcomes[1], RuntimeError)
    assert outcomes[0] == ["DeclareDead", "Shutdown"]
    assert outcomes[2] == ["DeclareDead", "SyncNow", "Shutdown"]
