"""Every FT/2 payload message (SPEC §2.7) as an attrs frozen class.

Annotations are the wire types; field order is the wire order. Lists are tuples in Python.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from .._errors import WireError
from ._cbor import cbor_dumps, cbor_loads
from ._codegen import finalize
from ._schema import (
    F32,
    F64,
    U8,
    U16,
    U32,
    U64,
    Family,
    HostName,
    Nonce,
    WireMessage,
    variant,
    wire_enum,
)

CONTROL_MSG = Family("ControlMsg")
TIMING_MSG = Family("TimingMsg")
RELAY_CONTROL_MSG = Family("RelayControlMsg")


# flodl decodes an unknown reason byte as a graceful shutdown; so do we.
@wire_enum(bits=8, fallback="GRACEFUL_SHUTDOWN")
class SaveReason(enum.IntEnum):
    """Why the cohort is told to save and stop (``ShutdownWithSave``)."""

    GRACEFUL_SHUTDOWN = 0
    MAX_FAILURE_EXCEEDED = 1
    SINGLE_SURVIVOR = 2
    ALL_RANKS_LOST = 3
    REDUCE_STALL = 4


class IntentKind(enum.IntEnum):
    """What a rank asks the coordinator for in ``Intent``."""

    EVAL_NOW = 0
    CHECKPOINT_NOW = 1


# ---------------------------------------------------------------- nested structs


@attrs.frozen
class EpochPlan(WireMessage):
    """One rank's slice of the dataset for one epoch."""

    epoch: U64
    partition_offset: U64
    partition_size: U64


@attrs.frozen
class EpochMetrics(WireMessage):
    """Aggregated metrics of one epoch, broadcast in ``EpochAggregated``."""

    epoch: U64
    scalars: dict[str, F64]
    per_rank: tuple[dict[str, F64], ...]
    avg_loss: F64
    epoch_ms: F64
    per_rank_throughput: tuple[F64, ...]
    per_rank_batch_share: tuple[F64, ...]
    per_rank_share_complete_ms: tuple[F64, ...]
    per_rank_compute_only_ms: tuple[F64, ...]
    per_rank_data_starve_ms: tuple[F64, ...]
    device_indices: tuple[U8, ...]


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


# ---------------------------------------------------------------- ControlMsg (coord → rank)


class ControlMsg(WireMessage):
    """Base of coordinator → rank messages (kind CONTROL)."""

    __slots__ = ()


@variant(CONTROL_MSG, 0)
@attrs.frozen
class RequestParams(ControlMsg):
    """Coordinator → rank: send the current parameters (flodl's averaging handshake)."""
    pass


@variant(CONTROL_MSG, 1)
@attrs.frozen
class Update(ControlMsg):
    """Coordinator → rank: a new averaged parameter version is ready.

    Attributes:
        version: the parameter version.
        next_plan: the plan of the next epoch, if decided.
    """
    version: U64
    next_plan: EpochPlan | None = None


@variant(CONTROL_MSG, 2)
@attrs.frozen
class SyncNow(ControlMsg):
    """Coordinator → rank: synchronise now; the rank answers with ``SyncAck``."""
    pass


@variant(CONTROL_MSG, 3)
@attrs.frozen
class StartEpoch(ControlMsg):
    """Coordinator → rank: start an epoch on the given slice of the dataset.

    Attributes:
        plan: the :class:`EpochPlan` (epoch, partition offset and size).
    """
    plan: EpochPlan


@variant(CONTROL_MSG, 4)
@attrs.frozen
class ExtendPartition(ControlMsg):
    """Coordinator → rank: also process these samples in this epoch (a dead rank's remainder).

    Attributes:
        partition_offset: first sample index.
        partition_size: number of samples.
    """
    partition_offset: U64
    partition_size: U64


@variant(CONTROL_MSG, 5)
@attrs.frozen
class DeclareDead(ControlMsg):
    """Coordinator → rank: this rank was declared dead; never wait for it again.

    Attributes:
        rank: the dead rank.
    """
    rank: U64


