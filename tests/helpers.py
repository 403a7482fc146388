"""Shared helpers for the test suite: small in-memory clusters built from the public API."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import attrs
import trio

import flodl_trio as ft
from flodl_trio.testing import MemoryNetwork

COORD = "coordinator"


@attrs.define
class MiniCluster:
    coord: ft.Coordinator
    relays: dict[str, ft.Relay]
    ranks: dict[int, ft.RankEndpoint]
    salt: ft.SessionSalt
    net: MemoryNetwork


def layout(hosts: int, per_host: int) -> dict[str, list[int]]:
    return {f"host-{h}": list(range(h * per_host, (h + 1) * per_host)) for h in range(hosts)}


@asynccontextmanager
async def mini_cluster(
    net: MemoryNetwork,
    hosts: dict[str, Sequence[int]],
    *,
    salt: ft.SessionSalt | None = None,
    coord_config: ft.CoordinatorConfig | None = None,
    relay_config: ft.RelayConfig | None = None,
    rank_config: ft.RankConfig | None = None,
    timeline: ft.Timeline | None = None,
) -> AsyncIterator[MiniCluster]:
    """Coordinator + relays + rank endpoints over one MemoryNetwork, in this Trio run."""
    salt = salt or ft.SessionSalt.generate()
    world = sum(len(r) for r in hosts.values())
    cfg = coord_config or ft.CoordinatorConfig(world_size=world)
    relays: dict[str, ft.Relay] = {}
    ranks: dict[int, ft.RankEndpoint] = {}
    listener = net.listener(COORD)
    async with AsyncExitStack() as stack:
        entered = trio.Event()
        holder: dict[str, Any] = {}

        async def run_relay(host: str, host_ranks: Sequence[int], task_status: Any) -> None:
            rank_net = f"relay:{host}"
            async with ft.open_relay(
                lambda: net.connect(COORD), salt=salt, host=host, ranks=host_ranks,
                world_size=world, rank_listen=net.listener(rank_net),
                config=relay_config or ft.RelayConfig(),
            ) as relay:
                relays[host] = relay
                task_status.started()
                await relay.wait_closed()

        async def run_rank(host: str, rank: int, task_status: Any) -> None:
            async with ft.open_rank(
                lambda: net.connect(f"relay:{host}"), salt=salt, rank=rank, world_size=world,
                config=rank_config or ft.RankConfig(),
            ) as ep:
                ranks[rank] = ep
                task_status.started()
                await holder["done"].wait()

        nursery = await stack.enter_async_context(trio.open_nursery())
        holder["done"] = trio.Event()
        for host, host_ranks in hosts.items():
            await nursery.start(run_relay, host, host_ranks)
        for host, host_ranks in hosts.items():
            for r in host_ranks:
                nursery.start_soon(run_rank_started, nursery, run_rank, host, r)
        coord = await stack.enter_async_context(
            ft.open_coordinator(listener, salt=salt, config=cfg, timeline=timeline)
        )
        with trio.fail_after(5):
            while len(ranks) < world:
                await trio.sleep(0.01)
        entered.set()
        try:
            yield MiniCluster(coord, relays, ranks, salt, net)
        finally:
            holder["done"].set()


async def run_rank_started(nursery: trio.Nursery, fn: Any, *args: Any) -> None:
    await nursery.start(fn, *args)
