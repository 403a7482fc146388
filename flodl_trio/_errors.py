"""The one exception hierarchy of flodl-trio, rooted in :class:`FlodlError`.

Every message says what was expected, what arrived and from whom (peer address, host, rank), so a
log line alone is enough to find the misbehaving process.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
    from ._coord_types import BroadcastResult


class FlodlError(Exception):
    """Base class of every error flodl-trio raises on purpose."""


class ConfigError(FlodlError, ValueError):
    """A configuration value (argument, config field, environment variable) is invalid."""


class WireError(FlodlError):
    """Bytes on the wire do not form a valid FT/2 frame, record or message."""

    def carrying(self, frames: list[Any]) -> Self:
        """This error, carrying the whole frames a decoder's ``feed`` decoded before it
        (:func:`flodl_trio.wire.frames_before` reads them)."""
        self.frames_before = frames
        return self


class AuthError(WireError):
    """A MAC did not verify: wrong session salt, tampering, replay or reordering."""


class FrameTooLarge(WireError):
    """A declared length is over its ceiling; refused from the header alone."""


class HandshakeError(FlodlError):
    """A rank or relay handshake failed (bad magic, version, MAC, world size, rank set...)."""


class JoinRefused(HandshakeError):
    """The coordinator authenticated this relay's Hello and refused it (a verified
    ``Refused{reason}``): its world size, model signatures or ranks contradict the cohort.
    :func:`~flodl_trio.open_relay` raises it at once, without re-dialing: no retry can change
    the answer.

    Attributes:
        reason: the coordinator's reason.
        host: this relay's host name.
        peer: the coordinator's address.
    """

    def __init__(self, reason: str, *, host: str, peer: str) -> None:
        super().__init__(f"relay {host!r}: refused by the coordinator at {peer}: {reason}")
        self.reason = reason
        self.host = host
        self.peer = peer

    def __reduce__(self) -> Any:
        return (_rebuild, (type(self), (self.reason,), {"host": self.host, "peer": self.peer}))


class WrongSession(HandshakeError):
    """The coordinator's ``Challenge`` did not verify with this relay's salt on ``attempts``
    consecutive connections: the salt differs, or that address is not a coordinator of this
    session. :func:`~flodl_trio.open_relay` raises it after a few attempts (about a second),
    not at ``connect_timeout``; the last failure is its ``__cause__``.

    Attributes:
        host: this relay's host name.
        peer: the address dialed.
        attempts: how many Challenges in a row did not verify.
    """

    def __init__(self, *, host: str, peer: str, attempts: int) -> None:
        super().__init__(
            f"relay {host!r}: the session salt differs from the coordinator's at {peer} (or that "
            f"is not a coordinator of this session): {attempts} Challenges in a row did not "
            "verify")
        self.host = host
        self.peer = peer
        self.attempts = attempts

    def __reduce__(self) -> Any:
        return (_rebuild, (type(self), (), {"host": self.host, "peer": self.peer,
                                            "attempts": self.attempts}))


def _rebuild(cls: type[FlodlError], args: tuple[Any, ...], kwargs: dict[str, Any]) -> FlodlError:
    return cls(*args, **kwargs)


class FormationError(FlodlError):
    """Cohort formation failed: an authenticated relay contradicted the world, or similar."""


class FormationTimeout(FormationError):
    """``formation_timeout`` passed before every rank of the world was covered."""


class FormationAborted(FormationError):
    """The caller's ``abort`` event was set during formation."""


