"""The coordinator: formation, readers, sending, liveness and shutdown (SPEC §4).

Re-exports only; the code lives in its private modules.
"""

from ._board import DashboardPush
from ._core import Coordinator
from ._open import (
    MUX_QUEUE as MUX_QUEUE,
    CoordinatorBind,
    ListenSpec as ListenSpec,
    bind_coordinator,
    open_coordinator,
)

__all__ = [
    "Coordinator",
    "CoordinatorBind",
    "DashboardPush",
    "bind_coordinator",
    "open_coordinator",
]
