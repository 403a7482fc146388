"""Elastic membership (issue 37) with real relays and recording ranks over the in-memory network,
under MockClock: a world of MIN to MAX ranks forms once its minimum is covered and its join window
passed (at once with its maximum), a host the run did not start with joins the running cohort,
and dead ranks are retired so the world stops waiting for them."""

from __future__ import annotations

import functools

import pytest
import trio

import flodl_trio as ft
from flodl_trio.events import (
    FormationComplete,
    RankDeclaredDead,
    RankJoined,
    RankRejoined,
    RankRetired,
)
from flodl_trio.testing import EventLog, MemoryNetwork
from flodl_trio.wire import DeclareAlive

from helpers import COORD, failed_formation, hosts_by_hand, wait_until
from helpers.rejoin import RawCohort, raw_cohort


def elastic(least: int, most: int, **kw: object) -> ft.CoordinatorConfig:
    settings: dict[str, object] = {"formation_timeout": 60, "heartbeat_timeout": 30,
                                   "join_window": 1.0, **kw}
    return ft.CoordinatorConfig(world_size=most, min_world_size=least,
                                **settings)  # type: ignore[arg-type]


# ------------------------------------------------------------------ forming


async def test_a_range_forms_with_its_minimum_once_no_relay_joined_for_the_join_window(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    log = EventLog()
    async with hosts_by_hand(memory_network, 6) as hosts:
        began = trio.current_time()
        await hosts.start("host-a", [0, 1])
        async with hosts.coordinator(elastic(2, 6), timeline=log) as coord:
            formed_at = trio.current_time() - began
            assert coord.current_world == 2 and coord.live_ranks == {0, 1}
            assert coord.world_range == (2, 6)
            assert coord.state()["world"] == {"min": 2, "max": 6, "current": 2}
            [(_, done)] = log.of(FormationComplete)
            assert done.world_size == 2 and done.relays == 1
        # The window (1 s) ran from host-a's join, a few milliseconds in.
        assert 1.0 <= formed_at < 1.1


async def test_each_relay_that_joins_within_the_window_starts_it_again(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with hosts_by_hand(memory_network, 6) as hosts:
        began = trio.current_time()
        await hosts.start("host-a", [0, 1])

        async def later() -> None:
            await trio.sleep(0.8)
            await hosts.start("host-b", [2, 3])

        hosts.nursery.start_soon(later)
        async with hosts.coordinator(elastic(2, 6)) as coord:
            formed_at = trio.current_time() - began
            assert coord.live_ranks == {0, 1, 2, 3} and coord.current_world == 4
        assert 1.8 <= formed_at < 1.9


async def test_the_maximum_forms_at_once_without_waiting_for_the_window(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    layout = {"host-a": [0, 1], "host-b": [2, 3]}
    async with hosts_by_hand(memory_network, 4, layout) as hosts:
        began = trio.current_time()
        async with hosts.coordinator(elastic(2, 4, join_window=30)) as coord:
            assert trio.current_time() - began < 0.1
            assert coord.current_world == 4


async def test_formation_timeout_bounds_the_wait_for_the_minimum_and_says_so(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with hosts_by_hand(memory_network, 6, {"host-a": [0]}) as hosts:
        exc, took = await failed_formation(
            hosts.coordinator(elastic(2, 6, formation_timeout=5)), ft.FormationTimeout,
            why="one rank of a minimum of two cannot form")
    assert 5 <= took < 5.1
    assert str(exc).startswith("formation timed out after 5s: 1/2 (the minimum of a world of 2 "
                               "to 6) ranks covered; hosts joined: host-a [0]")


# ------------------------------------------------------------------ growing


async def test_a_host_the_run_did_not_start_with_joins_and_the_others_learn_its_ranks(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    log = EventLog()
    async with hosts_by_hand(memory_network, 6, {"host-a": [0, 1]}) as hosts:
        async with hosts.coordinator(elastic(2, 6), timeline=log) as coord:
            assert coord.live_ranks == {0, 1}
            started = trio.current_time()
            await hosts.start("host-b", [2, 3, 4, 5])
            await wait_until(lambda: coord.live_ranks == set(range(6)), limit=5)
            assert trio.current_time() - started < 0.5
            assert coord.current_world == 6 and coord.rejoins == {}
            assert coord.state()["world"] == {"min": 2, "max": 6, "current": 6}
            assert log.events_of(RankJoined) == [
                RankJoined(rank=r, host="host-b", world=6) for r in (2, 3, 4, 5)]
            assert log.events_of(RankRejoined) == []
            survivors = hosts.runs["host-a"].ranks.values()
            await wait_until(lambda: all(rec.labels().count("DeclareAlive") == 4
                                         for rec in survivors), limit=2)
            for rec in survivors:
                alive = [int(m.rank) for m in rec.received if isinstance(m, DeclareAlive)]
                assert sorted(alive) == [2, 3, 4, 5]
                assert rec.ep is not None and rec.ep.dead_peers == frozenset()
            # The newcomers are addressed like everyone else.
            result = await coord.broadcast_control(ft.wire.SyncNow())
            assert result.delivered == frozenset(range(6))


async def test_a_joining_host_that_does_not_fit_is_refused_at_once_naming_why(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    cfg = elastic(2, 6, heartbeat_interval=3600, heartbeat_timeout=3600)
    async with raw_cohort(memory_network, RawCohort) as run:
        run.nursery.start_soon(functools.partial(run.dial, "host-a", [0, 1], world_size=6))
        async with ft.open_coordinator(memory_network.listener(COORD), salt=run.salt,
                                       config=cfg, timeline=run.timeline) as coord:
            a = coord.relays[0].peer
            cases = [
                (("host-x", [5, 6]), {}, "rank 6 is out of range for world_size 6"),
                (("host-y", [2, 3]), {"model_sigs": {"model": bytes(32)}},
                 f"model signature mismatch: relay 'host-y' and relay 'host-a' at {a} disagree "
                 "on 'model'"),
                (("host-z", [2]), {"world_size": 8}, "world_size mismatch: the coordinator's "
                 "world_size is 6, the relay's is 8"),
                (("host-w", [1, 2]), {}, "expected every rank it names to be dead, but rank 1 "
                 f"is alive on relay 'host-a' at {a}"),
            ]
            for (host, ranks), kw, reason in cases:
                began = trio.current_time()
                raw = await run.dial(host, ranks, **{"world_size": 6, **kw})
                assert not raw.acked and raw.refused is not None, host
                assert reason in raw.refused, raw.refused
                assert trio.current_time() - began < 0.1
            assert coord.live_ranks == {0, 1} and coord.current_world == 2
            assert len(run.refusals()) == 4
            assert all(r.startswith("rejoin refused") for r in run.refusals())


# ------------------------------------------------------------------ retiring


async def test_retiring_dead_ranks_takes_them_out_of_the_world_and_their_ids_may_join_again(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    log = EventLog()
    layout = {"host-a": [0, 1], "host-b": [2, 3]}
    async with hosts_by_hand(memory_network, 6, layout) as hosts:
        async with hosts.coordinator(elastic(2, 6), timeline=log) as coord:
            hosts.runs["host-b"].kill()
            await wait_until(lambda: coord.dead_ranks == {2, 3}, limit=5)
            await coord.retire([3, 2])
            assert [(ev.rank, ev.host, ev.world) for ev in log.events_of(RankRetired)] == [
                (2, "host-b", 3), (3, "host-b", 2)]
            assert coord.dead_ranks == frozenset() and coord.current_world == 2
            assert coord.retired_ranks == {2, 3}
            assert coord.retired_reason(2) == "retired by the orchestrator"
            assert [r.host for r in coord.relays] == ["host-a"]
            state = coord.state()
            assert state["world"] == {"min": 2, "max": 6, "current": 2}
            assert state["retired"] == [2, 3] and state["dead"] == []
            # Bad input is one clear answer and changes nothing.
            a = coord.relays[0].peer
            with pytest.raises(ft.MembershipError) as alive:
                await coord.retire(0)
            assert str(alive.value) == (
                f"retire: expected a dead or exited rank, but rank 0 is alive on relay "
                f"'host-a' at {a} (drain its host to retire it)")
            with pytest.raises(ft.MembershipError, match=r"rank 2 was retired already"):
                await coord.retire([2])
            with pytest.raises(ft.MembershipError, match=r"rank 5 is not in the world"):
                await coord.retire([5])
            with pytest.raises(ft.ConfigError, match=r"expected rank ids in \[0, 6\), got 6"):
                await coord.retire([1, 6])
            assert coord.current_world == 2 and coord.live_ranks == {0, 1}
            # A retired id joins again: the world grows, whichever host brings it.
            await hosts.start("host-c", [2, 3])
            await wait_until(lambda: coord.live_ranks == {0, 1, 2, 3}, limit=5)
            assert coord.retired_ranks == frozenset() and coord.current_world == 4
            assert [(ev.rank, ev.host) for ev in log.events_of(RankJoined)] == [
                (2, "host-c"), (3, "host-c")]
            assert coord.rejoins == {}


async def test_a_world_at_its_minimum_retires_nothing_and_the_policy_decides_as_before(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with hosts_by_hand(memory_network, 4, {"host-a": [0, 1], "host-b": [2, 3]}) as hosts:
        async with hosts.coordinator(elastic(3, 4)) as coord:
            hosts.runs["host-b"].kill()
            await wait_until(lambda: coord.dead_ranks == {2, 3}, limit=5)
            with pytest.raises(ft.MembershipError) as below:
                await coord.retire([2, 3])
            assert str(below.value) == (
                "retire: retiring rank(s) [2, 3] would leave 2 ranks, below the world's "
                "minimum of 3 (it has 4); the failure policy decides about dead ranks there")
            await coord.retire(2)  # one of them still fits
            assert coord.current_world == 3 and coord.dead_ranks == {3}


async def test_retire_after_retires_a_dead_rank_then_and_it_no_longer_counts_as_a_failure(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    log = EventLog()
    layout = {"host-a": [0, 1], "host-b": [2, 3], "host-c": [4, 5]}
    cfg = elastic(2, 6, retire_after=2, max_failure=ft.MaxFailure.absolute(3))
    async with hosts_by_hand(memory_network, 6, layout) as hosts:
        async with hosts.coordinator(cfg, timeline=log) as coord:
            hosts.runs["host-b"].kill()
            await wait_until(lambda: coord.dead_ranks == {2, 3}, limit=5)
            died = log.of(RankDeclaredDead)[-1][0]
            await wait_until(lambda: coord.retired_ranks == {2, 3}, limit=5)
            retired = log.of(RankRetired)
            assert all(2 <= t - died < 2.1 for t, _ in retired), retired
            assert retired[0][1].reason.startswith(
                "dead for 2s (retire_after): relay 'host-b' at ")
            # Two more deaths: 2 dead of 4, under max_failure 3 (without the retirement:
            # 4 dead, the run would stop).
            hosts.runs["host-c"].kill()
            await wait_until(lambda: coord.dead_ranks == {4, 5}, limit=5)
            await trio.sleep(0.5)
            assert coord.failure is None
            # host-c's ranks go too; host-a's are the world's minimum and stay.
            await wait_until(lambda: coord.retired_ranks == {2, 3, 4, 5}, limit=5)
            assert coord.current_world == 2 and coord.live_ranks == {0, 1}


async def test_ranks_due_for_retirement_below_the_minimum_stay_dead_and_are_said_once(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork,
    caplog: pytest.LogCaptureFixture,
) -> None:
    layout = {"host-a": [0, 1], "host-b": [2, 3], "host-c": [4, 5]}
    async with hosts_by_hand(memory_network, 6, layout) as hosts:
        async with hosts.coordinator(elastic(3, 6, retire_after=1)) as coord:
            for host in ("host-b", "host-c"):
                hosts.runs[host].kill()
            await wait_until(lambda: coord.dead_ranks == {2, 3, 4, 5}, limit=5)
            await trio.sleep(5)
            assert coord.retired_ranks == {2, 3, 4} and coord.dead_ranks == {5}
            assert coord.current_world == 3
            held = [r.getMessage() for r in caplog.records if "is not retired" in r.message]
            assert held == ["rank 5 has been dead for 1s but is not retired: the world is at "
                            "its minimum of 3 ranks; the failure policy decides (it counts as "
                            "dead)"]