@variant(CONTROL_MSG, 6)
@attrs.frozen
class RequestNewNcclId(ControlMsg):
    """Coordinator → rank: generate a new NCCL unique id (answered by ``NewNcclIdGenerated``)."""
    pass


@variant(CONTROL_MSG, 7)
@attrs.frozen
class NewNcclSession(ControlMsg):
    """Coordinator → rank: join a new NCCL session after the world changed.

    Attributes:
        uid: the NCCL unique id.
        new_rank: this rank's rank in the new session.
        new_world_size: the new session's size.
    """
    uid: bytes
    new_rank: U64
    new_world_size: U64


@variant(CONTROL_MSG, 8)
@attrs.frozen
class Throttle(ControlMsg):
    """Coordinator → rank: pause after the current batch until the next command."""
    pass


@variant(CONTROL_MSG, 9)
@attrs.frozen
class SetGlobalStep(ControlMsg):
    """Coordinator → rank: the cohort's global step after a sync.

    Attributes:
        global_step: the step count to adopt.
    """
    global_step: U64


@variant(CONTROL_MSG, 10)
@attrs.frozen
class Checkpoint(ControlMsg):
    """Coordinator → rank: write a checkpoint (answered by ``CheckpointResult``).

    Attributes:
        version: checkpoint version.
        target_rank: the rank that writes it.
    """
    version: U64
    target_rank: U64


@variant(CONTROL_MSG, 11)
@attrs.frozen
class ExecuteEvalCallback(ControlMsg):
    """Coordinator → rank: run the evaluation callback (answered by ``EvalResult``).

    Attributes:
        schedule_id: which scheduled evaluation.
        epoch: the epoch it evaluates.
        target_rank: the rank that runs it.
    """
    schedule_id: U64
    epoch: U64
    target_rank: U64


@variant(CONTROL_MSG, 12)
@attrs.frozen
class SetEpochCallbackRole(ControlMsg):
    """Coordinator → rank: this rank runs the epoch callbacks (checkpoints, evaluations).

    Attributes:
        rank: the rank given the role.
    """
    rank: U64


@variant(CONTROL_MSG, 13)
@attrs.frozen
class Shutdown(ControlMsg):
    """Coordinator → rank: the run is over; iteration ends after it."""
    pass


@variant(CONTROL_MSG, 14)
@attrs.frozen
class ShutdownWithSave(ControlMsg):
    """Coordinator → rank: save and stop, for the given reason; iteration ends after it.

    Attributes:
        reason: a :class:`SaveReason` (an unknown byte decodes as ``GRACEFUL_SHUTDOWN``).
    """
    reason: SaveReason


@variant(CONTROL_MSG, 15)
@attrs.frozen
class EpochAggregated(ControlMsg):
    """Coordinator → rank: the epoch's aggregated metrics.

    Attributes:
        metrics: the :class:`EpochMetrics`.
    """
    metrics: EpochMetrics


@variant(CONTROL_MSG, 16)
@attrs.frozen
class EvalBroadcast(ControlMsg):
    """Coordinator → rank: an evaluation result, for every rank to see.

    Attributes:
        epoch: the epoch evaluated.
        metric: the result.
    """
    epoch: U64
    metric: F64


@variant(CONTROL_MSG, 17)
@attrs.frozen
class SaveConsensusModel(ControlMsg):
    """Coordinator → rank: save the consensus model.

    Attributes:
        target_rank: the rank that saves it.
    """
    target_rank: U64


@variant(CONTROL_MSG, 18)
@attrs.frozen
class CoordHeartbeat(ControlMsg):
    """Coordinator → rank: liveness, every ``heartbeat_interval``; absorbed by the rank endpoint."""
    pass


