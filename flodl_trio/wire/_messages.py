"""Every FT/2 payload message (SPEC §2.7), gathered from one module per family, and the codec's
entry points (``encode``, ``decode_*``).

The classes live in ``_msg_control`` (ControlMsg, the structs it carries, SaveReason),
``_msg_timing`` (TimingMsg, IntentKind), ``_msg_metrics`` (Metrics and its resource samples) and
``_msg_relay`` (RelayControlMsg); each variant registers with its family when its module is
imported. Their fast loaders and dumpers are generated here, once every family module is
imported: ``finalize`` derives the field specs of all classes before it generates any, so a struct
carried by another module's message is never generated half-known.
"""

from __future__ import annotations

from typing import Any, TypeVar

from .._errors import WireError
from ._cbor import cbor_dumps, cbor_loads
from ._codegen import finalize
from ._msg_control import (
    CONTROL_MSG,
    Checkpoint,
    ControlMsg,
    CoordHeartbeat,
    CoordinatorReconnecting,
    CoordinatorResumed,
    DeclareAlive,
    DeclareDead,
    Drain,
    EpochAggregated,
    EpochMetrics,
    EpochPlan,
    EvalBroadcast,
    ExecuteEvalCallback,
    ExtendPartition,
    Fenced,
    NewNcclSession,
    Readmitted,
    RelayWaiting,
    RequestNewNcclId,
    RequestParams,
    SaveConsensusModel,
    SaveReason,
    SetEpochCallbackRole,
    SetGlobalStep,
    Shutdown,
    ShutdownWithSave,
    StageAdvisory,
    StartEpoch,
    SyncNow,
    Throttle,
    Update,
)
from ._msg_metrics import (
    GpuSnapshot,
    Metrics,
    ResourceSample,
)
from ._msg_relay import (
    MAX_CADENCE,
    RELAY_CONTROL_MSG,
    Cadence,
    Challenge,
    Draining,
    FenceRank,
    Generation,
    Goodbye,
    Hello,
    HelloAck,
    Liveness,
    RankDropped,
    RankExit,
    Ready,
    Refused,
    RelayControlMsg,
    Resume,
    liveness_heartbeat,
)
from ._msg_timing import (
    TIMING_MSG,
    Batch,
    CheckpointResult,
    DashboardRegister,
    DashboardSetHardware,
    DashboardSetMetadata,
    DashboardSetSvg,
    EpochFnElapsed,
    EvalResult,
    Exiting,
    Heartbeat,
    Intent,
    IntentKind,
    LrUpdate,
    NewNcclIdGenerated,
    SnapshotReady,
    SyncAck,
    TimingMsg,
)

# F32 ... Nonce are not used here: the classes are shown as this module's (below), so this is
# where typing.get_type_hints (Sphinx, hypothesis) looks up the wire types their annotations name.
from ._schema import (  # noqa: F401
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
)

# What flodl_trio.wire re-exports (its __all__ takes this one): every message class and the
# codec's entry points.
__all__ = [
    "MAX_CADENCE",
    "Batch",
    "Cadence",
    "Challenge",
    "Checkpoint",
    "CheckpointResult",
    "ControlMsg",
    "CoordHeartbeat",
    "CoordinatorReconnecting",
    "CoordinatorResumed",
    "DashboardRegister",
    "DashboardSetHardware",
    "DashboardSetMetadata",
    "DashboardSetSvg",
    "DeclareAlive",
    "DeclareDead",
    "Drain",
    "Draining",
    "EpochAggregated",
    "EpochFnElapsed",
    "EpochMetrics",
    "EpochPlan",
    "EvalBroadcast",
    "EvalResult",
    "ExecuteEvalCallback",
    "Exiting",
    "ExtendPartition",
    "FenceRank",
    "Fenced",
    "Generation",
    "Goodbye",
    "GpuSnapshot",
    "Heartbeat",
    "Hello",
    "HelloAck",
    "Intent",
    "IntentKind",
    "Liveness",
    "LrUpdate",
    "Metrics",
    "NewNcclIdGenerated",
    "NewNcclSession",
    "RankDropped",
    "RankExit",
    "Readmitted",
    "Ready",
    "Refused",
    "RelayControlMsg",
    "RelayWaiting",
    "RequestNewNcclId",
    "RequestParams",
    "ResourceSample",
    "Resume",
    "SaveConsensusModel",
    "SaveReason",
    "SetEpochCallbackRole",
    "SetGlobalStep",
    "Shutdown",
    "ShutdownWithSave",
    "SnapshotReady",
    "StageAdvisory",
    "StartEpoch",
    "SyncAck",
    "SyncNow",
    "Throttle",
    "TimingMsg",
    "Update",
    "control_label",
    "decode_control",
    "decode_metrics",
    "decode_relay",
    "decode_timing",
    "encode",
    "liveness_heartbeat",
]

_ALL: list[type[WireMessage]] = [
    EpochPlan, EpochMetrics, GpuSnapshot, ResourceSample, Metrics,
    *CONTROL_MSG.variants.values(), *TIMING_MSG.variants.values(),
    *RELAY_CONTROL_MSG.variants.values(),
]  # fmt: skip
finalize(_ALL)

# Shown (repr, errors, docs, pickles) as this module's own, as before the families had modules.
for _cls in (SaveReason, IntentKind, ControlMsg, TimingMsg, RelayControlMsg, *_ALL):
    _cls.__module__ = __name__
del _cls


# ---------------------------------------------------------------- encode / decode

_M = TypeVar("_M", bound=WireMessage)


def encode(msg: WireMessage) -> bytes:
    """The CBOR payload of any message class."""
    if not isinstance(msg, WireMessage):
        raise WireError(f"encode: expected a flodl_trio.wire message, got {type(msg).__name__}")
    return cbor_dumps(msg.to_wire())


def decode_control(b: bytes) -> ControlMsg:
    """Strictly decode a ControlMsg payload."""
    return _decode(CONTROL_MSG, ControlMsg, b)


def decode_timing(b: bytes) -> TimingMsg:
    """Strictly decode a TimingMsg payload."""
    return _decode(TIMING_MSG, TimingMsg, b)


def decode_metrics(b: bytes) -> Metrics:
    """Strictly decode a Metrics payload."""
    value: Any = Metrics.strict_load(cbor_loads(b, "Metrics"), "Metrics")
    assert isinstance(value, Metrics)
    return value


def decode_relay(b: bytes) -> RelayControlMsg:
    """Strictly decode a RelayControlMsg payload."""
    return _decode(RELAY_CONTROL_MSG, RelayControlMsg, b)


def _decode(family: Family, base: type[_M], b: bytes) -> _M:
    """A ``base`` message of ``family`` from its CBOR payload (errors name ``base``)."""
    msg = family.load(cbor_loads(b, base.__name__))
    assert isinstance(msg, base)
    return msg


def control_label(msg: object) -> str:
    """The class name of a message (``"SyncNow"``); total: any object gets a label."""
    return type(msg).__name__
