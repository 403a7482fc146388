"""Issue 22, the scheduler's part: a dead rank is credited only with what it synced, the scheduler
checkpoints through ``coord.save_checkpoint``, and a new scheduler on the same coordinator resumes
from ``coord.checkpoint``. Simulated ranks in a local cluster under MockClock; the sims record
which of their batches a ``SyncAck`` covered (the updates that survive them), and that is the
truth every epoch must cover exactly once."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings, strategies as st

import flodl_trio as ft
from flodl_trio.events import Note
from flodl_trio.local_cluster import layout
from flodl_trio.scheduler import RunSummary, SyncScheduler, exactly_once_fraction
from flodl_trio.sim import SimRecord
from flodl_trio.store import SessionState, salt_id
from flodl_trio.testing import MemoryNetwork
from flodl_trio.wire import ExtendPartition, Shutdown, StartEpoch, SyncNow

from helpers.sims import SimCluster, sim_cluster


def sim_args(batch_size: int, speeds: dict[int, float], **per_rank: dict[int, Any]) -> Any:
    def make(rank: int) -> dict[str, Any]:
        kw: dict[str, Any] = {"batch_size": batch_size, "batch_ms": speeds.get(rank, 10.0),
                              "seed": rank}
        kw.update({name: values[rank] for name, values in per_rank.items() if rank in values})
        return kw
    return make


def assert_synced_exactly_once(records: list[SimRecord], total: int, epochs: range) -> None:
    for epoch in epochs:
        counts = Counter(i for rec in records for i in rec.synced_samples(epoch))
        assert sorted(counts) == list(range(total)), f"epoch {epoch}: samples lost"
        assert max(counts.values()) == 1, f"epoch {epoch}: samples synced twice"


def assert_accounting_matches(scheduler: SyncScheduler, records: list[SimRecord]) -> None:
    """The scheduler's coverage is exactly what each rank synced, range by range."""
    assert exactly_once_fraction(scheduler.coverage) == 1.0
    for cov in scheduler.coverage:
        assert cov.exactly_once, cov
        for rec in records:
            counted = sorted(i for o, n in cov.ranges.get(rec.rank, ()) for i in range(o, o + n))
            assert counted == sorted(rec.synced_samples(cov.epoch)), (cov.epoch, rec.rank)


def mock_run(scenario: Any) -> None:
    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


# ---------------------------------------------------------------------------- the credit rule


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_whenever_ranks_die_every_epochs_synced_coverage_is_the_data_set_exactly_once(
        data: st.DataObject) -> None:
    world = data.draw(st.integers(3, 4), label="world")
    batch_size = data.draw(st.integers(1, 4), label="batch_size")
    total = data.draw(st.integers(world * batch_size, 60), label="total")
    speeds = {r: data.draw(st.sampled_from([5.0, 10.0, 25.0])) for r in range(world)}
    doomed = data.draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=world - 1,
                                unique=True), label="doomed")
    per_rank = total // (world * batch_size) + 2
    # before the first batch, between two syncs, right after a SyncAck, or in an extension
    how = {r: data.draw(st.sampled_from(["batches", "syncs"])) for r in doomed}
    after_batches = {r: data.draw(st.integers(0, 2 * per_rank)) for r in doomed
                     if how[r] == "batches"}
    after_syncs = {r: data.draw(st.integers(1, 2 * per_rank)) for r in doomed
                   if how[r] == "syncs"}

    async def scenario() -> None:
        net = MemoryNetwork()
        sims = sim_args(batch_size, speeds, fail_after_batches=after_batches,
                        fail_after_syncs=after_syncs)
        async with sim_cluster(net, layout(1, world), sims) as c:
            scheduler = SyncScheduler(c.coord, total_samples=total, batch_size=batch_size,
                                      num_epochs=2)
            with trio.fail_after(600):
                summary = await scheduler.run()
        records = [c.sims[r].record for r in range(world)]
        assert summary.epochs_completed == 2 and set(summary.deaths) <= set(doomed)
        assert_synced_exactly_once(records, total, range(2))
        assert_accounting_matches(scheduler, records)
        # what a dead rank processed but never synced was processed again by a survivor
        for rank in summary.deaths:
            rec = records[rank]
            for epoch in range(2):
                lost = Counter(rec.samples(epoch)) - Counter(rec.synced_samples(epoch))
                rerun = {i for r in records if r.rank != rank for i in r.synced_samples(epoch)}
                assert set(lost) <= rerun
        net.assert_all_closed()

    mock_run(scenario)


