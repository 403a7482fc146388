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

import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal, Protocol

import attrs
import trio

from ._config import CoordinatorConfig, RankConfig, RelayConfig, relay_config_for
from ._errors import ConfigError, FlodlError
from ._lifecycle import choose_one_exception
from .chaos import FaultPlan, FaultyDialer
from .coordinator import Coordinator, bind_coordinator, open_coordinator
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


class _Started:
    """The ``task_status`` of a raw rank: ``started()`` counts it as connected."""

    def __init__(self, on_started: Callable[[], None]) -> None:
        self._on_started = on_started
        self.called = False

    def started(self, value: object = None) -> None:
        if self.called:
            raise RuntimeError("open_local_cluster: a raw rank called task_status.started() "
                               "twice")
        self.called = True
        self._on_started()


class _Running:
    """The relay and rank tasks still running, by name; ``all_done`` once there are none."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = set(names)
        self.all_done = trio.Event()
        if not self.names:
            self.all_done.set()

    def finished(self, name: str) -> None:
        self.names.discard(name)
        if not self.names:
            self.all_done.set()


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
    raw_ranks: Mapping[int, RawRankMain] | None = None,
    teardown_timeout: float = 60.0,
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
    world = len(all_ranks)
    relay_config = relay_config_for(relay_config, [rank_config or RankConfig(),
                                                   *(rank_configs or {}).values()])
    salt = salt or SessionSalt.generate()
    cfg = coord_config or CoordinatorConfig(world_size=world)
    net = network
    if transport == "memory" and net is None:
        net = MemoryNetwork()
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

    relays: dict[str, Relay] = {}
    ranks: dict[int, RankEndpoint] = {}
    connected: set[int] = set()
    all_connected = trio.Event()
    release = trio.Event()
    rank_stops: dict[int, trio.CancelScope] = {}
    relay_stops: dict[str, trio.CancelScope] = {}
    rank_done = {rank: trio.Event() for rank in all_ranks}
    outcomes: dict[int, object] = {}
    relay_exits: dict[str, RelayExit] = {}
    configs = dict(rank_configs or {})
    running = _Running([f"relay {h!r}" for h in hosts] + [f"rank {r}" for r in all_ranks])

    def rank_connected(rank: int) -> None:
        connected.add(rank)
        if len(connected) == world:
            all_connected.set()

    async def run_rank(rank: int, dial: Any) -> None:
        with trio.CancelScope() as scope:
            rank_stops[rank] = scope
            try:
                async with open_rank(dial, salt=salt, rank=rank, world_size=world,
                                     config=configs.get(rank, rank_config)) as ep:
                    ranks[rank] = ep
                    rank_connected(rank)
                    if rank_main is None:
                        await release.wait()
                        return
                    result = await rank_main(ep)
                outcomes[rank] = result
            except rank_errors as exc:
                if rank_main is None:
                    raise
                outcomes[rank] = exc

    async def run_raw_rank(slot: RawRankSlot, main: RawRankMain) -> None:
        status = _Started(lambda: rank_connected(slot.rank))
        with trio.CancelScope() as scope:
            rank_stops[slot.rank] = scope
            try:
                outcomes[slot.rank] = await main(slot, task_status=status)
            except rank_errors as exc:
                if not status.called:
                    raise
                outcomes[slot.rank] = exc
            if not status.called:
                # The cluster would wait for it forever (trio's nursery.start raises too).
                raise RuntimeError(f"open_local_cluster: raw rank {slot.rank} returned without "
                                   f"calling task_status.started()")

    async def run_one_rank(rank: int, body: Callable[..., Awaitable[None]], *args: Any) -> None:
        try:
            await body(*args)
        finally:
            rank_done[rank].set()
            running.finished(f"rank {rank}")

    async def run_relay(host: str, host_ranks: Sequence[int], nursery: trio.Nursery) -> None:
        try:
            with trio.CancelScope() as scope:
                relay_stops[host] = scope
                rank_listen: Any = None
                if transport == "memory":
                    assert net is not None
                    rank_listen = net.listener(f"relay:{host}")
                upstream: Any = target
                if host in plans:
                    upstream = FaultyDialer(_tcp_dialer(target) if isinstance(target, tuple)
                                            else target, plans[host])
                async with open_relay(upstream, salt=salt, host=host, ranks=host_ranks,
                                      world_size=world, rank_listen=rank_listen,
                                      config=relay_config) as relay:
                    relays[host] = relay
                    dial = _rank_port_dialer(net if transport == "memory" else None, host,
                                             relay)
                    # open_rank dials TCP by address (its messages name it).
                    target_of_ranks: Any = dial if transport == "memory" else relay.rank_address
                    for r in host_ranks:
                        if r in raws:
                            slot = RawRankSlot(r, host, world, salt, dial)
                            nursery.start_soon(run_one_rank, r, run_raw_rank, slot, raws[r])
                        elif r in plans:
                            nursery.start_soon(run_one_rank, r, run_rank, r,
                                               FaultyDialer(dial, plans[r]))
                        else:
                            nursery.start_soon(run_one_rank, r, run_rank, r, target_of_ranks)
                    relay_exits[host] = await relay.wait_closed()
        finally:
            running.finished(f"relay {host!r}")

    # What the block (the body, or the coordinator around it) raised: it leaves the cluster once
    # the relays and ranks have ended, since cancelling them sooner would cut what they still
    # deliver (a ShutdownWithSave a test asserts on).
    first: BaseException | None = None
    body_exc: BaseException | None = None
    too_slow: trio.TooSlowError | None = None
    failures: list[BaseException] = []
    try:
        async with trio.open_nursery() as nursery:
            for host, host_ranks in hosts.items():
                nursery.start_soon(run_relay, host, list(host_ranks), nursery)
            try:
                async with open_coordinator(listen, salt=salt, config=cfg,
                                            timeline=timeline, store=store) as coord:
                    await all_connected.wait()
                    try:
                        yield LocalCluster(coord, relays, ranks, salt, net, outcomes,
                                           relay_exits, rank_stops, relay_stops, rank_done)
                    except BaseException as exc:
                        # The body's own: it wins even if the coordinator's shutdown was then
                        # cut short (a part failing) and open_coordinator raised Cancelled.
                        body_exc = exc
                        raise
                    finally:
                        # Ranks leave cleanly (Exiting) before the coordinator shuts down, so the
                        # shutdown does not wait out its grace period for ranks nobody iterates.
                        release.set()
            except BaseException as exc:
                first = exc
            release.set()
            # The coordinator is closed: its Shutdown, Goodbye or EOF ends the relays and ranks.
            # (Cancelled from outside, this wait raises at once.)
            with trio.move_on_after(teardown_timeout):
                await running.all_done.wait()
            if running.names:
                too_slow = trio.TooSlowError(
                    f"open_local_cluster: expected every relay and rank to end within "
                    f"teardown_timeout={teardown_timeout:g}s of the coordinator closing, "
                    f"still running: {', '.join(sorted(running.names))}")
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        failures.extend(group.exceptions)
    own = body_exc if body_exc is not None and not isinstance(body_exc, trio.Cancelled) else first
    candidates = [own, first, *failures]
    failures = [exc for i, exc in enumerate(candidates)
                if exc is not None and all(exc is not seen for seen in candidates[:i])]
    cancelled_from_outside = trio.current_effective_deadline() == -math.inf
    if (own is None or isinstance(own, trio.Cancelled)) and not cancelled_from_outside:
        # One part failed (a rank_main's AssertionError, ...): that is the error, not an
        # internal one; the parts are the caller's code.
        own = _only_failure(failures)
    error: BaseException | None = too_slow
    if failures:
        error = choose_one_exception(
            BaseExceptionGroup("local cluster", failures), body_exc=own, failure=too_slow,
            what="local cluster", cancelled_from_outside=cancelled_from_outside)
    if error is None:
        return
    # A raise while the body's exception is being handled would overwrite the context chosen
    # above (as in flodl_trio._lifecycle).
    context = error.__context__
    try:
        raise error
    finally:
        error.__context__ = context
        del error, context


def _only_failure(excs: Sequence[BaseException]) -> BaseException | None:
    """The one exception in ``excs`` (groups flattened) that is not a cancellation, if one."""
    found: list[BaseException] = []
    todo = list(excs)
    while todo:
        exc = todo.pop()
        if isinstance(exc, BaseExceptionGroup):
            todo.extend(exc.exceptions)
        elif not isinstance(exc, trio.Cancelled):
            found.append(exc)
    return found[0] if len(found) == 1 else None


def _rank_port_dialer(net: MemoryNetwork | None, host: str, relay: Relay) -> Dialer:
    if net is not None:
        memory = net

        async def dial_memory() -> trio.abc.Stream:
            return await memory.connect(f"relay:{host}")
        return dial_memory
    return _tcp_dialer(relay.rank_address)


def _tcp_dialer(address: tuple[str, int]) -> Dialer:
    async def dial_tcp() -> trio.abc.Stream:
        return await trio.open_tcp_stream(*address)
    return dial_tcp
