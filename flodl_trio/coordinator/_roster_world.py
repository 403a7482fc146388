"""An elastic world's rules (issue 37; a mixin of :class:`._roster.Roster`): how many ranks are
in the cohort now, when a range may form, and retiring ranks from it. Plain data, no trio, no IO.

The world's maximum is ``world_size`` (the rank id space); ``min_world`` its minimum (equal for a
fixed world). A retired rank is out of the world: not covered, not dead, not awaited, announced by
no host, so its id may join again (grow) through any relay.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Generic

from ..wire import ranks_text
from ._roster_liveness import M


class WorldRules(Generic[M]):
    """The current world, the range and retirement, over the roster's state."""

    world_size: int
    min_world: int
    _phase: str
    _relay_of: dict[int, M]
    _unconfirmed: dict[M, None]
    _dead: dict[int, str]
    _exited: set[int]
    _last_seen: dict[int, float]
    _live: set[int]
    _announced: dict[int, str]
    _retired: dict[int, str]
    _retired_from: dict[int, str]
    _joins: dict[int, int]
    on_change: Callable[[M | None], None]

    def unregister(self, relay: M) -> None:
        raise NotImplementedError  # the roster's

    @property
    def current_world(self) -> int:
        """Ranks in the cohort: covered, live or dead-and-awaited or exited; retired ranks
        and ranks never covered are not."""
        return len(self._relay_of) - sum(1 for relay in self._unconfirmed
                                         for r in relay.ranks if self._relay_of.get(r) is relay)

    @property
    def retired(self) -> tuple[int, ...]:
        """Ranks retired from the world and not back since, in the order they were."""
        return tuple(self._retired)

    def restore_world(self, min_world: int, retired: Mapping[int, str]) -> None:
        """An adopted session's range and retired ranks (SPEC §4.7: a failover keeps them)."""
        self.min_world = min_world
        self._retired = dict(retired)

    def retired_reason(self, rank: int) -> str | None:
        return self._retired.get(rank)

    def retired_host(self, rank: int) -> str | None:
        """The host ``rank`` was retired from (None: not retired, or retired before this
        coordinator adopted the session)."""
        return self._retired_from.get(rank)

    def world_fields(self) -> dict[str, Any]:
        """The elastic part of the status document: the range and the cohort's size now,
        the retired ranks (and each one's host and reason), and how many times each rank
        joined the running cohort (``status --watch`` prints a line when a count moves)."""
        return {
            "world": {"min": self.min_world, "max": self.world_size,
                      "current": self.current_world},
            "retired": sorted(self._retired),
            "retirements": [{"rank": r, "host": self._retired_from.get(r), "reason": why}
                            for r, why in sorted(self._retired.items())],
            "joins": {str(r): n for r, n in sorted(self._joins.items())},
        }

    def retire_problem(self, ranks: tuple[int, ...]) -> str | None:
        """Why ``ranks`` cannot be retired now (all or none), or None: each must be in the
        running cohort and not live (dead, or exited cleanly), and the world must keep its
        minimum."""
        if self._phase != "running":
            return (f"expected a running cohort to retire ranks from, but the coordinator is "
                    f"{self._phase.replace('_', ' ')}")
        for rank in ranks:
            owner = self._relay_of.get(rank)
            if rank in self._retired:
                return f"rank {rank} was retired already ({self._retired[rank]})"
            if owner is None:
                return (f"expected a rank of the cohort, but rank {rank} is not in the world "
                        f"(it never joined; the world is {self.current_world} ranks)")
            if rank in self._live:
                return (f"expected a dead or exited rank, but rank {rank} is alive on relay "
                        f"{owner.host!r} at {owner.peer} (drain its host to retire it)")
        after = self.current_world - len(set(ranks))
        if after < self.min_world:
            return (f"retiring rank(s) {ranks_text(sorted(set(ranks)))} would leave "
                    f"{after} ranks, below the world's minimum of {self.min_world} (it has "
                    f"{self.current_world}); the failure policy decides about dead ranks there")
        return None

    def retire(self, rank: int, reason: str) -> M:
        """Take ``rank`` (dead or exited; :meth:`retire_problem` said so) out of the world:
        it no longer counts, nobody waits for it, and its id may join again (grow). Returns
        the relay that carried it; a relay left carrying nothing leaves the roster."""
        owner = self._relay_of.pop(rank)
        self._dead.pop(rank, None)
        self._exited.discard(rank)
        self._live.discard(rank)
        self._last_seen.pop(rank, None)
        self._announced.pop(rank, None)  # an id nobody holds: any host may grow into it
        self._retired[rank] = reason
        self._retired_from[rank] = owner.host
        if not any(self._relay_of.get(r) is owner for r in owner.ranks):
            self.unregister(owner)
        else:
            self.on_change(owner)
        return owner

    @property
    def quorate(self) -> bool:
        """Forming, at least the world's minimum covered, and no relay waiting for its
        ``Ready``: an elastic world may form (once its join window passed)."""
        return (self._phase == "forming" and not self._unconfirmed
                and len(self._relay_of) >= self.min_world)
