"""flodl-trio: the control plane of a multi-host training cluster, on Trio.

A port of flodl's cluster coordinator: one coordinator, one relay per host, one endpoint per rank,
all speaking the authenticated FT/2 wire protocol (:mod:`flodl_trio.wire`).

The messages an orchestrator sends and reads most (``StartEpoch``, ``EpochPlan``,
``SetGlobalStep``, ``SyncNow``, ``DeclareDead``, ``Throttle``, ``Shutdown``, ``ShutdownWithSave``;
``Batch``, ``SyncAck``, ``Heartbeat``; the unions ``ControlMsg`` and ``TimingMsg``) are re-exported
here from :mod:`flodl_trio.wire`, which has every other one.
"""

from ._config import CoordinatorConfig, MaxFailure, RankConfig, RelayConfig
from ._coord_types import BroadcastResult, RelayInfo
from ._errors import (
    AuthError,
    BroadcastError,
    ClusterFailure,
    ConfigError,
    CoordinatorLost,
    FlodlError,
    FlodlInternalError,
    ForeignSession,
    FormationAborted,
    FormationError,
    FormationTimeout,
    FrameTooLarge,
    HandshakeError,
    JoinRefused,
    LeadershipLost,
    MembershipError,
    RankEvicted,
    SendError,
    SessionEnded,
    StoreAuthError,
    StoreCorrupt,
    StoreError,
    StoreUnavailable,
    SvgRejected,
    WireError,
    WrongSession,
)
from ._timeouts import timeout_scale
from ._version import __version__
from .coordinator import (
    Coordinator,
    CoordinatorBind,
    DashboardPush,
    bind_coordinator,
    open_coordinator,
)
from .rank import RankEndpoint, open_rank
from .rank_client import RankClient
from .relay import Relay, RelayExit, open_relay
from .scheduler._reformation import ReformationError
from .status._svg import sanitize_svg
from .timeline import Timeline
from .wire import (
    Batch,
    ControlMsg,
    DeclareDead,
    EpochPlan,
    Heartbeat,
    SaveReason,
    SessionSalt,
    SetGlobalStep,
    Shutdown,
    ShutdownWithSave,
    StartEpoch,
    SyncAck,
    SyncNow,
    Throttle,
    TimingMsg,
)

__all__ = [
    "AuthError",
    "Batch",
    "BroadcastError",
    "BroadcastResult",
    "ClusterFailure",
    "ConfigError",
    "ControlMsg",
    "Coordinator",
    "CoordinatorBind",
    "CoordinatorConfig",
    "CoordinatorLost",
    "DashboardPush",
    "DeclareDead",
    "EpochPlan",
    "FlodlError",
    "FlodlInternalError",
    "ForeignSession",
    "FormationAborted",
    "FormationError",
    "FormationTimeout",
    "FrameTooLarge",
    "HandshakeError",
    "Heartbeat",
    "JoinRefused",
    "LeadershipLost",
    "MaxFailure",
    "MembershipError",
    "RankClient",
    "RankConfig",
    "RankEndpoint",
    "RankEvicted",
    "ReformationError",
    "Relay",
    "RelayConfig",
    "RelayExit",
    "RelayInfo",
    "SaveReason",
    "SendError",
    "SessionEnded",
    "SessionSalt",
    "SetGlobalStep",
    "Shutdown",
    "ShutdownWithSave",
    "StartEpoch",
    "StoreAuthError",
    "StoreCorrupt",
    "StoreError",
    "StoreUnavailable",
    "SvgRejected",
    "SyncAck",
    "SyncNow",
    "Throttle",
    "Timeline",
    "TimingMsg",
    "WireError",
    "WrongSession",
    "__version__",
    "bind_coordinator",
    "open_coordinator",
    "open_rank",
    "open_relay",
    "sanitize_svg",
    "timeout_scale",
]
