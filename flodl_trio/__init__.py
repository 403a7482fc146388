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
    JoinRefused,
    RankEvicted,
    SendError,
    WireError,
    WrongSession,
)
from ._reformation import ReformationError
from ._timeouts import timeout_scale
from ._version import __version__
from .coordinator import Coordinator, CoordinatorBind, bind_coordinator, open_coordinator
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
    "FlodlError",
    "FlodlInternalError",
    "FormationAborted",
    "FormationError",
    "FormationTimeout",
    "FrameTooLarge",
    "HandshakeError",
    "JoinRefused",
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
    "Timeline",
    "WireError",
    "WrongSession",
    "__version__",
    "bind_coordinator",
    "open_coordinator",
    "open_rank",
    "open_relay",
    "timeout_scale",
]
