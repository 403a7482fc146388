"""A frozen leader must not kill the ranks (issue 34): relays that dial through the session store
watch the leader it publishes, and move to a standby that took over as soon as it answers a
``Resume`` with a newer generation -- seconds after the freeze, not after
``coord_liveness_timeout`` -- and never on a stale read.

The leader is frozen as by ``SIGSTOP`` (tests/helpers/frozen.py: nothing it sends leaves, nothing it
closes closes, its store lease is not renewed); real coordinators, relays and ranks over the
in-memory network under MockClock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.events import RankDeclaredDead
from flodl_trio.relay import StoreDialer
from flodl_trio.store import MemoryStore
from flodl_trio.testing import EventLog, MemoryNetwork

from helpers import HostRun, start_host, wait_until
from helpers.durable_peer import accept_leg
from helpers.frozen import Freeze, FrozenListener, FrozenStore, publish_once_leading

ROSTER = (("host-a", (0, 1)), ("host-b", (2, 3)))
LEASE_TTL = 2.0  # an etcd lease at its default TTL: the standby leads this long after the freeze


def store_dialer(store: MemoryStore, net: MemoryNetwork) -> StoreDialer:
    """A relay's view of the store; a published ``(name, n)`` is dialed as ``name``."""
    async def connect(host: str, port: int) -> trio.abc.Stream:
        return await net.connect(host)
    return StoreDialer(store.clone(), connect=connect)


def relay_of(host: HostRun) -> ft.Relay:
    assert host.relay is not None
    return host.relay


def plain_dialer(store: MemoryStore, net: MemoryNetwork) -> Any:
    """A callable that reads the store on each attempt: the relay cannot watch it."""
    view = store.clone()

    async def dial() -> trio.abc.Stream:
        found = await view.resolve_address()
        if not found:
            raise ConnectionRefusedError("no leader yet")
        return await net.connect(found[0][0])
    return dial


async def drain_host(host: HostRun) -> None:
    """``host`` leaves on purpose: its relay drains, and each of its ranks is told."""
    await relay_of(host).drain("maintenance")
    await wait_until(lambda: all(any(isinstance(m, wire.Drain) for m in run.received)
                                 for run in host.ranks.values()), limit=10)


async def lead_until_deposed(net: MemoryNetwork, salt: ft.SessionSalt, cfg: ft.CoordinatorConfig,
                             store: MemoryStore, freeze: Freeze, leader: list[Any]) -> None:
    """The leader on ``coord-1``, frozen by ``freeze``; ``leader`` gets it, then how it ended.
    Its timers ran while it was stopped: once thawed it finds every rank stale
    (ClusterFailure) or its leadership gone (LeadershipLost); either way it ends, and what it
    says on the way reaches nobody."""
    try:
        async with ft.open_coordinator(
                FrozenListener(net.listener("coord-1"), freeze), salt=salt, config=cfg,
                store=FrozenStore(store, freeze), timeline=EventLog()) as coord:
            leader.append(coord)
            await trio.sleep_forever()
    except (ft.LeadershipLost, ft.ClusterFailure) as exc:
        leader.append(exc)


async def stand_by(net: MemoryNetwork, salt: ft.SessionSalt, cfg: ft.CoordinatorConfig,
                   handle: MemoryStore, standby: list[ft.Coordinator], log: EventLog,
                   done: trio.Event) -> None:
    """The standby on ``coord-2``: it leads once the leader's lease runs out, until ``done``."""
    async with ft.open_coordinator(net.listener("coord-2"), salt=salt, config=cfg,
                                   store=handle, timeline=log) as coord:
        standby.append(coord)
        await done.wait()



@attrs.define(eq=False)
class LeaderAndStandby:
    """A leader (frozen by ``freeze``) running the ROSTER's hosts, and its standby waiting."""

    salt: ft.SessionSalt
    store: MemoryStore
    handle: MemoryStore  # the standby's handle on the store
    freeze: Freeze
    hosts: list[HostRun]
    leader: list[Any]  # the leader, then how it ended
    standby: list[ft.Coordinator]
    standby_log: EventLog
    done: trio.Event  # the standby's block ends


