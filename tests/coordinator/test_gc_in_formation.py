"""Issue 38: Python's cyclic garbage collector is paused while a cohort forms and resumed as it
was found, however formation ends (formed, timed out, cancelled), with several coordinators
forming at once in one process, and never touched with ``pause_gc_in_formation=False``."""

from __future__ import annotations

import contextlib
import gc

import pytest
import trio

import flodl_trio as ft
from flodl_trio._gc import gc_pausers
from flodl_trio.testing import MemoryNetwork

from helpers import hosts_by_hand

# The relays leave the collector alone: these tests see the coordinator's pause only (the
# relay's own, RelayConfig.pause_gc_in_join, is tests/relay/test_gc_in_join.py's).
RELAY = ft.RelayConfig(pause_gc_in_join=False)


async def test_the_collector_is_paused_while_forming_and_resumed_once_formed(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork,
        gc_restored: None) -> None:
    seen: list[bool] = []
    async with hosts_by_hand(memory_network, 4) as hosts:
        await hosts.start("host-a", [0, 1], relay_config=RELAY)

        async def watch() -> None:
            await trio.sleep(1)  # formation waits for host-b
            seen.append(gc.isenabled())
            await hosts.start("host-b", [2, 3], relay_config=RELAY)

        hosts.nursery.start_soon(watch)
        async with hosts.coordinator():
            assert gc.isenabled() and gc_pausers() == 0
    assert seen == [False]
    assert gc.isenabled()


@pytest.mark.parametrize("how", ["timeout", "cancelled"])
async def test_the_collector_is_resumed_when_formation_fails_or_is_cancelled(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, gc_restored: None,
        how: str) -> None:
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=5)
    async with hosts_by_hand(memory_network, 4) as hosts:
        await hosts.start("host-a", [0, 1], relay_config=RELAY)
        expect = (pytest.raises(ft.FormationTimeout) if how == "timeout"
                  else contextlib.nullcontext())
        with trio.move_on_after(2 if how == "cancelled" else 60):
            with expect:
                async with hosts.coordinator(cfg):
                    pytest.fail("host-b never comes")
    assert gc.isenabled() and gc_pausers() == 0


async def test_coordinators_forming_at_once_resume_it_when_the_last_one_formed(
        autojump_clock: trio.abc.Clock, gc_restored: None) -> None:
    states: list[tuple[str, bool]] = []

    async def one(name: str, host_after: float) -> None:
        net = MemoryNetwork()
        async with hosts_by_hand(net, 2) as hosts:
            async def late_host() -> None:
                await trio.sleep(host_after)
                await hosts.start(f"{name}-host", [0, 1], relay_config=RELAY)

            hosts.nursery.start_soon(late_host)
            async with hosts.coordinator():
                states.append((name, gc.isenabled()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, "first", 1.0)
        nursery.start_soon(one, "second", 3.0)
    assert states == [("first", False), ("second", True)]
    assert gc.isenabled()


async def test_a_disabled_collector_stays_disabled_and_false_leaves_it_alone(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork,
        gc_restored: None) -> None:
    gc.disable()
    async with hosts_by_hand(memory_network, 2) as hosts:
        await hosts.start("host-a", [0, 1], relay_config=RELAY)
        async with hosts.coordinator():
            pass
    assert not gc.isenabled()
    gc.enable()
    seen: list[bool] = []
    cfg = ft.CoordinatorConfig(world_size=2, pause_gc_in_formation=False)
    async with hosts_by_hand(memory_network, 2) as hosts:
        async def late_host() -> None:
            await trio.sleep(1)
            seen.append(gc.isenabled())
            await hosts.start("host-a", [0, 1], relay_config=RELAY)

        hosts.nursery.start_soon(late_host)
        async with hosts.coordinator(cfg):
            pass
    assert seen == [True] and gc.isenabled()

