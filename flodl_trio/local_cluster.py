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
from typing import Any, Literal, Protocol

import attrs
import trio

from ._cluster_parts import ClusterNetwork, Running, Started, one_error
from ._config import CoordinatorConfig, RankConfig, RelayConfig, relay_config_for
from ._errors import ConfigError, FlodlError
from ._lifecycle import raise_keeping_context
from .chaos import FaultPlan, FaultyDialer
from .coordinator import Coordinator, open_coordinator
from .net._memory_network import MemoryNetwork
from .net._transport import Dialer
from .rank import RankEndpoint, open_rank
from .relay import Relay, RelayExit, open_relay
from .store import SessionStore
from .timeline import Timeline
from .wire import SessionSalt

__all__ = ["COORDINATOR_NAME", "LocalCluster", "RawRankMain", "RawRankSlot", "layout",
           "open_local_cluster"]

COORDINATOR_NAME = "coordinator"


@attrs.frozen
class RawRankSlot:
    """The place a raw rank (``raw_ranks=`` of :func:`open_local_cluster`) fills: who it is and
    how it reaches its relay.

    Attributes:
        rank: its global rank.
        host: the host whose relay it belongs to.
        world_size: the cluster's world size.
        salt: the session salt.
        dial: opens a new connection to its relay's rank port.
    """

    rank: int
    host: str
    world_size: int
    salt: SessionSalt
    dial: Dialer


class RawRankMain(Protocol):
    """A rank that speaks the wire itself instead of through :func:`open_rank`.

    It dials ``slot.dial()``, runs the rank handshake, calls ``task_status.started()`` once the
    relay confirmed it (the cluster is entered only after every rank got that far), then does
    whatever the test needs; what it returns goes to :attr:`LocalCluster.outcomes`.
    """

    def __call__(
        self, slot: RawRankSlot, *, task_status: trio.TaskStatus[None]
    ) -> Awaitable[object]: ...


@attrs.define
class LocalCluster:
    """Handles to every part of a local cluster.

    Attributes:
        coord: the formed :class:`Coordinator`.
        relays: host name → :class:`Relay`.
        ranks: global rank → :class:`RankEndpoint` (connected, not yet iterated); raw ranks
            have none.
        salt: the session salt.
        network: the MemoryNetwork in use (None over TCP).
        outcomes: global rank → what its ``rank_main`` (or raw rank) returned, or the
            ``rank_errors`` exception it raised, set once it has left its ``open_rank`` block. A
            rank ended by :meth:`kill_rank`, or that had no ``rank_main``, has none.
        relay_exits: host name → the :class:`RelayExit` its relay ended with (filled as relays
            end).
    """

    coord: Coordinator
    relays: dict[str, Relay]
    ranks: dict[int, RankEndpoint]
    salt: SessionSalt
    network: MemoryNetwork | None
    outcomes: dict[int, object] = attrs.field(factory=dict)
    relay_exits: dict[str, RelayExit] = attrs.field(factory=dict)
    _rank_stops: dict[int, trio.CancelScope] = attrs.field(factory=dict)
    _relay_stops: dict[str, trio.CancelScope] = attrs.field(factory=dict)
    _rank_done: dict[int, trio.Event] = attrs.field(factory=dict)

    def kill_rank(self, rank: int) -> None:
        """Cancel one rank's task: its connection closes without ``Exiting`` (a crash)."""
        self._rank_stops[rank].cancel()

    def kill_relay(self, host: str) -> None:
        """Cancel one relay's task: its upstream and rank connections close at once."""
        self._relay_stops[host].cancel()

    async def wait_rank_finished(self, rank: int) -> None:
        """Return once ``rank``'s task has ended (its ``open_rank`` block left, or killed)."""
        await self._rank_done[rank].wait()


def layout(hosts: int, ranks_per_host: int) -> dict[str, list[int]]:
    """``{"host-0": [0, 1], "host-1": [2, 3], ...}``."""
    return {f"host-{h}": list(range(h * ranks_per_host, (h + 1) * ranks_per_host))
            for h in range(hosts)}


