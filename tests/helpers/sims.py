"""Simulated ranks (:mod:`flodl_trio.sim`) in a local cluster, for the scheduler's whole runs; and
hosts of simulated ranks started by hand (:class:`SimHost`), for the runs where a host dies and
comes back."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

import flodl_trio as ft
from flodl_trio.sim import SimRecord, SimulatedRank
from flodl_trio.testing import MemoryNetwork, open_local_cluster

from helpers.raw import COORD


@attrs.define
class SimCluster:
    """What :func:`sim_cluster` yields.

    ``outcomes[rank]`` is set when that rank's sim ends: its ``SimRecord``, or the exception it
    ended with (``SimulatedCrash``, ``CoordinatorLost``, ...). ``sims[rank].record`` is live.
    """

    coord: ft.Coordinator
    sims: dict[int, Any]
    outcomes: dict[int, Any]
    net: MemoryNetwork


@asynccontextmanager
async def sim_cluster(
    net: MemoryNetwork,
    hosts: dict[str, Sequence[int]],
    sim_args: Any,
    *,
    coord_config: ft.CoordinatorConfig | None = None,
    rank_configs: dict[int, ft.RankConfig] | None = None,
    timeline: ft.Timeline | None = None,
    store: Any = None,
) -> AsyncIterator[SimCluster]:
    """``open_local_cluster`` with one ``SimulatedRank`` per rank (``sim_args(rank)`` gives its
    keyword arguments). A crash leaves that rank's block with an exception (no ``Exiting``; the
    relay reports ``RankExit``); hung sims are cancelled at exit."""
    from flodl_trio.sim import SimulatedCrash, SimulatedRank

    sims: dict[int, Any] = {}

    async def run_sim(ep: ft.RankEndpoint) -> Any:
        sims[ep.rank] = SimulatedRank(ep, **sim_args(ep.rank))
        return await sims[ep.rank].run()

    async with open_local_cluster(hosts, network=net, coord_config=coord_config,
                                  rank_configs=rank_configs, timeline=timeline,
                                  rank_main=run_sim, store=store,
                                  rank_errors=(SimulatedCrash, ft.FlodlError)) as cluster:
        try:
            yield SimCluster(cluster.coord, sims, cluster.outcomes, net)
        finally:
            for rank, sim in sims.items():
                if sim.record.failed and rank not in cluster.outcomes:
                    cluster.kill_rank(rank)




# ---------------------------------------------------------------------------------------------
# Hosts started by hand: a relay and its simulated ranks, killed and started again at will.


@attrs.define(eq=False)
class SimHost:
    """One relay and its simulated ranks, running until killed (``scope.cancel()``) or the run
    ends; ``exit`` is how its relay ended (a ``RelayExit`` or the error)."""

    host: str
    ranks: list[int]
    world_size: int
    batch_size: int
    batch_ms: float
    records: dict[int, SimRecord] = attrs.Factory(dict)
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    exit: Any = None
    done: trio.Event = attrs.Factory(trio.Event)

    def worked_in(self, epoch: int) -> bool:
        """Its first rank reported a batch of ``epoch``."""
        rec = self.records.get(self.ranks[0])
        return rec is not None and any(e == epoch for e, _, _ in rec.processed)

    async def kill(self) -> None:
        """Cancel the relay and its ranks (no ``Exiting``: a lost relay) and wait until done."""
        self.scope.cancel()
        await self.done.wait()


async def _sim_rank(net: MemoryNetwork, h: SimHost, rank: int, salt: ft.SessionSalt) -> None:
    async with ft.open_rank(lambda: net.connect(f"relay:{h.host}"), salt=salt, rank=rank,
                            world_size=h.world_size) as ep:
        sim = SimulatedRank(ep, batch_size=h.batch_size, batch_ms=h.batch_ms)
        h.records[rank] = sim.record
        await sim.run()


async def _run_host(net: MemoryNetwork, h: SimHost, salt: ft.SessionSalt) -> None:
    try:
        with h.scope:
            async with ft.open_relay(lambda: net.connect(COORD), salt=salt, host=h.host,
                                     ranks=h.ranks, world_size=h.world_size,
                                     rank_listen=net.listener(f"relay:{h.host}")) as relay:
                async with trio.open_nursery() as nursery:
                    for rank in h.ranks:
                        nursery.start_soon(_sim_rank, net, h, rank, salt)
                    h.exit = await relay.wait_closed()
    except ft.FlodlError as exc:
        h.exit = exc
    finally:
        h.done.set()


def start_sim_host(nursery: trio.Nursery, net: MemoryNetwork, host: str, ranks: list[int],
                   salt: ft.SessionSalt, *, world_size: int = 4, batch_size: int = 4,
                   batch_ms: float = 50.0) -> SimHost:
    """Start ``host``'s relay (reaching the coordinator at ``COORD``) and one ``SimulatedRank``
    per rank in ``nursery``; the returned :class:`SimHost` fills in as they run."""
    h = SimHost(host, ranks, world_size, batch_size, batch_ms)
    nursery.start_soon(functools.partial(_run_host, net, h, salt))
    return h