async def leader_and_standby(nursery: trio.Nursery, net: MemoryNetwork,
                             cfg: ft.CoordinatorConfig, dialer: Any) -> LeaderAndStandby:
    """The leader on ``coord-1`` with the ROSTER's hosts (each dialing ``dialer(store, net)``),
    then its standby on ``coord-2``, 5 s into the run."""
    salt = ft.SessionSalt.generate()
    store = MemoryStore(name="run1")
    freeze = Freeze()
    leader: list[Any] = []
    nursery.start_soon(lead_until_deposed, net, salt, cfg, store, freeze, leader)
    await publish_once_leading(store, ("coord-1", 1))
    hosts = [await start_host(nursery, net, host, ranks, salt=salt, world=4,
                              target=dialer(store, net)) for host, ranks in ROSTER]
    await wait_until(lambda: leader, limit=60)
    pair = LeaderAndStandby(salt, store, store.clone(), freeze, hosts, leader, [], EventLog(),
                            trio.Event())
    nursery.start_soon(stand_by, net, salt, cfg, pair.handle, pair.standby, pair.standby_log,
                       pair.done)
    await trio.sleep(5)  # a running cohort, its standby waiting for the leadership
    return pair


async def lease_runs_out(store: MemoryStore, handle: MemoryStore) -> None:
    """The leader's lease runs out (``LEASE_TTL`` after now, as etcd's would): the standby on
    ``handle`` leads, adopts the session and publishes ``coord-2``."""
    await trio.sleep(LEASE_TTL)
    store.expire()
    await publish_once_leading(handle, ("coord-2", 2))


async def freeze_then_drain(run: LeaderAndStandby) -> HostRun:
    """SIGSTOP the leader, then host-b leaves on purpose (its ranks told); returns host-b."""
    run.freeze.freeze()
    draining = run.hosts[1]
    await drain_host(draining)
    return draining


@asynccontextmanager
async def drained_while_frozen(net: MemoryNetwork
                               ) -> AsyncIterator[tuple[LeaderAndStandby, HostRun]]:
    """A leader and its standby (an elastic world of 2 to 4, ``resume_timeout`` 10 s) running
    the ROSTER's hosts; the leader is frozen and host-b drains: the block gets both. A failure
    in the block thaws the leader first (cancelling a frozen coordinator would hang)."""
    cfg = ft.CoordinatorConfig(world_size=4, min_world_size=2, resume_timeout=10)
    async with trio.open_nursery() as nursery:
        run = await leader_and_standby(nursery, net, cfg, store_dialer)
        try:
            yield run, await freeze_then_drain(run)
        finally:
            run.freeze.thaw()
            await run.freeze.run_closes()


async def retired_by_the_successor(coord: ft.Coordinator, draining: HostRun) -> None:
    """The standby that took over retired host-b's ranks (none dead), and host-b's relay ended
    cleanly after one resume with it (generation 2)."""
    await wait_until(lambda: coord.retired_ranks == {2, 3}, limit=60)
    assert coord.dead_ranks == frozenset() and coord.live_ranks == {0, 1}
    await wait_until(lambda: draining.all_done, limit=60)
    assert isinstance(draining.exit, ft.RelayExit) and draining.exit.clean, draining.exit
    assert relay_of(draining).reconnects == 1 and relay_of(draining).generation == 2


async def thaw_and_end(run: LeaderAndStandby) -> None:
    """The deposed leader thawed and ended, then the standby's block ends: host-a is done."""
    run.freeze.thaw()
    await run.freeze.run_closes()
    await wait_until(lambda: isinstance(run.leader[-1], ft.FlodlError), limit=30)
    run.done.set()
    await wait_until(lambda: run.hosts[0].all_done, limit=60)


