"""The one exception hierarchy of flodl-trio, rooted in :class:`FlodlError`.

Every message says what was expected, what arrived and from whom (peer address, host, rank), so a
log line alone is enough to find the misbehaving process.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._coord_types import BroadcastResult


class FlodlError(Exception):
    """Base class of every error flodl-trio raises on purpose."""


class ConfigError(FlodlError, ValueError):
    """A configuration value (argument, config field, environment variable) is invalid."""


class WireError(FlodlError):
    """Bytes on the wire do not form a valid FT/2 frame, record or message."""


class AuthError(WireError):
    """A MAC did not verify: wrong session salt, tampering, replay or reordering."""


class FrameTooLarge(WireError):
    """A declared length is over its ceiling; refused from the header alone."""


class HandshakeError(FlodlError):
    """A rank or relay handshake failed (bad magic, version, MAC, world size, rank set...)."""


class FormationError(FlodlError):
    """Cohort formation failed: an authenticated relay contradicted the world, or similar."""


class FormationTimeout(FormationError):
    """``formation_timeout`` passed before every rank of the world was covered."""


class FormationAborted(FormationError):
    """The caller's ``abort`` event was set during formation."""


class SendError(FlodlError):
    """A control message could not be written to a rank."""


class BroadcastError(FlodlError):
    """A best-effort broadcast did not reach every live rank.

    Attributes:
        result: the :class:`BroadcastResult` with the delivered ranks and the failures by rank.
    """

    def __init__(self, message: str, result: BroadcastResult) -> None:
        super().__init__(message)
        self.result = result

    @property
    def failed_ranks(self) -> frozenset[int]:
        """The ranks the broadcast did not reach."""
        return frozenset(self.result.failed)


class ClusterFailure(FlodlError):
    """The failure policy decided that the run cannot go on.

    Attributes:
        reason: the :class:`~flodl_trio.wire.SaveReason` broadcast in ``ShutdownWithSave``.
        dead: the ranks declared dead when the decision was taken.
    """

    def __init__(self, reason: Any, dead: Iterable[int], detail: str = "") -> None:
        self.reason = reason
        self.dead = frozenset(dead)
        name = getattr(reason, "name", str(reason))
        text = f"cluster failure: {name}; dead ranks {sorted(self.dead)}"
        if detail:
            text += f" ({detail})"
        super().__init__(text)

    def __reduce__(self) -> Any:
        return (type(self), (self.reason, self.dead))


class CoordinatorLost(FlodlError):
    """A rank lost its coordinator: the link ended without ``Shutdown``, or it went silent."""


class RankEvicted(CoordinatorLost):
    """The coordinator declared this rank dead and cut it off (fencing, SPEC §4.5); ``reason``
    is the coordinator's reason. A :class:`CoordinatorLost`, since the rank can no longer talk
    to it; catch ``RankEvicted`` to tell an eviction from a lost coordinator."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> Any:
        return (type(self), (str(self), self.reason))


class FlodlInternalError(FlodlError):
    """An unexpected internal failure; raised ``from`` the original exception (group)."""


class UsageError(Exception):
    """A command line that cannot be run as given (exit code 2). Raised by the command line
    only, never by the library's API, hence outside the FlodlError hierarchy."""


class SvgRejected(FlodlError):
    """An SVG pushed for the status page (``DashboardSetSvg``) cannot be shown safely: too large,
    not well-formed, or it declares a DTD; the page shows why instead of the picture."""