async def test_a_rank_dying_right_after_its_sync_ack_keeps_exactly_what_it_synced(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    sims = sim_args(2, {0: 10.0, 1: 10.0, 2: 10.0}, fail_after_syncs={1: 2})
    async with sim_cluster(memory_network, layout(1, 3), sims) as c:
        scheduler = SyncScheduler(c.coord, total_samples=36, batch_size=2, num_epochs=1)
        with trio.fail_after(600):
            summary = await scheduler.run()
    rec = c.sims[1].record
    assert list(summary.deaths) == [1]
    (cov,) = scheduler.coverage
    assert cov.ranges[1] == ((12, len(rec.synced_samples(0))),)  # a prefix of its plan 12..23
    assert rec.synced_samples(0) == list(range(12, 12 + len(rec.synced_samples(0))))
    handed = [(m.partition_offset, m.partition_size) for r in (0, 2)
              for m in c.sims[r].record.of_type(ExtendPartition)]
    assert sorted(handed)[0][0] == 12 + len(rec.synced_samples(0))
    assert sum(n for _, n in handed) == 12 - len(rec.synced_samples(0))
    assert_synced_exactly_once([c.sims[r].record for r in range(3)], 36, range(1))


async def test_an_epoch_ends_with_a_sync_so_every_survivor_batch_is_synced_before_the_next(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    # rank 1 is 4x slower: rank 0 finishes first and waits; the last batches sync before epoch 1
    async with sim_cluster(memory_network, layout(1, 2),
                           sim_args(2, {0: 10.0, 1: 40.0})) as c:
        scheduler = SyncScheduler(c.coord, total_samples=16, batch_size=2, num_epochs=2)
        with trio.fail_after(600):
            await scheduler.run()
    for r in (0, 1):
        rec = c.sims[r].record
        starts = [i for i, m in enumerate(rec.received) if isinstance(m, StartEpoch)]
        assert isinstance(rec.received[starts[1] - 3], SyncNow)  # SyncNow, SetGlobalStep, Agg.
        assert rec.synced == rec.processed


# ---------------------------------------------------------------------------- checkpoints


async def test_the_last_checkpoint_says_the_run_ended_and_survives_the_store_encoding(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    saved: list[dict[str, Any]] = []
    async with sim_cluster(memory_network, layout(1, 2), sim_args(2, {})) as c:
        keep = c.coord.save_checkpoint

        async def spy(checkpoint: Any, **kw: Any) -> None:
            saved.append(dict(checkpoint))
            await keep(checkpoint, **kw)

        c.coord.save_checkpoint = spy  # type: ignore[method-assign]
        with trio.fail_after(600):
            summary = await SyncScheduler(c.coord, total_samples=12, batch_size=2,
                                          num_epochs=2).run()
    last = c.coord.checkpoint
    assert last is not None and last == saved[-1]
    assert (last["epoch"], last["epochs_completed"], last["shares"]) == (2, 2, [])
    assert last["samples_done"] == 24 and last["global_step"] == summary.global_step
    assert last["syncs"] == summary.syncs
    # one per completed sync and per epoch boundary, every one a valid store state
    assert len(saved) >= summary.syncs + 2 * 2
    done = [cp["samples_done"] for cp in saved]
    assert done == sorted(done)
    for cp in saved:
        state = SessionState(salt_id=salt_id(ft.SessionSalt.generate()), world_size=2,
                             checkpoint=cp)
        assert SessionState.decode(state.encode(), source="test").checkpoint == cp


def test_a_checkpoint_of_other_settings_or_malformed_is_refused_naming_why() -> None:
    class FakeCoord:
        world_size = 2
        timeline = timing = metrics = None
        checkpoint: Any = {"format": "flodl-trio.sync-scheduler/1", "total_samples": 12,
                           "batch_size": 2, "num_epochs": 2, "epoch": 1, "epochs_completed": 1,
                           "global_step": 3, "syncs": 4, "shares": [], "last_steps": []}

    coord: Any = FakeCoord()
    with pytest.raises(ft.ConfigError, match=r"total_samples=12 \(this scheduler: 10\)"):
        SyncScheduler(coord, total_samples=10, batch_size=2, num_epochs=2)
    SyncScheduler(coord, total_samples=12, batch_size=2, num_epochs=2)  # the same settings
    coord.checkpoint = {**FakeCoord.checkpoint, "shares": [{"rank": 0, "ranges": "x"}]}
    with pytest.raises(ft.StoreCorrupt, match="ranges of rank 0"):
        SyncScheduler(coord, total_samples=12, batch_size=2, num_epochs=2)
    coord.checkpoint = {**FakeCoord.checkpoint, "losses": [0.5, "low"]}
    with pytest.raises(ft.StoreCorrupt, match=r"a list of numbers \(or null\) as losses"):
        SyncScheduler(coord, total_samples=12, batch_size=2, num_epochs=2)
    coord.checkpoint = {"format": "something else"}
    with pytest.raises(ft.StoreCorrupt, match=r"format 'flodl-trio\.sync-scheduler/1'"):
        SyncScheduler(coord, total_samples=12, batch_size=2, num_epochs=2)


# ---------------------------------------------------------------------------- resuming


async def run_with_takeover(c: SimCluster, *, cancel_at: float, outage: float,
                            **kw: Any) -> tuple[SyncScheduler, SyncScheduler, RunSummary]:
    """Run a scheduler until ``cancel_at`` (virtual seconds), leave the ranks alone for
    ``outage``, then run a new scheduler on the same coordinator to the end."""
    first = SyncScheduler(c.coord, **kw)
    with trio.move_on_after(cancel_at) as scope:
        await first.run()
    assert scope.cancelled_caught, "the first scheduler finished before it was cancelled"
    second, summary = await take_over(c, outage=outage, **kw)
    return first, second, summary


async def take_over(c: SimCluster, *, outage: float,
                    **kw: Any) -> tuple[SyncScheduler, RunSummary]:
    """After ``outage`` (virtual seconds) with no scheduler, run a new one on the same
    coordinator (it resumes from ``coord.checkpoint``) to the end."""
    await trio.sleep(outage)
    second = SyncScheduler(c.coord, **kw)
    with trio.fail_after(600):
        return second, await second.run()


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cancel_frac=st.floats(0.01, 0.95), outage=st.sampled_from([0.0, 0.02, 0.3]),
       batch_size=st.integers(1, 3), death=st.sampled_from([None, 1, 2]),
       death_after=st.integers(0, 12))
def test_a_new_scheduler_resumes_the_run_and_every_epoch_is_synced_exactly_once(
        cancel_frac: float, outage: float, batch_size: int, death: int | None,
        death_after: int) -> None:
    total, epochs = 30, 3
    speeds = {0: 5.0, 1: 10.0, 2: 15.0}
    failing = {} if death is None else {death: death_after}
    # no run can be faster than every rank batching all the time, in parallel
    shortest = epochs * total / sum(batch_size / ms for ms in speeds.values()) / 1000.0
    cancel_at = cancel_frac * shortest

    async def scenario() -> None:
        net = MemoryNetwork()
        async with sim_cluster(net, layout(1, 3), sim_args(
                batch_size, speeds, fail_after_batches=failing)) as c:
            first, second, summary = await run_with_takeover(
                c, cancel_at=cancel_at, outage=outage, total_samples=total,
                batch_size=batch_size, num_epochs=epochs)
        records = [c.sims[r].record for r in range(3)]
        assert_synced_exactly_once(records, total, range(epochs))
        assert summary.resumed and summary.epochs_completed == epochs
        assert summary.first_epoch == len(first.coverage)  # closed epochs are not run again
        assert [m.epoch for m in summary.epoch_metrics] == list(range(summary.first_epoch,
                                                                      epochs))
        # the whole run's losses: the first scheduler's epochs come from its checkpoint
        assert len(summary.epoch_losses) == epochs
        assert all(isinstance(loss, float) for loss in summary.epoch_losses[:summary.first_epoch])
        assert [cov.epoch for cov in first.coverage + second.coverage] == list(range(epochs))
        assert_accounting_matches(second, records)
        for rec in records:
            if rec.rank not in summary.deaths:  # every SyncNow reaches every live rank
                assert rec.syncs == summary.syncs
        assert set(summary.deaths) <= set(failing)
        net.assert_all_closed()

    mock_run(scenario)


async def test_a_resumed_scheduler_repeats_each_share_and_the_ranks_ignore_what_they_have(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    async with sim_cluster(memory_network, layout(1, 2), sim_args(1, {0: 10.0, 1: 10.0})) as c:
        first, _, summary = await run_with_takeover(
            c, cancel_at=0.055, outage=0.02, total_samples=20, batch_size=1, num_epochs=1)
    assert summary.first_epoch == 0 and first.coverage == ()
    resumed = [ev.fields for ev in c.coord.timeline.events(Note)
               if ev.what == "scheduler_resumed"]
    assert resumed == [{"epoch": 0, "epochs_completed": 0, "global_step": resumed[0][
        "global_step"]}]
    for r in (0, 1):
        rec = c.sims[r].record
        assert [m.plan.partition_offset for m in rec.of_type(StartEpoch)] == [10 * r, 10 * r]
        # the work done while no scheduler read was synced by the resume, not done again
        assert rec.samples(0) == list(range(10 * r, 10 * r + 10))
    assert_synced_exactly_once([c.sims[r].record for r in (0, 1)], 20, range(1))


async def test_a_scheduler_on_a_finished_runs_checkpoint_only_shuts_the_ranks_down(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    async with sim_cluster(memory_network, layout(1, 2), sim_args(2, {})) as c:
        broadcast = c.coord.broadcast_control

        async def without_shutdown(msg: Any) -> None:  # the first one "dies" right before it
            if not isinstance(msg, Shutdown):
                await broadcast(msg)

        c.coord.broadcast_control = without_shutdown  # type: ignore[method-assign]
        with trio.fail_after(600):
            first = await SyncScheduler(c.coord, total_samples=8, batch_size=2,
                                        num_epochs=1).run()
        c.coord.broadcast_control = broadcast  # type: ignore[method-assign]
        second = SyncScheduler(c.coord, total_samples=8, batch_size=2, num_epochs=1)
        with trio.fail_after(600):
            summary = await second.run()
    assert summary.resumed and summary.epochs_completed == 1 and summary.epoch_metrics == ()
    assert summary.epoch_losses == (first.epoch_metrics[0].avg_loss,)  # the whole run's
    for r in (0, 1):
        assert isinstance(c.sims[r].record.received[-1], Shutdown)
        assert len(c.sims[r].record.of_type(StartEpoch)) == 1


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(saves=st.integers(1, 30), outage=st.sampled_from([0.0, 0.05]),
       doomed=st.sampled_from([None, 0, 2]), death_after=st.integers(1, 6),
       process_group=st.booleans())
def test_a_scheduler_that_dies_right_after_any_checkpoint_is_resumed_without_loss(
        saves: int, outage: float, doomed: int | None, death_after: int,
        process_group: bool) -> None:
    """The previous scheduler stops right after its n-th checkpoint: after a completed sync,
    ahead of extensions (a death), between two epochs, or ahead of an epoch's StartEpochs."""
    total, epochs = 24, 3
    failing = {} if doomed is None else {doomed: death_after}

    async def scenario() -> None:
        net = MemoryNetwork()
        async with sim_cluster(net, layout(1, 3), sim_args(
                2, {0: 10.0, 1: 10.0, 2: 20.0}, fail_after_batches=failing)) as c:
            keep = c.coord.save_checkpoint
            kinds: list[str] = []

            async def save_then_die(checkpoint: Any, **kw: Any) -> None:
                await keep(checkpoint, **kw)
                kinds.append("between" if not checkpoint["shares"] else "in epoch")
                if len(kinds) == saves:
                    scope.cancel()
                    await trio.lowlevel.checkpoint()  # dies here, the checkpoint written

            c.coord.save_checkpoint = save_then_die  # type: ignore[method-assign]
            kw: dict[str, Any] = {"total_samples": total, "batch_size": 2,
                                  "num_epochs": epochs, "process_group": process_group}
            with trio.move_on_after(600) as scope:
                first = await SyncScheduler(c.coord, **kw).run()
            c.coord.save_checkpoint = keep  # type: ignore[method-assign]
            if not scope.cancelled_caught:  # fewer checkpoints than that: nothing to resume
                assert first.epochs_completed == epochs
                return
            second, summary = await take_over(c, outage=outage, **kw)
        records = [c.sims[r].record for r in range(3)]
        assert_synced_exactly_once(records, total, range(epochs))
        assert summary.resumed and summary.epochs_completed == epochs
        assert_accounting_matches(second, records)
        assert set(summary.deaths) <= set(failing)
        net.assert_all_closed()

    mock_run(scenario)


def test_an_anchoring_ack_that_cannot_be_the_share_holders_marks_a_restarted_process() -> None:
    from flodl_trio.scheduler._checkpoint import checkpoint_map, read_checkpoint
    from flodl_trio.scheduler._epoch_ledger import EpochLedger
    from flodl_trio.scheduler._parts import Share

    settings_ = {"total_samples": 40, "batch_size": 2, "num_epochs": 2}
    saved = checkpoint_map(**settings_, epoch=1, epochs_completed=1, global_step=9, syncs=5,
                           shares={0: Share([(0, 20)], batches=6, synced=4, start_step=10),
                                   1: Share([(20, 20)], batches=7, synced=7, start_step=12)},
                           last_steps={0: 16, 1: 19})
    assert saved["samples_done"] == 40 + 8 + 14
    res = read_checkpoint(saved, **settings_)
    ledger = EpochLedger(ft.Timeline(), world_size=2, ratios=None,
                         total_samples=40, batch_size=2)
    ledger.restore(res.epoch, res.shares, res.epochs_completed, res.last_steps)
    assert not ledger.on_batch(0, 15)  # before the anchor: in the anchor's count
    assert not ledger.on_sync_ack(0, 13)  # 3 batches < the 4 credited: a new process
    assert not ledger.on_sync_ack(1, 12 + 11)  # 11 batches > the 10 of its share
    assert ledger.on_sync_ack(0, 10 + 10)  # the whole share done and synced
    assert ledger.shares[0].synced == 10 and ledger.unsynced == []
    assert ledger.settle(0) == [] and ledger.settle(1) == [(34, 6)]  # 1 credited with its 7


def test_an_earlier_process_credit_survives_the_checkpoint_and_counts_in_the_epoch() -> None:
    """A rank back from a death that took an epoch over (every other member had left) keeps
    what its earlier process synced in the epoch's accounting: the checkpoint carries it, so a
    coordinator that adopts the run counts it, no gap and no second count."""
    from flodl_trio.scheduler._checkpoint import checkpoint_map, read_checkpoint
    from flodl_trio.scheduler._epoch_ledger import EpochLedger
    from flodl_trio.scheduler._parts import Share

    settings_ = {"total_samples": 40, "batch_size": 2, "num_epochs": 2}
    back = Share([(10, 10), (30, 10)], synced=0, start_step=3, earlier=[(0, 10)])
    gone = Share([(20, 20)], synced=5, done=[(20, 10)])
    saved = checkpoint_map(**settings_, epoch=0, epochs_completed=0, global_step=9, syncs=5,
                           shares={0: back, 1: gone}, last_steps={0: 3})
    assert saved["samples_done"] == 10 + 10  # the earlier process's 10, the gone rank's 10
    res = read_checkpoint(saved, **settings_)
    assert res.shares[0].earlier == [(0, 10)] and res.shares[0].ranges == [(10, 10), (30, 10)]
    ledger = EpochLedger(ft.Timeline(), world_size=2, ratios=None,
                         total_samples=40, batch_size=2)
    ledger.restore(res.epoch, res.shares, res.epochs_completed, res.last_steps)
    assert ledger.on_sync_ack(0, 3 + 10)  # its whole share done and synced
    ledger.on_metrics(ft.wire.Metrics(
        rank=0, epoch=0, avg_loss=1.0, batches_processed=10, epoch_ms=1.0,
        samples_processed=20, share_complete_ms=1.0, compute_only_ms=1.0, data_starve_ms=0.0,
        scalars={}))
    ledger.close()
    cov = ledger.coverage[-1]
    assert (cov.samples, cov.gaps, cov.overlaps) == (40, 0, 0) and cov.exactly_once
