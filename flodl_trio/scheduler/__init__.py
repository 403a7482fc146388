"""The reference Sync-policy scheduler (SPEC §11): it drives whole epochs through the control
vocabulary of a formed :class:`~flodl_trio.Coordinator`.

How it decides, in one place:

- **Phases.** One value says where a scheduler is: ``BUILT``, ``STARTING``, then ``FORMING``
  (the process group forms before an epoch goes out), ``ANCHOR_DUE`` / ``ANCHORING`` (a resume
  inside an epoch, see *Checkpoints and resumption*), ``EPOCH`` / ``SYNCING`` (an epoch runs;
  a ``SyncNow`` is out), ``FINISHING`` / ``FINAL_SYNC`` / ``CLOSING`` (after the last epoch)
  and ``DONE``. The moves between them are one table (``scheduler/_phase.py``); each turn of
  the scheduler's loop reads what arrived, settles ranks that left or came back, then takes
  the step of its phase.
- **Partitions.** Each epoch's plans are computed once, when the epoch is first dispatched, over
  the ranks live at that moment: equal sizes, or ``partition_ratios`` (one per world rank; only the
  live ranks' ratios count) rounded by largest remainder, contiguous, covering
  ``[0, total_samples)`` exactly. (flodl plans over every rank and skips the dead ones' slices;
  planning over the live ranks keeps the cover exact.)
- **Sync.** Once every live rank has reported at least one ``Batch`` since the last sync, and
  every live rank acknowledged that sync's ``SyncNow`` (a dead rank counts as settled), the
  scheduler broadcasts ``SyncNow`` then ``SetGlobalStep``. The global step counts lock-step steps:
  each sync adds the *smallest* number of batches a participating rank took since the previous
  sync (flodl adds the sum over ranks; the minimum is the number of steps every replica took).
  After the last epoch, if two or more ranks are live and some took steps since the last sync, one
  final sync runs before ``Shutdown`` (flodl's forced final consensus).
- **Deaths: a rank is credited only with what it synced** (issue 22). A rank the coordinator
  declared dead (or that exited cleanly) is credited with the batches it reported before its last
  ``SyncAck``: their updates reached a sync and survive it. What it processed after that died with
  it, so it is left over like its unprocessed part: its remainder is its plan and extensions, in
  order, minus what its synced batches covered (its ``Metrics`` then no longer count). A rank
  processes its ranges in order, in batches of ``batch_size``, never mixing two ranges in one batch
  (the last batch of a range may be short), so ``k`` batches cover an exact prefix. The remainder
  is split across the survivors in ascending rank order, equal parts and the leftover one sample
  each to the first ranks, sent as ``ExtendPartition`` messages (contiguous sub-ranges whose sizes
  sum to exactly the remainder). So every epoch's *synced* coverage is the data set exactly once
  (:attr:`SyncScheduler.coverage`, :attr:`EpochCoverage.exactly_once`): never a sample lost, never
  one counted twice.
- **Rejoins** (issue 26). A rank that comes back after its death (``coord.rejoins`` moved; a
  death and return between two looks is a death all the same) gets no work in the current epoch,
  whose cover was settled when it died; from the next epoch on it is planned like any rank, after
  it was sent the role and the global step (and, with ``process_group``, after the group was
  re-formed with it). When every member of the epoch left, the ranks that came back take it
  over at once instead (in a resume too), rather than the run failing with live ranks. So every
  epoch stays covered exactly once.
- **An elastic world** (issue 37). A rank the scheduler never saw in the cohort (a host that
  joined the running world) waits for the next epoch like a rank that came back, and is planned
  from it; the process group is re-formed first with the new size (``new_world_size``, dense
  ``new_rank``). A retired rank left like a dead one (its share was settled when it died, or is
  settled now if it was retired before the scheduler looked), and a rank whose id joined again
  (``coord.joins`` moved) is a new process. A draining host's ranks (``coord.draining_ranks``)
  leave after their next sync: one goes out at once when they have batches no sync covered, and
  they take over no other rank's remainder.
- **Epoch end.** A rank is done with the epoch when its ``Metrics`` for it arrived and, if it was
  extended, reports ``samples_processed`` covering its plan plus extensions (a rank sends
  cumulative ``Metrics`` each time it runs out of work). When every live rank is done, and a
  sync covered every batch of the epoch (if not, one more ``SyncNow`` / ``SetGlobalStep`` goes
  out first: no batch of an epoch may die unsynced once the epoch is closed), the scheduler
  broadcasts ``EpochAggregated``, sends the cadence callbacks to the role rank, and dispatches
  the next epoch; after the last one it broadcasts ``Shutdown``.
- **Checkpoints and resumption** (issue 22). The scheduler saves its position through
  ``Coordinator.save_checkpoint`` when a sync completed (paced: ``durable=False``, issue 34),
  when it settles a rank that left, ahead of the extensions that hand a remainder over, and at
  each epoch boundary (durable); a scheduler built on a coordinator whose
  ``checkpoint`` is set resumes the run from it: closed epochs are not run again, and in the
  current one what the ranks did since the checkpoint is kept (an anchoring ``SyncNow`` syncs it
  and its step counts say how far each rank got), never lost and never counted twice
  (:mod:`flodl_trio.scheduler._resume` has the details).
- **Process group** (opt-in, ``process_group=True``): before the first epoch and after every
  death the ranks' collective group is (re-)formed with ``RequestNewNcclId`` /
  ``NewNcclIdGenerated`` / ``NewNcclSession`` (:mod:`flodl_trio.scheduler._reformation`);
  meanwhile no ``SyncNow`` and no new epoch go out.
- **Reading.** The scheduler is the consumer of ``coord.timing`` and ``coord.metrics``. The
  coordinator delivers each relay's frames in order but into two channels, so the scheduler always
  drains timing before it takes a ``Metrics``: a rank's last ``Batch`` is counted before its
  ``Metrics``. Every wait is bounded by a short poll; a silent rank is ended by the liveness
  layer's ``heartbeat_timeout``. A rank that keeps heartbeating but never reports holds the epoch,
  as in flodl (the barriers are count-based, never wall-time-based).

Re-exports only; the code lives in its private modules.
"""

from ._core import SyncScheduler
from ._epoch_math import (
    EpochCoverage,
    aggregate_metrics,
    exactly_once_fraction,
    partition_sizes,
    plan_epoch,
    split_remainder,
    unprocessed_ranges,
)
from ._parts import RunSummary
from ._reformation import ReformationError

__all__ = [
    "EpochCoverage",
    "ReformationError",
    "RunSummary",
    "SyncScheduler",
    "aggregate_metrics",
    "exactly_once_fraction",
    "partition_sizes",
    "plan_epoch",
    "split_remainder",
    "unprocessed_ranges",
]
