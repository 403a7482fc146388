"""The Sync scheduler's phases: the (phase, event) -> phase table of ``scheduler/_phase.py``, and
the moves a run makes through it, as the scheduler's debug log says them (raw endpoints over an
in-memory cluster, MockClock): a plain run, the final sync after the last epoch, and every rank
leaving after the last epoch."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio

import flodl_trio as ft
from flodl_trio.local_cluster import layout, open_local_cluster
from flodl_trio.scheduler import RunSummary, SyncScheduler
from flodl_trio.scheduler._checkpoint import read_checkpoint
from flodl_trio.scheduler._phase import TRANSITIONS, Phase, PhaseEvent, PhaseMachine
from flodl_trio.testing import MemoryNetwork
from flodl_trio.wire import ControlMsg, EpochAggregated, SetGlobalStep, StartEpoch, SyncNow

from helpers.scheduling import batch, metrics_for, run_answering

# ---------------------------------------------------------------------------- the table


def test_every_phase_is_reachable_from_built_and_every_phase_can_end_in_done() -> None:
    moves: dict[Phase, set[Phase]] = {phase: set() for phase in Phase}
    for (phase, _), new in TRANSITIONS.items():
        moves[phase].add(new)

    def reachable(start: Phase) -> set[Phase]:
        seen, todo = {start}, [start]
        while todo:
            for new in moves[todo.pop()] - seen:
                seen.add(new)
                todo.append(new)
        return seen

    assert reachable(Phase.BUILT) == set(Phase)
    assert moves[Phase.DONE] == set()  # the only end
    assert all(Phase.DONE in reachable(phase) for phase in Phase)


def test_a_move_the_phase_table_does_not_hold_is_refused_naming_the_phase_and_the_event() -> None:
    machine = PhaseMachine()
    with pytest.raises(ft.FlodlError,
                       match=r"expected one of \['run'\] in phase 'built', got 'sync_sent'"):
        machine.fire(PhaseEvent.SYNC_SENT)
    assert machine.now is Phase.BUILT
    assert machine.fire(PhaseEvent.RUN) is Phase.STARTING
    machine.form_group_before(3)
    assert (machine.now, machine.deferred_epoch) == (Phase.FORMING, 3)
    machine.fire(PhaseEvent.DISPATCH)
    assert machine.in_epoch and not machine.sync_open
    with pytest.raises(ft.FlodlError, match="expected a deferred epoch"):
        _ = machine.deferred_epoch
    with pytest.raises(ft.FlodlError, match=r"in phase 'epoch', got 'anchored'"):
        machine.fire(PhaseEvent.ANCHORED)


# ---------------------------------------------------------------------------- runs


def phase_moves(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The scheduler's phase moves, as its debug log says them ("epoch --sync_sent--> ...")."""
    return [r.getMessage().removeprefix("scheduler phase ") for r in caplog.records
            if r.name == "flodl_trio.scheduler" and r.getMessage().startswith("scheduler phase")]


async def test_a_run_logs_each_phase_move_from_built_to_done(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="flodl_trio.scheduler")
    await run_answering(memory_network, {0: 1.0, 1: 1.0}, total_samples=8, batch_size=4,
                        num_epochs=2)
    assert phase_moves(caplog) == [
        "built --run--> starting", "starting --dispatch--> epoch", "epoch --dispatch--> epoch",
        "epoch --last_closed--> finishing", "finishing --no_final_sync--> closing",
        "closing --shutdown--> done"]


async def after_the_last_epoch(ep: ft.RankEndpoint, seen: list[ControlMsg], then: str) -> None:
    """A rank that answers its plan with a ``Metrics`` at once and acknowledges each SyncNow;
    once the epoch is aggregated it takes one more step (``then="step"``) or exits
    (``then="exit"``)."""
    async for msg in ep:
        seen.append(msg)
        if isinstance(msg, StartEpoch):
            await ep.send(metrics_for(ep.rank, msg.plan.epoch, msg.plan.partition_size))
        elif isinstance(msg, SyncNow):
            await ep.send(ft.wire.SyncAck(rank=ep.rank, step_count=1))
        elif isinstance(msg, EpochAggregated) and then == "step":
            await ep.send(batch(ep.rank, 1))
        elif isinstance(msg, EpochAggregated):
            await ep.send(ft.wire.Exiting(rank=ep.rank))
            return