@asynccontextmanager
async def open_local_cluster(
    hosts: Mapping[str, Sequence[int]], *, transport: Literal["memory", "tcp"] = "memory",
    network: MemoryNetwork | None = None, salt: SessionSalt | None = None,
    coord_config: CoordinatorConfig | None = None, relay_config: RelayConfig | None = None,
    rank_config: RankConfig | None = None, timeline: Timeline | None = None,
    rank_configs: Mapping[int, RankConfig] | None = None,
    rank_main: Callable[[RankEndpoint], Awaitable[object]] | None = None,
    rank_errors: tuple[type[Exception], ...] = (FlodlError,),
    raw_ranks: Mapping[int, RawRankMain] | None = None, teardown_timeout: float = 60.0,
    store: SessionStore | None = None,
    faults: Mapping[str | int, FaultPlan | Sequence[FaultPlan]] | None = None,
) -> AsyncIterator[LocalCluster]:
    """Start a coordinator, one relay per host and every rank; yield once all are connected.

    Leaving the block lets every rank without a ``rank_main`` leave cleanly (``Exiting``), then
    shuts the coordinator down; the ranks with one see its ``Shutdown`` and the relays end once
    their ranks are gone. Like :func:`open_coordinator`, the block raises one exception, never
    an ``ExceptionGroup``: the body's own, else the coordinator's (``ClusterFailure``, ...) or a
    part's, each only after the other parts had ``teardown_timeout`` to end on their own.

    Args:
        relay_config: every relay's :class:`RelayConfig`; without one, the defaults with a
            ``coord_liveness_timeout`` of at most 2/3 of the shortest rank's.
        rank_configs: per-rank :class:`RankConfig` overrides of ``rank_config``.
        rank_main: what each rank does inside its ``open_rank`` block (e.g. run a
            ``SimulatedRank``); its result goes to ``cluster.outcomes``. Without it a rank waits
            until the block is left.
        rank_errors: exceptions of ``rank_main`` that end only that rank: they leave its
            ``open_rank`` block (no ``Exiting``, like a crash) and go to ``cluster.outcomes``
            (the same for a raw rank once it has called ``task_status.started()``).
        raw_ranks: ranks that are not opened with :func:`open_rank` but speak the wire by hand:
            each ``main`` is called as ``main(slot, task_status=...)`` with its
            :class:`RawRankSlot` (see :class:`RawRankMain`).
        teardown_timeout: seconds the relays and ranks get to end on their own once the
            coordinator has closed; past it they are cancelled and ``trio.TooSlowError``
            (naming them) is raised.
        store: the coordinator's session store (``open_coordinator(store=...)``), if any.
        faults: fault plans for the first connections of a part (a
            :class:`~flodl_trio.chaos.FaultyDialer`, in memory or over TCP): a host name
            for its relay's connections to the coordinator, a rank for its connections to its
            relay; one plan (the first connection) or several (the first few); the re-dials
            after them are clean. ``FaultPlan().cut(*upstream_handshake_bytes(...).after(
            "Hello"))`` cuts a relay's first handshake right after its Hello.

    Raises:
        ConfigError: the layout is empty or its ranks are not exactly ``range(world_size)``,
            or ``raw_ranks`` (or ``faults``) names a rank (or host) outside it, or
            ``relay_config``'s ``coord_liveness_timeout`` is over 2/3 of a rank's (naming
            both).
        RuntimeError: a raw rank ended without calling ``task_status.started()``.
        trio.TooSlowError: a relay or rank did not end within ``teardown_timeout``.
    """
    plan = _Plan.checked(hosts, raw_ranks, faults, teardown_timeout, relay_config,
                         _RankPlan(rank_config, dict(rank_configs or {}), rank_main, rank_errors))
    builder = _ClusterBuilder(plan, salt or SessionSalt.generate(),
                              await ClusterNetwork.open(transport, network, COORDINATOR_NAME))
    async with builder.run(coord_config or CoordinatorConfig(world_size=plan.world),
                           timeline=timeline, store=store) as cluster:
        yield cluster


@attrs.frozen
class _RankPlan:
    """How every rank is opened and run (``rank_config``, ``rank_configs``, ``rank_main`` and
    ``rank_errors`` of :func:`open_local_cluster`)."""

    config: RankConfig | None
    configs: dict[int, RankConfig]
    main: Callable[[RankEndpoint], Awaitable[object]] | None
    errors: tuple[type[Exception], ...]