@variant(CONTROL_MSG, 19)
@attrs.frozen
class StageAdvisory(ControlMsg):
    """Coordinator → rank: pipeline-stage advice (carried, not interpreted, by flodl-trio).

    Attributes:
        counts: per-stage counts.
        segments: per-stage segments as ``[stage, [[start, end], ...]]``.
    """
    counts: tuple[U64, ...]
    segments: tuple[tuple[U64, tuple[tuple[U64, U64], ...]], ...]


@variant(CONTROL_MSG, 20)
@attrs.frozen
class RelayWaiting(ControlMsg):
    """Relay → rank only (FT/2, beyond flodl): sent by the relay itself, sealed with the salt,
    while it has not joined the cohort yet: what it is waiting for (local ranks it rejected,
    the coordinator it cannot reach). It keeps the rank's liveness clock alive until the
    relay's own deadlines decide, and the rank's error quotes it. Never delivered to users."""

    host: HostName
    detail: str


@variant(CONTROL_MSG, 21)
@attrs.frozen
class Fenced(ControlMsg):
    """To the rank itself (beyond flodl): the coordinator declared ``rank`` dead and ignores it
    from now on; ``reason`` says why. The endpoint ends with ``RankEvicted``; never delivered
    to users."""

    rank: U64
    reason: str


# ---------------------------------------------------------------- TimingMsg (rank → coord)


class TimingMsg(WireMessage):
    """Base of rank → coordinator timing messages (kind TIMING); each has ``rank`` first."""

    __slots__ = ()
    rank: int


@variant(TIMING_MSG, 0)
@attrs.frozen
class Batch(TimingMsg):
    """Rank → coordinator: one training batch done.

    Attributes:
        rank: the sender.
        batch_ms: wall time of the batch, milliseconds.
        data_ms: time spent waiting for data, milliseconds.
        step_count: the rank's step count after it.
        param_norm: parameter norm, if measured.
        batch_loss: the batch's loss.
        sync_divergence: divergence from the last sync, if measured.
    """
    rank: U64
    batch_ms: F64
    data_ms: F64
    step_count: U64
    param_norm: F64 | None
    batch_loss: F64
    sync_divergence: F64 | None = None


@variant(TIMING_MSG, 1)
@attrs.frozen
class SyncAck(TimingMsg):
    """Rank → coordinator: the answer to ``SyncNow``.

    Attributes:
        rank: the sender.
        step_count: its step count.
        divergence: divergence, if measured.
        post_norm: parameter norm after the sync, if measured.
        pre_norm: before it, if measured.
    """
    rank: U64
    step_count: U64
    divergence: F64 | None = None
    post_norm: F64 | None = None
    pre_norm: F64 | None = None


@variant(TIMING_MSG, 2)
@attrs.frozen
class Exiting(TimingMsg):
    """Rank → coordinator: leaving cleanly; the rank is never declared dead or addressed again.

    Attributes:
        rank: the sender.
    """
    rank: U64


@variant(TIMING_MSG, 3)
@attrs.frozen
class LrUpdate(TimingMsg):
    """Rank → coordinator: the rank's learning rate changed.

    Attributes:
        rank: the sender.
        lr: the new learning rate.
    """
    rank: U64
    lr: F64


@variant(TIMING_MSG, 4)
@attrs.frozen
class Intent(TimingMsg):
    """Rank → coordinator: the rank asks for an evaluation or a checkpoint now.

    Attributes:
        rank: the sender.
        kind: an :class:`IntentKind`.
    """
    rank: U64
    kind: IntentKind


@variant(TIMING_MSG, 5)
@attrs.frozen
class Heartbeat(TimingMsg):
    """Rank → coordinator: liveness, every ``heartbeat_interval``; sent by the endpoint itself.

    Attributes:
        rank: the sender.
        step_count: the endpoint's ``step_count``.
    """
    rank: U64
    step_count: U64


@variant(TIMING_MSG, 6)
@attrs.frozen
class SnapshotReady(TimingMsg):
    """Rank → coordinator: the rank's parameter snapshot is ready.

    Attributes:
        rank: the sender.
    """
    rank: U64


