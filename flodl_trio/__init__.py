"""flodl-trio: the control plane of a multi-host training cluster, on Trio.

A port of flodl's cluster coordinator: one coordinator, one relay per host, one endpoint per rank,
all speaking the authenticated FT/2 wire protocol (:mod:`flodl_trio.wire`).
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
    FormationAborted,
    FormationError,
    FormationTimeout,
    FrameTooLarge,
    HandshakeError,
    RankEvicted,
    SendError,
    SvgRejected,
    WireError,
)
from ._reformation import ReformationError
from ._svg import sanitize_svg
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
from .timeline import Timeline
from .wire import SaveReason, SessionSalt

__all__ = [
    "AuthError",
    "BroadcastError",
    "BroadcastResult",
    "ClusterFailure",
    "ConfigError",
    "Coordinator",
    "CoordinatorBind",
    "CoordinatorConfig",
    "CoordinatorLost",
    "DashboardPush",
    "FlodlError",
    "FlodlInternalError",
    "FormationAborted",
    "FormationError",
    "FormationTimeout",
    "FrameTooLarge",
    "HandshakeError",
    "MaxFailure",
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
    "SessionSalt",
    "SvgRejected",
    "Timeline",
    "WireError",
    "__version__",
    "bind_coordinator",
    "open_coordinator",
    "open_rank",
    "open_relay",
    "sanitize_svg",
    "timeout_scale",
]
