"""Shared helpers for the test suite: small in-memory clusters built from the public API."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

import flodl_trio as ft
from flodl_trio import events
from flodl_trio.testing import EventLog, MemoryNetwork, wait_until

COORD = "coordinator"


# ---------------------------------------------------------------------------------------------
# Hosts whose ranks record what they receive, and raw peers that speak the wire by hand.


@attrs.define(eq=False)
class RankRun:
    """One rank endpoint running in a task: what it received and how it ended.

    ``leave()`` makes the body leave the ``open_rank`` block cleanly (so ``Exiting`` is sent),
    ``kill()`` cancels the task through the block (no ``Exiting``), ``crash(exc)`` makes the body
    raise ``exc``.
    """

    rank: int
    host: str
    received: list[Any] = attrs.Factory(list)
    endpoint: ft.RankEndpoint | None = None
    # "ended" after a clean end of iteration, "left" after leave(), or the exception it ended with.
    outcome: Any = None
    entered: trio.Event = attrs.Factory(trio.Event)
    done: trio.Event = attrs.Factory(trio.Event)
    leave_scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    kill_scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    crash_scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    crash_with: BaseException | None = None

    def leave(self) -> None:
        self.leave_scope.cancel()

    def kill(self) -> None:
        self.kill_scope.cancel()

    def crash(self, exc: BaseException) -> None:
        self.crash_with = exc
        self.crash_scope.cancel()


@attrs.define(eq=False)
class HostRun:
    """One relay and its ranks, each running in a task."""

    host: str
    ranks: dict[int, RankRun]
    relay: ft.Relay | None = None
    # The RelayExit it ended with, or the exception open_relay raised.
    exit: Any = None
    done: trio.Event = attrs.Factory(trio.Event)
    kill_scope: trio.CancelScope = attrs.Factory(trio.CancelScope)

    def kill(self) -> None:
        self.kill_scope.cancel()

    @property
    def all_done(self) -> bool:
        return self.done.is_set() and all(r.done.is_set() for r in self.ranks.values())


async def _run_rank(net: MemoryNetwork, run: RankRun, *, salt: ft.SessionSalt, world: int,
                    config: ft.RankConfig | None) -> None:
    try:
        with run.kill_scope:
            async with ft.open_rank(
                lambda: net.connect(f"relay:{run.host}"), salt=salt, rank=run.rank,
                world_size=world, config=config,
            ) as ep:
                run.endpoint = ep
                run.entered.set()
                with run.crash_scope, run.leave_scope:
                    try:
                        async for msg in ep:
                            run.received.append(msg)
                    except ft.CoordinatorLost as exc:
                        run.outcome = exc
                    else:
                        run.outcome = "ended"
                if run.crash_with is not None:
                    raise run.crash_with
                if run.leave_scope.cancelled_caught:
                    run.outcome = "left"
    except Exception as exc:  # recorded for the test to assert on
        run.outcome = exc
    finally:
        if run.kill_scope.cancelled_caught:
            run.outcome = "killed"
        run.done.set()


async def _run_relay(net: MemoryNetwork, hr: HostRun, *, salt: ft.SessionSalt, world: int,
                     config: ft.RelayConfig | None, coordinator: str,
                     task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    try:
        with hr.kill_scope:
            async with ft.open_relay(
                lambda: net.connect(coordinator), salt=salt, host=hr.host,
                ranks=list(hr.ranks), world_size=world,
                rank_listen=net.listener(f"relay:{hr.host}"), config=config,
            ) as relay:
                hr.relay = relay
                task_status.started()
                hr.exit = await relay.wait_closed()
    except Exception as exc:  # recorded for the test to assert on
        hr.exit = exc
    finally:
        if hr.kill_scope.cancelled_caught:
            hr.exit = "killed"
        hr.done.set()


async def start_host(
    nursery: trio.Nursery, net: MemoryNetwork, host: str, ranks: Sequence[int], *,
    salt: ft.SessionSalt, world: int, relay_config: ft.RelayConfig | None = None,
    rank_config: ft.RankConfig | None = None, rank_salt: ft.SessionSalt | None = None,
    coordinator: str = COORD, start_ranks: Sequence[int] | None = None,
) -> HostRun:
    """Start a relay (listening on ``relay:<host>``) and one recording rank per rank.

    ``start_ranks`` limits which ranks start now; start the others with :func:`start_rank`.
    """
    hr = HostRun(host, {r: RankRun(r, host) for r in ranks})
    await nursery.start(partial_kw(_run_relay, net, hr, salt=salt, world=world,
                                   config=relay_config, coordinator=coordinator))
    for rank in (ranks if start_ranks is None else start_ranks):
        start_rank(nursery, net, hr.ranks[rank], salt=rank_salt or salt, world=world,
                   rank_config=rank_config)
    return hr


def start_rank(nursery: trio.Nursery, net: MemoryNetwork, run: RankRun, *,
               salt: ft.SessionSalt, world: int, rank_config: ft.RankConfig | None = None
               ) -> None:
    """Start one recording rank that dials ``relay:<its host>``."""
    nursery.start_soon(partial_kw(_run_rank, net, run, salt=salt, world=world,
                                  config=rank_config))


def partial_kw(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``functools.partial`` (imported here so the helpers above stay import-light)."""
    from functools import partial

    return partial(fn, *args, **kwargs)


