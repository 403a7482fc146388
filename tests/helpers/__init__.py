"""Shared helpers for the test suite, built from the public API.

Clusters come from :func:`flodl_trio.testing.open_local_cluster`, as for users; these helpers give
it ranks that record what they receive (:class:`Recorder`). :func:`start_host` starts a relay and
its ranks alone, for the tests that open the coordinator themselves (formation failures) or play
it by hand; the raw peers drive the library's sans-IO handshakes, then only what the test says.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import trio

import flodl_trio as ft
from flodl_trio import events
from flodl_trio.testing import (
    EventLog,
    LocalCluster,
    MemoryConnection,
    MemoryNetwork,
    RawRankMain,
    RawRankSlot,
    open_local_cluster,
    wait_until as wait_until,  # the tests import it from here
)

COORD = "coordinator"


# ---------------------------------------------------------------------------------------------
# Ranks that record what they receive: the rank_main of open_local_cluster, or start_host's.


@attrs.define(eq=False)
class RankRecord:
    """What one rank endpoint received, and how its iteration ended (see
    :func:`record_iteration`)."""

    rank: int
    ep: ft.RankEndpoint | None = None
    received: list[Any] = attrs.Factory(list)
    lost: ft.CoordinatorLost | None = None
    ended_at: float | None = None
    ended: trio.Event = attrs.Factory(trio.Event)
    stop_scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    crash_with: BaseException | None = None

    def leave(self) -> None:
        """Stop iterating and leave the ``open_rank`` block cleanly (it says ``Exiting``)."""
        self.stop_scope.cancel()

    def crash(self, exc: BaseException) -> None:
        """Raise ``exc`` out of the ``open_rank`` block (no ``Exiting``); pass its type in the
        cluster's ``rank_errors`` to have it land in ``outcomes``."""
        self.crash_with = exc
        self.stop_scope.cancel()

    def labels(self) -> list[str]:
        return [type(m).__name__ for m in self.received]

    def declared_dead(self) -> list[int]:
        return [int(m.rank) for m in self.received if isinstance(m, ft.wire.DeclareDead)]


async def record_iteration(rec: RankRecord, ep: ft.RankEndpoint) -> object:
    """Iterate ``ep`` into ``rec``; returns ``"ended"`` after a clean end of iteration, ``"left"``
    after ``leave()``, or the ``CoordinatorLost`` it ended with (``crash()`` raises)."""
    rec.ep = ep
    try:
        with rec.stop_scope:
            try:
                async for msg in ep:
                    rec.received.append(msg)
            except ft.CoordinatorLost as exc:
                rec.lost = exc
        rec.ended_at = trio.current_time()
    finally:
        rec.ended.set()
    if rec.crash_with is not None:
        raise rec.crash_with
    if rec.lost is not None:
        return rec.lost
    return "left" if rec.stop_scope.cancelled_caught else "ended"


class Recorder:
    """``rank_main=`` (and ``raw_ranks=recorder.raw_mains``) of ``open_local_cluster``.

    Every endpoint rank iterates and records each control message in ``recorder[rank]``; its
    outcome is ``"ended"`` after a clean end of iteration, ``"left"`` after ``leave()``, or the
    ``CoordinatorLost`` it ended with. The ranks of ``raw`` (rank → heartbeat interval) are
    :class:`RawRank` clients instead, in ``recorder.raw`` once their handshake is done.
    """

    def __init__(self, *, raw: dict[int, float | None] | None = None) -> None:
        self.ranks: dict[int, RankRecord] = {}
        self.raw: dict[int, RawRank] = {}
        self._intervals = dict(raw or {})

    def __getitem__(self, rank: int) -> RankRecord:
        return self.ranks.setdefault(rank, RankRecord(rank))

    def survivors(self, dead: Sequence[int]) -> list[RankRecord]:
        return [rec for rank, rec in sorted(self.ranks.items()) if rank not in dead]

    async def __call__(self, ep: ft.RankEndpoint) -> object:
        return await record_iteration(self[ep.rank], ep)

    @property
    def raw_mains(self) -> dict[int, RawRankMain]:
        return {rank: self._run_raw for rank in self._intervals}

    async def _run_raw(self, slot: RawRankSlot, *, task_status: trio.TaskStatus[None]) -> None:
        raw = await RawRank.connect(slot.dial, salt=slot.salt, rank=slot.rank,
                                    world_size=slot.world_size,
                                    interval=self._intervals[slot.rank])
        self.raw[slot.rank] = raw
        task_status.started()
        await raw.run()


def formed_at(log: EventLog) -> float:
    """The Trio time of the coordinator's ``FormationComplete``."""
    return log.of(events.FormationComplete)[0][0]


def upstream_of(cluster: LocalCluster, host: str) -> MemoryConnection:
    """The MemoryConnection of ``host``'s relay to the coordinator."""
    assert cluster.network is not None
    (info,) = [r for r in cluster.coord.relays if r.host == host]
    (conn,) = [c for c in cluster.network.connections
               if c.name == COORD and info.peer.endswith(f":{c.index}")]
    return conn


# ---------------------------------------------------------------------------------------------
# Relays and ranks started by hand, for a coordinator the test opens itself or plays by hand.