@variant(TIMING_MSG, 7)
@attrs.frozen
class EvalResult(TimingMsg):
    """Rank → coordinator: the answer to ``ExecuteEvalCallback``.

    Attributes:
        rank: the sender.
        schedule_id: which scheduled evaluation.
        epoch: the epoch evaluated.
        metric: the result.
        elapsed_ms: how long it took.
        error: why it failed, or None.
    """
    rank: U64
    schedule_id: U64
    epoch: U64
    metric: F64
    elapsed_ms: F64
    error: str | None = None


@variant(TIMING_MSG, 8)
@attrs.frozen
class CheckpointResult(TimingMsg):
    """Rank → coordinator: the answer to ``Checkpoint``.

    Attributes:
        rank: the sender.
        version: checkpoint version.
        elapsed_ms: how long it took.
        error: why it failed, or None.
    """
    rank: U64
    version: U64
    elapsed_ms: F64
    error: str | None = None


@variant(TIMING_MSG, 9)
@attrs.frozen
class NewNcclIdGenerated(TimingMsg):
    """Rank → coordinator: the answer to ``RequestNewNcclId``.

    Attributes:
        rank: the sender.
        uid: the NCCL unique id.
    """
    rank: U64
    uid: bytes


@variant(TIMING_MSG, 10)
@attrs.frozen
class EpochFnElapsed(TimingMsg):
    """Rank → coordinator: how long the epoch function took.

    Attributes:
        rank: the sender.
        epoch: the epoch.
        elapsed_ms: milliseconds.
    """
    rank: U64
    epoch: U64
    elapsed_ms: F64


@variant(TIMING_MSG, 11)
@attrs.frozen
class DashboardRegister(TimingMsg):
    """Rank → coordinator: the rank serves a dashboard on this port.

    Attributes:
        rank: the sender.
        port: TCP port.
    """
    rank: U64
    port: U16


@variant(TIMING_MSG, 12)
@attrs.frozen
class DashboardSetSvg(TimingMsg):
    """Rank → coordinator: an SVG for the dashboard.

    Attributes:
        rank: the sender.
        svg: the SVG text.
        label: its label, or None.
        hash: its content hash, or None.
    """
    rank: U64
    svg: str
    label: str | None = None
    hash: str | None = None


@variant(TIMING_MSG, 13)
@attrs.frozen
class DashboardSetMetadata(TimingMsg):
    """Rank → coordinator: dashboard metadata.

    Attributes:
        rank: the sender.
        json: a JSON document.
    """
    rank: U64
    json: str


@variant(TIMING_MSG, 14)
@attrs.frozen
class DashboardSetHardware(TimingMsg):
    """Rank → coordinator: a hardware summary for the dashboard.

    Attributes:
        rank: the sender.
        summary: free text.
    """
    rank: U64
    summary: str


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


# ---------------------------------------------------------------- RelayControlMsg


class RelayControlMsg(WireMessage):
    """Base of the CONTROL records of the relay ↔ coordinator leg."""

    __slots__ = ()


@variant(RELAY_CONTROL_MSG, 0)
@attrs.frozen
class Challenge(RelayControlMsg):
    """Coordinator → relay, first record of the upstream handshake, sealed with the salt itself.

    Attributes:
        nonce: 16 fresh random bytes.
    """
    nonce: Nonce


@variant(RELAY_CONTROL_MSG, 1)
@attrs.frozen
class Hello(RelayControlMsg):
    """Relay → coordinator: who the relay is, sealed with the handshake key.

    Attributes:
        host: the host name (1-255 bytes of UTF-8).
        world_size: the relay's world size (FT/2); a disagreement with the coordinator's is an
            authenticated contradiction that fails formation naming both numbers.
        model_sigs: the relay's model signatures, name -> digest (FT/2, flodl's
            ``model_sigs``; may be empty); relays whose digests for one name differ fail
            formation, naming the hosts and the names.
        ranks: the global ranks it carries, ascending.
        nonce: the relay's 16 fresh random bytes.
    """
    host: HostName
    world_size: U32
    model_sigs: dict[str, bytes]
    ranks: tuple[U32, ...]
    nonce: Nonce


