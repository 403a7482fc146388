"""The public local-cluster tools: every part in one Trio run, memory or TCP."""

from __future__ import annotations

from typing import Any

import trio

from flodl_trio.local_cluster import layout
from flodl_trio.wire import DeclareDead, SyncNow


async def test_local_cluster_factory_forms_and_delivers_over_memory(
    autojump_clock: trio.abc.Clock, local_cluster_factory: Any
) -> None:
    async with local_cluster_factory(layout(2, 2)) as cluster:
        assert cluster.coord.live_ranks == frozenset(range(4))
        await cluster.coord.send_control(3, SyncNow())
        assert isinstance(await cluster.ranks[3].receive(), SyncNow)


async def test_killed_relay_in_local_cluster_is_declared_dead_and_survivors_told(
    autojump_clock: trio.abc.Clock, local_cluster_factory: Any
) -> None:
    async with local_cluster_factory(layout(2, 2)) as cluster:
        cluster.kill_relay("host-1")
        await trio.sleep(0.1)
        assert cluster.coord.dead_ranks == frozenset({2, 3})
        told = {(await cluster.ranks[0].receive()).rank for _ in range(2)}
        assert told == {2, 3}
        assert all(isinstance(e, DeclareDead) for e in [])


async def test_local_cluster_over_real_tcp() -> None:
    from flodl_trio.local_cluster import open_local_cluster

    with trio.fail_after(10):
        async with open_local_cluster(layout(2, 1), transport="tcp") as cluster:
            assert cluster.coord.address is not None
            await cluster.coord.broadcast_control(SyncNow())
            for r in (0, 1):
                assert isinstance(await cluster.ranks[r].receive(), SyncNow)