def events_of(timeline: ft.Timeline, kind: type[Any]) -> list[Any]:
    return [ev for ev in timeline.events() if isinstance(ev, kind)]


@attrs.define
class Cluster:
    coord: ft.Coordinator
    hosts: dict[str, HostRun]
    salt: ft.SessionSalt
    net: MemoryNetwork

    @property
    def rank_runs(self) -> dict[int, RankRun]:
        return {r: run for hr in self.hosts.values() for r, run in hr.ranks.items()}


@asynccontextmanager
async def recording_cluster(
    net: MemoryNetwork,
    hosts: dict[str, Sequence[int]],
    *,
    salt: ft.SessionSalt | None = None,
    coord_config: ft.CoordinatorConfig | None = None,
    relay_config: ft.RelayConfig | None = None,
    rank_config: ft.RankConfig | None = None,
    teardown_timeout: float = 60.0,
) -> AsyncIterator[Cluster]:
    """Coordinator, relays and ranks that iterate and record what they receive (``start_host``).

    On exit the coordinator shuts down first, then every relay and rank task must finish within
    ``teardown_timeout`` seconds of trio time.
    """
    salt = salt or ft.SessionSalt.generate()
    world = sum(len(r) for r in hosts.values())
    cfg = coord_config or ft.CoordinatorConfig(world_size=world)
    listener = net.listener(COORD)
    try:
        async with _recording_cluster(net, hosts, listener, salt=salt, world=world, cfg=cfg,
                                      relay_config=relay_config, rank_config=rank_config,
                                      teardown_timeout=teardown_timeout) as cluster:
            yield cluster
    except BaseExceptionGroup as group:
        # The helper's own nursery wraps what the body or the coordinator raised; a test asserts
        # on the exception itself, as open_coordinator raises it.
        _, rest = group.split(trio.Cancelled)
        leaves = _leaves(rest) if rest is not None else []
        if len(leaves) == 1:
            raise leaves[0] from None
        raise


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


@asynccontextmanager
async def _recording_cluster(
    net: MemoryNetwork, hosts: dict[str, Sequence[int]], listener: Any, *,
    salt: ft.SessionSalt, world: int, cfg: ft.CoordinatorConfig,
    relay_config: ft.RelayConfig | None, rank_config: ft.RankConfig | None,
    teardown_timeout: float,
) -> AsyncIterator[Cluster]:
    async with trio.open_nursery() as nursery:
        runs: dict[str, HostRun] = {}
        for host, host_ranks in hosts.items():
            runs[host] = await start_host(nursery, net, host, host_ranks, salt=salt, world=world,
                                          relay_config=relay_config, rank_config=rank_config)
        async with ft.open_coordinator(listener, salt=salt, config=cfg) as coord:
            cluster = Cluster(coord, runs, salt, net)
            await wait_until(lambda: all(r.entered.is_set() or r.done.is_set()
                                         for r in cluster.rank_runs.values()), limit=5)
            yield cluster
        await wait_until(lambda: all(hr.all_done for hr in runs.values()),
                         limit=teardown_timeout)