class MembershipError(FlodlError):
    """A change of an elastic world's membership that cannot be made as asked (issue 37):
    retiring a live rank, or one not in the world, below the world's minimum; draining a relay
    twice. Nothing was changed; the message says what was expected and what the rank is."""


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

    The message names the dead ranks and, when the caller knows them (``why``, in the order the
    ranks died), why each died: ranks with the same reason together, the first few reasons in
    the order they first happened, and a count of the rest.

    Attributes:
        reason: the :class:`~flodl_trio.wire.SaveReason` broadcast in ``ShutdownWithSave``.
        dead: the ranks declared dead when the decision was taken.
        detail: what decided it (the policy's limit, or who found no live rank left).
        why: rank -> why it was declared dead (empty when not given).
    """

    def __init__(self, reason: Any, dead: Iterable[int], detail: str = "", *,
                 why: Mapping[int, str] | None = None) -> None:
        self.reason = reason
        self.dead = frozenset(dead)
        self.why = dict(why or {})
        self.detail = detail
        name = getattr(reason, "name", str(reason))
        text = f"cluster failure: {name}; dead ranks {_ranks_text(sorted(self.dead))}"
        if detail:
            text += f" ({detail})"
        if self.why:
            text += f"; why: {_grouped_reasons(self.why)}"
        super().__init__(text)

    def __reduce__(self) -> Any:
        return (_cluster_failure, (self.reason, self.dead, self.detail, self.why))


def _cluster_failure(reason: Any, dead: Iterable[int], detail: str, why: Mapping[int, str]
                     ) -> ClusterFailure:
    return ClusterFailure(reason, dead, detail, why=why)


_REASONS_SHOWN = 4


def _grouped_reasons(why: Mapping[int, str]) -> str:
    """``rank 0: reason a; ranks [1, 2]: reason b`` -- reasons in the order of ``why`` (the
    order the ranks died: the first reason is what happened first), at most a few."""
    groups: dict[str, list[int]] = {}
    for rank, reason in why.items():
        groups.setdefault(reason, []).append(rank)
    ordered = list(groups.items())
    parts = []
    for reason, ranks in ordered[:_REASONS_SHOWN]:
        ranks.sort()
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranks_text(ranks)}"
        parts.append(f"{who}: {reason}")
    if len(ordered) > _REASONS_SHOWN:
        rest = sum(len(ranks) for _, ranks in ordered[_REASONS_SHOWN:])
        parts.append(f"{len(ordered) - _REASONS_SHOWN} more reasons ({rest} ranks)")
    return "; ".join(parts)


def _ranks_text(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 8 else f"[{ranks[0]}..{ranks[-1]}, {len(ranks)} ranks]"


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


class StoreError(FlodlError):
    """The coordinator's session store (SPEC §4.7) failed: unreachable, unhealthy, corrupt,
    foreign, or this coordinator is no longer its leader. The message names the store (path or
    endpoint) and why."""


class StoreUnavailable(StoreError):
    """The store cannot be reached or is unhealthy (an etcd endpoint that refuses, times out or
    reports no leader; a file that cannot be opened)."""


class StoreAuthError(StoreUnavailable):
    """The store refused this client, or this client refused the store, for a reason no retry
    can change: a TLS certificate either side does not trust, a user or password etcd refuses,
    a role without permission on the store's keys. The message names the endpoint and what to
    fix; a standby does not wait through it."""


class StoreCorrupt(StoreError):
    """The stored session state is not a flodl-trio state, is damaged, or belongs to another
    session (salt, world size); it is refused whole, never half-loaded."""


class ForeignSession(StoreCorrupt):
    """The store holds another run's unfinished session (another salt or world size): it is
    refused whole, nothing is loaded. To start a new session there anyway (discarding that
    one), open the coordinator with ``fresh=True`` (``flodl-trio coordinator --fresh``); or
    use another store (a new path or prefix).

    Attributes:
        store: the store, as its ``description`` names it.
        generation: the generation that wrote the refused session.
        why: what differs (``"another salt"``, ``"world size 8, not 4"``).
    """

    def __init__(self, message: str, *, store: str, generation: int, why: str) -> None:
        super().__init__(message)
        self.store = store
        self.generation = generation
        self.why = why

    def __reduce__(self) -> Any:
        return (_rebuild, (type(self), (str(self),), {"store": self.store,
                                                      "generation": self.generation,
                                                      "why": self.why}))


class SessionEnded(FlodlError):
    """A coordinator that waited for its store's leadership (a standby) found that the session
    it waited for had ended: its coordinator shut the cohort down and recorded the end, so
    there is nothing to adopt. Nothing was loaded and the leadership was released; a
    coordinator opened on the store again starts a new session.

    Attributes:
        store: the store, as its ``description`` names it.
        generation: the generation of the coordinator that ended the session.
        outcome: how it ended (``"the block exited"``, ``"cluster failure: ..."``).
        ended_at: when (Unix time), or None if the state does not say.
    """

    def __init__(self, *, store: str, generation: int, outcome: str,
                 ended_at: float | None) -> None:
        super().__init__(f"store {store}: the session waited for (generation {generation}) "
                         f"ended ({outcome}); expected a running session to adopt, found none "
                         "(nothing was loaded; open a coordinator on the store again to start a "
                         "new session)")
        self.store = store
        self.generation = generation
        self.outcome = outcome
        self.ended_at = ended_at

    def __reduce__(self) -> Any:
        return (_rebuild, (type(self), (), {"store": self.store, "generation": self.generation,
                                            "outcome": self.outcome,
                                            "ended_at": self.ended_at}))


class LeadershipLost(StoreError):
    """This coordinator is no longer the store's leader (its lease expired or a newer
    generation took over): it must step down without broadcasting or shutting anyone down."""


class UsageError(Exception):
    """A command line that cannot be run as given (exit code 2). Raised by the command line
    only, never by the library's API, hence outside the FlodlError hierarchy."""


class SvgRejected(FlodlError):
    """An SVG pushed for the status page (``DashboardSetSvg``) cannot be shown safely: too large,
    not well-formed, or it declares a DTD; the page shows why instead of the picture."""
