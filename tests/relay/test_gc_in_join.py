"""Issue 38: a relay pauses Python's cyclic garbage collector for its join (its ranks' accept,
their handshakes, the upstream handshake, the pump's start) and resumes it as it was found once
its pump runs or the join failed; ``RelayConfig(pause_gc_in_join=False)`` leaves it alone."""

from __future__ import annotations

import gc

import pytest
import trio

import flodl_trio as ft
from flodl_trio._gc import gc_pausers
from flodl_trio.testing import MemoryNetwork

from helpers import COORD, hosts_by_hand, start_rank

COORDINATOR = ft.CoordinatorConfig(world_size=2, pause_gc_in_formation=False)


@pytest.mark.parametrize("pause", [True, False])
async def test_the_collector_is_paused_while_the_relay_joins_and_resumed_once_it_runs(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, gc_restored: None,
        pause: bool) -> None:
    done = trio.Event()
    async with hosts_by_hand(memory_network, 2) as hosts:

        async def coordinator() -> None:
            async with hosts.coordinator(COORDINATOR):
                await done.wait()

        hosts.nursery.start_soon(coordinator)
        host = await hosts.start("host-a", [0, 1], start_ranks=[0],
                                 relay_config=ft.RelayConfig(pause_gc_in_join=pause))
        await trio.sleep(1)  # the relay waits for rank 1
        assert gc.isenabled() is not pause and gc_pausers() == int(pause)
        start_rank(hosts.nursery, memory_network, host.ranks[1], salt=hosts.salt, world=2)
        assert host.relay is not None
        await host.relay.wait_connected()
        assert gc.isenabled() and gc_pausers() == 0  # resumed as its pump started
        done.set()
    assert gc.isenabled()


async def test_the_collector_is_resumed_when_the_join_fails(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork,
        gc_restored: None) -> None:
    net = memory_network
    cfg = ft.RelayConfig(rank_accept_timeout=5)
    with pytest.raises(ft.FormationTimeout):
        async with ft.open_relay(lambda: net.connect(COORD), salt=ft.SessionSalt.generate(),
                                 host="host-a", ranks=[0], world_size=1,
                                 rank_listen=net.listener("relay:host-a"), config=cfg) as relay:
            await trio.sleep(1)  # it waits for rank 0
            assert not gc.isenabled() and gc_pausers() == 1
            await relay.wait_closed()
    assert gc.isenabled() and gc_pausers() == 0
    gc.disable()  # a collector the program disabled stays disabled
    with pytest.raises(ft.FormationTimeout):
        async with ft.open_relay(lambda: net.connect(COORD), salt=ft.SessionSalt.generate(),
                                 host="host-a", ranks=[0], world_size=1,
                                 rank_listen=net.listener("relay:host-a"), config=cfg) as relay:
            await relay.wait_closed()
    assert not gc.isenabled() and gc_pausers() == 0
