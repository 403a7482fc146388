"""Structured events of everything the control plane decided (SPEC §8).

Each event is an attrs frozen class; :class:`~flodl_trio.timeline.Timeline` stamps and stores them.
"""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class Event:
    """Base class of every timeline event."""

    @property
    def kind(self) -> str:
        return type(self).__name__

    def to_dict(self) -> dict[str, Any]:
        """The event's fields as JSON-ready values (tuples and frozensets become lists)."""
        return {k: _jsonable(v) for k, v in attrs.asdict(self, recurse=False).items()}


def _jsonable(value: Any) -> Any:
    if isinstance(value, frozenset | set):
        return sorted(value)
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if hasattr(value, "name") and hasattr(value, "value") and isinstance(value.value, int):
        return value.name  # IntEnum members read better by name
    return value


@attrs.frozen
class Listening(Event):
    """The coordinator's port is bound; ``address`` is ``"host:port"``."""

    address: str


@attrs.frozen
class RelayJoined(Event):
    """A relay authenticated and was acknowledged."""

    host: str
    ranks: tuple[int, ...]
    peer: str


@attrs.frozen
class HandshakeRejected(Event):
    """A connection failed before authenticating and was dropped."""

    peer: str
    reason: str


@attrs.frozen
class FormationComplete(Event):
    """Every rank of the world is covered."""

    relays: int
    world_size: int
    elapsed_ms: float


@attrs.frozen
class FormationFailed(Event):
    reason: str
    covered: int


@attrs.frozen
class LostBroadcast(Event):
    """A broadcast did not reach every live rank; ``failures`` maps rank → cause."""

    control: str
    failures: dict[int, str]


@attrs.frozen
class RankDeclaredDead(Event):
    rank: int
    host: str
    reason: str


@attrs.frozen
class RankRejoined(Event):
    """A rank declared dead earlier is alive again: ``host``'s relay dialed back in with the full
    handshake and was admitted (every rank it named was dead). The survivors are told with a
    ``DeclareAlive`` control message, as they were told of the death with ``DeclareDead``."""

    rank: int
    host: str


@attrs.frozen
class RankJoined(Event):
    """Elastic membership (issue 37): a rank that was not in the running cohort (never covered,
    or retired) joined it through ``host``'s relay, and the world grew to ``world`` ranks. The
    others are told with ``DeclareAlive``, as of a rank that rejoins."""

    rank: int
    host: str
    world: int


@attrs.frozen
class RankRetired(Event):
    """Elastic membership (issue 37): a rank left the world for good (``reason``: retired by
    the orchestrator, dead for ``retire_after``, or its host drained), which is ``world`` ranks
    now. It no longer counts against ``max_failure`` and nobody waits for it; its id may join
    again later."""

    rank: int
    host: str
    reason: str
    world: int


@attrs.frozen
class RelayDraining(Event):
    """Elastic membership (issue 37): ``host``'s relay said its host leaves on purpose
    (``Relay.drain()``, SIGTERM to ``flodl-trio relay``): its ranks finish their current sync
    and exit, and each is retired as it does (``RankRetired``), not counted as a failure."""

    host: str
    ranks: tuple[int, ...]
    reason: str


@attrs.frozen
class RankTakenOver(Event):
    """A dead rank was taken over by a relay of a different host (a spare), which
    ``CoordinatorConfig(allow_rank_takeover=True)`` allows; a ``RankRejoined`` follows."""

    rank: int
    host: str
    previous_host: str


@attrs.frozen
class RankExited(Event):
    """A rank said ``Exiting``: it left cleanly and is never declared dead."""

    rank: int


@attrs.frozen
class RelayLost(Event):
    """A relay connection ended (EOF, error, write stall)."""

    host: str
    ranks: tuple[int, ...]
    reason: str


@attrs.frozen
class RelayStalled(Event):
    """The coordinator's writer to a relay made no progress for ``write_stall_timeout``: the
    relay stopped reading. It is lost (a ``RelayLost`` follows); nobody else waited on it."""

    host: str
    ranks: tuple[int, ...]
    stalled_s: float


@attrs.frozen
class RankFenced(Event):
    """A rank declared dead was told so through its relay (``Fenced``) and is ignored from now
    on (SPEC §4.5)."""

    rank: int
    host: str
    reason: str


@attrs.frozen
class RelayRetired(Event):
    """Every rank of a relay is dead: the coordinator half-closed its connection and closes it
    (after ``shutdown_grace`` at the latest)."""

    host: str
    ranks: tuple[int, ...]


@attrs.frozen
class RelayDroppedRank(Event):
    """A relay dropped one of its local ranks: it did not drain its queue within
    ``write_stall_timeout``, or the coordinator fenced it. Its siblings never waited on it."""

    rank: int
    host: str
    reason: str


@attrs.frozen
class InvalidFrame(Event):
    """An inner frame failed its MAC or decode, or spoke for a rank its relay does not carry."""

    rank: int
    host: str
    reason: str


@attrs.frozen
class ShutdownStarted(Event):
    reason: str


@attrs.frozen
class ShutdownComplete(Event):
    pass


@attrs.frozen
class ClusterFailed(Event):
    reason: str
    dead: tuple[int, ...]


# Events that other components (scheduler, demo) record on the same timeline.
@attrs.frozen
class Note(Event):
    """A free-form event recorded by an orchestrator (``what`` plus JSON-ready fields)."""

    what: str
    fields: dict[str, Any] = attrs.field(factory=dict)
