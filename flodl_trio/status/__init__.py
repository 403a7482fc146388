"""The HTTP/1.1 status responder of the coordinator port, and a client for it.

Re-exports only; the code lives in its private modules.
"""

from ._http import (
    BOARD_ROUTES as BOARD_ROUTES,
    ROUTES as ROUTES,
    StateFn as StateFn,
    fetch_state,
    serve_status,
)
from ._prometheus import (
    PHASES as PHASES,
    PROMETHEUS_CONTENT_TYPE as PROMETHEUS_CONTENT_TYPE,
    render_prometheus,
)

__all__ = [
    "fetch_state",
    "render_prometheus",
    "serve_status",
]
