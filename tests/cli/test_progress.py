"""The coordinator command's progress: a line per completed epoch (number from 1, samples covered,
throughput, deaths) and one per death, from the coordinator's timeline as the run goes."""

from __future__ import annotations

import io

import trio
import trio.testing

from flodl_trio.cli._progress import EpochProgress, print_progress
from flodl_trio.events import Note, RankDeclaredDead
from flodl_trio.scheduler._epoch_math import EpochCoverage
from flodl_trio.timeline import Stamped, Timeline


def coverage(epoch: int, *, gaps: int = 0, overlaps: int = 0) -> EpochCoverage:
    return EpochCoverage(epoch=epoch, total=240, samples=240 - gaps + overlaps,
                         per_rank={0: 120, 1: 120}, overlaps=overlaps, gaps=gaps)


def test_each_epoch_gets_one_line_with_coverage_throughput_and_its_deaths() -> None:
    done: list[EpochCoverage] = []
    progress = EpochProgress(2, lambda: done)
    assert progress.lines_for(Stamped(0.0, Note(what="epoch_started", fields={"epoch": 0}))) == []
    done.append(coverage(0))
    assert progress.lines_for(Stamped(500.0, Note(what="epoch_aggregated",
                                             fields={"epoch": 0, "avg_loss": 1.0}))) == [
        "epoch 1/2: 240/240 samples covered (exactly once), 480 samples/s over 0.50 s, "
        "0 deaths (0 dead in all)"]
    progress.lines_for(Stamped(600.0, Note(what="epoch_started", fields={"epoch": 1})))
    assert progress.lines_for(Stamped(700.0, RankDeclaredDead(rank=3, host="host-b",
                                                         reason="relay link lost"))) == [
        "rank 3 (host-b) declared dead: relay link lost"]
    done.append(coverage(1, gaps=4, overlaps=2))
    [line] = progress.lines_for(Stamped(1600.0, Note(what="epoch_aggregated",
                                                fields={"epoch": 1, "avg_loss": 0.5})))
    assert line == ("epoch 2/2: 236/240 samples covered (4 missed, 2 repeated), 238 samples/s "
                    "over 1.00 s, 1 death (1 dead in all)")


def test_without_the_schedulers_accounting_deaths_are_still_told() -> None:
    progress = EpochProgress(0, tuple)
    assert progress.lines_for(Stamped(1.0, Note(what="sync", fields={}))) == []
    death = RankDeclaredDead(rank=0, host="h", reason="silent")
    assert progress.lines_for(Stamped(2.0, death)) == ["rank 0 (h) declared dead: silent"]


async def test_lines_are_printed_as_events_arrive_and_none_is_lost_at_the_end() -> None:
    timeline, out = Timeline(), io.StringIO()
    progress = EpochProgress(1, lambda: [coverage(0)])
    async with trio.open_nursery() as nursery:
        await nursery.start(print_progress, timeline, progress, out)
        timeline.event(RankDeclaredDead(rank=1, host="h", reason="silent"))
        await trio.testing.wait_all_tasks_blocked()
        assert out.getvalue() == "rank 1 (h) declared dead: silent\n"
        timeline.event(Note(what="epoch_started", fields={"epoch": 0}))
        timeline.event(Note(what="epoch_aggregated", fields={"epoch": 0, "avg_loss": 1.0}))
        nursery.cancel_scope.cancel()  # at once: the queued events are still told
    assert out.getvalue().splitlines()[-1].startswith("epoch 1/1: 240/240 samples covered")


def test_the_epoch_taken_over_mid_way_says_so_instead_of_a_throughput_over_a_part() -> None:
    """Issue 34 item 7: it printed ``- samples/s over 0.00 s`` (its start was the dead
    coordinator's)."""
    done: list[EpochCoverage] = []
    progress = EpochProgress(3, lambda: done)
    progress.lines_for(Stamped(100.0, Note(what="scheduler_resumed", fields={
        "epoch": 1, "epochs_completed": 1, "global_step": 9})))
    done.append(coverage(1))
    assert progress.lines_for(Stamped(400.0, Note(what="epoch_aggregated", fields={
        "epoch": 1, "avg_loss": 1.0}))) == [
        "epoch 2/3: 240/240 samples covered (exactly once), begun before the takeover "
        "(0.30 s of it on this coordinator), 0 deaths (0 dead in all)"]
    progress.lines_for(Stamped(400.0, Note(what="epoch_started", fields={"epoch": 2})))
    done.append(coverage(2))
    [line] = progress.lines_for(Stamped(900.0, Note(what="epoch_aggregated", fields={
        "epoch": 2, "avg_loss": 0.5})))
    assert "480 samples/s over 0.50 s" in line  # the next one is whole again


def test_a_takeover_between_two_epochs_starts_the_next_one_here_whole() -> None:
    progress = EpochProgress(2, lambda: [coverage(1)])
    progress.lines_for(Stamped(0.0, Note(what="scheduler_resumed", fields={
        "epoch": 1, "epochs_completed": 1, "global_step": 9})))
    progress.lines_for(Stamped(100.0, Note(what="epoch_started", fields={"epoch": 1})))
    [line] = progress.lines_for(Stamped(600.0, Note(what="epoch_aggregated", fields={
        "epoch": 1, "avg_loss": 1.0})))
    assert "480 samples/s over 0.50 s" in line