# ---------------------------------------------------------------------------------------------
# Raw peers: the handshakes driven through the library's own sans-IO machines, then only what the
# test says.


async def read_one_record(stream: trio.abc.ReceiveStream, opener: Any) -> Any:
    """The next record from ``stream``, or None at EOF."""
    while True:
        rec = opener.next_record()
        if rec is not None:
            return rec
        data = await stream.receive_some(65536)
        if not data:
            return None
        opener.push(data)


@attrs.define(eq=False)
class RawRelay:
    """An upstream connection whose relay side is driven by the test."""

    stream: trio.abc.Stream
    sealer: Any
    opener: Any
    acked: bool


async def raw_relay_handshake(
    stream: trio.abc.Stream, salt: ft.SessionSalt, host: str, ranks: Sequence[int], *,
    world_size: int, model_sigs: dict[str, bytes] | None = None,
) -> RawRelay:
    """Run the relay's end with Hello{host, world_size, model_sigs, ranks} exactly as given
    (duplicates, unsorted and empty lists included); ``acked`` says whether the join was
    confirmed (HelloAck, Ready, welcome), else the coordinator closed it (EOF)."""
    from flodl_trio import wire
    from flodl_trio._handshake_io import run_handshake

    machine = wire.RelayHandshake(salt, host=host, ranks=tuple(ranks), world_size=world_size,
                                  model_sigs=model_sigs, coordinator=COORD)
    try:
        done = await run_handshake(stream, machine)
    except ft.WireError as exc:
        assert "closed" in str(exc), exc  # an EOF, never anything else
        return RawRelay(stream, machine.sealer, machine.opener, acked=False)
    assert isinstance(done, wire.Established)
    return RawRelay(stream, done.sealer, done.opener, acked=True)



async def raw_rank_accept(stream: trio.abc.Stream, salt: ft.SessionSalt, *, world_size: int,
                          ranks: Sequence[int], host: str = "fake-relay") -> int:
    """Run the relay's end of one rank handshake (SPEC §2.3, FT/2: through the rank's first
    frame and the relay's notice) with the library's own machine; returns the rank."""
    from flodl_trio import wire
    from flodl_trio._handshake_io import run_handshake

    machine = wire.RankAcceptHandshake(salt, world_size=world_size, host=host,
                                       ranks=frozenset(ranks), peer="test")
    hello = await run_handshake(stream, machine)
    assert isinstance(hello, wire.RankHelloReceived)
    machine.accept()
    done = await run_handshake(stream, machine)
    assert isinstance(done, wire.RankConfirmed)
    return done.rank


@attrs.define(eq=False)
class RawCoordinatorSide:
    """The coordinator end of one upstream connection, driven by the test."""

    stream: trio.abc.Stream
    sealer: Any
    opener: Any
    hello: Any


async def raw_coordinator_accept(
    listener: trio.abc.Listener[Any], salt: ft.SessionSalt
) -> RawCoordinatorSide:
    """Accept one relay and complete the coordinator side of the upstream handshake."""
    from flodl_trio import wire
    from flodl_trio._handshake_io import run_handshake

    stream = await listener.accept()
    machine = wire.CoordinatorHandshake(salt, peer="test")
    received = await run_handshake(stream, machine)
    assert isinstance(received, wire.HelloReceived)
    machine.accept()
    done = await run_handshake(stream, machine)
    assert isinstance(done, wire.Established)
    return RawCoordinatorSide(stream, done.sealer, done.opener, received.hello)


def live_task_names() -> list[str]:
    """Names of every task alive in this trio run (walks the task tree from the root)."""
    names: list[str] = []
    todo = [trio.lowlevel.current_root_task()]
    while todo and len(names) < 100_000:
        task = todo.pop()
        assert task is not None
        names.append(task.name)
        for nursery in task.child_nurseries:
            todo.extend(nursery.child_tasks)
    return names


# ---------------------------------------------------------------------------------------------
# Liveness helpers: ranks that record what arrives, raw wire-level peers, and mock-time events.




