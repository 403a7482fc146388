"""Staleness judged on evidence (SPEC §4.5, issue 34 item 8).

A rank is stale once its last heartbeat is ``heartbeat_timeout`` old *and* its relay reported
(a ``Liveness``) since that deadline without a newer one, or sent nothing for
``heartbeat_timeout``. First the rule itself: the coordinator's roster fed by the relay's real
coalescing (``Heartbeats``) and a model of the staleness watch, over intervals, timeouts and
phases drawn by hypothesis, in integer milliseconds so that every comparison is exact; then
whole clusters on ``MockClock`` whose healthy ranks the old rule declared dead.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator

import attrs
import pytest
import trio
from hypothesis import given, settings, strategies as st

import flodl_trio as ft
from flodl_trio.coordinator._roster import Roster
from flodl_trio.events import RankDeclaredDead
from flodl_trio.relay._liveness import Heartbeats
from flodl_trio.testing import EventLog, MemoryNetwork, open_local_cluster
from flodl_trio.wire import Liveness

from helpers import Recorder, wait_until
from helpers.board import FakeRelay


@attrs.frozen
class RelayPlan:
    """One relay: its own interval, the coordinator's Cadence (0: none; else slower than
    its interval), the first tick, and its ranks' (interval, first beat)."""

    interval: int
    cadence: int
    first_tick: int
    ranks: tuple[tuple[int, int], ...]

    @property
    def period(self) -> int:
        """Seconds (ms) between two ticks: what the relay reports at."""
        return max(self.interval, self.cadence)


