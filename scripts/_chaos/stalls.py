"""Stall scenarios with real processes (issue 13), shared by ``tests/chaos/test_chaos_stalls.py``
and the ``stall`` family of ``scripts/chaos_sweep.py``: relay processes (the CLI as shipped, by
default with ``FLODL_NET_TIMEOUT_SCALE=0.1``: relay write stall 3 s, shutdown grace 0.5 s),
in-test rank endpoints or rank processes, an in-test coordinator; SIGSTOP/SIGCONT to freeze a
process while its sockets stay open. Each scenario returns what it measured; the callers judge
it.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

import flodl_trio as ft
from flodl_trio.events import RankDeclaredDead, RelayStalled
from flodl_trio.testing import EventLog
from flodl_trio.wire import NewNcclSession, SetGlobalStep

from .procs import Child, child_env, cli, rank_address

BIG = 4 * 1024 * 1024  # one frame this large fills a good part of a loopback socket's buffers


@attrs.define(eq=False)
class Endpoint:
    """An in-test rank endpoint: every control message with its arrival time, and its end."""

    rank: int
    got: list[tuple[float, Any]] = attrs.Factory(list)
    error: BaseException | None = None
    ended_at: float | None = None
    done: trio.Event = attrs.Factory(trio.Event)

    def arrival(self, msg: Any) -> float | None:
        return next((t for t, m in self.got if m == msg), None)


@attrs.define(eq=False)
class Cluster:
    coord: ft.Coordinator
    log: EventLog
    relays: dict[str, Child]
    endpoints: dict[int, Endpoint]
    processes: dict[int, Child]


async def run_endpoint(ep: Endpoint, address: tuple[str, int], salt: ft.SessionSalt,
                       world: int, config: ft.RankConfig) -> None:
    try:
        async with ft.open_rank(address, salt=salt, rank=ep.rank, world_size=world,
                                config=config) as endpoint:
            async for msg in endpoint:
                ep.got.append((trio.current_time(), msg))
    except ft.FlodlError as exc:
        ep.error = exc
    finally:
        ep.ended_at = trio.current_time()
        ep.done.set()


@asynccontextmanager
async def process_cluster(
    hosts: dict[str, Sequence[int]], config: ft.CoordinatorConfig, *,
    rank_config: ft.RankConfig, rank_processes: Sequence[int] = (), relay_scale: str = "0.1",
) -> AsyncIterator[Cluster]:
    """Relay processes (CLI), in-test rank endpoints (or rank processes for
    ``rank_processes``), and an in-test coordinator that is formed when the block starts."""
    salt = ft.SessionSalt.generate()
    world = sum(len(r) for r in hosts.values())
    env = child_env(salt)
    env["FLODL_NET_TIMEOUT_SCALE"] = relay_scale
    log = EventLog()
    bind = await ft.bind_coordinator(("127.0.0.1", 0))
    children: list[Child] = []
    async with trio.open_nursery() as nursery:
        try:
            relays: dict[str, Child] = {}
            endpoints: dict[int, Endpoint] = {}
            processes: dict[int, Child] = {}
            for host, ranks in hosts.items():
                relays[host] = await Child.start(nursery, f"relay {host}", cli(
                    "relay", "--coordinator", f"127.0.0.1:{bind.address[1]}", "--host", host,
                    "--ranks", ",".join(map(str, ranks)), "--world-size", str(world)), env=env)
                children.append(relays[host])
            for host, ranks in hosts.items():
                with trio.fail_after(30):
                    line = await relays[host].wait_line(lambda s: "listening for ranks" in s)
                address = rank_address(line)
                for rank in ranks:
                    if rank in rank_processes:
                        processes[rank] = await Child.start(nursery, f"rank {rank}", cli(
                            "rank", "--relay", f"{address[0]}:{address[1]}", "--rank",
                            str(rank), "--world-size", str(world), "--batch-ms", "50"),
                            env=env)
                        children.append(processes[rank])
                    else:
                        endpoints[rank] = Endpoint(rank)
                        nursery.start_soon(run_endpoint, endpoints[rank], address, salt, world,
                                           rank_config)
            async with ft.open_coordinator(bind, salt=salt, config=config,
                                           timeline=log) as coord:

                async def drain_timing() -> None:  # the sim ranks' Batch messages
                    async for _ in coord.timing:
                        pass

                nursery.start_soon(drain_timing)
                yield Cluster(coord, log, relays, endpoints, processes)
        finally:
            for child in children:
                if child.running:
                    os.kill(child.proc.pid, signal.SIGCONT)
                await child.stop()
            nursery.cancel_scope.cancel()


def pause(child: Child) -> None:
    os.kill(child.proc.pid, signal.SIGSTOP)


def resume(child: Child) -> None:
    os.kill(child.proc.pid, signal.SIGCONT)


async def broadcast_every(coord: ft.Coordinator, interval: float, count: int,
                          sent: dict[int, float]) -> None:
    """``SetGlobalStep(i)`` every ``interval``, each from its own task (a broadcast waits for a
    stalled relay to be given up on; the next one must not wait for that)."""
    async with trio.open_nursery() as nursery:
        for step in range(1, count + 1):
            await trio.sleep(interval)
            sent[step] = trio.current_time()

            async def one(step: int = step) -> None:
                try:
                    await coord.broadcast_control(SetGlobalStep(global_step=step))
                except ft.BroadcastError:
                    pass  # the stalled relay's ranks: asserted through the coordinator's state

            nursery.start_soon(one)


def lateness(endpoint: Endpoint, sent: dict[int, float]) -> dict[int, float | None]:
    """Seconds from each broadcast to its arrival at ``endpoint`` (None: never arrived)."""
    out: dict[int, float | None] = {}
    for step, at in sent.items():
        arrived = endpoint.arrival(SetGlobalStep(global_step=step))
        out[step] = None if arrived is None else round(arrived - at, 3)
    return out


@attrs.define
class StallResult:
    """What one stall scenario measured (times in seconds, real clock)."""

    scenario: str
    dead: dict[int, str]
    # From the freeze (or the resume) to the decision: loss, drop, or eviction.
    decided_after: float | None
    # Per healthy rank: broadcasts that arrived 1 s or more late, or never.
    late: dict[int, dict[int, float | None]]
    healthy_errors: dict[int, str]
    evicted: dict[int, str] = attrs.Factory(dict)  # rank -> RankEvicted.reason
    connection_closed: bool | None = None
    counters: dict[str, int] = attrs.Factory(dict)


def _late(endpoints: dict[int, Endpoint], ranks: Sequence[int],
          sent: dict[int, float]) -> dict[int, dict[int, float | None]]:
    out: dict[int, dict[int, float | None]] = {}
    for rank in ranks:
        late = lateness(endpoints[rank], sent)
        out[rank] = {step: v for step, v in late.items() if v is None or v >= 1.0}
    return out


def _dead(coord: ft.Coordinator) -> dict[int, str]:
    return {r: str(coord.dead_reason(r)) for r in sorted(coord.dead_ranks)}


def _counters(coord: ft.Coordinator) -> dict[str, int]:
    state = coord.state()
    return {k: int(state[k]) for k in ("fenced_ranks", "relay_write_stalls",
                                        "relays_disconnected", "lost_broadcasts")}


async def _fill(coord: ft.Coordinator, rank: int, count: int) -> None:
    """More than a frozen peer's socket buffers hold, to one rank."""
    for _ in range(count):
        try:
            await coord.send_control(rank, NewNcclSession(uid=b"u" * BIG, new_rank=0,
                                                          new_world_size=1))
        except ft.SendError:
            return