@attrs.define(eq=False)
class RankProbe:
    """A rank endpoint that iterates and records every control message it is given.

    Set ``leave`` to make it leave its ``open_rank`` block cleanly (it then says ``Exiting``).
    """

    rank: int
    host: str
    ep: ft.RankEndpoint | None = None
    received: list[Any] = attrs.Factory(list)
    lost: ft.CoordinatorLost | None = None
    ended_at: float | None = None
    ended: trio.Event = attrs.Factory(trio.Event)
    left: trio.Event = attrs.Factory(trio.Event)
    leave: trio.Event = attrs.Factory(trio.Event)

    def labels(self) -> list[str]:
        return [type(m).__name__ for m in self.received]

    def declared_dead(self) -> list[int]:
        return [int(m.rank) for m in self.received if isinstance(m, ft.wire.DeclareDead)]


async def run_probe(probe: RankProbe, dialer: Any, *, salt: ft.SessionSalt, world_size: int,
                    config: ft.RankConfig, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    try:
        async with ft.open_rank(dialer, salt=salt, rank=probe.rank, world_size=world_size,
                                config=config) as ep:
            probe.ep = ep
            task_status.started()
            with trio.CancelScope() as iteration:

                async def leave_on_request() -> None:
                    await probe.leave.wait()
                    iteration.cancel()

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(leave_on_request)
                    try:
                        async for msg in ep:
                            probe.received.append(msg)
                    except ft.CoordinatorLost as exc:
                        probe.lost = exc
                    probe.ended_at = trio.current_time()
                    probe.ended.set()
                    nursery.cancel_scope.cancel()
    finally:
        probe.ended.set()
        probe.left.set()


class RawRank:
    """A rank client built from the wire API alone: hello, ack, then only what the test says.

    It records every control message that arrives (``CoordHeartbeat`` included, which a real
    endpoint absorbs) and, while ``beating``, sends ``Heartbeat`` every ``interval`` seconds.
    """

    def __init__(self, *, rank: int, salt: ft.SessionSalt, stream: trio.abc.Stream,
                 interval: float | None, leftover: bytes = b"") -> None:
        self.rank = rank
        self.leftover = leftover
        self.salt = salt
        self.stream = stream
        self.interval = interval
        self.beating = interval is not None
        self.received: list[Any] = []
        self.eof = trio.Event()
        self.last_sent: float | None = None
        self._lock = trio.Lock()

    @classmethod
    async def connect(cls, dialer: Any, *, salt: ft.SessionSalt, rank: int, world_size: int,
                      interval: float | None = 1.0) -> RawRank:
        from flodl_trio._handshake_io import run_handshake

        stream = await dialer()
        machine = ft.wire.RankDialHandshake(salt, rank=rank, world_size=world_size, relay="test")
        confirmed = await run_handshake(stream, machine)
        assert isinstance(confirmed, ft.wire.RankConfirmed)
        return cls(rank=rank, salt=salt, stream=stream, interval=interval,
                   leftover=confirmed.leftover)

    def count(self, kind: type[Any]) -> int:
        return sum(isinstance(m, kind) for m in self.received)

    def labels(self, *, heartbeats: bool = False) -> list[str]:
        # The relay's own RelayWaiting notices (its FT/2 handshake answer) are not the
        # coordinator's words.
        return [type(m).__name__ for m in self.received
                if not isinstance(m, ft.wire.RelayWaiting)
                and (heartbeats or not isinstance(m, ft.wire.CoordHeartbeat))]

    async def send(self, msg: Any) -> None:
        blob = ft.wire.len_frame(ft.wire.encode_frame(self.salt, msg))
        async with self._lock:
            await self.stream.send_all(blob)
        self.last_sent = trio.current_time()

    async def run(self) -> None:
        """Read until EOF (then close), heartbeating meanwhile."""
        try:
            async with trio.open_nursery() as nursery:
                if self.interval is not None:
                    nursery.start_soon(self._heartbeats, self.interval)
                await self._read()
                nursery.cancel_scope.cancel()
        finally:
            self.eof.set()
            await trio.aclose_forcefully(self.stream)

    async def _read(self) -> None:
        decoder = ft.wire.LenFrameDecoder(max_len=ft.wire.MAX_LEN_FRAME)
        data: bytes | bytearray = self.leftover  # what the relay sent right behind its ack
        while True:
            if not data:
                try:
                    data = await self.stream.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
                if not data:
                    return
            blobs, data = decoder.feed(data), b""
            for blob in blobs:
                frame = ft.wire.decode_frame(self.salt, blob)
                self.received.append(ft.wire.frame_message(frame))

    async def _heartbeats(self, interval: float) -> None:
        while True:
            await trio.sleep(interval)
            if self.beating:
                try:
                    await self.send(ft.wire.Heartbeat(rank=self.rank, step_count=0))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return


async def read_exactly(stream: trio.abc.ReceiveStream, count: int) -> bytes:
    data = bytearray()
    for _ in range(count):  # each read returns at least one byte, so this bound is enough
        if len(data) >= count:
            break
        chunk = await stream.receive_some(count - len(data))
        if not chunk:
            raise AssertionError(f"EOF after {len(data)} of {count} bytes")
        data += chunk
    return bytes(data)


@attrs.define(eq=False)
class Peers:
    """Relays and ranks of a test cluster; the coordinator is the test's or probed_cluster's."""

    salt: ft.SessionSalt
    world_size: int
    relays: dict[str, ft.Relay]
    probes: dict[int, RankProbe]
    raw: dict[int, RawRank]
    relay_scopes: dict[str, trio.CancelScope]
    relay_exits: dict[str, ft.RelayExit]

    def stop_relay(self, host: str) -> None:
        """Cancel a relay's task: it closes its upstream connection and its ranks' links."""
        self.relay_scopes[host].cancel()

    def survivors(self, dead: Sequence[int]) -> list[RankProbe]:
        return [p for r, p in sorted(self.probes.items()) if r not in dead]




@asynccontextmanager
async def open_peers(
    net: MemoryNetwork,
    hosts: dict[str, Sequence[int]],
    *,
    salt: ft.SessionSalt | None = None,
    relay_config: ft.RelayConfig | None = None,
    rank_config: ft.RankConfig | None = None,
    rank_configs: dict[int, ft.RankConfig] | None = None,
    raw_ranks: dict[int, float | None] | None = None,
    teardown_grace: float = 60.0,
) -> AsyncIterator[Peers]:
    """Relays dialing ``COORD`` on ``net`` and their ranks (probes, or ``RawRank`` for the ranks in
    ``raw_ranks``, mapped to their heartbeat interval).

    On exit every peer gets ``teardown_grace`` seconds to end on its own (the coordinator's
    close reaches it), then what is left is cancelled. An ``Exception`` from the body is
    re-raised after that, unwrapped (not inside an ``ExceptionGroup``).
    """
    salt = salt or ft.SessionSalt.generate()
    world = sum(len(r) for r in hosts.values())
    raw_ranks = raw_ranks or {}
    rank_configs = rank_configs or {}
    peers = Peers(salt, world, {}, {}, {}, {}, {})
    relays_done: list[trio.Event] = []
    failure: Exception | None = None

    async def run_relay(host: str, host_ranks: Sequence[int], done: trio.Event,
                        task_status: Any) -> None:
        try:
            with trio.CancelScope() as scope:
                peers.relay_scopes[host] = scope
                async with ft.open_relay(
                    lambda: net.connect(COORD), salt=salt, host=host, ranks=host_ranks,
                    world_size=world, rank_listen=net.listener(f"relay:{host}"),
                    config=relay_config or ft.RelayConfig(),
                ) as relay:
                    peers.relays[host] = relay
                    task_status.started()
                    peers.relay_exits[host] = await relay.wait_closed()
        finally:
            done.set()

    async def run_raw(host: str, rank: int, interval: float | None) -> None:
        raw = await RawRank.connect(lambda: net.connect(f"relay:{host}"), salt=salt, rank=rank,
                                    world_size=world, interval=interval)
        peers.raw[rank] = raw
        await raw.run()

    async with trio.open_nursery() as nursery:
        for host, host_ranks in hosts.items():
            done = trio.Event()
            relays_done.append(done)
            await nursery.start(run_relay, host, host_ranks, done)
        for host, host_ranks in hosts.items():
            for rank in host_ranks:
                if rank in raw_ranks:
                    nursery.start_soon(run_raw, host, rank, raw_ranks[rank])
                else:
                    probe = RankProbe(rank, host)
                    peers.probes[rank] = probe
                    nursery.start_soon(functools.partial(
                        run_probe, probe, functools.partial(net.connect, f"relay:{host}"),
                        salt=salt, world_size=world,
                        config=rank_configs.get(rank, rank_config or ft.RankConfig())))
        try:
            yield peers
        except Exception as exc:
            failure = exc
        with trio.move_on_after(teardown_grace):
            for event in relays_done:
                await event.wait()
            for probe in peers.probes.values():
                await probe.left.wait()
            for raw in peers.raw.values():
                await raw.eof.wait()
        nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure


@attrs.define(eq=False)
class ProbedCluster:
    coord: ft.Coordinator
    peers: Peers
    log: EventLog
    net: MemoryNetwork

    @property
    def probes(self) -> dict[int, RankProbe]:
        return self.peers.probes

    @property
    def raw(self) -> dict[int, RawRank]:
        return self.peers.raw

    @property
    def formed_at(self) -> float:
        return self.log.of(events.FormationComplete)[0][0]

    def upstream_of(self, host: str) -> Any:
        """The MemoryConnection of ``host``'s relay to the coordinator."""
        (info,) = [r for r in self.coord.relays if r.host == host]
        (conn,) = [c for c in self.net.connections
                   if c.name == COORD and info.peer.endswith(f":{c.index}")]
        return conn


@asynccontextmanager
async def probed_cluster(
    net: MemoryNetwork,
    hosts: dict[str, Sequence[int]],
    *,
    coord_config: ft.CoordinatorConfig | None = None,
    relay_config: ft.RelayConfig | None = None,
    rank_config: ft.RankConfig | None = None,
    rank_configs: dict[int, ft.RankConfig] | None = None,
    raw_ranks: dict[int, float | None] | None = None,
) -> AsyncIterator[ProbedCluster]:
    """A formed cluster whose ranks record what they receive; ``ClusterFailure`` and other errors
    of ``open_coordinator`` come out unwrapped, after every peer was torn down."""
    world = sum(len(r) for r in hosts.values())
    cfg = coord_config or ft.CoordinatorConfig(world_size=world)
    timeline = EventLog()
    async with open_peers(net, hosts, relay_config=relay_config, rank_config=rank_config,
                          rank_configs=rank_configs, raw_ranks=raw_ranks) as peers:
        async with ft.open_coordinator(net.listener(COORD), salt=peers.salt, config=cfg,
                                       timeline=timeline) as coord:
            # Entered at formation; the endpoints are up by then, the last one may lag a pass,
            # and a relay may not have read its HelloAck yet.
            await wait_until(lambda: all(p.ep is not None for p in peers.probes.values())
                           and len(peers.raw) == len(raw_ranks or {}), limit=1)
            with trio.fail_after(1):
                for relay in peers.relays.values():
                    await relay.wait_connected()
            yield ProbedCluster(coord, peers, timeline, net)


# ---------------------------------------------------------------------------- simulated ranks


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
) -> AsyncIterator[SimCluster]:
    """``open_local_cluster`` with one ``SimulatedRank`` per rank (``sim_args(rank)`` gives its
    keyword arguments). A crash leaves that rank's block with an exception (no ``Exiting``; the
    relay reports ``RankExit``); hung sims are cancelled at exit."""
    from flodl_trio.local_cluster import open_local_cluster
    from flodl_trio.sim import SimulatedCrash, SimulatedRank

    sims: dict[int, Any] = {}

    async def run_sim(ep: ft.RankEndpoint) -> Any:
        sims[ep.rank] = SimulatedRank(ep, **sim_args(ep.rank))
        return await sims[ep.rank].run()

    async with open_local_cluster(hosts, network=net, coord_config=coord_config,
                                  rank_configs=rank_configs, timeline=timeline,
                                  rank_main=run_sim,
                                  rank_errors=(SimulatedCrash, ft.FlodlError)) as cluster:
        try:
            yield SimCluster(cluster.coord, sims, cluster.outcomes, net)
        finally:
            for rank, sim in sims.items():
                if sim.record.failed and rank not in cluster.outcomes:
                    cluster.kill_rank(rank)
