"""Formation: relays with several ranks each form a cohort, over memory and real TCP."""

from __future__ import annotations

import trio

import flodl_trio as ft
from flodl_trio.local_cluster import layout, open_local_cluster
from flodl_trio.testing import MemoryNetwork


async def test_three_relays_with_two_ranks_each_form_over_memory(autojump_clock: trio.abc.Clock,
                                                                 memory_network: MemoryNetwork
                                                                 ) -> None:
    async with open_local_cluster(layout(3, 2), network=memory_network) as c:
        assert c.coord.world_size == 6
        assert c.coord.live_ranks == frozenset(range(6))
        assert [r.host for r in c.coord.relays] != []
        assert sorted(r.host for r in c.coord.relays) == ["host-0", "host-1", "host-2"]
        assert c.coord.state()["phase"] == "running"


async def test_two_relays_form_and_exchange_frames_over_real_tcp() -> None:
    salt = ft.SessionSalt.generate()
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=10)
    got: dict[int, list[str]] = {0: [], 1: [], 2: [], 3: []}
    bound = await ft.bind_coordinator(("127.0.0.1", 0))
    async with trio.open_nursery() as nursery:

        async def relay(host: str, ranks: list[int]) -> None:
            async with ft.open_relay(bound.address, salt=salt, host=host, ranks=ranks,
                                     world_size=4) as r:
                for rank in ranks:
                    nursery.start_soon(rank_task, r.rank_address, rank)
                await r.wait_closed()

        async def rank_task(addr: tuple[str, int], rank: int) -> None:
            async with ft.open_rank(addr, salt=salt, rank=rank, world_size=4) as ep:
                async for msg in ep:
                    got[rank].append(type(msg).__name__)

        nursery.start_soon(relay, "host-a", [0, 1, 2])
        nursery.start_soon(relay, "host-b", [3])
        with trio.fail_after(10):
            async with ft.open_coordinator(bound, salt=salt, config=cfg) as coord:
                assert coord.address == bound.address
                assert coord.covered_ranks == frozenset(range(4))
                await coord.send_control(2, ft.wire.SyncNow())
                result = await coord.broadcast_control(ft.wire.Throttle())
                assert result.delivered == frozenset(range(4))
                hb = await coord.timing.receive()
                assert isinstance(hb, ft.wire.TimingMsg)
    assert got[2] == ["SyncNow", "Throttle", "Shutdown"]
    assert got[0] == ["Throttle", "Shutdown"] and got[3] == ["Throttle", "Shutdown"]
