"""The run's membership, as plain data with methods (no trio, no IO; time is passed in).

Which relays joined and which ranks each carries, who is dead (and why), who exited cleanly,
when each rank was last heard from, how many handshakes were rejected and in which phase the
run is. The coordinator's IO modules (formation, readers, liveness, sending) ask and tell this
object; it never waits and never reads a clock, so every rule here is testable without trio.
The liveness rules (deaths, staleness, the failure policy) are in :mod:`._roster_liveness`; an
elastic world's rules (its current size, forming with a range, retiring) in :mod:`._roster_world`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..net._ratelimit import JunkCounter, JunkReport
from ..wire import ranks_text
from ..wire._handshake import WRONG_SALT_HINT
from ._roster_liveness import PAUSED_RECHECK, PHASES, LivenessRules, M, Member
from ._roster_world import WorldRules

__all__ = ["PAUSED_RECHECK", "PHASES", "M", "Member", "Roster", "ranks_text"]


class Roster(WorldRules[M], LivenessRules[M]):
    """Relays, rank → relay, dead ranks (with reasons), exited ranks, last-seen clocks, reject
    counters and the run's phase (``forming``, ``running``, ``shutting_down``, ``closed``)."""

    def __init__(self, world_size: int, *, min_world: int | None = None) -> None:
        self.world_size = world_size  # the largest world: the rank id space
        # Elastic membership (issue 37): the smallest world the run forms with and keeps.
        self.min_world = world_size if min_world is None else min_world
        self._retired: dict[int, str] = {}  # ranks taken out of the world, why, in order
        self._retired_from: dict[int, str] = {}  # their hosts (unknown after an adoption)
        # Insertion-ordered sets (dicts): a 16k-rank world has 2,048 relays, and every Hello
        # asks about them, so nothing here may scan the list per relay.
        self._relays: dict[M, None] = {}
        self._by_host: dict[str, list[M]] = {}
        self._sig_owner: dict[str, tuple[bytes, M]] = {}  # first digest seen per name
        self._relay_of: dict[int, M] = {}
        self._unconfirmed: dict[M, None] = {}  # registered, Ready not yet verified (FT/2)
        self._dead: dict[int, str] = {}
        self._rejoins: dict[int, int] = {}  # rank -> times it came back after a death
        self._joins: dict[int, int] = {}  # rank -> times it joined a running cohort (grew it)
        self._announced: dict[int, str] = {}  # rank -> host of the last relay that covered it
        self._exited: set[int] = set()
        self._last_seen: dict[int, float] = {}
        # Covered, not dead, not exited: kept as it changes, since the staleness watch and
        # every broadcast ask for it and the world can be 16k ranks.
        self._live: set[int] = set()
        # Staleness on evidence (see LivenessRules.stale): per relay, its last record, its
        # last Liveness, and whether the staleness watch waits for its next report.
        self._heard: dict[M, float] = {}
        self._reports: dict[M, float] = {}
        self._awaited: set[M] = set()
        # Junk is counted by reason and reported rate-limited, never one line or event each.
        self._rejects = JunkCounter()
        self._wrong_salt_rejects = 0  # of the rejects, those that look like a salt that differs
        self._invalid_frames = JunkCounter()
        self._phase = "forming"
        self.formed = False  # formation completed once (whatever the phase is now)
        # Called after each change a session store keeps (SPEC §4.7) with the relay it
        # touched: a relay confirmed, rejoined (each relay it took ranks from too) or
        # uncovered, a death or a clean exit (the rank's relay); formation complete (None).
        self.on_change: Callable[[M | None], None] = _unchanged

    def report_changes_to(self, on_change: Callable[[M | None], None]) -> None:
        """Call ``on_change`` after each change a session store keeps (see ``on_change``)."""
        self.on_change = on_change

    # ------------------------------------------------------------------ views

    @property
    def phase(self) -> str:
        return self._phase

    @property
    def forming(self) -> bool:
        return self._phase == "forming"

    @property
    def running(self) -> bool:
        return self._phase == "running"

    @property
    def shutting_down(self) -> bool:
        """True from the start of shutdown on (deaths are no longer declared)."""
        return self._phase in ("shutting_down", "closed")

    @property
    def relays(self) -> tuple[M, ...]:
        """Registered relays, in join order."""
        return tuple(self._relays)

    def connected(self) -> int:
        """How many registered relays are connected now (not lost, not awaiting a resume)."""
        return sum(1 for relay in self._relays if relay.alive)

    def pacing_relays(self) -> int:
        """The relays to pace the heartbeat exchange for: while forming, the relays the world
        will have at the ranks per relay registered so far (at least those registered; O(1),
        as it is asked at every join); then the connected ones."""
        if self._phase == "forming":
            registered, claimed = len(self._relays), len(self._relay_of)
            if not claimed:
                return registered
            return max(registered, -(-registered * self.world_size // claimed))
        return self.connected()

    @property
    def covered(self) -> frozenset[int]:
        """Ranks of relays whose join both sides confirmed (``Ready`` verified)."""
        if not self._unconfirmed:
            return frozenset(self._relay_of)
        waiting = self._unconfirmed
        return frozenset(r for r, relay in self._relay_of.items() if relay not in waiting)

    @property
    def live(self) -> frozenset[int]:
        """Covered ranks that are neither dead nor cleanly exited."""
        return frozenset(self._live)

    @property
    def last_seen(self) -> Mapping[int, float]:
        """When each covered rank was last heard from (trio clock), read-only."""
        return self._last_seen

    def live_of(self, relay: M) -> list[int]:
        """``relay``'s live ranks, ascending."""
        live, relay_of = self._live, self._relay_of
        return [r for r in relay.ranks if r in live and relay_of[r] is relay]

    def carries(self, relay: M, rank: int) -> bool:
        """``rank`` is carried by ``relay`` now (not by a relay that rejoined it since)."""
        return self._relay_of.get(rank) is relay

    @property
    def dead(self) -> dict[int, str]:
        """Dead ranks and why (a copy)."""
        return dict(self._dead)

    @property
    def rejoins(self) -> dict[int, int]:
        """Times each rank came back after being declared dead (a copy)."""
        return dict(self._rejoins)

    @property
    def joins(self) -> dict[int, int]:
        """Times each rank joined the running cohort as a rank it did not cover (an elastic
        world grew; a copy)."""
        return dict(self._joins)

    @property
    def exited(self) -> frozenset[int]:
        return frozenset(self._exited)

    @property
    def rejects(self) -> dict[str, int]:
        """Rejected handshakes by category (a copy)."""
        return self._rejects.by_reason()

    @property
    def invalid_frames(self) -> dict[str, int]:
        """Frames dropped from authenticated relays, by category (a copy)."""
        return self._invalid_frames.by_reason()

    def relay_of(self, rank: int) -> M | None:
        return self._relay_of.get(rank)

    def is_dead(self, rank: int) -> bool:
        return rank in self._dead

    def announced_by(self, rank: int) -> str | None:
        """The host of the last relay whose ``Ready`` verified with ``rank`` (its relay may
        be gone since), or None."""
        return self._announced.get(rank)

    def dead_reason(self, rank: int) -> str | None:
        return self._dead.get(rank)

    def has_exited(self, rank: int) -> bool:
        return rank in self._exited

    def is_registered(self, relay: M) -> bool:
        return relay in self._relays

    # ------------------------------------------------------------------ formation

    def hello_problem(self, host: str, ranks: tuple[int, ...], peer: str, *,
                      world_size: int | None = None,
                      model_sigs: dict[str, bytes] | None = None,
                      rejoin: bool = False) -> str | None:
        """Why an authenticated Hello contradicts the world, or None when it fits.

        ``world_size`` (FT/2) must equal the coordinator's; ``model_sigs`` must agree, name by
        name, with those of every relay registered so far (a host built from another model
        never joins). A rank announced by a relay and declared dead since is not a
        contradiction: the rejoin rules judge it. With ``rejoin`` the ranks' owners are not
        checked here (the rejoin rules are) and the signatures are compared with every
        relay's, the same host's earlier connection included.
        """
        who = f"authenticated Hello from relay {host!r} at {peer}"
        if world_size is not None and world_size != self.world_size:
            return (f"{who}: world_size mismatch: the coordinator's world_size is "
                    f"{self.world_size}, the relay's is {world_size}")
        if model_sigs:
            problem = self._sigs_problem(who, host, model_sigs, same_host_too=rejoin)
            if problem is not None:
                return problem
        if not ranks:
            return f"{who}: expected at least one rank, got an empty rank list"
        if list(ranks) != sorted(ranks):
            return f"{who}: expected ranks in ascending order, got {list(ranks)[:16]}"
        seen: set[int] = set()
        for r in ranks:
            if r in seen:
                return f"{who}: rank {r} is announced twice in one Hello"
            seen.add(r)
            if r >= self.world_size:
                return f"{who}: rank {r} is out of range for world_size {self.world_size}"
            owner = self._relay_of.get(r)
            if owner is not None and not rejoin and r not in self._dead:
                return (f"{who}: rank {r} was already announced by relay {owner.host!r} at "
                        f"{owner.peer}")
        return None

    def _sigs_problem(self, who: str, host: str, sigs: dict[str, bytes], *,
                      same_host_too: bool) -> str | None:
        # Every registered relay agrees with the first digest seen for each name, so comparing
        # with those is comparing with all of them.
        owners = {self._sig_owner[name][1] for name in sigs if name in self._sig_owner}
        for other in owners:
            if other.host == host and not same_host_too:
                continue  # a re-dial of the same relay (during formation) is judged on its own
            theirs = other.model_sigs
            differ = sorted(name for name, digest in sigs.items()
                            if name in theirs and theirs[name] != digest)
            if differ:
                names = ", ".join(repr(n) for n in differ[:8])
                more = f" and {len(differ) - 8} more" if len(differ) > 8 else ""
                return (f"{who}: model signature mismatch: relay {host!r} and relay "
                        f"{other.host!r} at {other.peer} disagree on {names}{more} (expected "
                        f"{theirs[differ[0]].hex()[:16]}... for {differ[0]!r}, got "
                        f"{sigs[differ[0]].hex()[:16]}...)")
        return None

    def same_relay(self, host: str, ranks: tuple[int, ...]) -> list[M]:
        """Registered relays with exactly this host and these ranks (a re-dial replaces them)."""
        return [old for old in self._by_host.get(host, ()) if old.ranks == ranks]

    def relays_of_host(self, host: str) -> tuple[M, ...]:
        """Registered relays of ``host``, in the order they registered."""
        return tuple(self._by_host.get(host, ()))

    def register(self, relay: M, now: float) -> None:
        """Reserve ``relay``'s ranks; formation waits for :meth:`confirm` (its ``Ready``)."""
        self._relays[relay] = None
        self._by_host.setdefault(relay.host, []).append(relay)
        self._unconfirmed[relay] = None
        for name, digest in relay.model_sigs.items():
            self._sig_owner.setdefault(name, (digest, relay))
        self._heard[relay] = now
        for r in relay.ranks:
            self._relay_of[r] = relay
            self._last_seen[r] = now

    def confirm(self, relay: M) -> bool:
        """``relay``'s ``Ready`` verified (FT/2: both sides know it joined); True when this
        completes coverage."""
        self._unconfirmed.pop(relay, None)
        for r in relay.ranks:
            if self._relay_of.get(r) is not relay:
                continue
            self._announced[r] = relay.host
            if r not in self._dead and r not in self._exited:
                self._live.add(r)
        self.on_change(relay)
        return self.complete

    @property
    def complete(self) -> bool:
        """Every rank covered by a relay whose ``Ready`` verified, still forming."""
        return (self._phase == "forming" and len(self._relay_of) == self.world_size
                and not self._unconfirmed)

    def unregister(self, relay: M) -> None:
        """Forget ``relay``: the ranks it still carries are uncovered again."""
        if self._relays.pop(relay, 0) is None:  # it was registered
            same_host = self._by_host[relay.host]
            same_host.remove(relay)
            if not same_host:
                del self._by_host[relay.host]
            if any(owner is relay for _, owner in self._sig_owner.values()):
                self._sig_owner = {}
                for other in self._relays:
                    for name, digest in other.model_sigs.items():
                        self._sig_owner.setdefault(name, (digest, other))
        self._unconfirmed.pop(relay, None)
        self._heard.pop(relay, None)
        self._reports.pop(relay, None)
        self._awaited.discard(relay)
        for r in relay.ranks:
            if self._relay_of.get(r) is relay:
                del self._relay_of[r]
                self._last_seen.pop(r, None)
                self._live.discard(r)
        self.on_change(relay)

    def rejoin(self, relay: M, now: float) -> tuple[dict[int, str | None], list[M]]:
        """After formation, ``relay`` (its ``Ready`` verified) carries its ranks again: they are
        live on it from ``now`` (during formation too: a dead rank brought back, an uncovered
        one covered). Returns each rank's previous host (None: never covered) and
        the relays that no longer carry any rank, which leave the roster."""
        self._relays[relay] = None
        self._by_host.setdefault(relay.host, []).append(relay)
        for name, digest in relay.model_sigs.items():
            self._sig_owner.setdefault(name, (digest, relay))
        self._heard[relay] = now
        previous: dict[int, str | None] = {}
        before: dict[M, None] = {}
        for r in relay.ranks:
            old = self._relay_of.get(r)
            previous[r] = self._announced.get(r) if old is None else old.host
            if old is None and self._phase == "running":
                self._joins[r] = self._joins.get(r, 0) + 1
            if old is not None and old is not relay:
                before[old] = None
            self._relay_of[r] = relay
            self._retired.pop(r, None)  # a retired rank's id joined again: the world grew
            self._retired_from.pop(r, None)
            if self._dead.pop(r, None) is not None or r in self._exited:
                self._exited.discard(r)  # an elastic world's rank that left comes back
                self._rejoins[r] = self._rejoins.get(r, 0) + 1
            self._last_seen[r] = now
            self._live.add(r)
            self._announced[r] = relay.host
        dropped = [old for old in before if not any(self._relay_of.get(r) is old
                                                     for r in old.ranks)]
        for old in dropped:
            self.unregister(old)
        for old in before:  # the relays it took ranks from (some of them, or all)
            self.on_change(old)
        self.on_change(relay)
        return previous, dropped

    def reject(self, category: str, detail: str, now: float, *, wrong_salt: bool = False
               ) -> JunkReport | None:
        """Count one rejected handshake; a report when one is due (rate-limited).
        ``wrong_salt``: it looks like a relay whose session salt differs (counted apart, for
        :meth:`coverage_text`)."""
        self._wrong_salt_rejects += wrong_salt
        return self._rejects.add(category, detail, now)

    def invalid_frame(self, category: str, detail: str, now: float) -> JunkReport | None:
        """Count one frame dropped from an authenticated relay; a report when one is due."""
        return self._invalid_frames.add(category, detail, now)

    def rejects_tail(self, now: float) -> JunkReport | None:
        """A summary of the rejects not reported yet (for the end of formation)."""
        return self._rejects.flush(now, force=True)

    def invalid_frames_tail(self, now: float) -> JunkReport | None:
        """A summary of the invalid frames not reported yet (for shutdown)."""
        return self._invalid_frames.flush(now, force=True)

    def coverage_text(self, headline: str) -> str:
        """``headline`` with the c/W coverage, the hosts that joined and the rejects."""
        joined = ", ".join(f"{c.host} {ranks_text(c.ranks)}" for c in self._relays
                           if c not in self._unconfirmed) or "none"
        if self._unconfirmed:
            joined += "; awaiting Ready from: " + ", ".join(c.host for c in self._unconfirmed)
        salt = self._wrong_salt_rejects
        # Hung up on our Challenge, or a Hello that failed its MAC: what a relay does whose
        # salt differs.
        hint = f" ({salt} like a relay with another salt: {WRONG_SALT_HINT})" if salt else ""
        world = (f"{self.world_size}" if self.min_world == self.world_size else
                 f"{self.min_world} (the minimum of a world of {self.min_world} to "
                 f"{self.world_size})")
        return (
            f"{headline}: {len(self.covered)}/{world} ranks covered; hosts joined: "
            f"{joined}; rejected connections: {self._rejects.summary()}{hint}"
        )

    def start_running(self, now: float) -> None:
        """Formation is complete: staleness counts from ``now`` for every rank (and every
        relay's silence). A rank left uncovered (an elastic world formed without it) was
        never in the cohort: any host may grow into it, whoever announced it before."""
        self._phase = "running"
        self.formed = True
        for r in [r for r in self._announced if r not in self._relay_of]:
            del self._announced[r]
        for r in self._relay_of:
            self._last_seen[r] = now
        for relay in self._relays:
            self._heard[relay] = now
        self.on_change(None)

    def begin_shutdown(self) -> None:
        self._phase = "shutting_down"

    def close(self) -> None:
        self._phase = "closed"

    def carried(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """``(host, ranks)`` of every registered relay whose join is confirmed, in join order,
        with only the ranks it still carries (what a session store keeps as the roster)."""
        out = []
        for relay in self._relays:
            if relay in self._unconfirmed:
                continue
            ranks = tuple(r for r in relay.ranks if self._relay_of.get(r) is relay)
            if ranks:
                out.append((relay.host, ranks))
        return tuple(out)

    def cohort_sigs(self) -> dict[str, bytes]:
        """The model signatures the registered relays agree on (name -> digest)."""
        return {name: digest for name, (digest, _) in self._sig_owner.items()}

    def state_fields(self) -> dict[str, Any]:
        """The membership part of the status document (SPEC §7)."""
        return {
            "phase": self._phase,
            "world_size": self.world_size,
            "covered": len(self._relay_of),
            "relays": [
                {"host": c.host, "ranks": list(c.ranks), "peer": c.peer, "connected": c.alive}
                for c in self._relays
            ],
            "live": sorted(self.live),
            "dead": [{"rank": r, "reason": why} for r, why in sorted(self._dead.items())],
            "exited": sorted(self._exited),
            "rejoins": {str(r): n for r, n in sorted(self._rejoins.items())},
            **self.world_fields(),
        }


def _unchanged(relay: object) -> None:
    """The default :attr:`Roster.on_change`: nothing keeps the changes."""