@attrs.define(eq=False)
class RankRun(RankRecord):
    """A rank of :func:`start_host`: its record, plus how its task ended.

    ``kill()`` cancels the task through the ``open_rank`` block (no ``Exiting``); ``outcome`` is
    what :func:`record_iteration` returned, ``"killed"``, or the exception the task ended with.
    """

    host: str = ""
    outcome: Any = None
    entered: trio.Event = attrs.Factory(trio.Event)
    done: trio.Event = attrs.Factory(trio.Event)
    kill_scope: trio.CancelScope = attrs.Factory(trio.CancelScope)

    @property
    def endpoint(self) -> ft.RankEndpoint | None:
        return self.ep

    def kill(self) -> None:
        self.kill_scope.cancel()


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
                run.entered.set()
                run.outcome = await record_iteration(run, ep)
    except Exception as exc:  # recorded for the test to assert on
        run.outcome = exc
    finally:
        if run.kill_scope.cancelled_caught:
            run.outcome = "killed"
        run.done.set()


async def _run_relay(net: MemoryNetwork, hr: HostRun, *, salt: ft.SessionSalt, world: int,
                     config: ft.RelayConfig | None, coordinator: str, target: Any = None,
                     task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    try:
        with hr.kill_scope:
            async with ft.open_relay(
                target if target is not None else lambda: net.connect(coordinator),
                salt=salt, host=hr.host,
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
    target: Any = None,
) -> HostRun:
    """Start a relay (listening on ``relay:<host>``) and one recording rank per rank.

    ``start_ranks`` limits which ranks start now; start the others with :func:`start_rank`.
    ``target``: what the relay dials (default: ``coordinator`` on ``net``).
    """
    hr = HostRun(host, {r: RankRun(r, host=host) for r in ranks})
    await nursery.start(functools.partial(_run_relay, net, hr, salt=salt, world=world,
                                          config=relay_config, coordinator=coordinator,
                                          target=target))
    for rank in (ranks if start_ranks is None else start_ranks):
        start_rank(nursery, net, hr.ranks[rank], salt=rank_salt or salt, world=world,
                   rank_config=rank_config)
    return hr


def start_rank(nursery: trio.Nursery, net: MemoryNetwork, run: RankRun, *,
               salt: ft.SessionSalt, world: int, rank_config: ft.RankConfig | None = None
               ) -> None:
    """Start one recording rank that dials ``relay:<its host>``."""
    nursery.start_soon(functools.partial(_run_rank, net, run, salt=salt, world=world,
                                         config=rank_config))


def events_of(timeline: ft.Timeline, kind: type[Any]) -> list[Any]:
    return [ev for ev in timeline.events() if isinstance(ev, kind)]


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
    refused: str | None = None


async def raw_relay_handshake(
    stream: trio.abc.Stream, salt: ft.SessionSalt, host: str, ranks: Sequence[int], *,
    world_size: int, model_sigs: dict[str, bytes] | None = None,
) -> RawRelay:
    """Run the relay's end with Hello{host, world_size, model_sigs, ranks} exactly as given
    (duplicates, unsorted and empty lists included); ``acked`` says whether the join was
    confirmed (HelloAck, Ready, welcome), else the coordinator refused it (``refused``, its
    reason) or closed it (EOF)."""
    from flodl_trio import wire
    from flodl_trio.net._handshake_io import run_handshake

    machine = wire.RelayHandshake(salt, host=host, ranks=tuple(ranks), world_size=world_size,
                                  model_sigs=model_sigs, coordinator=COORD)
    try:
        done = await run_handshake(stream, machine)
    except ft.WireError as exc:
        assert "closed" in str(exc), exc  # an EOF, never anything else
        return RawRelay(stream, machine.sealer, machine.opener, acked=False)
    if isinstance(done, wire.RefusalReceived):
        return RawRelay(stream, machine.sealer, machine.opener, acked=False,
                        refused=done.reason)
    assert isinstance(done, wire.Established)
    return RawRelay(stream, done.sealer, done.opener, acked=True)



async def drain_and_close(stream: trio.abc.Stream, *, limit: float = 30) -> None:
    """Read (and drop) what a raw peer's stream receives until EOF or ``limit``, then close."""
    with trio.move_on_after(limit):
        try:
            while await stream.receive_some(65536):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    await trio.aclose_forcefully(stream)


async def raw_rank_accept(stream: trio.abc.Stream, salt: ft.SessionSalt, *, world_size: int,
                          ranks: Sequence[int], host: str = "fake-relay") -> int:
    """Run the relay's end of one rank handshake (SPEC §2.3, FT/2: through the rank's first
    frame and the relay's notice) with the library's own machine; returns the rank."""
    from flodl_trio import wire
    from flodl_trio.net._handshake_io import run_handshake

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
    from flodl_trio.net._handshake_io import run_handshake

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
        from flodl_trio.net._handshake_io import run_handshake

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


SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
TWO_HOSTS = (("host-a", [0, 1]), ("host-b", [2, 3]))


@functools.cache
def load_script(name: str) -> ModuleType:
    """``scripts/NAME.py`` as a module: the child programs and their parent-side handles."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def start_relay_processes(
    nursery: trio.Nursery, coordinator: tuple[str, int], salt: ft.SessionSalt,
    children: list[Any], *, hosts: Sequence[tuple[str, list[int]]] = TWO_HOSTS,
    world_size: int = 4, extra: Sequence[str] = (),
) -> list[Any]:
    """One ``scripts/_relay_proc.py`` process (a relay and its ranks) per host, in order; each
    joins ``children`` as soon as it started, so the caller's cleanup stops it whatever fails
    next. Returns the new ones."""
    relay_process = load_script("_relay_proc").RelayProcess
    started = []
    for host, ranks in hosts:
        child = await relay_process.start(nursery, coordinator=coordinator, salt=salt, host=host,
                                          ranks=ranks, world_size=world_size, extra=tuple(extra))
        children.append(child)
        started.append(child)
    return started
