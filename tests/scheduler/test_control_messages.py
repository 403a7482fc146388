"""The Sync scheduler, seen from the ranks: the control messages it sends and when (raw endpoints
over an in-memory cluster, MockClock), plus property tests of its partition math."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from hypothesis import given, strategies as st

import flodl_trio as ft
from flodl_trio.local_cluster import layout, open_local_cluster
from flodl_trio.scheduler import (
    SyncScheduler,
    partition_sizes,
    plan_epoch,
    split_remainder,
    unprocessed_ranges,
)
from flodl_trio.testing import LocalCluster, MemoryNetwork
from flodl_trio.wire import (
    EpochAggregated,
    EpochPlan,
    SetEpochCallbackRole,
    SetGlobalStep,
    StartEpoch,
    SyncNow,
)

from helpers.scheduling import batch, run_answering

# ---------------------------------------------------------------------------- wire sequences


@asynccontextmanager
async def scheduling(net: MemoryNetwork, hosts: int, per_host: int,
                     **kw: Any) -> AsyncIterator[tuple[LocalCluster, dict[int, Plan]]]:
    """A cluster of raw rank endpoints driven by a ``SyncScheduler(**kw)``, which is cancelled
    when the block ends (the test plays the ranks by hand); yields it once every rank got the
    role (rank 0) and its first plan (:func:`first_plans`)."""
    async with (open_local_cluster(layout(hosts, per_host), network=net) as c,
                trio.open_nursery() as nursery):
        nursery.start_soon(SyncScheduler(c.coord, **kw).run)
        yield c, await first_plans(c)
        nursery.cancel_scope.cancel()


Plan = tuple[int, int, int]  # a StartEpoch plan's (epoch, offset, size)


async def first_plans(c: LocalCluster, *, role: int = 0) -> dict[int, Plan]:
    """Each rank's first two messages, ``SetEpochCallbackRole(role)`` then its ``StartEpoch``;
    rank -> its plan."""
    plans = {}
    for rank, ep in sorted(c.ranks.items()):
        assert await ep.receive() == SetEpochCallbackRole(rank=role)
        start = await ep.receive()
        assert isinstance(start, StartEpoch)
        plans[rank] = (start.plan.epoch, start.plan.partition_offset, start.plan.partition_size)
    return plans


async def test_one_batch_from_each_rank_brings_sync_now_then_set_global_step(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    async with scheduling(memory_network, 2, 1, total_samples=8, batch_size=4,
                          num_epochs=1) as (c, _):
        await c.ranks[0].send(batch(0))
        await trio.sleep(1)
        await c.ranks[1].send(batch(1))
        for _, ep in sorted(c.ranks.items()):
            assert isinstance(await ep.receive(), SyncNow)
            step = await ep.receive()
            assert isinstance(step, SetGlobalStep) and step.global_step == 1


async def test_no_sync_until_every_live_rank_reported_a_batch(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    async with scheduling(memory_network, 1, 2, total_samples=8, batch_size=1,
                          num_epochs=1) as (c, _):
        for step in range(1, 4):
            await c.ranks[0].send(batch(0, step))
        with trio.move_on_after(5) as waited:
            await c.ranks[0].receive()
        assert waited.cancelled_caught  # rank 1 has not stepped: no SyncNow
        await c.ranks[1].send(batch(1))
        assert isinstance(await c.ranks[0].receive(), SyncNow)
        step_msg = await c.ranks[0].receive()
        # the global step counts lock-step steps: the slowest rank took one
        assert isinstance(step_msg, SetGlobalStep) and step_msg.global_step == 1


@pytest.mark.parametrize(("hosts", "per_host", "total", "batch_size", "ratios", "plans"), [
    (1, 2, 10, 5, None, {0: (0, 0, 5), 1: (0, 5, 5)}),  # ten samples: zero-five and five-five
    (2, 1, 12, 3, [1, 3], {0: (0, 0, 3), 1: (0, 3, 9)}),  # ratios one to three: three and nine
])
async def test_plans_are_contiguous_equal_or_by_ratio_after_one_role(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, hosts: int,
        per_host: int, total: int, batch_size: int, ratios: list[float] | None,
        plans: dict[int, Plan]) -> None:
    kw = {"total_samples": total, "batch_size": batch_size, "partition_ratios": ratios}
    async with scheduling(memory_network, hosts, per_host, num_epochs=1, **kw) as (_, first):
        assert first == plans


async def test_two_epochs_of_eight_samples_each_rank_sees_two_start_epochs_then_shutdown(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    summary, seen = await run_answering(memory_network, {0: 1.0, 1: 1.0}, total_samples=8,
                                        batch_size=4, num_epochs=2)
    assert summary.epochs_completed == 2 and len(summary.epoch_metrics) == 2
    for rank in (0, 1):
        kinds = [type(m).__name__ for m in seen[rank]]
        assert kinds == ["SetEpochCallbackRole", "StartEpoch", "EpochAggregated", "StartEpoch",
                         "EpochAggregated", "Shutdown"]
        starts = [m for m in seen[rank] if isinstance(m, StartEpoch)]
        assert [s.plan.epoch for s in starts] == [0, 1]
        assert starts[0].plan == EpochPlan(epoch=0, partition_offset=4 * rank, partition_size=4)


async def test_epoch_losses_ten_and_eleven_aggregate_to_ten_and_a_half_for_every_rank(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    summary, seen = await run_answering(memory_network, {0: 10.0, 1: 11.0}, total_samples=10,
                                        batch_size=5, num_epochs=1)
    for rank in (0, 1):
        (agg,) = [m for m in seen[rank] if isinstance(m, EpochAggregated)]
        em = agg.metrics
        assert em.epoch == 0
        assert em.avg_loss == pytest.approx(10.5)
        assert em.scalars == {"loss": pytest.approx(10.5)}  # (20 + 22) / (2 + 2)
        assert em.per_rank[0]["avg_loss"] == 10.0 and em.per_rank[1]["avg_loss"] == 11.0
        assert em.per_rank[0]["loss"] == 10.0 and em.per_rank[1]["loss"] == 11.0
        assert em.per_rank_batch_share == (0.5, 0.5)
        assert em.per_rank_throughput == (50.0, 50.0)  # 5 samples in 100 ms
        assert em.per_rank_share_complete_ms == (100.0, 100.0)
        assert em.per_rank_compute_only_ms == (50.0, 50.0)
        assert em.per_rank_data_starve_ms == (1.0, 1.0)
        assert em.epoch_ms == 100.0
    assert summary.epoch_metrics[0] == em


async def test_a_rank_that_exits_cleanly_mid_epoch_has_its_unsynced_share_extended_to_the_others(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    async with scheduling(memory_network, 1, 3, total_samples=9, batch_size=1,
                          num_epochs=1) as (c, _):
        await c.ranks[2].send(batch(2))
        await c.ranks[2].send(ft.wire.Exiting(rank=2))  # 1 of its 3 samples done, never synced
        got = [await c.ranks[r].receive() for r in (0, 1)]
        assert got == [ft.wire.ExtendPartition(partition_offset=6, partition_size=2),
                       ft.wire.ExtendPartition(partition_offset=8, partition_size=1)]


async def test_a_rank_that_dies_after_a_sync_is_credited_up_to_its_sync_ack_only(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    async with scheduling(memory_network, 1, 2, total_samples=12, batch_size=1,
                          num_epochs=1) as (c, _):
        for rank in (0, 1):  # samples 0 and 6
            await c.ranks[rank].send(batch(rank, 1))
        for rank in (0, 1):
            assert isinstance(await c.ranks[rank].receive(), SyncNow)
            await c.ranks[rank].send(ft.wire.SyncAck(rank=rank, step_count=1))
        for step in (2, 3):  # samples 7 and 8: processed, never synced
            await c.ranks[1].send(batch(1, step))
        await trio.sleep(1)
        await c.ranks[1].send(ft.wire.Exiting(rank=1))
        while not isinstance(msg := await c.ranks[0].receive(), ft.wire.ExtendPartition):
            pass
        assert msg == ft.wire.ExtendPartition(partition_offset=7, partition_size=5)


async def test_every_rank_exiting_before_the_run_ends_raises_cluster_failure(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    async with open_local_cluster(layout(1, 2), network=memory_network) as c:
        sched = SyncScheduler(c.coord, total_samples=4, batch_size=1, num_epochs=1)
        for rank, ep in sorted(c.ranks.items()):
            await ep.send(ft.wire.Exiting(rank=rank))
        with trio.fail_after(10), pytest.raises(ft.ClusterFailure, match="no live rank left"):
            await sched.run()
        with pytest.raises(ft.ConfigError, match="runs once"):
            await sched.run()


def test_invalid_arguments_raise_config_error_naming_them() -> None:
    class FakeCoord:
        world_size = 2
        checkpoint = None

    coord: Any = FakeCoord()
    with pytest.raises(ft.ConfigError, match="one partition ratio per rank"):
        SyncScheduler(coord, total_samples=4, batch_size=1, num_epochs=1, partition_ratios=[1])
    with pytest.raises(ft.ConfigError, match="rank 1: expected a finite number >= 0"):
        SyncScheduler(coord, total_samples=4, batch_size=1, num_epochs=1,
                      partition_ratios=[1, float("nan")])
    with pytest.raises(ft.ConfigError, match="sum > 0"):
        SyncScheduler(coord, total_samples=4, batch_size=1, num_epochs=1,
                      partition_ratios=[0, 0])
    with pytest.raises(ft.ConfigError, match="batch_size"):
        SyncScheduler(coord, total_samples=4, batch_size=0, num_epochs=1)
    with pytest.raises(ft.ConfigError, match="checkpoint_every"):
        SyncScheduler(coord, total_samples=4, batch_size=1, num_epochs=1, checkpoint_every=0)


# ---------------------------------------------------------------------------- partition math

ratios_st = st.lists(st.one_of(st.integers(0, 1000), st.floats(0, 1e6)), min_size=1,
                     max_size=64).filter(lambda rs: sum(rs) > 0)


@given(total=st.integers(0, 10**9), ratios=ratios_st)
def test_ratio_partitions_are_contiguous_and_cover_the_dataset_exactly(
        total: int, ratios: list[float]) -> None:
    plans = plan_epoch(3, total, list(range(len(ratios))), ratios)
    offset = 0
    for rank in range(len(ratios)):
        assert plans[rank].epoch == 3 and plans[rank].partition_offset == offset
        offset += plans[rank].partition_size
    assert offset == total


@given(total=st.integers(0, 10**6), ratios=ratios_st)
def test_largest_remainder_sizes_are_within_one_of_the_exact_quota(
        total: int, ratios: list[float]) -> None:
    sizes = partition_sizes(total, ratios)
    assert sum(sizes) == total
    from fractions import Fraction
    weight = sum(Fraction(r) for r in ratios)
    for size, r in zip(sizes, ratios, strict=True):
        assert abs(size - total * Fraction(r) / weight) < 1


def test_equal_partitions_give_the_leftover_to_the_first_ranks() -> None:
    assert partition_sizes(10, [1, 1, 1]) == [4, 3, 3]
    assert partition_sizes(12, [1, 3]) == [3, 9]
    assert partition_sizes(5, [0, 0]) == [3, 2]


ranges_st = st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 500)), max_size=8)


@given(ranges=ranges_st, parts=st.integers(1, 40))
def test_remainder_split_sums_exactly_and_keeps_every_sample_once(
        ranges: list[tuple[int, int]], parts: int) -> None:
    shares = split_remainder(ranges, parts)
    assert len(shares) == parts
    sizes = [sum(s for _, s in share) for share in shares]
    total = sum(s for _, s in ranges)
    assert sum(sizes) == total
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    flat = [(o, s) for share in shares for o, s in share]
    assert all(s > 0 for _, s in flat)
    expand = [i for o, s in flat for i in range(o, o + s)]
    assert expand == [i for o, s in ranges for i in range(o, o + s)]


@given(ranges=ranges_st, batch_size=st.integers(1, 50), data=st.data())
def test_unprocessed_ranges_are_what_batches_in_order_did_not_cover(
        ranges: list[tuple[int, int]], batch_size: int, data: st.DataObject) -> None:
    batches = [(o + i, min(batch_size, s - i)) for o, s in ranges
               for i in range(0, s, batch_size)]
    k = data.draw(st.integers(0, len(batches) + 2))
    done = [i for o, s in batches[:k] for i in range(o, o + s)]
    rest = [i for o, s in unprocessed_ranges(ranges, k, batch_size) for i in range(o, o + s)]
    assert done + rest == [i for o, s in ranges for i in range(o, o + s)]


def test_a_dead_ranks_remainder_is_offset_plus_processed() -> None:
    assert unprocessed_ranges([(20, 10)], 3, 2) == [(26, 4)]
    assert unprocessed_ranges([(0, 5), (40, 3)], 3, 2) == [(40, 3)]
    assert unprocessed_ranges([(0, 5), (40, 3)], 4, 2) == [(42, 1)]
    assert split_remainder([(20, 10)], 3) == [[(20, 4)], [(24, 3)], [(27, 3)]]
    assert split_remainder([(0, 1)], 3) == [[(0, 1)], [], []]
