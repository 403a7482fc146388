"""Formation deadlines (SPEC §4.2): the timeout and the abort event, under MockClock."""

from __future__ import annotations

import pytest
import trio

import flodl_trio as ft
from flodl_trio.events import FormationComplete, FormationFailed, RelayJoined
from flodl_trio.testing import MemoryNetwork

from helpers import COORD, events_of, failed_formation, hosts_by_hand, wait_until

WITHOUT_FORMATION = "the block must not be entered without formation"


async def test_formation_with_no_relay_times_out_at_formation_timeout_with_0_covered(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    timeline = ft.Timeline()
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=12.5)
    error, took = await failed_formation(
        ft.open_coordinator(memory_network.listener(COORD), salt=salt, config=cfg,
                            timeline=timeline), ft.FormationTimeout, why=WITHOUT_FORMATION)
    assert took == pytest.approx(12.5)
    text = str(error)
    assert "0/4 ranks covered" in text
    assert "12.5s" in text
    assert "hosts joined: none" in text
    (failed,) = events_of(timeline, FormationFailed)
    assert failed.covered == 0
    assert "0/4 ranks covered" in failed.reason
    assert not events_of(timeline, FormationComplete)


async def test_formation_with_one_of_two_relays_reports_2_of_4_and_names_the_host(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=20)
    async with hosts_by_hand(memory_network, 4, {"host-a": [0, 1]}) as hosts:
        host_a = hosts.runs["host-a"]
        error, elapsed = await failed_formation(hosts.coordinator(cfg),
                                                ft.FormationTimeout, why=WITHOUT_FORMATION)
        await wait_until(lambda: host_a.all_done, limit=30)
    assert elapsed == pytest.approx(20)
    text = str(error)
    assert "2/4 ranks covered" in text
    assert "host-a [0, 1]" in text
    assert "host-b" not in text
    (joined,) = events_of(hosts.timeline, RelayJoined)
    assert joined.host == "host-a" and joined.ranks == (0, 1)
    (failed,) = events_of(hosts.timeline, FormationFailed)
    assert failed.covered == 2
    assert "2/4 ranks covered" in failed.reason
    # The joined relay's connection was closed by the coordinator; its ranks were told to stop.
    assert isinstance(host_a.exit, ft.RelayExit)
    for run in host_a.ranks.values():
        assert run.outcome in ("ended", "left") or isinstance(run.outcome, ft.CoordinatorLost)


async def test_formation_deadline_counts_from_the_start_not_from_the_last_join(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    """A relay joining late does not extend the deadline."""
    cfg = ft.CoordinatorConfig(world_size=3, formation_timeout=10)
    async with hosts_by_hand(memory_network, 3) as hosts:

        async def late_host() -> None:
            await trio.sleep(9)
            await hosts.start("host-late", [2])

        hosts.nursery.start_soon(late_host)
        await hosts.start("host-a", [0])
        started = trio.current_time()
        with pytest.raises(ft.FormationTimeout) as excinfo:
            async with hosts.coordinator(cfg):
                pytest.fail("rank 1 is never covered")
        assert trio.current_time() - started == pytest.approx(10)
    text = str(excinfo.value)
    assert "2/3 ranks covered" in text
    assert "host-a [0]" in text and "host-late [2]" in text


async def test_abort_during_formation_raises_formation_aborted_with_coverage(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    abort = trio.Event()
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=60)
    async with hosts_by_hand(memory_network, 4, {"host-a": [0, 1]}) as hosts:
        host_a = hosts.runs["host-a"]

        async def abort_later() -> None:
            await wait_until(lambda: bool(events_of(hosts.timeline, RelayJoined)))
            await trio.sleep(3)
            abort.set()

        hosts.nursery.start_soon(abort_later)
        error, elapsed = await failed_formation(
            hosts.coordinator(cfg, abort=abort), ft.FormationAborted,
            why="the block must not be entered after abort")
        await wait_until(lambda: host_a.all_done, limit=30)
    assert isinstance(error, ft.FormationError)
    assert elapsed < 60
    text = str(error)
    assert "aborted" in text
    assert "2/4 ranks covered" in text
    assert "host-a [0, 1]" in text
    (failed,) = events_of(hosts.timeline, FormationFailed)
    assert failed.covered == 2


async def test_abort_set_before_open_fails_formation_immediately(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    abort = trio.Event()
    abort.set()
    cfg = ft.CoordinatorConfig(world_size=2, formation_timeout=60)
    started = trio.current_time()
    with pytest.raises(ft.FormationAborted, match=r"0/2 ranks covered"):
        async with ft.open_coordinator(memory_network.listener(COORD),
                                       salt=ft.SessionSalt.generate(), config=cfg, abort=abort):
            pytest.fail("the block must not be entered after abort")
    assert trio.current_time() - started == pytest.approx(0)


async def test_abort_after_formation_has_no_effect(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    abort = trio.Event()
    cfg = ft.CoordinatorConfig(world_size=1, formation_timeout=60)
    async with hosts_by_hand(memory_network, 1, {"host-a": [0]}) as hosts:
        host = hosts.runs["host-a"]
        async with hosts.coordinator(cfg, abort=abort) as coord:
            abort.set()
            await trio.sleep(2)
            assert coord.state()["phase"] == "running"
            assert coord.live_ranks == frozenset({0})
        await wait_until(lambda: host.all_done)
    assert host.ranks[0].outcome == "ended"
