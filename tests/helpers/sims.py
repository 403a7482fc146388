"""Simulated ranks (:mod:`flodl_trio.sim`) in a local cluster, for the scheduler's whole runs."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs

import flodl_trio as ft
from flodl_trio.testing import MemoryNetwork, open_local_cluster


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


