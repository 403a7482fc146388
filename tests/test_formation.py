"""Formation: relays with several ranks each form a cohort, over memory and real TCP."""

from __future__ import annotations

import trio

import flodl_trio as ft
from flodl_trio.testing import MemoryNetwork

from helpers import layout, mini_cluster


async def test_three_relays_with_two_ranks_each_form_over_memory(autojump_clock: trio.abc.Clock,
                                                                 memory_network: MemoryNetwork
                                                                 ) -> None:
    async with mini_cluster(memory_network, layout(3, 2)) as c:
        assert c.coord.world_size == 6
        assert c.coord.live_ranks == frozenset(range(6))
        assert [r.host for r in c.coord.relays] != []
        assert sorted(r.host for r in c.coord.relays) == ["host-0", "host-1", "host-2"]
        assert c.coord.state()["phase"] == "running"