@pytest.mark.parametrize("target", ["store", "callable"])
async def test_relays_leave_a_frozen_leader_for_its_standby_and_no_rank_dies(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, target: str
) -> None:
    # Through the store the relays move seconds after the freeze. Through a callable they
    # cannot watch, their own silence deadline (20 s, 2/3 of the ranks') moves them, and they
    # feed their ranks from then on: with it at the ranks' 30 s, every rank died.
    net = memory_network
    cfg = ft.CoordinatorConfig(world_size=4, resume_timeout=30)  # heartbeats every second
    dialer = store_dialer if target == "store" else plain_dialer
    async with trio.open_nursery() as nursery:
        run = await leader_and_standby(nursery, net, cfg, dialer)
        store, handle, freeze, hosts = run.store, run.handle, run.freeze, run.hosts
        leader, standby, standby_log, done = run.leader, run.standby, run.standby_log, run.done
        try:
            freeze.freeze()  # SIGSTOP
            frozen_at = trio.current_time()
            await lease_runs_out(store, handle)  # the standby leads, adopts and publishes
            await wait_until(lambda: all(relay_of(h).reconnects == 1 for h in hosts), limit=60)
            resumed_after = trio.current_time() - frozen_at
            if target == "store":  # neither the relays' silence deadline nor the ranks' came in
                assert resumed_after < LEASE_TTL + 3, resumed_after
            else:
                assert 19 <= resumed_after < 25, resumed_after
            assert all(relay_of(h).generation == 2 for h in hosts)
            assert [relay_of(h).leader_moves for h in hosts] == [int(target == "store")] * 2

            await trio.sleep(40 - (trio.current_time() - frozen_at))
            freeze.thaw()  # SIGCONT 40 s after the freeze: it finds itself deposed
            await freeze.run_closes()
            await wait_until(lambda: isinstance(leader[-1], ft.FlodlError), limit=30)
            await trio.sleep(5)
            (coord,) = standby
            assert coord.generation == 2 and coord.dead_ranks == frozenset()
            assert coord.live_ranks == frozenset(range(4))
            done.set()  # the standby's block ends: Shutdown
            await wait_until(lambda: all(h.all_done for h in hosts), limit=60)
        finally:  # a failure above must not leave a frozen coordinator to cancel: it would hang
            freeze.thaw()
            await freeze.run_closes()

    assert standby_log.of(RankDeclaredDead) == []
    for host in hosts:
        assert isinstance(host.exit, ft.RelayExit) and host.exit.clean, host.exit
        for run in host.ranks.values():
            assert run.outcome == "ended" and run.lost is None, run.outcome
            labels = [label for label in run.labels() if label != "CoordHeartbeat"]
            assert labels[-3:] == ["CoordinatorReconnecting", "CoordinatorResumed", "Shutdown"]
            assert run.declared_dead() == []  # nothing from the deposed leader reached a rank
            (told,) = [m for m in run.received if isinstance(m, wire.CoordinatorReconnecting)]
            assert ("a newer coordinator leads: generation 2 at coord-2:2" if target == "store"
                    else "coord_liveness_timeout=20s") in told.detail


