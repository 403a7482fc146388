"""flodl-trio: the control plane of a multi-host training cluster, on Trio.

A port of flodl's cluster coordinator: one coordinator, one relay per host, one endpoint per rank,
all speaking the authenticated FT/1 wire protocol (:mod:`flodl_trio.wire`).
"""

from ._config import CoordinatorConfig, MaxFailure, RankConfig, RelayConfig
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
    SendError,
    WireError,
)
from ._timeouts import timeout_scale
from ._version import __version__
from .wire import SessionSalt

__all__ = [
    "AuthError",
    "BroadcastError",
    "ClusterFailure",
    "ConfigError",
    "CoordinatorConfig",
    "CoordinatorLost",
    "FlodlError",
    "FlodlInternalError",
    "FormationAborted",
    "FormationError",
    "FormationTimeout",
    "FrameTooLarge",
    "HandshakeError",
    "MaxFailure",
    "RankConfig",
    "RelayConfig",
    "SendError",
    "SessionSalt",
    "WireError",
    "__version__",
    "timeout_scale",
]
