"""The nemesis's fault kinds, its seeded schedule, and how each fault is injected and healed.

A schedule is drawn from the seed alone (:func:`plan`): when each fault starts (seconds after
the cluster formed), its kind, how long it lasts and a draw that picks its target when it starts
(the etcd leader or a follower, the leading coordinator or the standby, a host, a rank). Faults on
different targets overlap; at most one cluster-wide fault (coordinator, etcd) runs at a time and
the next one waits ``SETTLE_S`` after it healed (a takeover in progress is not a fault of its
own); at most ``hosts_down`` hosts (2 by default, ``--max-hosts-down``) are under a fault at
once, so the run never loses all its ranks (the failure policy's limit, which the schedule does
not mean to reach). A drained host counts among them until it joined again, which keeps the
elastic world at or above its MIN (:class:`~_nemesis_layout.Layout`); the spare host a
``host-join`` starts is a target of its own, drawn again only once its last drain ended.

Each kind says whether the documented deadlines make its target's ranks die (``kills``): the
checker accepts a death only inside the window of a fault that may cause it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trio
from _nemesis_actions import ACTIONS
from _nemesis_cluster import Cluster
from _nemesis_layout import Timings

SETTLE_S = 6.0       # after a cluster-wide fault healed, before the next one
WAIT_FOR_TARGET_S = 30.0  # a fault whose target is busy waits this long, then is skipped


@attrs.frozen(kw_only=True)
class Kind:
    """A kind of fault.

    Attributes:
        name: how ``--kinds`` / ``--exclude`` and the history name it.
        scope: ``cluster`` (a coordinator or etcd), ``host`` (a relay or its link), ``rank``,
            or ``spare`` (the host that is not started with the run).
        seconds: the range its duration is drawn from (a function of the timings).
        weight: how often the schedule draws it.
        kills: the docs say its target's ranks die (or may die) of it.
        what: one line for the docs and the report.
    """

    name: str
    scope: str
    seconds: Callable[[Timings], tuple[float, float]]
    weight: float
    kills: bool
    what: str


KINDS: tuple[Kind, ...] = (
    Kind(name="coord-kill", scope="cluster", seconds=lambda t: (0.5, 2.0), weight=2,
         kills=False, what="SIGKILL a coordinator (the leader 3 times in 4), restarted as the "
         "next standby after the duration"),
    Kind(name="coord-stop", scope="cluster",
         seconds=lambda t: (1.5 * t.lease_ttl, min(2.5 * t.lease_ttl, 0.8 * t.coord_liveness)),
         weight=2, kills=False, what="SIGSTOP the leader longer than its lease, shorter than "
         "the relays' coord_liveness_timeout, then SIGCONT: it must step down unheard"),
    Kind(name="coord-stop-long", scope="cluster",
         seconds=lambda t: (t.coord_liveness + 1.5, t.coord_liveness + 4.0), weight=1,
         kills=False, what="SIGSTOP the leader past the relays' and ranks' "
         "coord_liveness_timeout, then SIGCONT"),
    Kind(name="etcd-kill", scope="cluster", seconds=lambda t: (2.0, 5.0), weight=2,
         kills=False, what="SIGKILL one etcd member (the etcd leader one time in two), "
         "restart it after the duration (quorum kept)"),
    Kind(name="etcd-quorum", scope="cluster",
         seconds=lambda t: (3.0, max(3.5, t.grace / 2 - 4.0)), weight=1, kills=False,
         what="SIGKILL two etcd members (quorum lost) for less than the relays' grace, then "
         "restart them"),
    Kind(name="relay-kill", scope="host", seconds=lambda t: (1.0, 3.0), weight=2, kills=True,
         what="SIGKILL a relay; its host (relay and ranks) restarts after the duration"),
    Kind(name="relay-stop", scope="host",
         seconds=lambda t: (1.0, max(1.5, t.heartbeat_timeout / 2 - 1.0)), weight=2,
         kills=False, what="SIGSTOP a relay shorter than heartbeat_timeout (less the two "
         "intervals a healthy rank can look stale), then SIGCONT: nobody may die"),
    Kind(name="link-stall", scope="host",
         seconds=lambda t: (1.0, max(1.5, t.heartbeat_timeout / 2 - 1.0)), weight=2,
         kills=False, what="stall a relay's upstream both ways (the chaos proxy drips 1 byte/s) "
         "shorter than heartbeat_timeout: nobody may die"),
    Kind(name="link-stall-long", scope="host",
         seconds=lambda t: (t.heartbeat_timeout + 2.0, t.grace - 6.0), weight=1, kills=True,
         what="stall a relay's upstream past heartbeat_timeout, within the relay's grace: its "
         "ranks are declared dead, the relay resumes and they rejoin"),
    Kind(name="link-stall-past-grace", scope="host",
         seconds=lambda t: (t.grace + 2.0, t.grace + 5.0), weight=0.5, kills=True,
         what="stall a relay's upstream past the relay's grace: the relay gives up, its host "
         "restarts once the link heals"),
    Kind(name="link-cut", scope="host", seconds=lambda t: (1.0, t.grace / 4), weight=2,
         kills=True, what="cut a relay's upstream (RST, new connections reset) within the "
         "grace: its ranks are declared dead at the loss, the relay resumes, they rejoin"),
    Kind(name="link-cut-past-grace", scope="host",
         seconds=lambda t: (t.grace + 2.0, t.grace + 5.0), weight=0.5, kills=True,
         what="cut a relay's upstream past its grace: the relay gives up, its host restarts "
         "once the link heals"),
    Kind(name="rank-kill", scope="rank", seconds=lambda t: (0.5, 2.0), weight=2, kills=True,
         what="SIGKILL a rank process, start it again after the duration"),
    Kind(name="host-drain", scope="host", seconds=lambda t: (2.0, 6.0), weight=2, kills=False,
         what="SIGTERM a relay: it drains (its ranks leave after their sync, retired, exit 0); "
         "after the duration its host starts again and its ranks join anew"),
    Kind(name="host-join", scope="spare", seconds=lambda t: (6.0, 15.0), weight=2, kills=False,
         what="start the spare host (ranks 8-9): it joins the running cohort; when the fault "
         "heals it is drained (SIGTERM) and its ranks are retired"),
)
BY_NAME = {k.name: k for k in KINDS}
LEAVES = frozenset({"host-drain"})  # kinds whose host's ranks leave the world (retired)


@attrs.frozen(kw_only=True)
class Planned:
    """One fault of the schedule (target chosen when it starts, from ``draw``)."""

    index: int
    kind: str
    at: float
    seconds: float
    draw: float


def select(kinds: str | None, exclude: str | None) -> list[Kind]:
    """The kinds ``--kinds`` names (all by default) less those ``--exclude`` names.

    Raises:
        ValueError: a name that is not a kind (the message lists them).
    """
    names = [n.strip() for n in (kinds or ",".join(BY_NAME)).split(",") if n.strip()]
    dropped = {n.strip() for n in (exclude or "").split(",") if n.strip()}
    unknown = sorted((set(names) | dropped) - set(BY_NAME))
    if unknown:
        raise ValueError(f"unknown fault kind(s) {', '.join(unknown)}; expected some of "
                         f"{', '.join(BY_NAME)}")
    chosen = [BY_NAME[n] for n in dict.fromkeys(names) if n not in dropped]
    if not chosen:
        raise ValueError("no fault kind left after --kinds / --exclude")
    return chosen


def plan(seed: int, window: float, kinds: Sequence[Kind], timings: Timings, *,
         gap: tuple[float, float] = (2.0, 4.0)) -> list[Planned]:
    """The schedule of a run: faults from 0 to ``window`` seconds, drawn from ``seed`` only."""
    rng = random.Random(seed)
    out: list[Planned] = []
    at = rng.uniform(*gap)
    # Every kind once early in the run (in a seeded order), then weighted draws: a short run
    # still meets every kind it was given.
    first = rng.sample(list(kinds), len(kinds))
    while at < window:
        kind = first.pop() if first else rng.choices(kinds, [k.weight for k in kinds])[0]
        low, high = kind.seconds(timings)
        out.append(Planned(index=len(out), kind=kind.name, at=round(at, 3),
                           seconds=round(rng.uniform(low, high), 3), draw=rng.random()))
        at += rng.uniform(*gap)
    return out


class Nemesis:
    """Runs a schedule against a cluster: each fault in a task of its own, at its time."""

    def __init__(self, cluster: Cluster, schedule: Sequence[Planned],
                 record: Callable[..., None], *, hosts_down: int = 2) -> None:
        self.cluster = cluster
        self.hosts_down = hosts_down
        self.schedule = list(schedule)
        self.record = record
        self.busy: set[str] = set()
        self.settled_at = 0.0  # trio clock: when the next cluster-wide fault may start
        self.drained: set[str] = set()  # hosts a drain took out, until they are back
        self.injected: list[dict[str, Any]] = []
        self.skipped: list[Planned] = []

    async def run(self, stop: trio.Event) -> None:
        """Start each fault at its time until the schedule ends or ``stop`` is set; then wait
        (bounded) for the faults in progress to heal."""
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for fault in self.schedule:
                with trio.move_on_at(start + fault.at):
                    await stop.wait()
                if stop.is_set():
                    break
                nursery.start_soon(self._one, fault, stop)

    async def _one(self, fault: Planned, stop: trio.Event) -> None:
        kind = BY_NAME[fault.kind]
        target = None
        with trio.move_on_after(WAIT_FOR_TARGET_S):
            while not stop.is_set():
                target = self._claim(kind, fault.draw)
                if target is not None:
                    break
                await trio.sleep(0.2)
        if target is None or stop.is_set():
            if target is not None:
                self.busy.discard(target)
            self.skipped.append(fault)
            self.record("fault_skipped", index=fault.index, kind=fault.kind)
            return
        try:
            await self._inject(kind, fault, target, stop)
        finally:
            if (kind.kills or kind.name in LEAVES) and kind.scope != "cluster":
                # Its ranks died: the host is down until a fresh look at the leader counts
                # them live again (a stale status, e.g. while the leader is stopped, must not
                # let the schedule take one more host than --max-hosts-down allows).
                self.cluster.mark_recovering(target)
            self.busy.discard(target)
            if kind.scope == "cluster":
                self.settled_at = trio.current_time() + SETTLE_S

    def _claim(self, kind: Kind, draw: float) -> str | None:
        """A free target for ``kind`` (marked busy), or None while there is none."""
        hosts = self.cluster.layout.host_names
        if kind.scope == "spare":
            spares = [s for s in self.cluster.layout.spare_names
                      if s not in self.busy and self.cluster.host_gone(s)]
            if not spares:
                return None
            spare = spares[int(draw * len(spares))]
            self.busy.add(spare)
            return spare
        if kind.scope == "cluster":
            if "cluster" in self.busy or trio.current_time() < self.settled_at:
                return None
            self.busy.add("cluster")
            return "cluster"
        # A host is down while a fault holds it and until the leader counts its ranks live
        # again: the schedule never takes more hosts than that at once (every rank lost is the
        # failure policy's limit, which it does not mean to reach).
        down = {h for h in hosts if h in self.busy or not self.cluster.host_recovered(h)}
        free = [h for h in hosts if h not in down]
        if len(down) >= self.hosts_down or not free:
            return None
        self.drained = {h for h in self.drained if h in self.busy
                        or not self.cluster.host_recovered(h)}
        if kind.name in LEAVES and len(self.drained) >= self.cluster.layout.drains_at_once:
            return None  # one more would take the elastic world below its MIN
        host = free[int(draw * len(free))]
        self.busy.add(host)
        if kind.name in LEAVES:
            self.drained.add(host)
        return host

    async def _inject(self, kind: Kind, fault: Planned, claimed: str, stop: trio.Event) -> None:
        act = ACTIONS[kind.name]
        entry: dict[str, Any] = {"index": fault.index, "kind": kind.name,
                                 "seconds": fault.seconds, "kills": kind.kills}
        heal = await act(self.cluster, entry, claimed, fault.draw)
        entry["start"] = time.time()
        self.record("fault", **entry)
        self.injected.append(entry)
        with trio.move_on_after(fault.seconds):
            await stop.wait()
        with trio.CancelScope(shield=True):
            await heal()
        entry["end"] = time.time()
        self.record("heal", index=fault.index, kind=kind.name, target=entry.get("target"),
                    start=entry["start"], end=entry["end"], ranks=entry.get("ranks", []))
