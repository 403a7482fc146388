"""Elastic membership (issue 37) with real relays and recording ranks over the in-memory network,
under MockClock: a world of MIN to MAX ranks forms once its minimum is covered and its join window
passed (at once with its maximum), a host the run did not start with joins the running cohort,
and dead ranks are retired so the world stops waiting for them."""

from __future__ import annotations

import trio

import flodl_trio as ft
from flodl_trio.events import FormationComplete
from flodl_trio.testing import EventLog, MemoryNetwork

from helpers import failed_formation, hosts_by_hand


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
