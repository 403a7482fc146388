"""The reference scheduler and a host that comes back (issue 26), with simulated ranks over the
in-memory transport under MockClock: the rejoined ranks get work from the next epoch, the
process group is re-formed with them before it, every epoch is covered exactly once, and a host
that flaps does not count against ``max_failure`` once it is back."""

from __future__ import annotations

import functools
from typing import Any

import trio

import flodl_trio as ft
from flodl_trio.events import Note, RankRejoined
from flodl_trio.scheduler import SyncScheduler
from flodl_trio.scheduler._parts import Members
from flodl_trio.testing import EventLog, MemoryNetwork

from helpers import COORD, wait_until
from helpers.sims import SimHost, batches, start_sim_host

BATCH = 4
SAMPLES = 64


def start(nursery: trio.Nursery, net: MemoryNetwork, host: str, ranks: list[int],
          salt: ft.SessionSalt) -> SimHost:
    return start_sim_host(nursery, net, host, ranks, salt=salt, world=4, sim_args=batches(BATCH))


def _worked_in(h: SimHost, epoch: int) -> bool:
    return h.worked_in(epoch)


def notes(log: EventLog, what: str) -> list[tuple[float, dict[str, Any]]]:
    return [(t, ev.fields) for t, ev in log.of(Note) if ev.what == what]


async def test_rejoined_ranks_work_from_the_next_epoch_in_a_reformed_group_covering_once(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    log = EventLog()
    # host-a flaps twice (4 deaths in all) under max_failure 3: only ranks *currently* dead
    # count, so the run goes on.
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=60, heartbeat_timeout=30,
                               max_failure=ft.MaxFailure.absolute(3))
    async with trio.open_nursery() as nursery:
        incarnations = [start(nursery, memory_network, "host-a", [0, 1], salt)]
        b = start(nursery, memory_network, "host-b", [2, 3], salt)
        async with ft.open_coordinator(memory_network.listener(COORD), salt=salt, config=cfg,
                                       timeline=log) as coord:
            scheduler = SyncScheduler(coord, total_samples=SAMPLES, batch_size=BATCH,
                                      num_epochs=4, process_group=True, reform_timeout=5)

            async def flap() -> None:
                for epoch in (1, 2):  # mid epoch: host-a dies with work left, then comes back
                    a = incarnations[-1]
                    await wait_until(functools.partial(_worked_in, a, epoch), limit=60)
                    a.scope.cancel()
                    await a.done.wait()
                    await wait_until(lambda: coord.dead_ranks == {0, 1}, limit=5)
                    await trio.sleep(0.1)
                    incarnations.append(start(nursery, memory_network, "host-a", [0, 1], salt))
                    await wait_until(lambda: coord.live_ranks == {0, 1, 2, 3}, limit=3)

            nursery.start_soon(flap)
            summary = await scheduler.run()
            assert coord.rejoins == {0: 2, 1: 2}
        await wait_until(lambda: b.done.is_set() and incarnations[-1].done.is_set(), limit=10)
        nursery.cancel_scope.cancel()

    assert summary.epochs_completed == 4
    assert all(c.exact for c in scheduler.coverage), scheduler.coverage
    assert summary.deaths == {}  # alive again: nothing counts against max_failure
    assert [ev for _, ev in log.of(RankRejoined)] == [
        RankRejoined(rank=r, host="host-a") for r in (0, 1, 0, 1)]
    # Each incarnation got no work in the epoch it came back in, work from the next one, and
    # learned the role and the process group before its first StartEpoch.
    joined = [f for _, f in notes(log, "ranks_rejoined")]
    assert [f["ranks"] for f in joined] == [[0, 1], [0, 1]]
    for h, f in zip(incarnations[1:], joined, strict=True):
        started = [m.plan.epoch for m in h.records[0].of_type(ft.wire.StartEpoch)]
        assert started and started[0] == f["from_epoch"]
        labels = [type(m).__name__ for m in h.records[0].received]
        assert labels.index("SetEpochCallbackRole") < labels.index("StartEpoch")
        assert labels.index("NewNcclSession") < labels.index("StartEpoch")
    assert [m.plan.epoch for m in incarnations[2].records[1].of_type(ft.wire.StartEpoch)] == [3]
    # The group was re-formed after each death (without host-a) and again with it.
    formed = [f["ranks"] for _, f in notes(log, "process_group_formed")]
    assert formed == [[0, 1, 2, 3], [2, 3], [0, 1, 2, 3], [2, 3], [0, 1, 2, 3]]
    # Every sample of every epoch was processed by somebody (the dead incarnations' reported
    # batches, the survivors' extensions, the rejoined ranks).
    for epoch in range(4):
        seen = {i for h in (*incarnations, b) for rec in h.records.values()
                for i in rec.samples(epoch)}
        assert seen == set(range(SAMPLES)), epoch
    assert isinstance(incarnations[-1].exit, ft.RelayExit) and incarnations[-1].exit.clean