@attrs.frozen
class Plan:
    timeout: int
    relays: tuple[RelayPlan, ...]
    beats_first: bool  # at one instant, the ranks' beats reach the relay before its tick
    pause: tuple[int, int, int] | None  # (relay, from, to): the coordinator does not read it


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    """Any intervals below the timeout (so their sums can be well over it), any phases."""
    timeout = draw(st.integers(200, 4000))
    low = max(1, timeout // 16)  # at most ~16 beats or ticks per timeout: the runs stay short
    relays = []
    for _ in range(draw(st.integers(1, 2))):
        interval = draw(st.integers(low, timeout - 1))
        paced = draw(st.booleans()) and interval < timeout - 1
        cadence = draw(st.integers(interval + 1, timeout - 1)) if paced else 0
        period = max(interval, cadence)
        ranks = []
        for _ in range(draw(st.integers(1, 3))):
            every = draw(st.integers(low, timeout - 1))
            ranks.append((every, draw(st.integers(0, every - 1))))
        relays.append(RelayPlan(interval, cadence, draw(st.integers(0, period - 1)),
                                tuple(ranks)))
    pause = None
    if draw(st.booleans()):
        start = draw(st.integers(0, 6 * timeout))
        pause = (draw(st.integers(0, len(relays) - 1)), start,
                 start + draw(st.integers(1, 3 * timeout)))
    return Plan(timeout, tuple(relays), draw(st.booleans()), pause)


@attrs.define
class Run:
    """The relays (their real ``Heartbeats``) and the coordinator's roster on one clock, with
    the staleness watch as ``Liveness.staleness_watch`` runs it: it looks at the deadline
    ``Roster.stale`` gave, or when a report it waits for arrives (``Roster.awaits``)."""

    plan: Plan
    roster: Roster[FakeRelay] = attrs.field(init=False)
    relays: list[FakeRelay] = attrs.field(init=False)
    beats: list[Heartbeats] = attrs.field(init=False)
    queue: list[tuple[int, int, int, int]] = attrs.Factory(list)  # (time, order, kind, index)
    last_beat: dict[int, int] = attrs.Factory(dict)  # rank -> when its relay verified it
    last_record: dict[int, int] = attrs.Factory(dict)  # relay -> when its last record came
    silent: dict[int, int] = attrs.Factory(dict)  # rank -> from when it no longer beats
    frozen: dict[int, int] = attrs.Factory(dict)  # relay -> from when it sends nothing
    held: list[tuple[int, Liveness]] = attrs.Factory(list)  # sent while its reader is paused
    declared: dict[int, int] = attrs.Factory(dict)  # rank -> when the watch declared it
    watch_at: float = 0.0
    seq: int = 0

    def __attrs_post_init__(self) -> None:
        plan, rank = self.plan, 0
        self.roster = Roster(sum(len(relay.ranks) for relay in plan.relays))
        self.relays, self.beats = [], []
        for x, relay in enumerate(plan.relays):
            fake = FakeRelay(f"host-{x}", tuple(range(rank, rank + len(relay.ranks))))
            self.relays.append(fake)
            self.roster.register(fake, 0.0)
            self.roster.confirm(fake)
            beats = Heartbeats(float(relay.interval))
            if relay.cadence:
                beats.follow(float(relay.cadence))
            self.beats.append(beats)
            self.push(relay.first_tick, 1, x)
            for _, first in relay.ranks:
                self.push(first, 0, rank)
                rank += 1
        self.roster.start_running(0.0)
        self.look(0)

    def push(self, when: int, kind: int, index: int) -> None:
        order = kind if self.plan.beats_first else 1 - kind
        self.seq += 1
        heapq.heappush(self.queue, (when, order, self.seq, kind * 10_000 + index))

    def relay_of(self, rank: int) -> int:
        return next(x for x, relay in enumerate(self.relays) if rank in relay.ranks)

    def plan_of(self, rank: int) -> tuple[int, int]:
        x = self.relay_of(rank)
        return self.plan.relays[x].ranks[self.relays[x].ranks.index(rank)]

    def paused(self, x: int, now: int) -> bool:
        pause = self.plan.pause
        return pause is not None and pause[0] == x and pause[1] <= now < pause[2]

    def look(self, now: int) -> None:
        """The staleness watch looks at ``now``."""
        overdue, next_due = self.roster.stale(
            float(now), float(self.plan.timeout),
            lambda relay: self.paused(self.relays.index(relay), now))
        for rank in overdue:
            assert self.roster.mark_dead(rank, "stale")
            self.declared[rank] = now
        self.watch_at = next_due

    def deliver(self, x: int, msg: Liveness, now: int) -> None:
        """A record of relay ``x`` read at ``now`` (as ``Readers.act_on`` applies it)."""
        if self.paused(x, now):
            self.held.append((x, msg))
            return
        relay = self.relays[x]
        woken = self.roster.awaits(relay)
        self.roster.seen_by(relay, msg.ranks, msg.ages, float(now))
        self.roster.heard(relay, float(now))
        self.last_record[x] = now
        if woken:
            self.look(now)

    def unpause(self, now: int) -> None:
        """The reader's wait ends: the pause is credited, the records behind it are read."""
        assert self.plan.pause is not None
        x, start, end = self.plan.pause
        self.roster.credit_pause(self.relays[x], float(end - start))
        held, self.held = self.held, []
        for _, msg in held:
            self.deliver(x, msg, now)

    def step(self, when: int, code: int) -> None:
        kind, index = divmod(code, 10_000)
        if kind == 1:  # relay ``index`` ticks
            if index in self.frozen and when >= self.frozen[index]:
                return
            self.deliver(index, self.beats[index].tick(float(when)), when)
            self.push(when + self.plan.relays[index].period, 1, index)
            return
        rank, x = index, self.relay_of(index)
        if rank in self.silent and when >= self.silent[rank]:
            return
        if x in self.frozen and when >= self.frozen[x]:
            return
        beats = self.beats[x]
        if beats.due_before(rank, heartbeat=True):  # as the pump's rank reader does
            pending = beats.take(float(when))
            assert pending is not None
            self.deliver(x, pending, when)
        beats.record(rank, 0, float(when))
        self.last_beat[rank] = when
        self.push(when + self.plan_of(rank)[0], 0, rank)

    def run(self, until: int) -> None:
        pause = self.plan.pause
        unpaused = pause is None
        for _ in range(100_000):
            when = self.queue[0][0] if self.queue else math.inf  # all frozen or silent
            if not unpaused and pause is not None and pause[2] <= min(when, self.watch_at):
                unpaused = True
                self.unpause(pause[2])
                continue
            if self.watch_at <= when:  # the watch's deadline first at a tie: the worst case
                if self.watch_at > until:
                    return
                self.look(int(self.watch_at))
                continue
            if when > until:
                return
            assert isinstance(when, int)
            _, _, _, code = heapq.heappop(self.queue)
            self.step(when, code)
        raise AssertionError("the run did not reach its end within 100,000 steps")


def all_ranks(run: Run) -> Iterator[int]:
    return (rank for relay in run.relays for rank in relay.ranks)


@settings(max_examples=100, deadline=None)
@given(plans())
def test_a_healthy_rank_is_never_declared_dead_whatever_the_intervals_and_phases(
        plan: Plan) -> None:
    run = Run(plan)
    run.run(12 * plan.timeout)
    assert run.declared == {}
    assert run.roster.live == frozenset(all_ranks(run))


@settings(max_examples=100, deadline=None)
@given(plans(), st.data())
def test_a_rank_silent_behind_a_live_relay_is_declared_within_one_report_interval(
        plan: Plan, data: st.DataObject) -> None:
    run = Run(attrs.evolve(plan, pause=None))
    rank = data.draw(st.sampled_from(list(all_ranks(run))))
    run.silent[rank] = data.draw(st.integers(plan.timeout, 4 * plan.timeout))
    run.run(8 * plan.timeout)
    period = plan.relays[run.relay_of(rank)].period
    last = run.last_beat[rank]
    # Never before its deadline (the old rule's instant), at most one report interval later.
    assert run.declared.keys() == {rank}
    assert last + plan.timeout <= run.declared[rank] <= last + plan.timeout + period


@settings(max_examples=100, deadline=None)
@given(plans(), st.data())
def test_a_frozen_relays_ranks_are_declared_heartbeat_timeout_after_its_last_record(
        plan: Plan, data: st.DataObject) -> None:
    run = Run(attrs.evolve(plan, pause=None))
    x = data.draw(st.integers(0, len(run.relays) - 1))
    frozen_at = run.frozen[x] = data.draw(st.integers(plan.timeout, 4 * plan.timeout))
    run.run(8 * plan.timeout)
    last = run.last_record[x]
    # Its last record came less than a period before it froze; the watch declares its ranks
    # at that record's instant plus heartbeat_timeout exactly: never after the freeze plus
    # heartbeat_timeout, as fast as before.
    assert frozen_at - plan.relays[x].period <= last < frozen_at
    assert run.declared == {rank: last + plan.timeout for rank in run.relays[x].ranks}


# ------------------------------------------------------------------ the rule, by hand


def test_the_evidence_a_rank_past_its_deadline_waits_for() -> None:
    a, b = FakeRelay("a", (0, 1)), FakeRelay("b", (2,))
    roster: Roster[FakeRelay] = Roster(3)
    for relay in (a, b):
        roster.register(relay, 0.0)
        roster.confirm(relay)
    roster.start_running(0.0)
    # b never sent a Liveness: it forwards its rank's heartbeats, nothing is held back, and
    # rank 2 is stale at its deadline, as before.
    roster.seen_by(a, (0, 1), (0.5, 0.5), 1.0)
    roster.heard(a, 1.0)
    assert roster.stale(10.0, 10.0) == ([2], 10.5)
    # Rank 0's deadline (10.5) passes; a's last report (1.0) was before it: a may hold a newer
    # heartbeat. Looked at again when a has been silent for the timeout, or when it reports.
    assert roster.stale(10.6, 10.0) == ([2], 11.0)
    assert roster.awaits(a) and not roster.awaits(b)
    roster.seen_by(a, (1,), (0.0,), 10.7)  # a report that names rank 1 only
    roster.heard(a, 10.7)
    assert roster.stale(10.7, 10.0) == ([0, 2], 20.7)
    assert not roster.awaits(a)


def test_a_pause_is_credited_to_the_relays_silence_too() -> None:
    a = FakeRelay("a", (0,))
    roster: Roster[FakeRelay] = Roster(1)
    roster.register(a, 0.0)
    roster.confirm(a)
    roster.start_running(0.0)
    roster.seen_by(a, (0,), (0.0,), 1.0)
    roster.heard(a, 1.0)
    # The coordinator did not read a from 1 s to 9 s: neither its rank nor a was silent then.
    assert roster.stale(5.0, 3.0, lambda relay: True) == ([], 6.0)
    roster.credit_pause(a, 8.0)
    assert roster.stale(11.0, 3.0) == ([], 12.0)  # uncredited, both were due at 4 s
    roster.heard(a, 11.5)  # a record that is no report (another rank's frame, a RankExit)
    assert roster.stale(12.0, 3.0) == ([], 14.5) and roster.awaits(a)
    roster.seen_by(a, (), (), 13.0)  # its idle tick: it holds no heartbeat of rank 0
    roster.heard(a, 13.0)
    assert roster.stale(13.0, 3.0) == ([0], math.inf)


# ------------------------------------------------------------------------ whole clusters


@pytest.mark.parametrize("rank_interval", [1.0, 1.5, 1.9])
async def test_healthy_ranks_at_default_intervals_live_with_a_two_second_timeout(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork,
        rank_interval: float) -> None:
    # Ranks and relays at 1 s, heartbeat_timeout 2 s: the last heartbeat the coordinator knew
    # of could be 2 s old just before a report, and the old rule declared every rank dead
    # (a ClusterFailure within seconds). Rank 0 beats slower still: up to 2.9 s stale.
    log = EventLog()
    cfg = ft.CoordinatorConfig(world_size=3, heartbeat_timeout=2.0, formation_timeout=30)

    async def rank_main(ep: ft.RankEndpoint) -> None:
        async for _ in ep:
            pass

    async with open_local_cluster({"host-a": [0], "host-b": [1, 2]}, network=memory_network,
                                  coord_config=cfg, timeline=log, rank_main=rank_main,
                                  rank_configs={0: ft.RankConfig(
                                      heartbeat_interval=rank_interval)}) as c:
        await trio.sleep(60)
        assert log.of(RankDeclaredDead) == []
        assert c.coord.live_ranks == {0, 1, 2}


async def test_a_silent_rank_is_declared_within_a_report_interval_while_its_healthy_peer_lives(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    log = EventLog()
    rec = Recorder(raw={1: 1.0})  # rank 1 beats every second, by hand, until it falls silent
    cfg = ft.CoordinatorConfig(world_size=3, heartbeat_timeout=2.0, formation_timeout=30)
    async with open_local_cluster({"host-a": [0], "host-b": [1, 2]}, network=memory_network,
                                  coord_config=cfg, timeline=log, rank_main=rec,
                                  raw_ranks=rec.raw_mains) as c:
        await trio.sleep(10.4)
        silent_since = rec.raw[1].go_silent()
        await wait_until(lambda: 1 in c.coord.dead_ranks, limit=10)
        ((declared_at, event),) = log.of(RankDeclaredDead)
        # Its relay reports every second (relay heartbeat_interval): declared at the first
        # report after 2 s of silence.
        assert silent_since + 2 <= declared_at <= silent_since + 2 + 1
        assert event == RankDeclaredDead(rank=1, host="host-b", reason="heartbeat stale (>2s)")
        await trio.sleep(20)
        assert c.coord.live_ranks == {0, 2}