async def test_a_stale_or_unanswered_published_address_never_moves_the_relay(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    # The relay's coordinator (scripted, generation 5) stays up and beats. The store then names
    # another address three times: one nobody listens on, one where a deposed coordinator
    # (generation 4) answers, and one where a coordinator of generation 6 answers: only that
    # one takes the relay over.
    net = memory_network
    salt = ft.SessionSalt.generate()
    store = MemoryStore(name="run1")
    await store.acquire(owner="scripted")
    await store.publish_address([("coord-1", 1)])
    first_listener = net.listener("coord-1")
    async with trio.open_nursery() as nursery:
        host = await start_host(nursery, net, "host-a", [0, 1], salt=salt, world=2,
                                target=store_dialer(store, net))
        first = await accept_leg(first_listener, salt, generation=5)
        assert first is not None
        nursery.start_soon(first.beat, [0, 1])
        await relay_of(host).wait_connected()
        await trio.sleep(5)
        await store.publish_address([("coord-1", 1)])  # the same again: nothing to do
        await trio.sleep(5)

        await store.publish_address([("nobody", 1)])
        await trio.sleep(10)
        assert relay_of(host).reconnects == 0 and relay_of(host).reconnecting is None

        deposed = net.listener("deposed")
        await store.publish_address([("deposed", 1)])
        stale = await accept_leg(deposed, salt, generation=4)
        assert stale is not None and stale.received.resumed
        with trio.fail_after(1):  # the relay failed it at its Generation and closed it
            while await stale.stream.receive_some(65536):
                pass
        await stale.stream.aclose()
        await trio.sleep(3)  # not probed again at each read
        assert len([c for c in net.connections if c.name == "deposed"]) == 1
        assert relay_of(host).reconnects == 0 and relay_of(host).leader_moves == 0

        newer = net.listener("coord-2")
        await store.publish_address([("coord-2", 1)])
        moved_from = trio.current_time()
        leg = await accept_leg(newer, salt, generation=6)
        assert leg is not None and leg.received.resumed and leg.received.generation == 5
        nursery.start_soon(leg.beat, [0, 1])
        await wait_until(lambda: relay_of(host).reconnects == 1)
        assert trio.current_time() - moved_from < 3
        assert relay_of(host).generation == 6 and relay_of(host).leader_moves == 1
        with trio.fail_after(5):  # the relay closed the old connection
            while await first.stream.receive_some(65536):
                pass
        await leg.fanout([0, 1], wire.Shutdown())
        await leg.send(wire.RecordKind.CONTROL, wire.encode(wire.Goodbye("done")))
        await wait_until(lambda: host.all_done, limit=30)
        for listener in (first_listener, deposed, newer):
            await listener.aclose()
        await first.stream.aclose()
        await leg.stream.aclose()
    for run in host.ranks.values():
        assert run.outcome == "ended"
        labels = [label for label in run.labels() if label != "CoordHeartbeat"]
        assert labels == ["CoordinatorReconnecting", "CoordinatorResumed", "Shutdown"]


async def test_a_host_that_drains_while_its_leader_is_frozen_is_retired_by_the_successor(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    # Found by the nemesis (seed 3): host-b drains while the leader is SIGSTOPped. Its relay
    # wrote Draining and its ranks' exits into the frozen leader's socket and ended after
    # shutdown_grace; the standby adopted the session as the store had it, waited
    # resume_timeout for host-b and declared ranks 2 and 3 dead. Now a finish the durable
    # coordinator never confirmed (it did not close) is ridden out: the relay resumes with the
    # standby and tells it again, and the ranks are retired, never dead.
    async with drained_while_frozen(memory_network) as (run, draining):
        standby = run.standby
        for rank in draining.ranks.values():
            rank.leave()  # each finishes and exits (Exiting, then RankExit upstream)
        await lease_runs_out(run.store, run.handle)  # the standby leads, adopts and publishes
        await wait_until(lambda: bool(standby), limit=60)
        (coord,) = standby
        await retired_by_the_successor(coord, draining)

        await thaw_and_end(run)
    assert run.standby_log.of(RankDeclaredDead) == []


async def test_a_drain_begun_with_a_frozen_leader_and_ended_with_its_successor_retires_every_rank(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    # Found by the nemesis (seed 5): host-b's Draining went into the frozen leader's socket,
    # the relay resumed with the standby, and its ranks exited there. The standby never heard
    # that the host leaves: it kept them as exited (not retired), and the restarted host was
    # refused for good ("rank 8 exited cleanly and does not rejoin"). Now a resumed connection
    # tells the next coordinator again: Draining, and the ranks that left before (rank 2 here,
    # whose Exiting the frozen leader took and never read).
    async with drained_while_frozen(memory_network) as (run, draining):
        standby = run.standby
        draining.ranks[2].leave()  # one rank finishes before the leader is replaced
        await lease_runs_out(run.store, run.handle)  # the standby leads, adopts and publishes
        await wait_until(lambda: relay_of(draining).reconnects == 1, limit=60)
        (coord,) = standby
        await wait_until(lambda: coord.retired_ranks == {2}, limit=10)
        draining.ranks[3].leave()  # the other only once its relay resumed
        await wait_until(lambda: coord.retired_ranks == {2, 3}, limit=10)
        assert coord.dead_ranks == frozenset() and coord.live_ranks == {0, 1}
        assert coord.exited_ranks == frozenset()
        await wait_until(lambda: draining.all_done, limit=60)
        assert isinstance(draining.exit, ft.RelayExit) and draining.exit.clean, draining.exit

        await thaw_and_end(run)
    assert run.standby_log.of(RankDeclaredDead) == []


async def lead_on_a_failing_store(net: MemoryNetwork, salt: ft.SessionSalt,
                                  cfg: ft.CoordinatorConfig, store: MemoryStore,
                                  outage: Freeze, leader: list[Any]) -> None:
    """The leader on ``coord-1``, its network up, its store handle cut off by ``outage`` (an
    etcd that lost its quorum: no write lands); ``leader`` gets it, then how it ended."""
    try:
        async with ft.open_coordinator(net.listener("coord-1"), salt=salt, config=cfg,
                                       store=FrozenStore(store, outage),
                                       timeline=EventLog()) as coord:
            leader.append(coord)
            await trio.sleep_forever()
    except ft.LeadershipLost as exc:
        leader.append(exc)


async def test_a_drain_whose_retirement_never_became_durable_is_retired_by_the_successor(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    # Found by the soak (seed 4): the leader retired host-b's drained ranks, but its store had
    # lost its quorum and the retirement was never written; the leader closed the relay's
    # connection at its EOF (which the relay took for a confirmation), then stepped down. The
    # standby adopted the session with host-b's ranks live, awaiting a resume that never came:
    # declared dead after resume_timeout (or as host-b came back, superseded). Now a drained
    # relay's end is confirmed only by a Goodbye, said once the retirement is durable.
    net = memory_network
    cfg = ft.CoordinatorConfig(world_size=4, min_world_size=2, resume_timeout=10)
    salt = ft.SessionSalt.generate()
    store = MemoryStore(name="run1")
    outage = Freeze()
    leader: list[Any] = []
    standby: list[ft.Coordinator] = []
    standby_log, done = EventLog(), trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lead_on_a_failing_store, net, salt, cfg, store, outage, leader)
        await publish_once_leading(store, ("coord-1", 1))
        hosts = [await start_host(nursery, net, host, ranks, salt=salt, world=4,
                                  target=store_dialer(store, net)) for host, ranks in ROSTER]
        await wait_until(lambda: leader, limit=60)
        handle = store.clone()
        nursery.start_soon(stand_by, net, salt, cfg, handle, standby, standby_log, done)
        await trio.sleep(5)
        try:
            outage.freeze()  # no write lands any more
            draining = hosts[1]
            await drain_host(draining)
            for run in draining.ranks.values():
                run.leave()
            await wait_until(lambda: leader[0].retired_ranks == {2, 3}, limit=10)  # in memory
            await trio.sleep(1)
            assert not draining.all_done  # no Goodbye: the retirement is not durable
            await lease_runs_out(store, handle)  # the standby leads, adopts and publishes
            outage.thaw()  # the leader hears it was deposed and ends, saying nothing
            await wait_until(lambda: isinstance(leader[-1], ft.FlodlError), limit=30)
            (coord,) = standby
            await retired_by_the_successor(coord, draining)
            await trio.sleep(15)  # past resume_timeout: still nobody dead
            assert coord.dead_ranks == frozenset()
            done.set()
            await wait_until(lambda: hosts[0].all_done, limit=60)
        finally:
            outage.thaw()
            await outage.run_closes()
    assert standby_log.of(RankDeclaredDead) == []
