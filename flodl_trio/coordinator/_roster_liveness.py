"""The roster's liveness rules (a mixin of :class:`._roster.Roster`): deaths, clean exits,
last-seen clocks, staleness and the failure policy. Plain data, no trio, no IO; time is passed
in. Also the :class:`Member` protocol the roster is generic over."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, Protocol, TypeVar

from .._config import MaxFailure
from ..wire import SaveReason

PHASES = ("forming", "running", "shutting_down", "closed")
# How soon the staleness watch looks again at a relay whose reader waits on a full channel.
PAUSED_RECHECK = 1.0


class Member(Protocol):
    """What the roster needs to know about a relay connection."""

    @property
    def host(self) -> str: ...

    @property
    def ranks(self) -> tuple[int, ...]: ...

    @property
    def peer(self) -> str: ...

    @property
    def alive(self) -> bool: ...

    @property
    def model_sigs(self) -> dict[str, bytes]: ...


M = TypeVar("M", bound=Member)


class LivenessRules(Generic[M]):
    """Deaths, exits, clocks, staleness and the failure policy, over the roster's state."""

    world_size: int
    _phase: str
    _relay_of: dict[int, M]
    _dead: dict[int, str]
    _exited: set[int]
    _last_seen: dict[int, float]
    _live: set[int]
    on_change: Callable[[M | None], None]

    def mark_dead(self, rank: int, reason: str) -> bool:
        """Declare ``rank`` dead; False if it is not live (or shutdown has begun)."""
        if (self._phase in ("shutting_down", "closed") or rank in self._dead or rank in self._exited
                or rank not in self._relay_of):
            return False
        self._dead[rank] = reason
        self._live.discard(rank)
        self.on_change(self._relay_of[rank])
        return True

    def mark_exited(self, rank: int) -> bool:
        """``rank`` said Exiting; False if it had already."""
        if rank in self._exited:
            return False
        self._exited.add(rank)
        self._live.discard(rank)
        self.on_change(self._relay_of.get(rank))
        return True

    def seen(self, rank: int, now: float) -> None:
        """A TIMING frame from ``rank`` arrived at ``now``."""
        self._last_seen[rank] = now

    def seen_by(self, relay: M, ranks: Sequence[int], ages: Iterable[float],
                now: float) -> bool:
        """``relay`` verified a heartbeat of each of ``ranks`` the matching ``ages`` before
        ``now`` (a ``Liveness`` record that arrived at ``now``): each rank it carries that is
        not dead is seen then (an earlier reading never moves a clock back). True when that
        was every one of ``ranks``."""
        relay_of, dead, last_seen = self._relay_of, self._dead, self._last_seen
        everyone = True
        for rank, age in zip(ranks, ages, strict=True):
            if rank in dead or relay_of.get(rank) is not relay:
                everyone = False  # declared dead (or rejoined elsewhere) since the relay heard
            elif (when := now - age) > last_seen.get(rank, -math.inf):
                last_seen[rank] = when
        return everyone

    def credit_pause(self, relay: M, seconds: float) -> None:
        """The coordinator did not read ``relay`` for ``seconds``: not its ranks' silence."""
        for r in relay.ranks:
            if r in self._last_seen:
                self._last_seen[r] += seconds

    def stale(self, now: float, timeout: float,
              paused: Callable[[M], bool] = lambda relay: False) -> tuple[list[int], float]:
        """Live ranks silent for ``timeout`` at ``now`` (ranks on ``paused`` relays excepted),
        ascending, and when to look again (``inf`` when none is watched). Only while running:
        formation has its own deadline.

        A paused relay's wait is credited to its ranks when it ends (:meth:`credit_pause`), so
        their deadlines only move later: they are looked at again at their uncredited
        deadline, or within ``PAUSED_RECHECK`` seconds when that has passed. Nobody has to
        wake the watch when a pause ends (one wake per full channel cost a scan of the world
        per delivered frame).
        """
        if self._phase != "running":
            return [], math.inf
        overdue: list[int] = []
        next_due = math.inf
        recheck = now + min(timeout, PAUSED_RECHECK)
        last_seen, relay_of = self._last_seen, self._relay_of
        for rank in self._live:
            due = last_seen[rank] + timeout
            if paused(relay_of[rank]):
                next_due = min(next_due, max(due, recheck))
            elif due <= now:
                overdue.append(rank)
            elif due < next_due:
                next_due = due
        overdue.sort()
        return overdue, next_due

    def failure_reason(self, policy: MaxFailure | None) -> SaveReason | None:
        """Why the run cannot go on under ``policy``, or None while it can. Never while
        forming: an uncovered rank is not lost, and a dead one may still be brought back
        (the policy is applied once formation completes)."""
        if not self._dead or self._phase == "forming":
            return None
        if policy is not None and len(self._dead) >= policy.limit(self.world_size):
            return SaveReason.MAX_FAILURE_EXCEEDED
        if not self._live:
            return SaveReason.ALL_RANKS_LOST
        return None
