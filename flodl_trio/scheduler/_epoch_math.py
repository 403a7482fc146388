"""Sans-IO epoch math of the Sync scheduler: partitions, remainders, aggregation.

Pure functions of their arguments (no trio, no clock), so they are property-tested in isolation;
:mod:`flodl_trio.scheduler` re-exports them.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from fractions import Fraction

import attrs

from .._errors import ConfigError
from ..wire import EpochMetrics, EpochPlan, Metrics

Range = tuple[int, int]
"""``(offset, size)`` of a contiguous run of sample indices."""


def check_count(name: str, value: object) -> int:
    """``value`` as an integer > 0, or a :class:`ConfigError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"SyncScheduler: expected {name} to be an integer >= 1, got {value!r}")
    return value


def check_cadence(name: str, value: object) -> int | None:
    """``None`` (off) or an integer > 0."""
    return None if value is None else check_count(name, value)


def check_ratios(ratios: Sequence[float] | None, world: int) -> tuple[float, ...] | None:
    """Validate partition ratios: one finite weight >= 0 per rank, sum > 0."""
    if ratios is None:
        return None
    values = tuple(ratios)
    if len(values) != world:
        raise ConfigError(f"SyncScheduler: expected one partition ratio per rank ({world}), "
                          f"got {len(values)}: {list(values)[:16]}")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise ConfigError(f"SyncScheduler: partition ratio of rank {i}: expected a finite "
                              f"number >= 0, got {v!r}")
    if sum(values) <= 0:
        raise ConfigError(f"SyncScheduler: expected partition ratios with a sum > 0, got "
                          f"{list(values)[:16]}")
    return values

def partition_sizes(total: int, weights: Sequence[float]) -> list[int]:
    """Split ``total`` samples in proportion to ``weights`` by largest remainder.

    Exact rational arithmetic; ties in the fractional parts go to the lower index. All-zero
    weights split equally.

    Returns:
        one non-negative size per weight, summing to exactly ``total``.
    """
    fracs = [Fraction(w) for w in weights]
    weight_sum = sum(fracs, Fraction(0))
    if weight_sum == 0:
        fracs, weight_sum = [Fraction(1)] * len(fracs), Fraction(len(fracs))
    quotas = [total * f / weight_sum for f in fracs]
    sizes = [math.floor(q) for q in quotas]
    by_fraction = sorted(range(len(sizes)), key=lambda i: (sizes[i] - quotas[i], i))
    for i in by_fraction[: total - sum(sizes)]:
        sizes[i] += 1
    return sizes


def plan_epoch(epoch: int, total: int, ranks: Sequence[int],
               weights: Sequence[float] | None = None) -> dict[int, EpochPlan]:
    """Contiguous plans for ``ranks`` (ascending) covering ``[0, total)`` exactly."""
    sizes = partition_sizes(total, weights if weights is not None else [1.0] * len(ranks))
    plans: dict[int, EpochPlan] = {}
    offset = 0
    for rank, size in zip(ranks, sizes, strict=True):
        plans[rank] = EpochPlan(epoch=epoch, partition_offset=offset, partition_size=size)
        offset += size
    return plans


def unprocessed_ranges(ranges: Sequence[Range], batches: int, batch_size: int) -> list[Range]:
    """What is left of ``ranges`` (processed in order) after ``batches`` batches.

    A range of ``n`` samples takes ``ceil(n / batch_size)`` batches, the last one possibly short.
    """
    return _split_ranges(ranges, batches, batch_size)[1]


def processed_ranges(ranges: Sequence[Range], batches: int, batch_size: int) -> list[Range]:
    """What ``batches`` batches covered of ``ranges`` (processed in order): the complement of
    :func:`unprocessed_ranges`, a prefix."""
    return _split_ranges(ranges, batches, batch_size)[0]


def _split_ranges(ranges: Sequence[Range], batches: int,
                  batch_size: int) -> tuple[list[Range], list[Range]]:
    """``ranges`` (processed in order) split into what ``batches`` batches covered and what is
    left; an empty range counts as covered until the batches run short, then as neither."""
    left = batches
    done: list[Range] = []
    rest: list[Range] = []
    short = False
    for offset, size in ranges:
        need = -(-size // batch_size)
        if left >= need:
            left -= need
            if not short:
                done.append((offset, size))
            continue
        covered = left * batch_size
        left, short = 0, True
        if covered > 0:
            done.append((offset, covered))
        rest.append((offset + covered, size - covered))
    return done, rest


@attrs.frozen
class EpochCoverage:
    """The scheduler's accounting of one epoch: which samples it counts as processed, by whom.

    A rank is counted only for what it *synced*: the batches it reported before its last
    ``SyncAck`` (a rank that left); every batch of a rank that saw the epoch end (the epoch ends
    with a sync). What a dead rank processed after its last sync died with it and was
    redistributed, so it is not counted.

    Attributes:
        epoch: the epoch.
        total: samples in the dataset.
        samples: samples counted as processed (with repeats).
        per_rank: rank -> samples it is counted for.
        overlaps: samples counted more than once.
        gaps: samples of ``[0, total)`` counted by nobody.
        ranges: rank -> the ``(offset, size)`` ranges it is counted for, in processing order.
    """

    epoch: int
    total: int
    samples: int
    per_rank: Mapping[int, int]
    overlaps: int
    gaps: int
    ranges: Mapping[int, tuple[Range, ...]] = attrs.field(factory=dict)

    @property
    def exact(self) -> bool:
        """Every sample counted exactly once."""
        return self.overlaps == 0 and self.gaps == 0 and self.samples == self.total

    @property
    def exactly_once(self) -> bool:
        """The epoch's synced coverage is the data set exactly once: :attr:`exact`, and the
        per-rank ranges add up to the per-rank counts (the figure "epochs covered exactly
        once" of the failover benchmark is the fraction of epochs for which this holds)."""
        return self.exact and all(
            sum(size for _, size in self.ranges.get(rank, ())) == count
            for rank, count in self.per_rank.items())


def exactly_once_fraction(epochs: Sequence[EpochCoverage]) -> float:
    """The fraction of ``epochs`` whose synced coverage is the data set exactly once
    (:attr:`EpochCoverage.exactly_once`); 1.0 for no epoch."""
    if not epochs:
        return 1.0
    return sum(1 for cov in epochs if cov.exactly_once) / len(epochs)


def coverage(epoch: int, total: int, done: Mapping[int, Sequence[Range]]) -> EpochCoverage:
    """Account one epoch from each rank's processed ranges."""
    overlaps = gaps = cursor = 0
    for offset, size in sorted(r for ranges in done.values() for r in ranges if r[1] > 0):
        gaps += max(0, offset - cursor)
        overlaps += max(0, min(cursor, offset + size) - offset)
        cursor = max(cursor, offset + size)
    gaps += max(0, total - cursor)
    per_rank = {rank: sum(s for _, s in ranges) for rank, ranges in sorted(done.items())}
    return EpochCoverage(epoch=epoch, total=total, samples=sum(per_rank.values()),
                         per_rank=per_rank, overlaps=overlaps, gaps=gaps,
                         ranges={rank: tuple((o, s) for o, s in ranges if s > 0)
                                 for rank, ranges in sorted(done.items())})


def batches_needed(ranges: Sequence[Range], batch_size: int) -> int:
    """Batches a rank takes to process ``ranges`` in order (a range never shares a batch)."""
    return sum(-(-size // batch_size) for _, size in ranges)


def split_remainder(ranges: Sequence[Range], parts: int) -> list[list[Range]]:
    """Split ``ranges`` (taken in order) into ``parts`` consecutive shares.

    Shares are equal, the leftover going one sample each to the first parts; a share may span
    several ranges, so each is a list of contiguous sub-ranges (empty for a zero share).
    """
    pending = deque((o, s) for o, s in ranges if s > 0)
    base, extra = divmod(sum(s for _, s in pending), parts)
    shares: list[list[Range]] = []
    for i in range(parts):
        want = base + (1 if i < extra else 0)
        share: list[Range] = []
        while want > 0:
            offset, size = pending.popleft()
            take = min(want, size)
            share.append((offset, take))
            if take < size:
                pending.appendleft((offset + take, size - take))
            want -= take
        shares.append(share)
    return shares


def aggregate_metrics(epoch: int, reports: Sequence[Metrics], *, world_size: int,
                      total_samples: int) -> EpochMetrics:
    """Build one epoch's :class:`EpochMetrics` from each rank's latest ``Metrics``.

    Scalars are pooled (total sum / total count per key); ``avg_loss`` is the unweighted mean
    over the reporting ranks; ``epoch_ms`` is the slowest rank's. Per-rank lists are indexed by
    rank (``world_size`` long; zeros and ``{}`` for ranks that did not report): throughput is
    samples per second, batch share is ``samples_processed / total_samples``.
    """
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    per_rank: list[dict[str, float]] = [{} for _ in range(world_size)]
    vectors = {name: [0.0] * world_size for name in
               ("throughput", "share", "complete", "compute", "starve")}
    for m in reports:
        r = int(m.rank)
        for key, (s, c) in m.scalars.items():
            sums[key] += s
            counts[key] += c
        per_rank[r] = {k: s / c for k, (s, c) in m.scalars.items() if c > 0}
        per_rank[r]["avg_loss"] = m.avg_loss
        vectors["throughput"][r] = (m.samples_processed / m.epoch_ms * 1000.0
                                    if m.epoch_ms > 0 else 0.0)
        vectors["share"][r] = m.samples_processed / total_samples
        vectors["complete"][r] = m.share_complete_ms
        vectors["compute"][r] = m.compute_only_ms
        vectors["starve"][r] = m.data_starve_ms
    return EpochMetrics(
        epoch=epoch,
        scalars={k: sums[k] / counts[k] for k in sorted(sums) if counts[k] > 0},
        per_rank=tuple(per_rank),
        avg_loss=sum(m.avg_loss for m in reports) / len(reports) if reports else 0.0,
        epoch_ms=max((m.epoch_ms for m in reports), default=0.0),
        per_rank_throughput=tuple(vectors["throughput"]),
        per_rank_batch_share=tuple(vectors["share"]),
        per_rank_share_complete_ms=tuple(vectors["complete"]),
        per_rank_compute_only_ms=tuple(vectors["compute"]),
        per_rank_data_starve_ms=tuple(vectors["starve"]),
        device_indices=(),
    )
