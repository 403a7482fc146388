"""Retiring ranks from an elastic world (issue 37, docs/elastic.rst): a rank that is gone for
good stops counting in the world and against ``max_failure``, and nobody waits for it.

Three ways in, one rule: ``coord.retire(ranks)`` (the orchestrator), ``retire_after`` (a rank
dead that long; :meth:`Retirement.watch`) and a host that left on purpose (its ranks exited
after a drain: :meth:`Retirement.retire_exited`). A rank is retired only if it is dead or exited,
and only while the world keeps its minimum; below it nothing is retired, the ranks stay dead,
and the failure policy decides as it would in a fixed world (the watch says so once per rank).
A retired rank's id may join again later: the world grows (row 12 of :mod:`._admission`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any, Final, Protocol

import trio

from .._config import CoordinatorConfig
from .._errors import ConfigError, LeadershipLost, MembershipError, StoreUnavailable
from ..events import RankRetired, RelayDraining
from ..timeline import Timeline
from ._relayconn import RelayConn
from ._roster import Roster
from .liveness import Liveness

log = logging.getLogger("flodl_trio.coordinator")
DRAINS_LISTED: Final = 32


class Durability(Protocol):
    """The coordinator's session store, as far as a drained host's end needs it."""

    @property
    def durable(self) -> bool: ...

    async def flush(self) -> None: ...


class Retirement:
    """Takes ranks out of an elastic world (see the module doc)."""

    def __init__(self, *, roster: Roster[RelayConn], liveness: Liveness,
                 config: CoordinatorConfig, timeline: Timeline) -> None:
        self._roster = roster
        self._liveness = liveness
        self._config = config
        self._timeline = timeline
        self._held: set[int] = set()  # due, kept at the minimum: said once each
        self._draining: dict[RelayConn, str] = {}  # relays whose host leaves, and why

    def checked(self, ranks: Iterable[int] | int) -> tuple[int, ...]:
        """``ranks`` as a sorted tuple of rank ids of this world.

        Raises:
            ConfigError: not a rank id (an int in ``[0, world_size)``) or an iterable of them.
        """
        items = [ranks] if isinstance(ranks, int) else list(ranks)
        world = self._roster.world_size
        bad = [r for r in items if isinstance(r, bool) or not isinstance(r, int)
               or not 0 <= r < world]
        if bad or not items:
            got = repr(bad[0]) if bad else "no rank"
            raise ConfigError(f"retire: expected rank ids in [0, {world}), got {got}")
        return tuple(sorted(set(items)))

    def retire(self, ranks: tuple[int, ...], reason: str) -> None:
        """Retire every one of ``ranks`` now, or none.

        Raises:
            MembershipError: one is live, not in the world or retired already, or the world
                would drop below its minimum (the message says which).
        """
        problem = self._roster.retire_problem(ranks)
        if problem is not None:
            raise MembershipError(f"retire: {problem}")
        for rank in ranks:
            self._retire_one(rank, reason)

    def retire_exited(self, ranks: Iterable[int], reason: str) -> list[int]:
        """Retire those of ``ranks`` that exited cleanly (a drained host's), as far as the
        world's minimum allows; returns the ones retired."""
        done: list[int] = []
        for rank in ranks:
            if (self._roster.has_exited(rank) and rank not in self._roster.retired
                    and self._roster.retire_problem((rank,)) is None):
                self._retire_one(rank, reason)
                done.append(rank)
        return done

    def draining(self, conn: RelayConn, reason: str) -> None:
        """``conn``'s host leaves on purpose (its ``Draining`` record): its ranks that exited
        already are retired now, the others as they exit (:meth:`exited`)."""
        if conn in self._draining:
            log.info("%s: Draining again (%s); ignored", conn.describe(), reason)
            return
        self._draining[conn] = reason
        ranks = tuple(r for r in conn.ranks if self._roster.carries(conn, r))
        log.warning("%s: its host leaves (%s); ranks %s finish their current sync and exit",
                    conn.describe(), reason, list(ranks))
        self._timeline.event(RelayDraining(host=conn.host, ranks=ranks, reason=reason))
        self.retire_exited(ranks, self._drained(conn))

    def exited(self, conn: RelayConn, rank: int) -> None:
        """``rank`` of ``conn`` exited cleanly: retired if its host is leaving."""
        if conn in self._draining:
            self.retire_exited((rank,), self._drained(conn))

    def left(self, conn: RelayConn) -> bool:
        """``conn``'s host drained and every rank it carried has exited (retired, or kept
        exited at the world's minimum)."""
        roster = self._roster
        return conn in self._draining and all(
            roster.has_exited(r) or not roster.carries(conn, r) for r in conn.ranks)

    async def confirm_left(self, conn: RelayConn, store: Durability) -> None:
        """``conn`` (:meth:`left`) ended its side: with a session ``store``, once the session
        as it is now -- its ranks retired -- is durable (within ``shutdown_grace``), say
        ``Goodbye`` and close, so that its relay ends knowing that the next leader will not
        wait for its ranks. Without a store, or when the write fails (deposed: nothing is
        said), nothing: the relay then tells the coordinator that leads next (see
        ``Pump._tell_again``), and that one retires them."""
        if not store.durable:
            return
        grace = self._config.shutdown_grace
        with trio.move_on_after(grace):
            try:
                await store.flush()
            except (LeadershipLost, StoreUnavailable) as exc:
                log.info("%s left; its end is not confirmed: %s", conn.describe(), exc)
                return
            conn.retire(self._drained(conn), grace)

    def draining_ranks(self) -> frozenset[int]:
        """Ranks whose host is leaving on purpose and that are still carried by it."""
        return frozenset(r for conn, _ in self._draining.items() for r in conn.ranks
                         if self._roster.carries(conn, r))

    def drains(self) -> tuple[int, list[dict[str, Any]]]:
        """How many relays said ``Draining`` in this run, and the last :data:`DRAINS_LISTED`
        of them (host, ranks, reason), oldest first: the status document's, so a watcher
        that looked before and after a drain that ended in between still sees it."""
        told = list(self._draining.items())[-DRAINS_LISTED:]
        return len(self._draining), [{"host": conn.host, "ranks": list(conn.ranks),
                                      "reason": why} for conn, why in told]

    def _drained(self, conn: RelayConn) -> str:
        return f"its host {conn.host!r} left: {self._draining[conn]}"

    def _retire_one(self, rank: int, reason: str) -> None:
        self._held.discard(rank)
        relay = self._roster.retire(rank, reason)
        world = self._roster.current_world
        log.warning("rank %d (host %s) retired: %s; the world is %d ranks (%d..%d)", rank,
                    relay.host, reason, world, self._roster.min_world, self._roster.world_size)
        self._timeline.event(RankRetired(rank=rank, host=relay.host, reason=reason,
                                         world=world))

    async def watch(self) -> None:
        """``retire_after``: retire each rank dead that long, oldest death first, as long as
        the world keeps its minimum; wakes at the next due or at a new death."""
        after = self._config.retire_after
        while True:
            roster, liveness = self._roster, self._liveness
            next_due = math.inf
            if roster.running and liveness.failure is None:
                now = trio.current_time()
                for rank in sorted(roster.dead, key=liveness.died_at):
                    due = liveness.died_at(rank) + after
                    if due > now:
                        next_due = min(next_due, due)
                    elif roster.retire_problem((rank,)) is None:
                        self._retire_one(rank, f"dead for {after:g}s (retire_after): "
                                               f"{roster.dead_reason(rank)}")
                    elif rank not in self._held:
                        self._held.add(rank)
                        log.warning("rank %d has been dead for %gs but is not retired: the "
                                    "world is at its minimum of %d ranks; the failure policy "
                                    "decides (it counts as dead)", rank, after,
                                    roster.min_world)
                self._held &= set(roster.dead)
            with trio.move_on_at(next_due):
                await liveness.next_change()  # a death, or a join that makes room
