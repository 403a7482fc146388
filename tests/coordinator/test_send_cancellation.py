"""Cancelling a send or a broadcast never leaves half a record on a relay link."""

from __future__ import annotations

import trio

from flodl_trio.local_cluster import layout
from flodl_trio.pytest_plugin import LocalClusterFactory
from flodl_trio.testing import MemoryNetwork
from flodl_trio.wire import SetGlobalStep


async def test_cancelled_broadcasts_still_leave_every_link_in_sync(
    autojump_clock: trio.abc.Clock, local_cluster_factory: LocalClusterFactory,
    memory_network: MemoryNetwork,
) -> None:
    async with local_cluster_factory(layout(2, 2)) as cluster:
        coord = cluster.coord
        for step in range(20):
            with trio.move_on_after(0):  # cancelled at its first checkpoint
                await coord.broadcast_control(SetGlobalStep(global_step=step))
        await coord.broadcast_control(SetGlobalStep(global_step=100))
        for rank in range(4):
            seen = []
            while not seen or seen[-1] != 100:  # bounded: 21 messages at most
                msg = await cluster.ranks[rank].receive()
                seen.append(msg.global_step)
                assert len(seen) <= 21
            # Every cancelled broadcast was still written whole, in order: no torn record,
            # no lost sync on the link (a torn record would end it with an AuthError).
            assert seen == [*range(20), 100]
        assert coord.dead_ranks == frozenset()
