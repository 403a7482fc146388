"""The coordinator command's progress lines: one per completed epoch (its number, the samples it
covered, throughput, deaths) and one per death, read from the coordinator's timeline as it runs.

Epochs are numbered from 1 here, as in the demo's story and in the run summary the command prints.
The epoch a coordinator took over (it adopted the session mid-epoch) began before it: its line says
so and how long of it ran here, instead of a throughput over a part of the epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TextIO

import trio

from ..events import RankDeclaredDead, RankJoined, RankRetired
from ..scheduler._epoch_math import EpochCoverage
from ..timeline import Stamped, Timeline


class EpochProgress:
    """Turns timeline events into progress lines.

    Args:
        epochs: the epochs the run was asked for (``--epochs``).
        coverage: the scheduler's accounting of the epochs aggregated so far
            (``SyncScheduler.coverage``), read when an epoch is aggregated.
    """

    def __init__(self, epochs: int, coverage: Callable[[], Sequence[EpochCoverage]]) -> None:
        self.epochs = epochs
        self._coverage = coverage
        self._epoch_started_ms: dict[int, float] = {}
        self._deaths_in_epoch = 0
        self._taken_over: int | None = None  # the epoch in progress when this one took over
        self.dead = 0

    def lines_for(self, stamped: Stamped) -> list[str]:
        """The lines ``stamped`` is worth (none for most events)."""
        ev = stamped.event
        if isinstance(ev, RankDeclaredDead):
            self.dead += 1
            self._deaths_in_epoch += 1
            return [f"rank {ev.rank} ({ev.host}) declared dead: {ev.reason}"]
        if isinstance(ev, RankJoined):  # an elastic world grew (issue 37)
            return [f"rank {ev.rank} ({ev.host}) joined: the world is {ev.world} ranks"]
        if isinstance(ev, RankRetired):
            return [f"rank {ev.rank} ({ev.host}) retired: {ev.reason}; the world is "
                    f"{ev.world} ranks"]
        what = getattr(ev, "what", None)
        fields = getattr(ev, "fields", {})
        if what in ("epoch_started", "scheduler_resumed"):
            epoch = int(fields["epoch"])
            # A resume between two epochs dispatches the next one here, whole: started here.
            self._taken_over = epoch if what == "scheduler_resumed" else (
                None if epoch == self._taken_over else self._taken_over)
            self._epoch_started_ms[epoch] = stamped.t_ms
            self._deaths_in_epoch = 0
            return []
        if what == "epoch_aggregated":
            return [self._epoch_line(int(fields["epoch"]), stamped.t_ms)]
        return []

    def _epoch_line(self, epoch: int, t_ms: float) -> str:
        seconds = max(t_ms - self._epoch_started_ms.get(epoch, t_ms), 0.0) / 1000.0
        done = [c for c in self._coverage() if c.epoch == epoch]
        if done:
            cov = done[-1]
            exact = "exactly once" if cov.exact else (f"{cov.gaps} missed, {cov.overlaps} "
                                                      "repeated")
            covered = f"{cov.total - cov.gaps}/{cov.total} samples covered ({exact})"
            rate = f"{cov.samples / seconds:,.0f} samples/s" if seconds > 0 else "- samples/s"
        else:  # an orchestrator without the scheduler's accounting
            covered, rate = "coverage unknown", "- samples/s"
        timing = f"{rate} over {seconds:.2f} s"
        if epoch == self._taken_over:  # its samples/s would divide a whole epoch by a part
            timing = f"begun before the takeover ({seconds:.2f} s of it on this coordinator)"
        deaths = f"{self._deaths_in_epoch} death{'s' if self._deaths_in_epoch != 1 else ''}"
        return (f"epoch {epoch + 1}/{self.epochs}: {covered}, {timing}, {deaths} "
                f"({self.dead} dead in all)")


async def print_progress(timeline: Timeline, progress: EpochProgress, out: TextIO, *,
                         task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Print ``progress``'s lines for every new event of ``timeline`` until cancelled; then the
    lines of the events already queued, so that the last epoch's line is never lost."""
    async with timeline.subscribe(buffer=4096) as events:
        task_status.started()
        try:
            async for stamped in events:
                _emit(progress, stamped, out)
        finally:
            while True:  # bounded by the subscription's buffer
                try:
                    stamped = events.channel.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                    break
                _emit(progress, stamped, out)


def _emit(progress: EpochProgress, stamped: Stamped, out: TextIO) -> None:
    for line in progress.lines_for(stamped):
        print(line, file=out, flush=True)
