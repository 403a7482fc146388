"""The ControlMsg family (coordinator → rank, kind CONTROL, SPEC §2.7) and the structs it carries.

Annotations are the wire types; field order is the wire order. Lists are tuples in Python. Each
variant registers with :data:`CONTROL_MSG` on import; ``_messages`` generates the codecs.
"""

from __future__ import annotations

import enum

import attrs

from ._schema import F64, U8, U64, Family, HostName, WireMessage, variant, wire_enum

CONTROL_MSG = Family("ControlMsg")


# flodl decodes an unknown reason byte as a graceful shutdown; so do we.
@wire_enum(bits=8, fallback="GRACEFUL_SHUTDOWN")
class SaveReason(enum.IntEnum):
    """Why the cohort is told to save and stop (``ShutdownWithSave``)."""

    GRACEFUL_SHUTDOWN = 0
    MAX_FAILURE_EXCEEDED = 1
    SINGLE_SURVIVOR = 2
    ALL_RANKS_LOST = 3
    REDUCE_STALL = 4


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


@variant(CONTROL_MSG, 22)
@attrs.frozen
class DeclareAlive(ControlMsg):
    """Coordinator → rank (beyond flodl): ``rank``, declared dead earlier, rejoined the run (its
    host's relay came back, or a spare host took it over); it is a live peer again. The rank
    endpoint removes it from ``dead_peers`` and delivers the message.

    Attributes:
        rank: the rank that is alive again.
    """
    rank: U64


@variant(CONTROL_MSG, 23)
@attrs.frozen
class CoordinatorReconnecting(ControlMsg):
    """Relay → rank only (beyond flodl, issue 22): sent by the relay itself, sealed with the
    salt, when it lost its durable coordinator without a ``Goodbye`` and re-dials it within its
    ``coordinator_grace``. The rank's links stay up and its coordinator-liveness clock is fed by
    the relay meanwhile. Delivered to users.

    Attributes:
        host: the relay's host.
        detail: what happened to the coordinator connection.
    """

    host: HostName
    detail: str


@variant(CONTROL_MSG, 24)
@attrs.frozen
class CoordinatorResumed(ControlMsg):
    """Relay → rank only (beyond flodl, issue 22): sent by the relay itself, sealed with the
    salt, once it resumed with a (new) durable coordinator; the frames the rank sent meanwhile
    were forwarded first. Delivered to users.

    Attributes:
        generation: the generation of the coordinator the relay resumed with.
    """

    generation: U64


@variant(CONTROL_MSG, 25)
@attrs.frozen
class Drain(ControlMsg):
    """Relay → rank only (beyond flodl, issue 37): sent by the relay itself, sealed with the
    salt, when its host leaves the run on purpose (``Relay.drain()``, SIGTERM to ``flodl-trio
    relay``). The rank finishes its current sync (or leaves at once with nothing unsynced) and
    exits cleanly; the coordinator retires it, without counting it as a failure. Delivered to
    users (``RankEndpoint.draining`` says it came).

    Attributes:
        host: the relay's host.
        reason: why the host leaves.
    """

    host: HostName
    reason: str


@variant(CONTROL_MSG, 26)
@attrs.frozen
class Readmitted(ControlMsg):
    """Relay → rank only (beyond flodl, issue 37): sent by the relay itself, sealed with the
    salt, once a relay whose ranks were all fenced (its host froze past ``heartbeat_timeout``)
    re-dialed with a fresh ``Hello`` and the coordinator took this rank back. The rank's frames
    flow again; the work it did since its last acknowledged sync was settled without it, so it
    drops that and takes its state from the next plan (docs/elastic.rst, "Waking up").
    Delivered to users (``RankEndpoint.fenced`` is None again, ``readmissions`` counts it).

    Attributes:
        host: the relay's host.
        reason: why the coordinator had declared the rank dead.
    """

    host: HostName
    reason: str
