"""The public local-cluster tools: every part in one Trio run, memory or TCP."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from flodl_trio import ClusterFailure, ConfigError, CoordinatorConfig, MaxFailure, SendError
from flodl_trio.local_cluster import layout
from flodl_trio.pytest_plugin import LocalClusterFactory
from flodl_trio.testing import RawRankSlot, open_local_cluster, wait_until
from flodl_trio.wire import DeclareDead, Heartbeat, SyncNow


async def assert_a_broadcast_reaches_both_ranks(cluster: Any) -> None:
    """A ``SyncNow`` broadcast is what each of the two raw ranks receives next."""
    await cluster.coord.broadcast_control(SyncNow())
    for r in (0, 1):
        assert isinstance(await cluster.ranks[r].receive(), SyncNow)


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
            await assert_a_broadcast_reaches_both_ranks(cluster)


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
        await assert_a_broadcast_reaches_both_ranks(cluster)


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


async def test_raw_ranks_speak_the_wire_by_hand_and_the_cluster_waits_for_their_handshake(
    autojump_clock: trio.abc.Clock, local_cluster_factory: LocalClusterFactory
) -> None:
    from flodl_trio import wire
    from flodl_trio.net._handshake_io import run_handshake

    confirmed: list[float] = []

    async def raw_main(slot: RawRankSlot, *, task_status: trio.TaskStatus[None]) -> bytes:
        stream = await slot.dial()
        await trio.sleep(2)  # a slow rank: the cluster is not entered before its handshake
        machine = wire.RankDialHandshake(slot.salt, rank=slot.rank, world_size=slot.world_size,
                                         relay=slot.host)
        done = await run_handshake(stream, machine)
        assert isinstance(done, wire.RankConfirmed)
        confirmed.append(trio.current_time())
        task_status.started()
        data = bytes(done.leftover)
        while chunk := await stream.receive_some():
            data += chunk
        await stream.aclose()
        return data

    async with local_cluster_factory(layout(1, 2), raw_ranks={1: raw_main}) as cluster:
        assert confirmed and trio.current_time() >= confirmed[0] >= 2
        assert set(cluster.ranks) == {0}  # a raw rank has no endpoint
        assert cluster.coord.live_ranks == frozenset({0, 1})
    assert isinstance(cluster.outcomes[1], bytes) and cluster.outcomes[1]  # its frames, to EOF
    assert set(cluster.relay_exits) == {"host-0"} and cluster.relay_exits["host-0"].clean


async def test_errors_leave_the_cluster_as_one_exception_after_the_parts_ended(
    autojump_clock: trio.abc.Clock, local_cluster_factory: LocalClusterFactory
) -> None:
    async def breaks_at_the_end(ep: Any) -> None:
        async for _ in ep:
            pass
        raise RuntimeError(f"rank {ep.rank} broke after its Shutdown")

    with pytest.raises(KeyError, match="from the body") as raised:
        async with local_cluster_factory(layout(2, 1), rank_main=breaks_at_the_end):
            raise KeyError("from the body")
    # The ranks' failures, which cut the coordinator's shutdown short, are its context.
    also = raised.value.__context__
    assert isinstance(also, BaseExceptionGroup)
    assert sorted(str(e) for e in also.exceptions) == [
        "rank 0 broke after its Shutdown", "rank 1 broke after its Shutdown"]
    async def broken(ep: Any) -> None:
        if ep.rank == 1:
            raise AssertionError("rank 1's own check failed")
        async for _ in ep:
            pass

    # Not in rank_errors: the cluster stops, and the error is the rank's own, not an internal one.
    with pytest.raises(AssertionError, match="rank 1's own check failed"):
        async with local_cluster_factory(layout(2, 1), rank_main=broken):
            await trio.sleep_forever()

    async def never_started(slot: RawRankSlot, *, task_status: trio.TaskStatus[None]) -> None:
        await (await slot.dial()).aclose()  # ... and never says it is connected

    with pytest.raises(RuntimeError, match="raw rank 0 returned without calling task_status"):
        async with local_cluster_factory(layout(2, 1), raw_ranks={0: never_started}):
            pytest.fail("unreachable: rank 0 never connected")
    config = CoordinatorConfig(world_size=2, max_failure=MaxFailure.absolute(0))
    with pytest.raises(ClusterFailure) as info:
        async with local_cluster_factory(layout(2, 1), coord_config=config) as cluster:
            await cluster.coord.declare_dead(1, "gone")
            await trio.sleep_forever()
    assert info.value.dead == frozenset({1})
    assert cluster.relay_exits["host-0"].clean  # the survivor's relay ended on its own


async def test_a_rank_that_never_ends_fails_the_teardown_after_teardown_timeout(
    autojump_clock: trio.abc.Clock, local_cluster_factory: LocalClusterFactory
) -> None:
    async def deaf(ep: Any) -> None:
        if ep.rank == 1:
            await trio.sleep_forever()  # never reads: never sees the Shutdown

    started = trio.current_time()
    # The relay ends (the coordinator said Goodbye, it closed its rank links); rank 1 never looks.
    with pytest.raises(trio.TooSlowError, match=r"within teardown_timeout=7s of the coordinator "
                       r"closing, still running: rank 1$"):
        async with local_cluster_factory(layout(1, 2), rank_main=deaf, teardown_timeout=7):
            pass
    # The coordinator waited its shutdown_grace for rank 1's goodbye, then the teardown its 7 s.
    grace = CoordinatorConfig(world_size=2).shutdown_grace
    assert trio.current_time() - started == pytest.approx(grace + 7, abs=0.01)


async def test_killed_ranks_have_no_outcome_and_wait_rank_finished_returns_once_they_ended(
    autojump_clock: trio.abc.Clock, local_cluster_factory: LocalClusterFactory
) -> None:
    async def iterate(ep: Any) -> str:
        async for _ in ep:
            pass
        return "ended"

    async with local_cluster_factory(layout(1, 2), rank_main=iterate) as cluster:
        cluster.kill_rank(0)
        await cluster.wait_rank_finished(0)
        assert 0 not in cluster.outcomes
        await wait_until(lambda: 0 in cluster.coord.dead_ranks)  # its link ended: a crash
    assert cluster.outcomes == {1: "ended"}


def test_bad_raw_ranks_or_teardown_timeout_are_config_errors() -> None:
    async def main() -> None:
        async def raw(slot: RawRankSlot, *, task_status: trio.TaskStatus[None]) -> None:
            raise AssertionError("never started")

        with pytest.raises(ConfigError, match=r"expected raw_ranks among the ranks \[0, 1\], "
                           r"got \[2\]"):
            async with open_local_cluster(layout(1, 2), raw_ranks={2: raw}):
                pass
        with pytest.raises(ConfigError, match="expected teardown_timeout >= 0 seconds, got -1"):
            async with open_local_cluster(layout(1, 2), teardown_timeout=-1):
                pass

    trio.run(main)
