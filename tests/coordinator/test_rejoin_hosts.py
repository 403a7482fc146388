"""A host that comes back, end to end with real relays and rank endpoints on the in-memory
transport (issue 26): its relay re-runs the full handshake, its new rank endpoints join, the
survivors are told (``DeclareAlive``, as they were told ``DeclareDead``), the newcomers learn who
is still dead, and at the end of the run the restarted relay ends clean. At the edges a user
meets: a restart that reaches the coordinator after the run's final ``Shutdown`` went out (the
embedder still inside its ``open_coordinator`` block, saving a checkpoint, say), a relay claiming
a live rank, a host restarted before its death was noticed. MockClock."""

from __future__ import annotations

import trio

import flodl_trio as ft
from flodl_trio.events import (
    HandshakeRejected,
    RankDeclaredDead,
    RankRejoined,
    RelayLost,
)
from flodl_trio.testing import EventLog, MemoryNetwork

from helpers import COORD, hosts_by_hand, wait_until
from helpers.raw import drain_and_close, raw_relay_handshake
from helpers.scripts import TWO_HOSTS


async def test_restarted_host_rejoins_survivors_are_told_and_its_relay_ends_clean(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    timeline = EventLog()
    cfg = ft.CoordinatorConfig(world_size=6, formation_timeout=60, heartbeat_timeout=30)
    layout = {"host-a": [0, 1], "host-b": [2, 3], "host-c": [4, 5]}
    async with hosts_by_hand(memory_network, 6, layout) as started:
        hosts = dict(started.runs)
        async with started.coordinator(cfg, timeline=timeline) as coord:
            # host-c dies for good, host-a dies and comes back.
            for host in ("host-c", "host-a"):
                hosts[host].kill()
            await wait_until(lambda: coord.dead_ranks == {0, 1, 4, 5}, limit=5)
            await wait_until(lambda: hosts["host-a"].all_done, limit=5)
            restarted_at = trio.current_time()
            back = await started.start("host-a", [0, 1])
            await wait_until(lambda: coord.live_ranks == {0, 1, 2, 3}, limit=5)
            rejoined = timeline.of(RankRejoined)
            assert [ev for _, ev in rejoined] == [RankRejoined(rank=0, host="host-a"),
                                                  RankRejoined(rank=1, host="host-a")]
            assert all(t - restarted_at < 1 for t, _ in rejoined)
            survivors = [hosts["host-b"].ranks[r] for r in (2, 3)]
            await wait_until(lambda: all(
                rec.labels().count("DeclareAlive") == 2 for rec in survivors), limit=2)
            for rec in survivors:
                assert rec.ep is not None and rec.ep.dead_peers == {4, 5}
                told = [(type(m).__name__, int(m.rank)) for m in rec.received
                        if isinstance(m, ft.wire.DeclareDead | ft.wire.DeclareAlive)]
                # Each death, then each return, in order (host-c's and host-a's deaths may
                # interleave).
                assert sorted(told[:4]) == [("DeclareDead", r) for r in (0, 1, 4, 5)]
                assert told[4:] == [("DeclareAlive", 0), ("DeclareAlive", 1)]
            newcomers = [back.ranks[r] for r in (0, 1)]
            await wait_until(lambda: all(rec.ep is not None and rec.ep.dead_peers == {4, 5}
                                         for rec in newcomers), limit=2)
            # The rejoined ranks are addressed like any other.
            result = await coord.broadcast_control(ft.wire.SyncNow())
            assert result.delivered == {0, 1, 2, 3}
            await wait_until(lambda: all("SyncNow" in rec.labels() for rec in newcomers),
                             limit=2)
        await wait_until(lambda: back.all_done and hosts["host-b"].all_done, limit=10)
        assert isinstance(back.exit, ft.RelayExit) and back.exit.clean, back.exit
        assert all(rec.labels()[-1] == "Shutdown" for rec in newcomers)
        # The old endpoints of host-a stayed ended: nothing was delivered to them since.
        assert all(run.outcome == "killed" or isinstance(run.outcome, ft.CoordinatorLost)
                   for run in hosts["host-a"].ranks.values())


# ---------------------------------------------------------------------- at the edges a user meets


async def test_host_restarted_after_the_final_shutdown_is_not_left_waiting_for_a_run_that_ended(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    log = EventLog()
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=60, heartbeat_timeout=30)
    async with hosts_by_hand(memory_network, 4, TWO_HOSTS) as hosts:
        a, b = hosts.runs["host-a"], hosts.runs["host-b"]
        async with hosts.coordinator(cfg, timeline=log) as coord:
            b.kill()
            await wait_until(lambda: coord.dead_ranks == {2, 3}, limit=5)
            await wait_until(lambda: b.all_done, limit=5)
            # The run is over: the scheduler's last word went out to every live rank.
            await coord.broadcast_control(ft.wire.Shutdown())
            await wait_until(lambda: all(r.done.is_set() for r in a.ranks.values()), limit=5)
            back = await hosts.start("host-b", [2, 3])
            # The embedder saves a checkpoint before leaving the block.
            await wait_until(lambda: log.events_of(RankRejoined)
                             or log.events_of(HandshakeRejected), limit=5)
            await trio.sleep(5)
        with trio.fail_after(30):
            await back.done.wait()
            for run in back.ranks.values():
                await run.done.wait()
        # Either refused (the run is over) or admitted and then told Shutdown like everyone:
        # never left with ranks that fail for want of a Shutdown.
        for rank, run in back.ranks.items():
            assert run.outcome == "ended", (rank, run.outcome, run.labels())


async def test_relay_claiming_a_live_rank_ends_at_once_naming_the_rank_and_its_owner(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    log = EventLog()
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=60, heartbeat_timeout=30)
    async with hosts_by_hand(memory_network, 4, TWO_HOSTS) as hosts:
        async with hosts.coordinator(cfg, timeline=log) as coord:
            started = trio.current_time()
            intruder = await hosts.start("host-x", [1])
            with trio.move_on_after(40):
                await intruder.done.wait()
            took = trio.current_time() - started
            assert coord.live_ranks == {0, 1, 2, 3}
            assert len(log.events_of(HandshakeRejected)) == 1, log.events_of(HandshakeRejected)
            assert intruder.done.is_set() and took < 3, took
            assert isinstance(intruder.exit, ft.JoinRefused), intruder.exit
            assert "rank 1 is alive on relay 'host-a'" in intruder.exit.reason, intruder.exit


async def test_host_restarted_before_its_death_was_noticed_rejoins_once_it_is(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    log = EventLog()
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=60, heartbeat_timeout=45)
    async with hosts_by_hand(memory_network, 4, {"host-a": [0, 1]}) as hosts:
        frozen_closed = trio.Event()

        async def frozen_host_b() -> None:  # joins, then never says a word again
            raw = await raw_relay_handshake(await memory_network.connect(COORD), hosts.salt,
                                            "host-b", [2, 3], world_size=4)
            assert raw.acked
            await drain_and_close(raw.stream, limit=3600)
            frozen_closed.set()  # the coordinator closed it (the drain ended before its limit)

        hosts.nursery.start_soon(frozen_host_b)
        async with hosts.coordinator(cfg, timeline=log) as coord:
            await trio.sleep(1)
            restarted_at = trio.current_time()
            back = await hosts.start("host-b", [2, 3])
            with trio.move_on_after(cfg.heartbeat_timeout + 10):
                await wait_until(lambda: len(log.events_of(RankRejoined)) == 2,
                                 limit=cfg.heartbeat_timeout + 10)
            took = trio.current_time() - restarted_at
            assert log.events_of(RankRejoined) == [RankRejoined(rank=2, host="host-b"),
                                                   RankRejoined(rank=3, host="host-b")], (
                took, back.exit)
            assert took < 3, took  # well before heartbeat_timeout (45 s)
            assert coord.live_ranks == {0, 1, 2, 3}
            # The frozen connection was lost as superseded and its ranks declared dead first.
            lost = log.events_of(RelayLost)
            assert [(e.host, e.ranks) for e in lost] == [("host-b", (2, 3))], lost
            assert lost[0].reason.startswith("superseded: host 'host-b' re-joined from "), lost
            assert [e.rank for e in log.events_of(RankDeclaredDead)] == [2, 3]
            await wait_until(lambda: frozen_closed.is_set(), limit=5)
