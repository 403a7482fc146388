"""The reference scheduler follows an elastic world (issue 37), simulated ranks over the in-memory
network under MockClock: ranks that join get work from the next epoch (after the role, the global
step and, with a process group, a re-formed group of the new size with dense ranks), ranks that
die or are retired mid-epoch hand their remainder over at once, and every epoch is covered exactly
once whenever hosts join, die or are retired."""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings, strategies as st

import flodl_trio as ft
from flodl_trio.events import Note, RankDeclaredDead, RankRejoined, RankRetired, RelayDraining
from flodl_trio.scheduler import SyncScheduler, exactly_once_fraction
from flodl_trio.scheduler._parts import Members
from flodl_trio.sim import SimRecord
from flodl_trio.testing import EventLog, MemoryNetwork
from flodl_trio.wire import Drain, NewNcclSession, StartEpoch

from helpers import COORD, wait_until
from helpers.sims import SimHost, start_sim_host

WORLD = 6


def sims(batch_size: int, batch_ms: float = 10.0, slow: frozenset[int] = frozenset()) -> Any:
    """Simulated ranks' arguments; the ``slow`` ranks take three times as long a batch."""
    return lambda rank: {"batch_size": batch_size, "seed": rank,
                         "batch_ms": batch_ms * (3 if rank in slow else 1)}


def records(hosts: list[SimHost]) -> list[SimRecord]:
    return [sim.record for h in hosts for sim in h.sims.values()]


def assert_covered_exactly_once(scheduler: SyncScheduler, recs: list[SimRecord], total: int,
                                epochs: int) -> None:
    """Every epoch's samples were synced once by somebody, as the scheduler counted them."""
    for epoch in range(epochs):
        counts = Counter(i for rec in recs for i in rec.synced_samples(epoch))
        assert sorted(counts) == list(range(total)), f"epoch {epoch}: samples lost"
        assert max(counts.values()) == 1, f"epoch {epoch}: samples synced twice"
    assert exactly_once_fraction(scheduler.coverage) == 1.0
    assert all(c.exactly_once for c in scheduler.coverage), scheduler.coverage


def config(**kw: Any) -> ft.CoordinatorConfig:
    fields: dict[str, Any] = {"world_size": WORLD, "min_world_size": 2, "join_window": 0.01,
                              "formation_timeout": 60, "heartbeat_timeout": 30, **kw}
    return ft.CoordinatorConfig(**fields)


