"""The TimingMsg family (rank → coordinator, kind TIMING, SPEC §2.7).

Annotations are the wire types; field order is the wire order. Each variant registers with
:data:`TIMING_MSG` on import; ``_messages`` generates the codecs.
"""

from __future__ import annotations

import enum

import attrs

from ._schema import F64, U16, U64, Family, WireMessage, variant

TIMING_MSG = Family("TimingMsg")


class IntentKind(enum.IntEnum):
    """What a rank asks the coordinator for in ``Intent``."""

    EVAL_NOW = 0
    CHECKPOINT_NOW = 1


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
