"""Whole runs: the Sync scheduler driving simulated ranks over an in-memory cluster (MockClock).

The sims record every batch they processed, so these tests check what matters to a user: each
epoch's samples were processed exactly once, whatever died on the way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings, strategies as st

import flodl_trio as ft
from flodl_trio.local_cluster import layout, open_local_cluster
from flodl_trio.scheduler import RunSummary, SyncScheduler
from flodl_trio.sim import SimRecord, SimulatedCrash, SimulatedRank
from flodl_trio.testing import MemoryNetwork
from flodl_trio.wire import (
    Checkpoint,
    EvalResult,
    ExecuteEvalCallback,
    ExtendPartition,
    SetEpochCallbackRole,
    Shutdown,
    SyncNow,
)

from helpers.sims import SimCluster, sim_cluster

SILENT = ft.RankConfig(heartbeat_interval=1e6)  # a hung process: no heartbeats either


def args(batch_size: int, speeds: dict[int, float], **per_rank: dict[int, Any]
         ) -> Callable[[int], dict[str, Any]]:
    def make(rank: int) -> dict[str, Any]:
        kw: dict[str, Any] = {"batch_size": batch_size, "batch_ms": speeds.get(rank, 10.0),
                              "seed": rank}
        for name, values in per_rank.items():
            if rank in values:
                kw[name] = values[rank]
        return kw
    return make


def assert_each_epoch_synced_exactly_once(records: list[SimRecord], total: int,
                                          epochs: int) -> None:
    """What the ranks synced (the updates that survived) covers every epoch exactly once."""
    for epoch in range(epochs):
        counts = Counter(i for rec in records for i in rec.synced_samples(epoch))
        assert sorted(counts) == list(range(total)), f"epoch {epoch}: missing samples"
        assert max(counts.values()) == 1, f"epoch {epoch}: samples synced twice"


def unsynced_left(rec: SimRecord, epoch: int, plan: Sequence[int]) -> list[int]:
    """What of ``plan`` a dead rank did not sync: its synced part is a prefix of the plan."""
    synced = rec.synced_samples(epoch)
    assert synced == list(plan)[:len(synced)]
    return list(plan)[len(synced):]


def extensions(record: SimRecord) -> list[tuple[int, int]]:
    return [(m.partition_offset, m.partition_size) for m in record.of_type(ExtendPartition)]


async def run_scheduler(c: SimCluster, **kw: Any) -> RunSummary:
    with trio.fail_after(600):  # virtual time: a hang fails the test instead of blocking it
        return await SyncScheduler(c.coord, **kw).run()


async def test_heterogeneous_ranks_process_every_sample_exactly_once_in_every_epoch(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    speeds = {0: 10.0, 1: 20.0, 2: 40.0}  # 1x, 2x and 4x slower
    async with sim_cluster(memory_network, layout(3, 1),
                           args(4, speeds, jitter={0: 0.2, 1: 0.2, 2: 0.2})) as c:
        summary = await run_scheduler(c, total_samples=62, batch_size=4, num_epochs=3)
        await trio.sleep(1)
    records = [c.outcomes[r] for r in range(3)]
    assert all(isinstance(rec, SimRecord) for rec in records)
    assert_each_epoch_synced_exactly_once(records, 62, 3)
    assert summary.epochs_completed == 3 and summary.deaths == {}
    assert summary.syncs >= 5 and summary.global_step >= summary.syncs - 1
    assert [m.epoch for m in summary.epoch_metrics] == [0, 1, 2]
    losses = [m.avg_loss for m in summary.epoch_metrics]
    assert losses == sorted(losses, reverse=True) and losses[0] > losses[-1]
    share = summary.epoch_metrics[0].per_rank_batch_share
    assert sum(share) == pytest.approx(1.0)
    throughput = summary.epoch_metrics[0].per_rank_throughput
    assert throughput[0] > throughput[1] > throughput[2]  # the fast rank waited for nobody
    for rec in records:
        assert isinstance(rec.received[-1], Shutdown)
        assert rec.syncs == len(rec.of_type(SyncNow)) == summary.syncs
        assert rec.received[0] == SetEpochCallbackRole(rank=0)


async def test_silent_rank_declared_dead_by_heartbeat_timeout_has_its_ten_samples_extended(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    cfg = ft.CoordinatorConfig(world_size=3, heartbeat_timeout=3.0)
    sims = args(1, {}, fail_after_batches={2: 0}, fail_mode={2: "hang"})
    async with sim_cluster(memory_network, layout(1, 3), sims, coord_config=cfg,
                           rank_configs={2: SILENT}) as c:
        summary = await run_scheduler(c, total_samples=30, batch_size=1, num_epochs=1)
    survivors = [c.sims[0].record, c.sims[1].record]
    got = [extensions(rec) for rec in survivors]
    assert sum(size for ext in got for _, size in ext) == 10
    assert got == [[(20, 5)], [(25, 5)]]
    assert_each_epoch_synced_exactly_once(survivors, 30, 1)
    assert c.sims[2].record.batches == 0 and c.sims[2].record.failed
    assert list(summary.deaths) == [2] and "heartbeat stale" in summary.deaths[2]
    assert summary.epochs_completed == 1


async def test_rank_killed_mid_epoch_its_processed_part_and_the_extensions_cover_the_epoch(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    sims = args(4, {0: 10.0, 1: 20.0, 2: 10.0}, fail_after_batches={1: 3})
    async with sim_cluster(memory_network, layout(1, 3), sims) as c:
        summary = await run_scheduler(c, total_samples=60, batch_size=4, num_epochs=2)
    assert isinstance(c.outcomes[1], SimulatedCrash)
    records = [c.sims[r].record for r in range(3)]
    assert records[1].samples(0) == list(range(20, 32))  # 3 batches of its plan (20, 20)
    # what it did not sync (its last batches included) went to the survivors, half each
    left = unsynced_left(records[1], 0, range(20, 40))
    assert len(left) > 8
    given = [[i for o, n in extensions(records[r]) for i in range(o, o + n)] for r in (0, 2)]
    assert given[0] + given[1] == left and len(given[0]) == len(given[1])
    assert_each_epoch_synced_exactly_once(records, 60, 2)
    # the next epoch is planned over the survivors
    assert sorted(set(records[0].samples(1)) | set(records[2].samples(1))) == list(range(60))
    assert list(summary.deaths) == [1] and "without Exiting" in summary.deaths[1]
    assert summary.epochs_completed == 2


async def test_an_extended_rank_that_dies_hands_on_what_is_left_of_its_extension(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    # 48 samples over 4 ranks (12 each, batch 2). Rank 3 dies after one batch, unsynced: its
    # 12 samples (36..47) go 4/4/4 to ranks 0, 1, 2. Rank 2 (slow) dies after its 6 plan batches
    # and one batch of its extension (44, 4), which it never synced: that goes to ranks 0 and 1.
    sims = args(2, {0: 10.0, 1: 10.0, 2: 40.0, 3: 10.0}, fail_after_batches={2: 7, 3: 1})
    async with sim_cluster(memory_network, layout(2, 2), sims) as c:
        summary = await run_scheduler(c, total_samples=48, batch_size=2, num_epochs=1)
    records = [c.sims[r].record for r in range(4)]
    assert extensions(records[2]) == [(44, 4)]
    assert records[2].samples(0)[-2:] == [44, 45]
    assert records[3].synced == []
    left = unsynced_left(records[2], 0, [*range(24, 36), *range(44, 48)])
    assert 44 in left and 45 in left  # processed, died unsynced: handed on again
    handed_on = [i for r in (0, 1) for o, n in extensions(records[r])[1:]
                 for i in range(o, o + n)]
    assert sorted(handed_on) == left
    assert_each_epoch_synced_exactly_once(records, 48, 1)
    assert sorted(summary.deaths) == [2, 3]


async def test_failed_checkpoint_moves_the_role_to_the_next_rank_and_retries_there(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    sims = args(2, {}, fail_checkpoint={0: True})
    async with sim_cluster(memory_network, layout(1, 3), sims) as c:
        summary = await run_scheduler(c, total_samples=12, batch_size=2, num_epochs=2,
                                      checkpoint_every=1)
    r0, r1, r2 = (c.sims[r].record for r in range(3))
    roles = r1.of_type(SetEpochCallbackRole)
    assert roles == [SetEpochCallbackRole(rank=0), SetEpochCallbackRole(rank=1)]
    assert r2.of_type(SetEpochCallbackRole) == roles
    assert r0.of_type(Checkpoint)[0] == Checkpoint(version=1, target_rank=0)
    assert Checkpoint(version=1, target_rank=1) in r1.of_type(Checkpoint)
    # the role moved before the retry reached its new holder
    assert r1.received.index(SetEpochCallbackRole(rank=1)) < r1.received.index(
        Checkpoint(version=1, target_rank=1))
    # later checkpoints go to the new role (rank 1 answers them fine)
    assert Checkpoint(version=2, target_rank=1) in r1.of_type(Checkpoint)
    assert r2.of_type(Checkpoint) == []
    assert summary.epochs_completed == 2 and c.sims[1].role == 1


async def test_role_rank_dying_moves_the_role_and_its_eval_to_the_lowest_survivor(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    sims = args(2, {0: 10.0, 1: 10.0, 2: 10.0}, fail_after_batches={0: 2})
    async with sim_cluster(memory_network, layout(1, 3), sims) as c:
        summary = await run_scheduler(c, total_samples=18, batch_size=2, num_epochs=2,
                                      eval_every=1)
    r1, r2 = c.sims[1].record, c.sims[2].record
    for rec in (r1, r2):
        assert rec.of_type(SetEpochCallbackRole) == [SetEpochCallbackRole(rank=0),
                                                     SetEpochCallbackRole(rank=1)]
    evals = r1.of_type(ExecuteEvalCallback)
    assert evals == [ExecuteEvalCallback(schedule_id=1, epoch=1, target_rank=1),
                     ExecuteEvalCallback(schedule_id=2, epoch=2, target_rank=1)]
    assert r2.of_type(ExecuteEvalCallback) == []
    assert_each_epoch_synced_exactly_once([c.sims[r].record for r in range(3)], 18, 2)
    assert list(summary.deaths) == [0]


async def test_sim_answers_sync_now_while_a_batch_is_in_flight_and_throttle_pauses_it(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    async with open_local_cluster(layout(1, 1), network=memory_network) as c:
        ep = c.ranks[0]
        sim = SimulatedRank(ep, batch_size=1, batch_ms=1000.0)
        coord = c.coord
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sim.run)
            plan = ft.wire.EpochPlan(epoch=0, partition_offset=0, partition_size=3)
            await coord.send_control(0, ft.wire.StartEpoch(plan=plan))
            await trio.sleep(0.5)
            await coord.send_control(0, SyncNow())
            await coord.send_control(0, ft.wire.Throttle())
            seen: list[str] = []
            with trio.move_on_after(4):
                async for msg in coord.timing:
                    if not isinstance(msg, ft.wire.Heartbeat):
                        seen.append(type(msg).__name__)
            # the ack came at once; one batch finished, then the throttle held the rest
            assert seen == ["SyncAck", "Batch"]
            await coord.send_control(0, ft.wire.SetGlobalStep(global_step=7))
            with trio.fail_after(5):
                metrics = await coord.metrics.receive()
            assert metrics.samples_processed == 3 and metrics.batches_processed == 3
            await coord.send_control(0, ft.wire.ExecuteEvalCallback(
                schedule_id=4, epoch=1, target_rank=0))
            while not isinstance(result := await coord.timing.receive(), EvalResult):
                pass
            assert result.schedule_id == 4 and result.error is None
            await coord.send_control(0, Shutdown())
        assert sim.record.processed == [(0, 0, 1), (0, 1, 1), (0, 2, 1)]


def test_simulated_rank_rejects_invalid_arguments() -> None:
    ep: Any = type("Ep", (), {"rank": 0})()
    with pytest.raises(ft.ConfigError, match="batch_size"):
        SimulatedRank(ep, batch_size=0, batch_ms=1.0)
    with pytest.raises(ft.ConfigError, match="jitter"):
        SimulatedRank(ep, batch_size=1, batch_ms=1.0, jitter=1.5)
    with pytest.raises(ft.ConfigError, match="fail_mode"):
        SimulatedRank(ep, batch_size=1, batch_ms=1.0, fail_mode="explode")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_cohorts_with_random_crashes_process_every_epoch_exactly_once(
        data: st.DataObject) -> None:
    world = data.draw(st.integers(2, 4), label="world")
    total = data.draw(st.integers(world, 80), label="total")
    batch_size = data.draw(st.integers(1, 5), label="batch_size")
    epochs = data.draw(st.integers(1, 2), label="epochs")
    speeds = {r: data.draw(st.sampled_from([5.0, 10.0, 20.0, 40.0])) for r in range(world)}
    doomed = data.draw(st.lists(st.integers(0, world - 1), max_size=world - 1, unique=True))
    crash_after = {r: data.draw(st.integers(1, 2 + total // (world * batch_size)))
                   for r in doomed}

    async def scenario() -> None:
        net = MemoryNetwork()
        sims = args(batch_size, speeds, fail_after_batches=crash_after)
        async with sim_cluster(net, layout(1, world), sims) as c:
            with trio.fail_after(600):
                scheduler = SyncScheduler(c.coord, total_samples=total, batch_size=batch_size,
                                          num_epochs=epochs)
                summary = await scheduler.run()
        assert summary.epochs_completed == epochs
        assert_each_epoch_synced_exactly_once([c.sims[r].record for r in range(world)],
                                                 total, epochs)
        assert set(summary.deaths) <= set(doomed)
        # the scheduler's own accounting agrees with what the ranks actually synced
        assert [cov.exactly_once for cov in scheduler.coverage] == [True] * epochs
        for cov in scheduler.coverage:
            assert {r: n for r, n in cov.per_rank.items() if n} == {
                r: len(c.sims[r].record.synced_samples(cov.epoch)) for r in range(world)
                if c.sims[r].record.synced_samples(cov.epoch)}
        net.assert_all_closed()

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))