@attrs.frozen
class _Plan:
    """What :func:`open_local_cluster` was asked to build, checked before anything starts."""

    hosts: dict[str, list[int]]
    world: int
    raws: dict[int, RawRankMain]
    faults: dict[str | int, FaultPlan | Sequence[FaultPlan]]
    teardown_timeout: float
    relay_config: RelayConfig
    rank: _RankPlan

    @classmethod
    def checked(
        cls, hosts: Mapping[str, Sequence[int]], raw_ranks: Mapping[int, RawRankMain] | None,
        faults: Mapping[str | int, FaultPlan | Sequence[FaultPlan]] | None,
        teardown_timeout: float, relay_config: RelayConfig | None, rank: _RankPlan,
    ) -> _Plan:
        """The plan, or ``ConfigError`` naming the first thing that does not fit."""
        all_ranks = sorted(r for rs in hosts.values() for r in rs)
        if not all_ranks or all_ranks != list(range(len(all_ranks))):
            raise ConfigError(f"open_local_cluster: expected the hosts' ranks to be exactly "
                              f"0..W-1 once each, got {all_ranks}")
        raws = dict(raw_ranks or {})
        if not set(raws) <= set(all_ranks):
            raise ConfigError(f"open_local_cluster: expected raw_ranks among the ranks "
                              f"{all_ranks}, got {sorted(raws)}")
        plans = dict(faults or {})
        strangers = [repr(part) for part in plans if part not in hosts and part not in all_ranks]
        if strangers:
            raise ConfigError(f"open_local_cluster: expected faults for hosts {sorted(hosts)} or "
                              f"ranks {all_ranks}, got [{', '.join(strangers)}]")
        if not teardown_timeout >= 0:
            raise ConfigError(f"open_local_cluster: expected teardown_timeout >= 0 seconds, got "
                              f"{teardown_timeout!r}")
        relay = relay_config_for(relay_config, [rank.config or RankConfig(),
                                                *rank.configs.values()])
        return cls({host: list(rs) for host, rs in hosts.items()}, len(all_ranks), raws, plans,
                   teardown_timeout, relay, rank)


