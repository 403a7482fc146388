"""The Sync scheduler's accounting of its epochs (the *Partitions*, *Deaths* and *Epoch end* rules
of :mod:`flodl_trio.scheduler`): which samples each rank owes in the current epoch, the batches
and ``Metrics`` it reported, what a rank that left still owed and who takes it over, and the
aggregate and coverage of every epoch closed. It decides and records; the scheduler sends.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..events import Note
from ..timeline import Timeline
from ..wire import EpochMetrics, EpochPlan, Metrics
from ._epoch_math import (
    EpochCoverage,
    Range,
    aggregate_metrics,
    batches_needed,
    coverage,
    plan_epoch,
    split_remainder,
)
from ._parts import Share

# The scheduler's records, whichever of its modules logs them.
log = logging.getLogger("flodl_trio.scheduler")


class EpochLedger:
    """Who owes what in the current epoch, and the record of every epoch closed so far.

    Args:
        timeline: where a rank whose batch size disagrees with ``batch_size`` is noted.
        total_samples: dataset size.
        batch_size: samples per batch on every rank.
        world_size: the coordinator's world size.
        ratios: one partition weight per world rank, or None for equal partitions.
    """

    def __init__(self, timeline: Timeline, *, total_samples: int, batch_size: int,
                 world_size: int, ratios: tuple[float, ...] | None) -> None:
        self._timeline = timeline
        self._total = total_samples
        self._batch_size = batch_size
        self._world_size = world_size
        self._ratios = ratios
        self._plans: dict[int, dict[int, EpochPlan]] = {}
        self._epoch = -1
        self._shares: dict[int, Share] = {}
        self._metrics: dict[int, Metrics] = {}
        self._awaiting_metrics: set[int] = set()
        self._batch_size_reported: set[int] = set()
        self._aggregated: list[EpochMetrics] = []
        self._coverage: list[EpochCoverage] = []
        self._last_step: dict[int, int] = {}  # each rank's highest step count seen
        self.epochs_before = 0  # epochs completed before this scheduler (a resume)

    @property
    def epoch(self) -> int:
        """The current epoch (-1 before the first one begins)."""
        return self._epoch

    @property
    def complete(self) -> bool:
        """Every rank that owes the current epoch's ``Metrics`` has reported them."""
        return not self._awaiting_metrics

    @property
    def epochs_completed(self) -> int:
        """Epochs closed in the whole run (those before a resume included)."""
        return self.epochs_before + len(self._aggregated)

    @property
    def shares(self) -> dict[int, Share]:
        """Each planned rank's share of the current epoch (read it, do not change it)."""
        return self._shares

    @property
    def unsynced(self) -> list[int]:
        """Ranks still in the epoch that reported batches no ``SyncAck`` covered yet."""
        return sorted(r for r, sh in self._shares.items()
                      if sh.done is None and sh.batches > sh.synced)

    @property
    def aggregated(self) -> tuple[EpochMetrics, ...]:
        """The ``EpochMetrics`` of every epoch closed, in order."""
        return tuple(self._aggregated)

    @property
    def coverage(self) -> tuple[EpochCoverage, ...]:
        """The coverage of every epoch closed, in order."""
        return tuple(self._coverage)

    def plan(self, epoch: int, live: Sequence[int]) -> dict[int, EpochPlan]:
        """The plans of ``epoch``, computed over ``live`` the first time it is asked for."""
        if epoch not in self._plans:
            weights = None if self._ratios is None else [self._ratios[r] for r in live]
            self._plans[epoch] = plan_epoch(epoch, self._total, live, weights)
        return self._plans[epoch]

    def begin(self, epoch: int, plans: dict[int, EpochPlan]) -> None:
        """Make ``epoch`` current: every planned rank owes its plan and its ``Metrics``."""
        self._epoch = epoch
        self._shares = {r: Share([(p.partition_offset, p.partition_size)],
                                 start_step=self._last_step.get(r, 0))
                        for r, p in plans.items()}
        self._metrics = {}
        self._awaiting_metrics = set(plans)

    @property
    def last_steps(self) -> dict[int, int]:
        """Each rank's highest step count reported (where its next epoch starts)."""
        return dict(self._last_step)

    def restore(self, epoch: int, shares: dict[int, Share], epochs_before: int,
                last_steps: dict[int, int]) -> None:
        """Make ``epoch`` current from a checkpoint: the shares still in it are not anchored
        (their rank's next ``SyncAck`` says how far it got); those that left are settled."""
        self._epoch = epoch
        self.epochs_before = epochs_before
        self._shares = shares
        self._metrics = {}
        self._awaiting_metrics = {r for r, sh in shares.items() if sh.done is None}
        self._last_step = dict(last_steps)

    def on_batch(self, rank: int, step: int) -> bool:
        """A ``Batch`` of ``rank`` (step count ``step``); False if it is not counted: it came
        before the rank's anchoring ``SyncAck`` after a resume, whose count includes it."""
        share = self._shares.get(rank)
        if share is not None and not share.anchored:
            return False
        self._last_step[rank] = max(self._last_step.get(rank, 0), step)
        if share is not None:
            share.count_batch()
        return True

    def on_sync_ack(self, rank: int, step: int) -> bool:
        """A ``SyncAck`` of ``rank``: every batch it reported so far is synced. After a resume
        the first one anchors the share: its step count says how many batches of the share the
        rank has done (all of them synced now). False if that count cannot be right (below what
        the checkpoint credits, or beyond the share): the rank is not the process that held the
        share (it restarted), and it must be settled as gone."""
        share = self._shares.get(rank)
        if share is None or share.done is not None:
            self._last_step[rank] = max(self._last_step.get(rank, 0), step)
            return True
        if not share.anchored:
            done = step - share.start_step
            if not share.synced <= done <= batches_needed(share.ranges, self._batch_size):
                log.warning("rank %d acknowledged step %d: %d batches of its share in epoch %d "
                            "where the checkpoint credits %d of at most %d; it is taken for a "
                            "restarted process", rank, step, done, self._epoch, share.synced,
                            batches_needed(share.ranges, self._batch_size))
                return False
            share.anchor(done)
            if done == batches_needed(share.ranges, self._batch_size):
                self._awaiting_metrics.discard(rank)  # done; its Metrics may have been read
        self._last_step[rank] = max(self._last_step.get(rank, 0), step)
        share.mark_synced()
        return True

    def on_metrics(self, msg: Metrics) -> None:
        rank, epoch = int(msg.rank), int(msg.epoch)
        if epoch != self._epoch:
            log.debug("Metrics of rank %d for epoch %d arrived during epoch %d; dropped", rank,
                      epoch, self._epoch)
            return
        share = self._shares.get(rank)
        if share is not None and share.done is not None:
            return  # it left: what it reported is not what it is credited for
        self._metrics[rank] = msg
        if share is not None and (not share.extended or msg.samples_processed >= share.assigned):
            self._awaiting_metrics.discard(rank)
        if share is not None and msg.samples_processed == share.assigned:
            self._check_batch_size(rank, share, msg)

    def _check_batch_size(self, rank: int, share: Share, msg: Metrics) -> None:
        # The plan's remainders (redistribution after a death) are computed with our batch size:
        # a rank that batches differently gets wrong remainders and a different sync count, so
        # say so once per rank instead of letting the two settings drift apart silently.
        planned = batches_needed(share.ranges, self._batch_size)
        if msg.batches_processed == planned or rank in self._batch_size_reported:
            return
        self._batch_size_reported.add(rank)
        log.warning("rank %d processed %d samples in %d batches where batch_size %d plans %d: "
                    "its batch size disagrees with the scheduler's", rank,
                    msg.samples_processed, msg.batches_processed, self._batch_size, planned)
        self._timeline.event(Note(what="batch_size_mismatch", fields={
            "rank": rank, "batch_size": self._batch_size, "samples": msg.samples_processed,
            "batches": int(msg.batches_processed), "planned_batches": planned}))

    def settle(self, rank: int) -> list[Range]:
        """``rank`` left (declared dead or exited): what it leaves of the current epoch, in
        order (empty if it owed nothing more). It is credited only up to its last ``SyncAck``:
        what it processed after it died with it, so it is left over like its unprocessed
        part (its ``Metrics``, if any, then no longer count)."""
        rest: list[Range] = []
        share = self._shares.get(rank)
        if share is not None and share.done is None:
            rest = share.leave(self._batch_size)
            if rest:
                self._metrics.pop(rank, None)
        self._awaiting_metrics.discard(rank)
        self._last_step.pop(rank, None)  # a rank that comes back is a new process
        return rest

    def hand_over(self, rest: Sequence[Range], survivors: Sequence[int]) -> dict[int, list[Range]]:
        """Split a remainder across ``survivors`` and extend their shares (each owes its
        ``Metrics`` again, covering the extension). Returns the part of each rank that got one,
        in ``survivors`` order."""
        parts = split_remainder(rest, len(survivors))
        given = {r: part for r, part in zip(survivors, parts, strict=True) if part}
        for rank, part in given.items():
            share = self._shares.get(rank)
            if share is None or share.done is not None:
                # Not a member of the epoch (back from a death): it begins the epoch here, and
                # what its earlier process is credited with stays counted.
                first, *more = part
                share = self._shares[rank] = Share(
                    [first], start_step=self._last_step.get(rank, 0),
                    earlier=[] if share is None else share.credited)
                if more:
                    share.extend(list(more))
            else:
                share.extend(part)
            self._awaiting_metrics.add(rank)
        return given

    def redistribute(self, dead: int, rest: Sequence[Range],
                     survivors: Sequence[int]) -> dict[int, list[Range]]:
        """:meth:`hand_over` what ``dead`` left, and note on the timeline who took which
        samples (``redistributed``)."""
        log.info("rank %d left %d unsynced samples of epoch %d; extending ranks %s", dead,
                 sum(s for _, s in rest), self._epoch, survivors)
        given = self.hand_over(rest, survivors)
        self._timeline.event(Note(what="redistributed", fields={
            "epoch": self._epoch, "from_rank": dead,
            "to": {str(r): [list(rng) for rng in p] for r, p in given.items()}}))
        return given

    def close(self) -> EpochMetrics:
        """Aggregate the current epoch's ``Metrics`` and record what it covered."""
        metrics = aggregate_metrics(
            self._epoch, [self._metrics[r] for r in sorted(self._metrics)],
            world_size=self._world_size, total_samples=self._total)
        self._aggregated.append(metrics)
        self._coverage.append(coverage(self._epoch, self._total, {
            r: share.credited for r, share in self._shares.items()}))
        return metrics

    def finish(self) -> None:
        """After the last epoch: nobody owes anything more."""
        self._shares, self._awaiting_metrics = {}, set()
