"""What the scheduler tells the timeline so that a person can follow a run (the demo prints it):
which survivors took a dead rank's samples, and a rank whose batch size disagrees with the plan."""

from __future__ import annotations

from typing import Any

import trio

from flodl_trio.events import Note
from flodl_trio.local_cluster import layout
from flodl_trio.scheduler import SyncScheduler
from flodl_trio.testing import MemoryNetwork

from helpers.sims import sim_cluster


def notes(timeline: Any, what: str) -> list[dict[str, Any]]:
    return [ev.fields for ev in timeline.events(Note) if ev.what == what]


async def test_a_dead_ranks_remaining_samples_are_noted_with_who_took_which(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    def sims(rank: int) -> dict[str, Any]:
        kw: dict[str, Any] = {"batch_size": 4, "batch_ms": 10.0, "seed": rank}
        if rank == 1:
            kw["fail_after_batches"] = 3
        return kw

    async with sim_cluster(memory_network, layout(1, 3), sims) as c:
        with trio.fail_after(600):
            await SyncScheduler(c.coord, total_samples=60, batch_size=4, num_epochs=1).run()
    # rank 1's plan is samples 20..39; it processed 3 batches (20..31) and synced 2 (its third
    # died unsynced with it), so 28..39 were left
    assert notes(c.coord.timeline, "redistributed") == [
        {"epoch": 0, "from_rank": 1, "to": {"0": [[28, 6]], "2": [[34, 6]]}}]
    assert notes(c.coord.timeline, "batch_size_mismatch") == []


async def test_a_rank_batching_differently_from_the_plan_is_reported_once(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    def sims(rank: int) -> dict[str, Any]:
        return {"batch_size": 8 if rank == 1 else 4, "batch_ms": 10.0, "seed": rank}

    async with sim_cluster(memory_network, layout(1, 2), sims) as c:
        with trio.fail_after(600):
            summary = await SyncScheduler(c.coord, total_samples=32, batch_size=4,
                                          num_epochs=2).run()
    assert summary.epochs_completed == 2
    assert notes(c.coord.timeline, "batch_size_mismatch") == [
        {"rank": 1, "batch_size": 4, "samples": 16, "batches": 2, "planned_batches": 4}]