class _ClusterBuilder:
    """The parts of a local cluster as they start: the steps that start them, and the one that
    lets them end."""

    def __init__(self, plan: _Plan, salt: SessionSalt, network: ClusterNetwork) -> None:
        self._plan = plan
        self._salt = salt
        self._network = network
        self._relays: dict[str, Relay] = {}
        self._ranks: dict[int, RankEndpoint] = {}
        self._connected: set[int] = set()
        self._all_connected = trio.Event()
        self._release = trio.Event()
        self._rank_stops: dict[int, trio.CancelScope] = {}
        self._relay_stops: dict[str, trio.CancelScope] = {}
        self._rank_done = {rank: trio.Event() for rank in range(plan.world)}
        self._outcomes: dict[int, object] = {}
        self._relay_exits: dict[str, RelayExit] = {}
        self._running = Running([f"relay {h!r}" for h in plan.hosts]
                                 + [f"rank {r}" for r in range(plan.world)])

    @asynccontextmanager
    async def run(self, config: CoordinatorConfig, *, timeline: Timeline | None,
                  store: SessionStore | None) -> AsyncIterator[LocalCluster]:
        """Start the relays (each starts its ranks) and the coordinator; yield the cluster once
        every rank is connected; then let the parts end and raise the one exception chosen."""
        # What the block (the body, or the coordinator around it) raised: it leaves the cluster
        # once the relays and ranks have ended, since cancelling them sooner would cut what they
        # still deliver (a ShutdownWithSave a test asserts on).
        first: BaseException | None = None
        body_exc: BaseException | None = None
        too_slow: trio.TooSlowError | None = None
        failures: list[BaseException] = []
        try:
            async with trio.open_nursery() as nursery:
                for host, host_ranks in self._plan.hosts.items():
                    nursery.start_soon(self._run_relay, host, host_ranks, nursery)
                try:
                    async with open_coordinator(self._network.listen, salt=self._salt,
                                                config=config, timeline=timeline,
                                                store=store) as coord:
                        await self._all_connected.wait()
                        try:
                            yield self._cluster(coord)
                        except BaseException as exc:
                            # The body's own: it wins even if the coordinator's shutdown was
                            # then cut short (a part failing) and open_coordinator raised
                            # Cancelled.
                            body_exc = exc
                            raise
                        finally:
                            # Ranks leave cleanly (Exiting) before the coordinator shuts down,
                            # so the shutdown does not wait out its grace period for ranks
                            # nobody iterates.
                            self._release.set()
                except BaseException as exc:
                    first = exc
                too_slow = await self._wind_down(nursery)
        except BaseExceptionGroup as group:
            failures.extend(group.exceptions)
        error = one_error(body_exc, first, failures, too_slow)
        if error is not None:
            raise_keeping_context(error)

    def _cluster(self, coord: Coordinator) -> LocalCluster:
        return LocalCluster(coord, self._relays, self._ranks, self._salt, self._network.shown,
                            self._outcomes, self._relay_exits, self._rank_stops,
                            self._relay_stops, self._rank_done)

    async def _wind_down(self, nursery: trio.Nursery) -> trio.TooSlowError | None:
        """Once the coordinator is closed, its Shutdown, Goodbye or EOF ends the relays and
        ranks: wait ``teardown_timeout`` for them, then cancel those left and name them."""
        self._release.set()
        # (Cancelled from outside, this wait raises at once.)
        with trio.move_on_after(self._plan.teardown_timeout):
            await self._running.all_done.wait()
        if not self._running.names:
            return None
        nursery.cancel_scope.cancel()
        return trio.TooSlowError(
            f"open_local_cluster: expected every relay and rank to end within "
            f"teardown_timeout={self._plan.teardown_timeout:g}s of the coordinator closing, "
            f"still running: {', '.join(sorted(self._running.names))}")

    async def _run_relay(self, host: str, host_ranks: list[int], nursery: trio.Nursery) -> None:
        try:
            with trio.CancelScope() as scope:
                self._relay_stops[host] = scope
                rank_listen = self._network.rank_port(host)
                upstream = self._network.upstream(host, self._plan.faults)
                async with open_relay(upstream, salt=self._salt, host=host, ranks=host_ranks,
                                      world_size=self._plan.world, rank_listen=rank_listen,
                                      config=self._plan.relay_config) as relay:
                    self._relays[host] = relay
                    self._start_ranks(host, host_ranks, relay, nursery)
                    self._relay_exits[host] = await relay.wait_closed()
        finally:
            self._running.finished(f"relay {host!r}")

    def _start_ranks(self, host: str, host_ranks: list[int], relay: Relay,
                     nursery: trio.Nursery) -> None:
        dial = self._network.rank_dialer(host, relay)
        # open_rank dials TCP by address (its messages name it).
        plain: Any = dial if self._network.memory is not None else relay.rank_address
        for r in host_ranks:
            if r in self._plan.raws:
                slot = RawRankSlot(r, host, self._plan.world, self._salt, dial)
                nursery.start_soon(self._run_one_rank, r, self._run_raw_rank, slot,
                                   self._plan.raws[r])
            elif r in self._plan.faults:
                nursery.start_soon(self._run_one_rank, r, self._run_rank, r,
                                   FaultyDialer(dial, self._plan.faults[r]))
            else:
                nursery.start_soon(self._run_one_rank, r, self._run_rank, r, plain)

    async def _run_one_rank(self, rank: int, body: Callable[..., Awaitable[None]],
                            *args: Any) -> None:
        try:
            await body(*args)
        finally:
            self._rank_done[rank].set()
            self._running.finished(f"rank {rank}")

    def _rank_connected(self, rank: int) -> None:
        self._connected.add(rank)
        if len(self._connected) == self._plan.world:
            self._all_connected.set()

    async def _run_rank(self, rank: int, dial: Any) -> None:
        how = self._plan.rank
        with trio.CancelScope() as scope:
            self._rank_stops[rank] = scope
            try:
                async with open_rank(dial, salt=self._salt, rank=rank,
                                     world_size=self._plan.world,
                                     config=how.configs.get(rank, how.config)) as ep:
                    self._ranks[rank] = ep
                    self._rank_connected(rank)
                    if how.main is None:
                        await self._release.wait()
                        return
                    result = await how.main(ep)
                self._outcomes[rank] = result
            except how.errors as exc:
                if how.main is None:
                    raise
                self._outcomes[rank] = exc

    async def _run_raw_rank(self, slot: RawRankSlot, main: RawRankMain) -> None:
        status = Started(lambda: self._rank_connected(slot.rank))
        with trio.CancelScope() as scope:
            self._rank_stops[slot.rank] = scope
            try:
                self._outcomes[slot.rank] = await main(slot, task_status=status)
            except self._plan.rank.errors as exc:
                if not status.called:
                    raise
                self._outcomes[slot.rank] = exc
            if not status.called:
                # The cluster would wait for it forever (trio's nursery.start raises too).
                raise RuntimeError(f"open_local_cluster: raw rank {slot.rank} returned without "
                                   f"calling task_status.started()")
