"""A whole cluster (coordinator + relays + rank endpoints) in one Trio run, for tests and demos.

:func:`open_local_cluster` and :class:`LocalCluster` are also importable from
:mod:`flodl_trio.testing`, beside the in-memory network they run on::

    async with open_local_cluster({"host-a": [0, 1], "host-b": [2]}) as cluster:
        await cluster.coord.broadcast_control(SyncNow())
        msg = await cluster.ranks[2].receive()

Over a :class:`~flodl_trio.testing.MemoryNetwork` (the default; works under ``MockClock``) or over
real loopback TCP (``transport="tcp"``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal

import attrs
import trio

from ._config import CoordinatorConfig, RankConfig, RelayConfig
from ._errors import ConfigError, FlodlError
from ._memory_network import MemoryNetwork
from .coordinator import Coordinator, bind_coordinator, open_coordinator
from .rank import RankEndpoint, open_rank
from .relay import Relay, open_relay
from .timeline import Timeline
from .wire import SessionSalt

COORDINATOR_NAME = "coordinator"


@attrs.define
class LocalCluster:
    """Handles to every part of a local cluster.

    Attributes:
        coord: the formed :class:`Coordinator`.
        relays: host name → :class:`Relay`.
        ranks: global rank → :class:`RankEndpoint` (connected, not yet iterated).
        salt: the session salt.
        network: the MemoryNetwork in use (None over TCP).
        outcomes: global rank → what its ``rank_main`` returned, or the ``rank_errors``
            exception it raised (filled as ranks finish).
    """

    coord: Coordinator
    relays: dict[str, Relay]
    ranks: dict[int, RankEndpoint]
    salt: SessionSalt
    network: MemoryNetwork | None
    outcomes: dict[int, object] = attrs.field(factory=dict)
    _rank_stops: dict[int, trio.CancelScope] = attrs.field(factory=dict)
    _relay_stops: dict[str, trio.CancelScope] = attrs.field(factory=dict)

    def kill_rank(self, rank: int) -> None:
        """Cancel one rank's task: its connection closes without ``Exiting`` (a crash)."""
        self._rank_stops[rank].cancel()

    def kill_relay(self, host: str) -> None:
        """Cancel one relay's task: its upstream and rank connections close at once."""
        self._relay_stops[host].cancel()


def layout(hosts: int, ranks_per_host: int) -> dict[str, list[int]]:
    """``{"host-0": [0, 1], "host-1": [2, 3], ...}``."""
    return {f"host-{h}": list(range(h * ranks_per_host, (h + 1) * ranks_per_host))
            for h in range(hosts)}


@asynccontextmanager
async def open_local_cluster(
    hosts: Mapping[str, Sequence[int]],
    *,
    transport: Literal["memory", "tcp"] = "memory",
    network: MemoryNetwork | None = None,
    salt: SessionSalt | None = None,
    coord_config: CoordinatorConfig | None = None,
    relay_config: RelayConfig | None = None,
    rank_config: RankConfig | None = None,
    timeline: Timeline | None = None,
    rank_configs: Mapping[int, RankConfig] | None = None,
    rank_main: Callable[[RankEndpoint], Awaitable[object]] | None = None,
    rank_errors: tuple[type[Exception], ...] = (FlodlError,),
) -> AsyncIterator[LocalCluster]:
    """Start a coordinator, one relay per host and every rank; yield once all are connected.

    Leaving the block lets every rank leave cleanly (``Exiting``), then shuts the coordinator
    down; the relays end once their ranks are gone.

    Args:
        rank_configs: per-rank :class:`RankConfig` overrides of ``rank_config``.
        rank_main: what each rank does inside its ``open_rank`` block (e.g. run a
            ``SimulatedRank``); its result goes to ``cluster.outcomes``. Without it a rank waits
            until the block is left.
        rank_errors: exceptions of ``rank_main`` that end only that rank: they leave its
            ``open_rank`` block (no ``Exiting``, like a crash) and go to ``cluster.outcomes``.

    Raises:
        ConfigError: the layout is empty or its ranks are not exactly ``range(world_size)``.
    """
    all_ranks = sorted(r for rs in hosts.values() for r in rs)
    if not all_ranks or all_ranks != list(range(len(all_ranks))):
        raise ConfigError(f"open_local_cluster: expected the hosts' ranks to be exactly "
                          f"0..W-1 once each, got {all_ranks}")
    world = len(all_ranks)
    salt = salt or SessionSalt.generate()
    cfg = coord_config or CoordinatorConfig(world_size=world)
    net = network
    if transport == "memory" and net is None:
        net = MemoryNetwork()
    relays: dict[str, Relay] = {}
    ranks: dict[int, RankEndpoint] = {}
    all_connected = trio.Event()
    release = trio.Event()
    rank_stops: dict[int, trio.CancelScope] = {}
    relay_stops: dict[str, trio.CancelScope] = {}
    listen: Any
    if transport == "memory":
        assert net is not None
        listen = net.listener(COORDINATOR_NAME)
        memory_net = net

        async def dial_coordinator() -> trio.abc.Stream:
            return await memory_net.connect(COORDINATOR_NAME)
        target: Any = dial_coordinator
    elif transport == "tcp":
        listen = await bind_coordinator(("127.0.0.1", 0))
        target = listen.address
    else:
        raise ConfigError(f"open_local_cluster: transport must be 'memory' or 'tcp', got "
                          f"{transport!r}")

    outcomes: dict[int, object] = {}
    configs = dict(rank_configs or {})

    async def run_rank(host: str, rank: int, dial: Any) -> None:
        with trio.CancelScope() as scope:
            rank_stops[rank] = scope
            try:
                async with open_rank(dial, salt=salt, rank=rank, world_size=world,
                                     config=configs.get(rank, rank_config)) as ep:
                    ranks[rank] = ep
                    if len(ranks) == world:
                        all_connected.set()
                    if rank_main is None:
                        await release.wait()
                    else:
                        outcomes[rank] = await rank_main(ep)
            except rank_errors as exc:
                if rank_main is None:
                    raise
                outcomes[rank] = exc

    async def run_relay(host: str, host_ranks: Sequence[int], nursery: trio.Nursery) -> None:
        with trio.CancelScope() as scope:
            relay_stops[host] = scope
            rank_listen: Any = None
            if transport == "memory":
                assert net is not None
                rank_listen = net.listener(f"relay:{host}")
            async with open_relay(target, salt=salt, host=host, ranks=host_ranks,
                                  world_size=world, rank_listen=rank_listen,
                                  config=relay_config) as relay:
                relays[host] = relay
                if transport == "memory":
                    assert net is not None
                    memory = net

                    async def dial_relay() -> trio.abc.Stream:
                        return await memory.connect(f"relay:{host}")
                    dial: Any = dial_relay
                else:
                    dial = relay.rank_address
                for r in host_ranks:
                    nursery.start_soon(run_rank, host, r, dial)
                await relay.wait_closed()

    async with trio.open_nursery() as nursery:
        for host, host_ranks in hosts.items():
            nursery.start_soon(run_relay, host, list(host_ranks), nursery)
        try:
            async with open_coordinator(listen, salt=salt, config=cfg,
                                        timeline=timeline) as coord:
                await all_connected.wait()
                try:
                    yield LocalCluster(coord, relays, ranks, salt, net, outcomes, rank_stops,
                                       relay_stops)
                finally:
                    # Ranks leave cleanly (Exiting) before the coordinator shuts down, so the
                    # shutdown does not wait out its grace period for ranks nobody iterates.
                    release.set()
        finally:
            release.set()
