"""Relays resuming with a coordinator that adopted their session (SPEC §4.7, issue 22), on the
in-memory transport under MockClock: a relay of the roster that resumes is attached without a
death or a DeclareAlive, a dead rank that resumes rejoins, the ranks of a relay that never resumes
die after resume_timeout and not before, a broadcast waits for the resumes, and a Resume that
would be refused as a Hello is refused the same way.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from flodl_trio import wire
from flodl_trio.events import RankDeclaredDead, RankRejoined
from flodl_trio.testing import EventLog, MemoryNetwork

from helpers import wait_until
from helpers.durable import ROSTER, cluster, until_stored


async def test_relays_that_resume_are_attached_without_a_death_or_declare_alive(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with cluster(memory_network) as c:
        await c.crashed_first_run()
        assert {host: r.generation for host, r in c.relays.items()} == {
            "host-a": 1, "host-b": 1}  # a durable coordinator says so at the join
        log = EventLog()
        async with c.adopting(timeline=log) as coord:
            for host, ranks in ROSTER:
                relay = await c.dial("coord-2", host, ranks, generation=1)
                assert relay.raw.acked and relay.generation == 2
            await wait_until(lambda: all(r.peer != "(not resumed)" for r in coord.relays),
                             limit=1)
            assert [(r.host, r.ranks) for r in coord.relays] == list(ROSTER)
            result = await coord.broadcast_control(wire.SyncNow())
            assert result.delivered == {0, 1, 2, 3}
            await wait_until(lambda: all("SyncNow" in r.messages for r in c.relays.values()),
                             limit=1)
            await trio.sleep(60)  # far past resume_timeout: nobody is declared dead
            assert coord.live_ranks == {0, 1, 2, 3}
            assert coord.rejoins == {}
            assert log.events_of(RankDeclaredDead) == []
            assert log.events_of(RankRejoined) == []
            for relay in c.relays.values():
                assert relay.messages[:1] == ["CoordHeartbeat"]  # the welcome
                assert not [m for m in relay.messages if m.startswith(("DeclareAlive",
                                                                       "DeclareDead"))]


async def test_ranks_of_a_relay_that_never_resumes_die_after_resume_timeout_and_not_before(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with cluster(memory_network) as c:
        await c.crashed_first_run()
        log = EventLog()
        async with c.adopting(timeline=log, resume_timeout=20) as coord:
            began = trio.current_time()
            await trio.sleep(5)
            host_b = await c.dial("coord-2", "host-b", (2, 3), generation=1)
            await trio.sleep(14.9)
            assert coord.live_ranks == {0, 1, 2, 3}
            await wait_until(lambda: coord.dead_ranks == {0, 1}, limit=1)
            deaths = log.of(RankDeclaredDead)
            assert [ev.rank for _, ev in deaths] == [0, 1]
            assert all(at - began == pytest.approx(20) for at, _ in deaths)
            reason = coord.dead_reason(0) or ""
            assert "relay 'host-a' did not resume within resume_timeout=20s" in reason
            assert "memory:memory" in reason
            await wait_until(lambda: {"DeclareDead(0)", "DeclareDead(1)"} <= set(
                host_b.messages), limit=1)
            await until_stored(c.store, lambda state: set(state.dead) == {0, 1})
            assert coord.live_ranks == {2, 3}


async def test_broadcast_after_a_failover_waits_for_the_resumes_and_reaches_who_came_back(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with cluster(memory_network) as c:
        await c.crashed_first_run()
        async with c.adopting(resume_timeout=20) as coord:
            async def resume_b_later() -> None:
                await trio.sleep(3)
                await c.dial("coord-2", "host-b", (2, 3), generation=1)

            c.nursery.start_soon(resume_b_later)
            began = trio.current_time()
            result = await coord.broadcast_control(wire.SyncNow())
            assert trio.current_time() - began == pytest.approx(20)  # host-a's timeout
            assert result.delivered == {2, 3}  # host-a's ranks died meanwhile: not attempted
            await wait_until(lambda: "SyncNow" in c.relays["host-b"].messages, limit=1)
            assert coord.dead_ranks == {0, 1}


async def test_dead_rank_that_resumes_rejoins_with_declare_alive(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with cluster(memory_network) as c:
        await c.crashed_first_run(c.lose_rank_1)
        log = EventLog()
        async with c.adopting(timeline=log) as coord:
            host_b = await c.dial("coord-2", "host-b", (2, 3), generation=1)
            assert host_b.raw.acked
            await wait_until(lambda: "DeclareDead(1)" in host_b.messages, limit=1)
            host_a = await c.dial("coord-2", "host-a", (0, 1), generation=1)
            assert host_a.raw.acked
            await wait_until(lambda: coord.live_ranks == {0, 1, 2, 3}, limit=1)
            assert log.events_of(RankRejoined) == [RankRejoined(rank=1, host="host-a")]
            await wait_until(lambda: "DeclareAlive(1)" in host_b.messages, limit=1)
            assert not [m for m in host_b.messages if m.startswith("DeclareAlive(0")]
            assert coord.rejoins == {1: 1}
            await until_stored(c.store, lambda state: dict(state.dead) == {})


async def test_resume_that_would_be_refused_as_a_hello_is_refused_the_same_way(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with cluster(memory_network) as c:
        await c.crashed_first_run()
        async with c.adopting() as coord:
            stranger = await c.dial("coord-2", "host-c", (0,), generation=1)
            assert not stranger.raw.acked
            assert stranger.raw.refused is not None
            assert "expected every rank it names to be dead, but rank 0 is alive on relay " \
                   "'host-a'" in stranger.raw.refused
            assert coord.state()["rejected_handshakes"] == {"rejoin refused": 1}
            assert coord.live_ranks == {0, 1, 2, 3}


async def test_resume_from_a_relay_that_follows_a_newer_coordinator_is_closed_not_refused(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with cluster(memory_network) as c:
        await c.crashed_first_run()
        async with c.adopting() as coord:
            ahead = await c.dial("coord-2", "host-a", (0, 1), generation=5)
            assert not ahead.raw.acked
            refused = ahead.raw.refused or ""
            assert refused.startswith("failed: "), refused  # an EOF: it may try elsewhere
            assert coord.state()["rejected_handshakes"] == {"newer generation": 1}


async def test_send_to_a_rank_whose_relay_has_not_resumed_waits_for_the_resume(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with cluster(memory_network) as c:
        await c.crashed_first_run()
        async with c.adopting() as coord:
            (entry,) = [r for r in coord.state()["relays"] if r["host"] == "host-a"]
            assert (entry["peer"], entry["connected"]) == ("(not resumed)", False)

            async def resume_a_later() -> None:
                await trio.sleep(2)
                await c.dial("coord-2", "host-a", (0, 1), generation=1)

            c.nursery.start_soon(resume_a_later)
            began = trio.current_time()
            await coord.send_control(0, wire.SyncNow())
            assert trio.current_time() - began == pytest.approx(2)
            await wait_until(lambda: "SyncNow" in c.relays["host-a"].messages, limit=1)
            (entry,) = [r for r in coord.state()["relays"] if r["host"] == "host-a"]
            assert entry["connected"] and entry["peer"] != "(not resumed)"



async def test_relay_whose_ranks_all_died_before_the_failover_is_not_waited_for(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async def lose_host_a(coord: Any) -> None:
        await coord.declare_dead(0, "gone")
        await coord.declare_dead(1, "gone")
        await until_stored(c.store, lambda state: set(state.dead) == {0, 1})

    async with cluster(memory_network) as c:
        await c.crashed_first_run(lose_host_a)
        async with c.adopting() as coord:
            assert coord.dead_ranks == {0, 1}
            assert (await c.dial("coord-2", "host-b", (2, 3), generation=1)).raw.acked
            await wait_until(lambda: coord.live_ranks == {2, 3} and all(
                r.peer != "(not resumed)" for r in coord.relays if r.host == "host-b"),
                limit=1)
            began = trio.current_time()
            result = await coord.broadcast_control(wire.SyncNow())
            assert trio.current_time() == began  # host-a carries nobody alive: no wait
            assert result.delivered == {2, 3}


async def test_relay_restarted_during_the_failover_rejoins_through_a_death_with_a_hello(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with cluster(memory_network) as c:
        await c.crashed_first_run()
        log = EventLog()
        async with c.adopting(timeline=log) as coord:
            host_b = await c.dial("coord-2", "host-b", (2, 3), generation=1)
            # host-a's relay process restarted: it knows no generation, it says Hello.
            host_a = await c.dial("coord-2", "host-a", (0, 1))
            assert host_a.raw.acked and host_a.generation == 2
            await wait_until(lambda: coord.live_ranks == {0, 1, 2, 3}, limit=1)
            assert [ev.rank for ev in log.events_of(RankDeclaredDead)] == [0, 1]
            assert [ev.rank for ev in log.events_of(RankRejoined)] == [0, 1]
            await wait_until(lambda: {"DeclareAlive(0)", "DeclareAlive(1)"} <= set(
                host_b.messages), limit=1)
            assert coord.rejoins == {0: 1, 1: 1}
