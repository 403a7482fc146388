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

    @property
    def current_world(self) -> int:
        """The ranks the failure policy's share is taken of (the roster's)."""
        raise NotImplementedError
    _relay_of: dict[int, M]
    _dead: dict[int, str]
    _exited: set[int]
    _last_seen: dict[int, float]
    _live: set[int]
    # Staleness on evidence (SPEC §4.5): when each relay's last record arrived (any record),
    # when each coalescing relay's last ``Liveness`` arrived (a relay with none forwards its
    # ranks' heartbeats), and the relays whose next report decides a rank past its deadline.
    _heard: dict[M, float]
    _reports: dict[M, float]
    _awaited: set[M]
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

    def heard(self, relay: M, now: float) -> None:
        """A read from ``relay`` brought at least one record at ``now``: it is not silent."""
        self._heard[relay] = now

    def seen_by(self, relay: M, ranks: Sequence[int], ages: Iterable[float],
                now: float) -> bool:
        """``relay`` verified a heartbeat of each of ``ranks`` the matching ``ages`` before
        ``now`` (a ``Liveness`` record that arrived at ``now``): each rank it carries that is
        not dead is seen then (an earlier reading never moves a clock back). True when that
        was every one of ``ranks``.

        The record is also ``relay``'s report at ``now``: it carried every heartbeat the relay
        held, so a rank of it whose deadline had passed by then is silent (:meth:`stale`)."""
        self._reports[relay] = now
        relay_of, dead, last_seen = self._relay_of, self._dead, self._last_seen
        everyone = True
        for rank, age in zip(ranks, ages, strict=True):
            if rank in dead or relay_of.get(rank) is not relay:
                everyone = False  # declared dead (or rejoined elsewhere) since the relay heard
            elif (when := now - age) > last_seen.get(rank, -math.inf):
                last_seen[rank] = when
        return everyone

    def credit_pause(self, relay: M, seconds: float) -> None:
        """The coordinator did not read ``relay`` for ``seconds``: not its ranks' silence, nor
        its own (its clocks move on by that much, the pause is taken out of its timeline)."""
        for r in relay.ranks:
            if r in self._last_seen:
                self._last_seen[r] += seconds
        if relay in self._heard:
            self._heard[relay] += seconds
        if relay in self._reports:
            self._reports[relay] += seconds

    def awaits(self, relay: M) -> bool:
        """The staleness watch waits for ``relay``'s next report (a rank of it is past its
        deadline without evidence yet): wake it when one arrives."""
        return relay in self._awaited

    def stale(self, now: float, timeout: float,
              paused: Callable[[M], bool] = lambda relay: False) -> tuple[list[int], float]:
        """Live ranks stale at ``now`` (ranks on ``paused`` relays excepted), ascending, and
        when to look again (``inf`` when none is watched). Only while running: formation has
        its own deadline.

        A rank is stale once its last heartbeat is ``timeout`` old (its deadline) *and* there
        is evidence that its relay does not hold a newer one (SPEC §4.5): the relay reported
        (a ``Liveness``, which carries every heartbeat it holds) at or after that deadline,
        or sent no record at all for ``timeout``. A relay that never sent a ``Liveness``
        forwards each heartbeat as it comes: its ranks are stale at their deadline. A rank
        past its deadline without evidence is looked at again when its relay's silence
        reaches ``timeout``, or when the relay reports (:meth:`awaits`: the caller wakes the
        watch), so the watch declares it the moment the evidence exists.

        A paused relay's wait is credited to it and its ranks when it ends
        (:meth:`credit_pause`), so their deadlines only move later: they are looked at again
        at their uncredited deadline, or within ``PAUSED_RECHECK`` seconds when that has
        passed. Nobody has to wake the watch when a pause ends (one wake per full channel
        cost a scan of the world per delivered frame).
        """
        self._awaited = set()
        if self._phase != "running":
            return [], math.inf
        overdue: list[int] = []
        next_due = math.inf
        recheck = now + min(timeout, PAUSED_RECHECK)
        last_seen, relay_of, reports = self._last_seen, self._relay_of, self._reports
        for rank in self._live:
            due = last_seen[rank] + timeout
            if due > now:
                if due < next_due:
                    next_due = due
                continue
            relay = relay_of[rank]
            if paused(relay):
                next_due = min(next_due, recheck)
                continue
            reported = reports.get(relay)
            if reported is None or due <= reported:
                overdue.append(rank)
                continue
            silent_until = self._heard.get(relay, -math.inf) + timeout
            if silent_until <= now:
                overdue.append(rank)
            else:  # its relay may still hold a heartbeat of it: its next report tells
                self._awaited.add(relay)
                next_due = min(next_due, silent_until)
        overdue.sort()
        return overdue, next_due

    def failure_reason(self, policy: MaxFailure | None) -> SaveReason | None:
        """Why the run cannot go on under ``policy``, or None while it can. Never while
        forming: an uncovered rank is not lost, and a dead one may still be brought back
        (the policy is applied once formation completes). A share of the world is a share of
        the current world (issue 37: ranks in the cohort, retired ones left out)."""
        if not self._dead or self._phase == "forming":
            return None
        if policy is not None and len(self._dead) >= policy.limit(self.current_world):
            return SaveReason.MAX_FAILURE_EXCEEDED
        if not self._live:
            return SaveReason.ALL_RANKS_LOST
        return None
