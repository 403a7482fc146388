"""Shared helpers for the test suite, built from the public API.

Clusters come from :func:`flodl_trio.testing.open_local_cluster`, as for users; these helpers give
it ranks that record what they receive (:class:`Recorder`, :func:`recorded`). :func:`start_host`
and :func:`hosts_by_hand` start relays and their ranks alone, for the tests that open the
coordinator themselves (formation failures) or play it by hand. The package's other modules hold
the rest, one subject each (tests/README.md lists them): raw peers, the wire's machines driven by
hand, bounded reads, the lifecycle's cancel scopes, simulated ranks, the programs of
``scripts/``, the command line as processes, session stores and their coordinators.
"""

from __future__ import annotations

import functools
import socket
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from typing import Any, TypeVar

import attrs
import pytest
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

from helpers.raw import COORD as COORD, RawRank

E = TypeVar("E", bound=BaseException)

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


@asynccontextmanager
async def recorded(net: MemoryNetwork,
                   hosts: Mapping[str, Sequence[int]] | None = None,
                   **kw: Any) -> AsyncIterator[tuple[LocalCluster, Recorder]]:
    """``open_local_cluster`` over ``net`` (``kw``: its other arguments) whose ranks a
    :class:`Recorder` runs: the cluster and the recorder. ``hosts``: host-a with ranks 0 and 1,
    host-b with 2 and 3, unless told."""
    rec = Recorder()
    layout = hosts if hosts is not None else {"host-a": [0, 1], "host-b": [2, 3]}
    async with open_local_cluster(layout, network=net, rank_main=rec, **kw) as cluster:
        yield cluster, rec


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

    def ended_with(self, outcome: Any) -> None:
        self.outcome = outcome


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

    def ended_with(self, exit: Any) -> None:
        self.exit = exit


@contextmanager
def until_killed(run: RankRun | HostRun) -> Iterator[None]:
    """The body of a task of ``run``, which ``run.kill()`` cancels: how it ended (an exception,
    recorded for the test to assert on, or ``"killed"``) goes to ``run.ended_with``; then
    ``run.done`` is set."""
    try:
        with run.kill_scope:
            yield
    except Exception as exc:
        run.ended_with(exc)
    finally:
        if run.kill_scope.cancelled_caught:
            run.ended_with("killed")
        run.done.set()


async def _run_rank(net: MemoryNetwork, run: RankRun, *, salt: ft.SessionSalt, world: int,
                    config: ft.RankConfig | None) -> None:
    with until_killed(run):
        async with ft.open_rank(
            lambda: net.connect(f"relay:{run.host}"), salt=salt, rank=run.rank,
            world_size=world, config=config,
        ) as ep:
            run.entered.set()
            run.ended_with(await record_iteration(run, ep))


async def _run_relay(net: MemoryNetwork, hr: HostRun, *, salt: ft.SessionSalt, world: int,
                     config: ft.RelayConfig | None, coordinator: str, target: Any = None,
                     task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    with until_killed(hr):
        async with ft.open_relay(
            target if target is not None else lambda: net.connect(coordinator),
            salt=salt, host=hr.host,
            ranks=list(hr.ranks), world_size=world,
            rank_listen=net.listener(f"relay:{hr.host}"), config=config,
        ) as relay:
            hr.relay = relay
            task_status.started()
            hr.ended_with(await relay.wait_closed())


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


@attrs.define(eq=False)
class Hosts:
    """Relays and recording ranks started by hand (:func:`start_host`), with one salt, for a
    coordinator the test opens on ``listener`` (:data:`COORD`) with :meth:`coordinator`; its
    events go to ``timeline``."""

    net: MemoryNetwork
    nursery: trio.Nursery
    salt: ft.SessionSalt
    world: int
    listener: trio.abc.Listener[Any]
    runs: dict[str, HostRun] = attrs.Factory(dict)
    timeline: ft.Timeline = attrs.Factory(ft.Timeline)

    async def start(self, host: str, ranks: Sequence[int], **kw: Any) -> HostRun:
        """One more relay and its ranks (``kw``: :func:`start_host`'s)."""
        self.runs[host] = await start_host(self.nursery, self.net, host, ranks, salt=self.salt,
                                           world=self.world, **kw)
        return self.runs[host]

    def coordinator(self, config: ft.CoordinatorConfig | None = None,
                    **kw: Any) -> AbstractAsyncContextManager[ft.Coordinator]:
        """``open_coordinator`` on the listener with this salt, recording to ``timeline`` (a
        plain config of this world unless told; ``kw``: its other arguments)."""
        return ft.open_coordinator(self.listener, salt=self.salt,
                                   config=config or ft.CoordinatorConfig(world_size=self.world),
                                   **{"timeline": self.timeline, **kw})

    @property
    def all_done(self) -> bool:
        return all(hr.all_done for hr in self.runs.values())


@asynccontextmanager
async def hosts_by_hand(
    net: MemoryNetwork, world: int,
    layout: Mapping[str, Sequence[int]] | Sequence[tuple[str, Sequence[int]]] | None = None,
) -> AsyncIterator[Hosts]:
    """A listener on :data:`COORD`, then the hosts of ``layout`` started by hand; when the
    block ends, whatever still runs is cancelled and the listener is closed."""
    listener = net.listener(COORD)
    try:
        async with trio.open_nursery() as nursery:
            hosts = Hosts(net, nursery, ft.SessionSalt.generate(), world, listener)
            for host, ranks in dict(layout or {}).items():
                await hosts.start(host, ranks)
            yield hosts
            nursery.cancel_scope.cancel()
    finally:
        await listener.aclose()


async def failed_formation(opening: AbstractAsyncContextManager[Any], kind: type[E], *,
                           why: str) -> tuple[E, float]:
    """The error of exactly the type ``kind`` that ``opening`` (an ``open_coordinator``) fails
    its formation with, and the seconds that took; ``why`` the block cannot be entered."""
    started = trio.current_time()
    with pytest.raises(kind) as excinfo:
        async with opening:
            pytest.fail(why)
    assert type(excinfo.value) is kind
    return excinfo.value, trio.current_time() - started


def events_of(timeline: ft.Timeline, kind: type[Any]) -> list[Any]:
    return [ev for ev in timeline.events() if isinstance(ev, kind)]


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


def ipv6_loopback_available() -> bool:
    """This machine can bind ``::1`` (some containers have no IPv6 at all)."""
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


needs_ipv6 = pytest.mark.skipif(not ipv6_loopback_available(), reason="no IPv6 loopback here")