async def test_a_host_that_joins_mid_epoch_works_from_the_next_one_in_a_regrown_group(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    log = EventLog()
    start = functools.partial(start_sim_host, net=memory_network, salt=salt, world=WORLD,
                              sim_args=sims(2))
    async with trio.open_nursery() as nursery:
        hosts = [start(nursery, host="host-a", ranks=[0, 1])]
        async with ft.open_coordinator(memory_network.listener(COORD), salt=salt,
                                       config=config(), timeline=log) as coord:
            scheduler = SyncScheduler(coord, total_samples=48, batch_size=2, num_epochs=3,
                                      process_group=True, reform_timeout=5)

            async def grow() -> None:
                await wait_until(lambda: any(e == 0 for e, _, _ in
                                             hosts[0].sims[0].record.processed), limit=5)
                hosts.append(start(nursery, host="host-b", ranks=[2, 3, 4]))

            nursery.start_soon(grow)
            summary = await scheduler.run()
            assert coord.current_world == 5
        nursery.cancel_scope.cancel()
    assert summary.epochs_completed == 3 and summary.deaths == {}
    assert_covered_exactly_once(scheduler, records(hosts), 48, 3)
    [joined] = [ev.fields for _, ev in log.of(Note) if ev.what == "ranks_joined"]
    assert joined == {"ranks": [2, 3, 4], "from_epoch": 1}
    started = [ev.fields["ranks"] for _, ev in log.of(Note) if ev.what == "epoch_started"]
    assert started == [[0, 1], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]
    # The group was formed of 2, then re-formed of 5 with dense ranks before epoch 1.
    formed = [ev.fields["ranks"] for _, ev in log.of(Note) if ev.what == "process_group_formed"]
    assert formed == [[0, 1], [0, 1, 2, 3, 4]]
    newcomer = hosts[1].sims[3].record
    [session] = newcomer.of_type(NewNcclSession)
    assert (session.new_rank, session.new_world_size) == (3, 5)
    labels = [type(m).__name__ for m in newcomer.received]
    assert labels.index("NewNcclSession") < labels.index("StartEpoch")
    assert labels.index("SetEpochCallbackRole") < labels.index("StartEpoch")
    assert [m.plan.epoch for m in newcomer.of_type(StartEpoch)] == [1, 2]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_whenever_hosts_join_die_or_are_retired_every_epoch_is_covered_exactly_once(
        data: st.DataObject) -> None:
    batch = data.draw(st.integers(1, 3), label="batch_size")
    total = data.draw(st.integers(24, 60), label="total")
    group = data.draw(st.booleans(), label="process_group")
    retire = data.draw(st.sampled_from(["never", "after", "by hand"]), label="retire")
    # host-a is the world's minimum and stays; host-b and host-c may be there from formation
    # (None) or join later, and may die some time after they joined.
    plan = {host: (data.draw(st.sampled_from([None, 0.02, 0.1, 0.3, 0.6]), label=f"{host} joins"),
                   data.draw(st.sampled_from([None, 0.0, 0.03, 0.1, 0.25]),
                             label=f"{host} leaves after"))
            for host in ("host-b", "host-c")}
    # How a host leaves: killed (then retired or not, as drawn), or drained (it leaves after
    # its current sync and is retired).
    how = {host: data.draw(st.sampled_from(["killed", "drained"]), label=f"{host} leaves")
           for host in plan}
    slow = frozenset(data.draw(st.sets(st.integers(0, 5)), label="slow ranks"))
    ranks = {"host-b": [2, 3], "host-c": [4, 5]}

    async def scenario() -> None:
        net = MemoryNetwork()
        salt = ft.SessionSalt.generate()
        start = functools.partial(start_sim_host, net=net, salt=salt, world=WORLD,
                                  sim_args=sims(batch, slow=slow))
        cfg = config(retire_after=0.05 if retire == "after" else float("inf"))
        async with trio.open_nursery() as nursery:
            hosts = [start(nursery, host="host-a", ranks=[0, 1])]
            hosts += [start(nursery, host=h, ranks=ranks[h]) for h, (join, _) in plan.items()
                      if join is None]
            async with ft.open_coordinator(net.listener(COORD), salt=salt, config=cfg) as coord:
                scheduler = SyncScheduler(coord, total_samples=total, batch_size=batch,
                                          num_epochs=3, process_group=group, reform_timeout=5)

                async def life(host: str, join: float | None, dies: float | None) -> None:
                    if join is not None:
                        await trio.sleep(join)
                        hosts.append(start(nursery, host=host, ranks=ranks[host]))
                    [h] = [h for h in hosts if h.host == host]
                    if dies is None:
                        return
                    await wait_until(lambda: set(h.ranks) <= coord.live_ranks, limit=5)
                    await trio.sleep(dies)
                    if how[host] == "drained":
                        assert h.relay is not None
                        with contextlib.suppress(ft.MembershipError):  # the run ended first
                            await h.relay.drain()
                        return
                    h.kill()
                    if retire == "by hand":
                        await wait_until(lambda: set(h.ranks) <= coord.dead_ranks, limit=5)
                        await coord.retire(h.ranks)

                for host, (join, dies) in plan.items():
                    nursery.start_soon(life, host, join, dies)
                with trio.fail_after(600):
                    summary = await scheduler.run()
            nursery.cancel_scope.cancel()
        assert summary.epochs_completed == 3
        assert_covered_exactly_once(scheduler, records(hosts), total, 3)
        assert set(summary.deaths) <= {r for h, (_, leaves) in plan.items()
                                       if leaves is not None and how[h] == "killed"
                                       for r in ranks[h]}
        # A rank that joined mid-run learned the role and (with a group) its place in the
        # group before its first plan.
        for h in hosts[1:]:
            for sim in h.sims.values():
                labels = [type(m).__name__ for m in sim.record.received]
                if "StartEpoch" not in labels:
                    continue
                first = labels.index("StartEpoch")
                assert "SetEpochCallbackRole" in labels[:first], (h.host, labels)
                if group:
                    assert "NewNcclSession" in labels[:first], (h.host, labels)

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_rank_retired_or_regrown_between_two_looks_is_settled_all_the_same() -> None:
    members = Members()
    members.know({0, 1, 2, 3})
    none: frozenset[int] = frozenset()
    # Rank 2 died and was retired before the scheduler looked: it is gone (retired with dead).
    assert members.newly_gone(frozenset({2}), none, {}) == [2]
    members.leave(2)
    # Rank 3 died, was retired and its id joined again through another host, unseen: only
    # its join count moved. Its old process's share is settled; the new one is joining.
    assert members.newly_gone(none, none, {3: 1}) == [3]
    members.leave(3)
    live = frozenset({0, 1, 3, 4})
    assert members.returned(live) == [3] and members.arrived(live) == [4]
    assert members.survivors(live) == [0, 1] and members.ignores(4)
    # A rank the scheduler never knew, joined and gone again: nothing to settle.
    assert members.newly_gone(frozenset({5}), none, {5: 1}) == []


async def test_a_drained_host_leaves_after_its_sync_and_is_retired_without_a_failure(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    log = EventLog()
    # host-b is slow: host-a finishes each epoch's share first and waits, so the only sync
    # left in an epoch may be the one that closes it (host-b's ranks must still finish).
    start = functools.partial(start_sim_host, net=memory_network, salt=salt, world=WORLD,
                              sim_args=sims(2, slow=frozenset({2, 3})))
    cfg = config(max_failure=ft.MaxFailure.absolute(1))  # one death would stop the run
    async with trio.open_nursery() as nursery:
        hosts = [start(nursery, host="host-a", ranks=[0, 1]),
                 start(nursery, host="host-b", ranks=[2, 3])]
        b = hosts[1]
        async with ft.open_coordinator(memory_network.listener(COORD), salt=salt,
                                       config=cfg, timeline=log) as coord:
            scheduler = SyncScheduler(coord, total_samples=64, batch_size=2, num_epochs=3)

            async def leave() -> None:
                # host-a did its whole share of epoch 1 (8 batches) and waits: host-b's ranks
                # have unsynced batches and no sync comes before they finish theirs.
                a0 = hosts[0].sims
                await wait_until(lambda: sum(e == 1 for e, _, _ in a0[0].record.processed) == 8,
                                 limit=5)
                await trio.sleep(0.05)  # past the last sync host-a's batches allowed
                assert b.relay is not None
                await b.relay.drain("maintenance")
                with pytest.raises(ft.MembershipError) as twice:
                    await b.relay.drain("again")
                assert str(twice.value) == (
                    "relay 'host-b': expected a relay that is not draining, but it drains "
                    "already (maintenance); its ranks leave after their current sync")

            nursery.start_soon(leave)
            summary = await scheduler.run()
            assert coord.retired_ranks == {2, 3} and coord.current_world == 2
            assert coord.failure is None
        await wait_until(lambda: b.done.is_set(), limit=5)
        nursery.cancel_scope.cancel()
    assert summary.epochs_completed == 3 and summary.deaths == {}
    assert_covered_exactly_once(scheduler, records(hosts), 64, 3)
    assert [(ev.host, ev.reason) for ev in log.events_of(RelayDraining)] == [
        ("host-b", "maintenance")]
    assert sorted((ev.rank, ev.reason) for ev in log.events_of(RankRetired)) == [
        (2, "its host 'host-b' left: maintenance"), (3, "its host 'host-b' left: maintenance")]
    assert log.events_of(RankDeclaredDead) == []
    assert isinstance(b.exit, ft.RelayExit) and b.exit.clean
    assert b.exit.reason == "all ranks exited"
    for rank in (2, 3):
        rec = b.sims[rank].record
        assert any(isinstance(m, Drain) and m.reason == "maintenance" for m in rec.received)
        # It left right after a SyncAck: every batch it reported was synced.
        assert rec.synced == rec.processed


async def test_a_host_drained_at_the_minimum_stays_in_the_world_and_comes_back_when_restarted(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    # Found by the nemesis (seed 5): a host drained while the world was at its minimum leaves
    # its ranks exited (never a failure, never retired), and its next Hello was refused for
    # good ("rank 2 exited cleanly and does not rejoin"): the world stayed a host short. In an
    # elastic world the restarted host brings them back, and they get work from the next epoch.
    salt = ft.SessionSalt.generate()
    log = EventLog()
    start = functools.partial(start_sim_host, net=memory_network, salt=salt, world=WORLD,
                              sim_args=sims(2))
    cfg = config(min_world_size=4, max_failure=ft.MaxFailure.absolute(0))  # no death allowed
    async with trio.open_nursery() as nursery:
        hosts = [start(nursery, host="host-a", ranks=[0, 1]),
                 start(nursery, host="host-b", ranks=[2, 3])]
        async with ft.open_coordinator(memory_network.listener(COORD), salt=salt,
                                       config=cfg, timeline=log) as coord:
            scheduler = SyncScheduler(coord, total_samples=64, batch_size=2, num_epochs=4)
            back: list[SimHost] = []

            async def leave_and_come_back() -> None:
                b = hosts[1]
                await wait_until(lambda: b.worked_in(1), limit=10)
                assert b.relay is not None
                await b.relay.drain("maintenance")
                await wait_until(lambda: b.done.is_set(), limit=10)
                assert coord.exited_ranks == {2, 3} and coord.retired_ranks == frozenset()
                assert coord.current_world == 4 and coord.failure is None
                back.append(start(nursery, host="host-b", ranks=[2, 3]))
                await wait_until(lambda: coord.live_ranks == {0, 1, 2, 3}, limit=10)
                assert coord.exited_ranks == frozenset() and coord.rejoins == {2: 1, 3: 1}

            nursery.start_soon(leave_and_come_back)
            summary = await scheduler.run()
            assert coord.failure is None and back and coord.live_ranks == {0, 1, 2, 3}
        nursery.cancel_scope.cancel()
    assert summary.epochs_completed == 4 and summary.deaths == {}
    assert_covered_exactly_once(scheduler, records(hosts + back), 64, 4)
    assert log.events_of(RankRetired) == [] and log.events_of(RankDeclaredDead) == []
    assert sorted((ev.rank, ev.host) for ev in log.events_of(RankRejoined)) == [
        (2, "host-b"), (3, "host-b")]
    assert any(e >= 2 for e, _, _ in back[0].sims[2].record.processed)  # it worked again


async def test_a_relay_that_has_not_joined_has_nothing_to_drain(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    async with ft.open_relay(lambda: memory_network.connect(COORD), salt=salt, host="host-x",
                             ranks=[0], world_size=2,
                             rank_listen=memory_network.listener("relay:host-x")) as relay:
        with pytest.raises(ft.MembershipError) as early:
            await relay.drain()
        assert str(early.value) == ("relay 'host-x': expected a relay that joined the cohort "
                                    "to drain, but it has not joined yet")
        assert relay.draining is None and not relay.joined