def test_a_rank_that_died_and_came_back_unseen_is_settled_then_works_from_the_next_epoch() -> None:
    members = Members()
    live = frozenset({0, 1, 2, 3})
    members.know(live)
    assert members.newly_gone(frozenset(), frozenset(), {}) == []
    # Rank 1 died and was back before the scheduler looked: only its rejoin count moved.
    assert members.newly_gone(frozenset(), frozenset(), {1: 1}) == [1]
    members.leave(1)
    assert members.survivors(live) == [0, 2, 3]
    assert members.returned(live) == [1]
    assert members.ignores(1) and members.survivors(live) == [0, 2, 3]
    assert members.newly_gone(frozenset(), frozenset(), {1: 1}) == []  # already settled
    assert members.take_joiners(live) == [1]
    assert members.survivors(live) == [0, 1, 2, 3] and not members.ignores(1)
    # A joining rank that dies again before its epoch leaves without a share.
    assert members.newly_gone(frozenset({2}), frozenset(), {1: 1}) == [2]
    members.leave(2)
    assert members.returned(frozenset({0, 1, 3})) == []
    assert members.survivors(frozenset({0, 1, 3})) == [0, 1, 3]


async def test_ranks_that_came_back_take_the_epoch_over_when_every_member_of_it_died(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    """Issue 35's nemesis: host-a died mid-epoch and came back (its ranks joining from the next
    epoch), then host-b, the last member of the epoch, died too: the scheduler raised
    ``ClusterFailure(ALL_RANKS_LOST)`` with two live ranks. The ranks that came back now take the
    epoch's remainder over (a plan, then extensions) and the run completes, every epoch covered
    exactly once."""
    salt = ft.SessionSalt.generate()
    log = EventLog()
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=60, heartbeat_timeout=30)
    async with trio.open_nursery() as nursery:
        a = start(nursery, memory_network, "host-a", [0, 1], salt)
        b = start(nursery, memory_network, "host-b", [2, 3], salt)
        async with ft.open_coordinator(memory_network.listener(COORD), salt=salt, config=cfg,
                                       timeline=log) as coord:
            scheduler = SyncScheduler(coord, total_samples=SAMPLES, batch_size=BATCH,
                                      num_epochs=3)
            back: list[SimHost] = []

            async def both_die_in_turn() -> None:
                await wait_until(functools.partial(_worked_in, a, 1), limit=60)
                a.scope.cancel()
                await a.done.wait()
                await wait_until(lambda: coord.dead_ranks == {0, 1}, limit=5)
                back.append(start(nursery, memory_network, "host-a", [0, 1], salt))
                await wait_until(lambda: coord.live_ranks == {0, 1, 2, 3}, limit=3)
                b.scope.cancel()  # the last member of epoch 1 dies before it closed
                await b.done.wait()

            nursery.start_soon(both_die_in_turn)
            summary = await scheduler.run()
        nursery.cancel_scope.cancel()

    assert summary.epochs_completed == 3
    assert all(c.exact for c in scheduler.coverage), scheduler.coverage
    assert set(summary.deaths) == {2, 3}
    # The ranks that came back worked in epoch 1 (the one whose members all died) and after.
    started = [m.plan.epoch for m in back[0].records[0].of_type(ft.wire.StartEpoch)]
    assert started == [1, 2], started
    for epoch in range(3):
        seen = {i for h in (a, b, *back) for rec in h.records.values()
                for i in rec.samples(epoch)}
        assert seen == set(range(SAMPLES)), epoch