@variant(RELAY_CONTROL_MSG, 2)
@attrs.frozen
class HelloAck(RelayControlMsg):
    """Coordinator → relay: accepted, echoing the relay's nonce; both switch to the connection key.

    Attributes:
        nonce: the relay's nonce.
    """
    nonce: Nonce


@variant(RELAY_CONTROL_MSG, 3)
@attrs.frozen
class RankExit(RelayControlMsg):
    """Relay → coordinator: a local rank's connection ended.

    Attributes:
        rank: the rank.
    """
    rank: U32


@variant(RELAY_CONTROL_MSG, 4)
@attrs.frozen
class Ready(RelayControlMsg):
    """Relay → coordinator (FT/2), the last record of the upstream handshake: the relay
    verified ``HelloAck``. The coordinator counts the relay's ranks as covered only once it
    has verified this; a connection that ends before that un-covers the relay."""


@variant(RELAY_CONTROL_MSG, 5)
@attrs.frozen
class Goodbye(RelayControlMsg):
    """Coordinator → relay (FT/2): the coordinator is shutting down gracefully; sent before
    the half-close, so a relay tells a clean end from a coordinator that died.

    Attributes:
        reason: why the coordinator shut down.
    """

    reason: str


@variant(RELAY_CONTROL_MSG, 6)
@attrs.frozen
class FenceRank(RelayControlMsg):
    """Coordinator → relay (beyond flodl): ``rank`` was declared dead. The relay delivers what
    is queued for it (the ``Fenced`` frame last), half-closes its link, stops forwarding its
    frames and closes the link after ``shutdown_grace``."""

    rank: U32
    reason: str


@variant(RELAY_CONTROL_MSG, 7)
@attrs.frozen
class RankDropped(RelayControlMsg):
    """Relay → coordinator (beyond flodl): the relay dropped a local rank itself (``RankExit``
    with the reason): it did not drain its queue within the relay's ``write_stall_timeout``."""

    rank: U32
    reason: str


_ALL: list[type[WireMessage]] = [
    EpochPlan, EpochMetrics, GpuSnapshot, ResourceSample, Metrics,
    *CONTROL_MSG.variants.values(), *TIMING_MSG.variants.values(),
    *RELAY_CONTROL_MSG.variants.values(),
]  # fmt: skip
finalize(_ALL)


# ---------------------------------------------------------------- encode / decode


def encode(msg: WireMessage) -> bytes:
    """The CBOR payload of any message class."""
    if not isinstance(msg, WireMessage):
        raise WireError(f"encode: expected a flodl_trio.wire message, got {type(msg).__name__}")
    return cbor_dumps(msg.to_wire())


def decode_control(b: bytes) -> ControlMsg:
    """Strictly decode a ControlMsg payload."""
    msg = CONTROL_MSG.load(cbor_loads(b, "ControlMsg"))
    assert isinstance(msg, ControlMsg)
    return msg


def decode_timing(b: bytes) -> TimingMsg:
    """Strictly decode a TimingMsg payload."""
    msg = TIMING_MSG.load(cbor_loads(b, "TimingMsg"))
    assert isinstance(msg, TimingMsg)
    return msg


def decode_metrics(b: bytes) -> Metrics:
    """Strictly decode a Metrics payload."""
    value: Any = Metrics.strict_load(cbor_loads(b, "Metrics"), "Metrics")
    assert isinstance(value, Metrics)
    return value


def decode_relay(b: bytes) -> RelayControlMsg:
    """Strictly decode a RelayControlMsg payload."""
    msg = RELAY_CONTROL_MSG.load(cbor_loads(b, "RelayControlMsg"))
    assert isinstance(msg, RelayControlMsg)
    return msg


def control_label(msg: object) -> str:
    """The class name of a message (``"SyncNow"``); total: any object gets a label."""
    return type(msg).__name__