async def relay_stops_reading() -> StallResult:
    """A relay process is frozen (socket open): lost after the coordinator's write stall
    (2 s) while the other relay's ranks (liveness deadline 2 s) get every broadcast."""
    cfg = ft.CoordinatorConfig(world_size=3, write_stall_timeout=2.0, heartbeat_interval=0.25,
                               heartbeat_timeout=60, formation_timeout=30)
    healthy = ft.RankConfig(coord_liveness_timeout=2.0)
    async with process_cluster({"host-a": [0, 1], "host-b": [2]}, cfg,
                               rank_config=healthy) as c:
        pause(c.relays["host-b"])
        stopped = trio.current_time()
        sent: dict[int, float] = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_fill, c.coord, 2, 8)
            await broadcast_every(c.coord, 0.25, 24, sent)
        await trio.sleep(1.0)  # the last broadcast's frames are still on their way
        stalls = c.log.of(RelayStalled)
        return StallResult(
            "relay stops reading", _dead(c.coord),
            stalls[0][0] - stopped if stalls else None, _late(c.endpoints, [0, 1], sent),
            {r: repr(c.endpoints[r].error) for r in (0, 1) if c.endpoints[r].error},
            counters=_counters(c.coord))


async def rank_stops_reading() -> StallResult:
    """A rank process is frozen (socket open): its relay drops it after its write stall (3 s)
    while its sibling gets every broadcast."""
    cfg = ft.CoordinatorConfig(world_size=2, heartbeat_interval=0.25, heartbeat_timeout=60,
                               formation_timeout=30)
    async with process_cluster({"host-a": [0, 1]}, cfg, rank_config=ft.RankConfig(),
                               rank_processes=[1]) as c:
        pause(c.processes[1])
        stopped = trio.current_time()
        sent: dict[int, float] = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_fill, c.coord, 1, 6)
            await broadcast_every(c.coord, 0.2, 40, sent)
        await trio.sleep(1.0)
        deaths = c.log.of(RankDeclaredDead)
        return StallResult(
            "rank stops reading", _dead(c.coord),
            deaths[0][0] - stopped if deaths else None, _late(c.endpoints, [0], sent),
            {0: repr(c.endpoints[0].error)} if c.endpoints[0].error else {},
            counters=_counters(c.coord))


