"""Waking up (issue 37): a host frozen past ``heartbeat_timeout`` is declared dead and fenced;
when it resumes, its relay (``rejoin_when_fenced``) joins again with a fresh ``Hello`` and brings
back its ranks, which were never restarted: they work again from the next epoch, and every epoch
is covered exactly once. Without the setting the host ends as before; a wake-up the coordinator
refuses (a spare took the ranks over) ends the relay with the refusal, and its ranks hear why.

Simulated ranks over the in-memory network under MockClock; the frozen host is
``helpers.frozen.Freeze`` gating the relay's upstream and the ranks' links, as ``SIGSTOP`` does.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import trio
import trio.testing

import flodl_trio as ft
from flodl_trio.events import Note, RankDeclaredDead, RankRejoined, RankTakenOver
from flodl_trio.scheduler import SyncScheduler
from flodl_trio.sim import SimRecord
from flodl_trio.testing import EventLog, MemoryNetwork
from flodl_trio.wire import Readmitted, StartEpoch

from helpers import COORD, wait_until
from helpers.frozen import Freeze
from helpers.sims import SimHost, start_sim_host

WORLD = 4
TOTAL = 512  # an epoch lasts longer than the freeze
HEARTBEAT_TIMEOUT = 3.0
FROZEN_FOR = HEARTBEAT_TIMEOUT + 3.0  # past heartbeat_timeout, within every other deadline
WAKE = {"relay_config": ft.RelayConfig(rejoin_when_fenced=True),
        "rank_config": ft.RankConfig(rejoin_when_fenced=True)}


def sims(rank: int) -> dict[str, Any]:
    return {"batch_size": 2, "batch_ms": 50.0, "seed": rank}


def starter(net: MemoryNetwork, salt: ft.SessionSalt) -> Any:
    """``start(nursery, host=..., ranks=..., ...)``: a host of simulated ranks of this world."""
    return functools.partial(start_sim_host, net=net, salt=salt, world=WORLD, sim_args=sims)


def config(**kw: Any) -> ft.CoordinatorConfig:
    return ft.CoordinatorConfig(world_size=WORLD, heartbeat_timeout=HEARTBEAT_TIMEOUT, **kw)


async def freeze_once_working(host: SimHost, freeze: Freeze) -> None:
    """Freeze ``host`` once it works in epoch 0 (as SIGSTOP), for ``FROZEN_FOR`` seconds."""
    await wait_until(lambda: host.worked_in(0), limit=30)
    freeze.freeze()
    await trio.sleep(FROZEN_FOR)
    freeze.thaw()
    await freeze.run_closes()


def assert_covered_exactly_once(scheduler: SyncScheduler, recs: list[SimRecord], total: int,
                                epochs: range) -> None:
    """Every epoch of ``epochs`` was synced once by somebody, as the scheduler counted it."""
    for epoch in epochs:
        counts = Counter(i for rec in recs for i in rec.synced_samples(epoch))
        assert sorted(counts) == list(range(total)), f"epoch {epoch}: samples lost"
        assert max(counts.values()) == 1, f"epoch {epoch}: samples synced twice"
    assert all(c.exactly_once for c in scheduler.coverage), scheduler.coverage


async def test_a_frozen_host_declared_dead_rejoins_when_it_wakes_and_works_from_the_next_epoch(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    log = EventLog()
    freeze = Freeze()
    start = starter(memory_network, salt)
    async with trio.open_nursery() as nursery:
        a = start(nursery, host="host-a", ranks=[0, 1])
        b = start(nursery, host="host-b", ranks=[2, 3], freeze=freeze, **WAKE)
        async with ft.open_coordinator(memory_network.listener(COORD), salt=salt,
                                       config=config(), timeline=log) as coord:
            scheduler = SyncScheduler(coord, total_samples=TOTAL, batch_size=2, num_epochs=4)
            nursery.start_soon(freeze_once_working, b, freeze)
            summary = await scheduler.run()
            assert coord.rejoins == {2: 1, 3: 1}
            assert coord.live_ranks == {0, 1, 2, 3}
        nursery.cancel_scope.cancel()
    assert summary.epochs_completed == 4
    deaths = log.events_of(RankDeclaredDead)
    assert [(d.rank, d.reason) for d in deaths] == [(2, "heartbeat stale (>3s)"),
                                                     (3, "heartbeat stale (>3s)")]
    assert sorted(ev.rank for ev in log.events_of(RankRejoined)) == [2, 3]
    # The same relay and rank processes: never restarted, the relay joined again once.
    assert b.relay is not None and b.relay.wakeups == 1 and not b.relay.fenced
    for rank in (2, 3):
        sim = b.sims[rank]
        assert sim.endpoint.readmissions == 1 and sim.endpoint.fenced is None
        labels = [type(m).__name__ for m in sim.record.received]
        assert labels.count("Readmitted") == 1
        back = labels.index("Readmitted")
        [readmitted] = sim.record.of_type(Readmitted)
        assert (readmitted.host, readmitted.reason) == ("host-b", "heartbeat stale (>3s)")
        # Work again from the next epoch, after the role and the global step.
        later = [m.plan.epoch for m in sim.record.received[back:] if isinstance(m, StartEpoch)]
        assert later and later == list(range(later[0], 4)) and later[0] >= 1
        assert labels.index("SetEpochCallbackRole", back) < labels.index("StartEpoch", back)
    # Every epoch covered exactly once: the scheduler's count, and what the ranks synced in
    # the epochs the woken ranks took part in whole (in the epoch they froze in, a SyncAck the
    # relay dropped after the fence is one the rank believes in; the scheduler settled it).
    recs = [s.record for h in (a, b) for s in h.sims.values()]
    assert_covered_exactly_once(scheduler, recs, TOTAL, range(1, 4))
    started = [ev.fields["ranks"] for _, ev in log.of(Note) if ev.what == "epoch_started"]
    assert started[0] == [0, 1, 2, 3] and started[-1] == [0, 1, 2, 3]


async def test_without_rejoin_when_fenced_a_frozen_host_ends_as_before(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    freeze = Freeze()
    start = starter(memory_network, salt)
    async with trio.open_nursery() as nursery:
        start(nursery, host="host-a", ranks=[0, 1])
        b = start(nursery, host="host-b", ranks=[2, 3], freeze=freeze)
        async with ft.open_coordinator(memory_network.listener(COORD), salt=salt,
                                       config=config()) as coord:
            scheduler = SyncScheduler(coord, total_samples=TOTAL, batch_size=2, num_epochs=3)
            nursery.start_soon(freeze_once_working, b, freeze)
            summary = await scheduler.run()
            await wait_until(b.done.is_set, limit=30)
            assert coord.rejoins == {} and coord.dead_ranks == {2, 3}
        nursery.cancel_scope.cancel()
    assert summary.epochs_completed == 3
    assert b.exit == ft.RelayExit("coordinator said Goodbye: every rank on it was declared dead",
                                  True)
    for rank in (2, 3):
        outcome = b.outcomes[rank]
        assert isinstance(outcome, ft.RankEvicted), outcome
        assert outcome.reason == "heartbeat stale (>3s)"


async def test_a_wake_up_refused_because_a_spare_took_the_ranks_over_ends_with_the_refusal(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    log = EventLog()
    freeze = Freeze()
    start = starter(memory_network, salt)
    async with trio.open_nursery() as nursery:
        start(nursery, host="host-a", ranks=[0, 1])
        b = start(nursery, host="host-b", ranks=[2, 3], freeze=freeze, **WAKE)
        async with ft.open_coordinator(memory_network.listener(COORD), salt=salt,
                                       config=config(allow_rank_takeover=True),
                                       timeline=log) as coord:
            scheduler = SyncScheduler(coord, total_samples=TOTAL, batch_size=2, num_epochs=3)
            hosts: list[SimHost] = []

            async def freeze_and_replace() -> None:
                await wait_until(lambda: b.worked_in(0), limit=30)
                freeze.freeze()
                await wait_until(lambda: coord.dead_ranks == {2, 3}, limit=30)
                hosts.append(start(nursery, host="host-s", ranks=[2, 3]))  # takes 2, 3 over
                await wait_until(lambda: coord.live_ranks == {0, 1, 2, 3}, limit=30)
                freeze.thaw()
                await freeze.run_closes()

            nursery.start_soon(freeze_and_replace)
            summary = await scheduler.run()
            await wait_until(b.done.is_set, limit=30)
        nursery.cancel_scope.cancel()
    assert summary.epochs_completed == 3
    assert sorted(ev.rank for ev in log.events_of(RankTakenOver)) == [2, 3]
    error = b.exit
    assert isinstance(error, ft.JoinRefused), error
    assert "rank 2 is alive on relay 'host-s'" in error.reason, error.reason
    assert b.relay is not None and b.relay.wakeups == 0
    for rank in (2, 3):
        outcome = b.outcomes[rank]
        assert isinstance(outcome, ft.RankEvicted), outcome
        assert "relay 'host-b' gave up: its ranks were fenced (heartbeat stale (>3s)) and its " \
            "wake-up failed" in str(outcome), outcome
    [spare] = hosts
    assert spare.relay is not None and spare.relay.wakeups == 0