async def run_to_the_end(net: MemoryNetwork, then: str, *, store_ms: float = 10.0,
                         saved: list[Any] | None = None,
                         **kw: Any) -> tuple[RunSummary, dict[int, list[ControlMsg]]]:
    """One epoch over two ranks playing :func:`after_the_last_epoch`, with a checkpoint store
    that takes ``store_ms`` a write (the ranks' last reports arrive while it writes); each
    checkpoint is appended to ``saved``."""
    seen: dict[int, list[ControlMsg]] = {0: [], 1: []}
    async with open_local_cluster(layout(1, 2), network=net) as c:
        store = c.coord.save_checkpoint

        async def slow_store(checkpoint: Any, *, durable: bool = True) -> None:
            await trio.sleep(store_ms / 1000)
            if saved is not None:
                saved.append(dict(checkpoint))
            await store(checkpoint, durable=durable)

        c.coord.save_checkpoint = slow_store  # type: ignore[method-assign]
        async with trio.open_nursery() as nursery:
            for rank, ep in sorted(c.ranks.items()):
                nursery.start_soon(after_the_last_epoch, ep, seen[rank], then)
            with trio.fail_after(60):
                summary = await SyncScheduler(c.coord, total_samples=8, batch_size=4,
                                              num_epochs=1, **kw).run()
    return summary, seen


async def test_ranks_that_stepped_after_the_last_epoch_are_synced_once_more_before_shutdown(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="flodl_trio.scheduler")
    saved: list[Any] = []
    summary, seen = await run_to_the_end(memory_network, "step", saved=saved)
    for rank in (0, 1):
        assert [type(m).__name__ for m in seen[rank]] == [
            "SetEpochCallbackRole", "StartEpoch", "EpochAggregated", "SyncNow", "SetGlobalStep",
            "Shutdown"]
        assert seen[rank][4] == SetGlobalStep(global_step=1)
    assert (summary.epochs_completed, summary.syncs, summary.global_step) == (1, 1, 1)
    assert phase_moves(caplog)[-4:] == [
        "epoch --last_closed--> finishing", "finishing --sync_sent--> final_sync",
        "final_sync --acked--> closing", "closing --shutdown--> done"]
    # What the final sync saved is a finished run's checkpoint: a coordinator that adopts it
    # between that save and the Shutdown resumes it (only the Shutdown is left), it does not
    # refuse it as corrupt.
    last = read_checkpoint(saved[-1], total_samples=8, batch_size=4, num_epochs=1)
    assert (last.epoch, last.epochs_completed, last.shares) == (1, 1, {})


@pytest.mark.parametrize(("store_ms", "ends"), [
    # the ranks leave while the epoch's checkpoint is written: before the final sync's turn
    (10.0, ["epoch --last_closed--> finishing", "finishing --all_gone--> done"]),
    # the ranks leave while the role rank's Checkpoint is unanswered (Shutdown waits for it)
    (0.0, ["epoch --last_closed--> finishing", "finishing --no_final_sync--> closing",
           "closing --all_gone--> done"]),
])
async def test_every_rank_leaving_after_the_last_epoch_ends_the_run_without_a_failure(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork,
        caplog: pytest.LogCaptureFixture, store_ms: float, ends: list[str]) -> None:
    caplog.set_level(logging.DEBUG, logger="flodl_trio.scheduler")
    summary, seen = await run_to_the_end(memory_network, "exit", store_ms=store_ms,
                                         checkpoint_every=1)
    assert summary.epochs_completed == 1 and summary.deaths == {}
    assert [type(m).__name__ for m in seen[1]] == [
        "SetEpochCallbackRole", "StartEpoch", "EpochAggregated"]  # no Shutdown to a rank gone
    assert phase_moves(caplog)[-len(ends):] == ends
