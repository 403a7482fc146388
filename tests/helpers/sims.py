"""Simulated ranks (:mod:`flodl_trio.sim`) in a local cluster, for the scheduler's whole runs; and
hosts of simulated ranks started by hand (:func:`start_sim_host`), for worlds that change: hosts
that die and come back, join or leave, or freeze and wake up."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

import flodl_trio as ft
from flodl_trio.sim import SimRecord
from flodl_trio.testing import MemoryNetwork, open_local_cluster

from helpers.frozen import Freeze, FrozenStream
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




@attrs.define(eq=False)
class SimHost:
    """One relay and its simulated ranks started by hand (:func:`start_sim_host`), running until
    killed or the run ends. ``sims[rank].record`` is what each rank did; ``exit`` is how the
    relay ended (a ``RelayExit`` or the exception), once ``done`` is set."""

    host: str
    ranks: list[int]
    sims: dict[int, Any] = attrs.Factory(dict)
    relay: ft.Relay | None = None
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    # How each rank's sim ended: its SimRecord, or the exception (RankEvicted, ...).
    outcomes: dict[int, Any] = attrs.Factory(dict)
    # Set: the host's streams (the relay's upstream, the ranks' links) freeze at its switch.
    freeze: Freeze | None = None
    relay_config: ft.RelayConfig | None = None
    rank_config: ft.RankConfig | None = None
    exit: Any = None
    done: trio.Event = attrs.Factory(trio.Event)

    @property
    def records(self) -> dict[int, SimRecord]:
        """What each of its ranks did so far."""
        return {rank: sim.record for rank, sim in self.sims.items()}

    def worked_in(self, epoch: int) -> bool:
        """Its first rank reported a batch of ``epoch``."""
        sim = self.sims.get(self.ranks[0])
        return sim is not None and any(e == epoch for e, _, _ in sim.record.processed)

    def kill(self) -> None:
        """The host is gone as a SIGKILLed one is: relay and ranks, without a word."""
        self.scope.cancel()

    async def kill_and_wait(self) -> None:
        """:meth:`kill`, then wait until the relay and its ranks are gone."""
        self.kill()
        await self.done.wait()


def batches(batch_size: int, batch_ms: float = 50.0) -> Any:
    """``sim_args`` for :func:`start_sim_host`: every rank the same batches."""
    return lambda rank: {"batch_size": batch_size, "batch_ms": batch_ms}


async def _sim_rank(net: MemoryNetwork, h: SimHost, rank: int, *, salt: ft.SessionSalt,
                    world: int, sim_args: Any) -> None:
    from flodl_trio.sim import SimulatedCrash, SimulatedRank

    try:
        async with ft.open_rank(_dialer(net, f"relay:{h.host}", h.freeze), salt=salt,
                                rank=rank, world_size=world, config=h.rank_config) as ep:
            h.sims[rank] = SimulatedRank(ep, **sim_args(rank))
            h.outcomes[rank] = await h.sims[rank].run()
    except (SimulatedCrash, ft.FlodlError) as exc:
        h.outcomes[rank] = exc  # the coordinator says what became of it


def _dialer(net: MemoryNetwork, name: str, freeze: Freeze | None) -> Any:
    """Dial ``name``; with ``freeze``, the dialer's end is gated by it (a frozen host's)."""
    if freeze is None:
        return lambda: net.connect(name)

    async def dial() -> trio.abc.Stream:
        return FrozenStream(await net.connect(name), freeze)

    return dial


async def _run_sim_host(net: MemoryNetwork, h: SimHost, *, salt: ft.SessionSalt, world: int,
                        sim_args: Any) -> None:
    try:
        with h.scope:
            async with ft.open_relay(_dialer(net, COORD, h.freeze), salt=salt, host=h.host,
                                     ranks=h.ranks, world_size=world,
                                     rank_listen=net.listener(f"relay:{h.host}"),
                                     config=h.relay_config) as relay:
                h.relay = relay
                async with trio.open_nursery() as nursery:
                    for rank in h.ranks:
                        nursery.start_soon(functools.partial(
                            _sim_rank, net, h, rank, salt=salt, world=world,
                            sim_args=sim_args))
                    h.exit = await relay.wait_closed()
    except ft.FlodlError as exc:
        h.exit = exc
    finally:
        h.done.set()


def start_sim_host(nursery: trio.Nursery, net: MemoryNetwork, host: str, ranks: Sequence[int],
                   *, salt: ft.SessionSalt, world: int, sim_args: Any,
                   freeze: Freeze | None = None, relay_config: ft.RelayConfig | None = None,
                   rank_config: ft.RankConfig | None = None) -> SimHost:
    """Start a relay (ranks dial ``relay:<host>``) that dials :data:`COORD`, and one
    ``SimulatedRank`` per rank (``sim_args(rank)``: its keyword arguments). With ``freeze``
    the host's streams stop at its switch, as a ``SIGSTOP``-ped host's do."""
    h = SimHost(host, list(ranks), freeze=freeze, relay_config=relay_config,
                rank_config=rank_config)
    nursery.start_soon(functools.partial(_run_sim_host, net, h, salt=salt, world=world,
                                         sim_args=sim_args))
    return h
