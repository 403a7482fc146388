"""The reference Sync-policy scheduler (SPEC §11): it drives whole epochs through the control
vocabulary of a formed :class:`~flodl_trio.Coordinator`.

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
