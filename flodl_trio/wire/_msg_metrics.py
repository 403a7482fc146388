"""Metrics (rank → coordinator, kind METRICS, SPEC §2.7): a plain struct, not a family, and the
resource samples it may carry.

Annotations are the wire types; field order is the wire order. Lists are tuples in Python.
"""

from __future__ import annotations

import attrs

from ._schema import F32, F64, U8, U64, WireMessage


@attrs.frozen
class GpuSnapshot(WireMessage):
    """One GPU in a :class:`ResourceSample`.

    Attributes:
        device_index: CUDA device index.
        name: device name.
        util_percent: utilisation, if known.
        vram_allocated_bytes: allocated memory, if known.
        vram_total_bytes: total memory, if known.
    """
    device_index: U8
    name: str
    util_percent: F32 | None = None
    vram_allocated_bytes: U64 | None = None
    vram_total_bytes: U64 | None = None


@attrs.frozen
class ResourceSample(WireMessage):
    """A rank's resource usage, optionally carried by :class:`Metrics`.

    Attributes:
        cpu_percent: CPU use, if known.
        ram_used_bytes: RAM used, if known.
        ram_total_bytes: RAM total, if known.
        gpu_util_percent: GPU utilisation, if known.
        vram_total_bytes: total VRAM, if known.
        vram_allocated_bytes: allocated VRAM, if known.
        aggregate_rank: the rank that aggregated the sample, if any.
        gpus: one :class:`GpuSnapshot` per device.
    """
    cpu_percent: F32 | None = None
    ram_used_bytes: U64 | None = None
    ram_total_bytes: U64 | None = None
    gpu_util_percent: F32 | None = None
    vram_total_bytes: U64 | None = None
    vram_allocated_bytes: U64 | None = None
    aggregate_rank: U8 | None = None
    gpus: tuple[GpuSnapshot, ...] = ()


# ---------------------------------------------------------------- Metrics (rank → coord)


@attrs.frozen
class Metrics(WireMessage):
    """One rank's end-of-epoch report (kind METRICS, a plain struct)."""

    rank: U64
    epoch: U64
    avg_loss: F64
    batches_processed: U64
    epoch_ms: F64
    samples_processed: U64
    share_complete_ms: F64
    compute_only_ms: F64
    data_starve_ms: F64
    scalars: dict[str, tuple[F64, U64]]
    resources: ResourceSample | None = None