async def relay_paused_past_heartbeat_timeout() -> StallResult:
    """A relay process is frozen past the coordinator's heartbeat timeout (2 s), then resumed:
    its ranks must end with ``RankEvicted`` and the coordinator close its connection."""
    cfg = ft.CoordinatorConfig(world_size=3, heartbeat_interval=0.25, heartbeat_timeout=2.0,
                               formation_timeout=30)
    # The ranks beat at the default 1 s behind their relays' 1 s Liveness cadence: a healthy
    # rank can look up to 2 s stale, this scenario's heartbeat_timeout, and is not declared
    # for it (staleness on evidence, see deadlines.rst).
    patient = ft.RankConfig(coord_liveness_timeout=30)
    # The relay's shutdown grace (its ranks' last chance to read what it delivered before it
    # closes their links) is 1.5 s here, so a loaded machine still lets them read it.
    async with process_cluster({"host-a": [0], "host-b": [1, 2]}, cfg,
                               rank_config=patient, relay_scale="0.3") as c:
        pause(c.relays["host-b"])
        with trio.move_on_after(10):
            while c.coord.dead_ranks != {1, 2}:  # noqa: ASYNC110 - state spans objects
                await trio.sleep(0.05)
        await trio.sleep(1.0)
        resume(c.relays["host-b"])
        resumed = trio.current_time()
        closed = False
        with trio.move_on_after(5):
            for rank in (1, 2):
                await c.endpoints[rank].done.wait()
            while not closed:
                closed = all(r["closed"] for r in c.coord.state()["relays"]
                             if r["host"] == "host-b")
                await trio.sleep(0.05)
        ended = [c.endpoints[r].ended_at for r in (1, 2)]
        evicted = {r: c.endpoints[r].error.reason for r in (1, 2)
                   if isinstance(c.endpoints[r].error, ft.RankEvicted)}
        return StallResult(
            "relay paused past heartbeat_timeout", _dead(c.coord),
            max(ended) - resumed if all(t is not None for t in ended) else None,  # type: ignore
            {}, {0: repr(c.endpoints[0].error)} if c.endpoints[0].error else {},
            evicted=evicted, connection_closed=closed, counters=_counters(c.coord))


SCENARIOS = (relay_stops_reading, rank_stops_reading, relay_paused_past_heartbeat_timeout)
