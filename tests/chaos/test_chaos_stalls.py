"""Issue 13 with real processes (the relay CLI as shipped, real loopback TCP): a relay or a rank
that stops reading while its socket stays open hurts nobody else, and a relay SIGSTOPped past
``heartbeat_timeout`` and then resumed ends its ranks with ``RankEvicted``.

The relays run with ``FLODL_NET_TIMEOUT_SCALE=0.1`` (relay write stall 3 s, shutdown grace
0.5 s); the coordinator and the in-test rank endpoints take their deadlines from the test.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio
from _procs import Child, child_env, cli, rank_address

import flodl_trio as ft
from flodl_trio.events import RelayRetired, RelayStalled
from flodl_trio.testing import EventLog
from flodl_trio.wire import NewNcclSession, SetGlobalStep

pytestmark = pytest.mark.slow

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
    rank_config: ft.RankConfig, rank_processes: Sequence[int] = (),
) -> AsyncIterator[Cluster]:
    """Relay processes (CLI), in-test rank endpoints (or rank processes for
    ``rank_processes``), and an in-test coordinator that is formed when the block starts."""
    salt = ft.SessionSalt.generate()
    world = sum(len(r) for r in hosts.values())
    env = child_env(salt)
    env["FLODL_NET_TIMEOUT_SCALE"] = "0.1"
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


async def test_relay_that_stops_reading_is_lost_after_write_stall_while_others_get_everything(
) -> None:
    cfg = ft.CoordinatorConfig(world_size=3, write_stall_timeout=2.0, heartbeat_interval=0.25,
                               heartbeat_timeout=60, formation_timeout=30)
    healthy = ft.RankConfig(coord_liveness_timeout=2.0)
    async with process_cluster({"host-a": [0, 1], "host-b": [2]}, cfg,
                               rank_config=healthy) as c:
        pause(c.relays["host-b"])  # alive, socket open, reading nothing
        stopped = trio.current_time()
        sent: dict[int, float] = {}

        async def fill() -> None:  # more than the stopped relay's socket buffers hold
            for _ in range(8):
                try:
                    await c.coord.send_control(2, NewNcclSession(uid=b"u" * BIG, new_rank=0,
                                                                 new_world_size=1))
                except ft.SendError:
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fill)
            await broadcast_every(c.coord, 0.25, 24, sent)
        await trio.sleep(1.0)  # the last broadcast's frames are still on their way
        ((stalled_at, stalled),) = c.log.of(RelayStalled)
        assert stalled.host == "host-b"
        # Lost write_stall_timeout after its writer blocked (the fill needs a moment to block).
        assert 2.0 <= stalled_at - stopped < 6.0
        assert c.coord.dead_ranks == {2} and "write stall" in str(c.coord.dead_reason(2))
        for rank in (0, 1):
            ep = c.endpoints[rank]
            late = lateness(ep, sent)
            bad = {step: v for step, v in late.items() if v is None or v >= 1.0}
            assert bad == {}, (rank, bad, late)
            assert ep.error is None, ep.error  # every heartbeat kept coming: never lost
        assert c.coord.state()["relay_write_stalls"] == 1


async def test_rank_that_stops_reading_is_dropped_by_its_relay_and_its_sibling_keeps_up() -> None:
    cfg = ft.CoordinatorConfig(world_size=2, heartbeat_interval=0.25, heartbeat_timeout=60,
                               formation_timeout=30)
    async with process_cluster({"host-a": [0, 1]}, cfg, rank_config=ft.RankConfig(),
                               rank_processes=[1]) as c:
        pause(c.processes[1])  # the rank process is frozen; its socket stays open
        stopped = trio.current_time()
        sent: dict[int, float] = {}

        async def fill() -> None:
            for _ in range(6):
                try:
                    await c.coord.send_control(1, NewNcclSession(uid=b"u" * BIG, new_rank=0,
                                                                 new_world_size=1))
                except ft.SendError:
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fill)
            await broadcast_every(c.coord, 0.2, 40, sent)
        await trio.sleep(1.0)  # the last broadcast's frames are still on their way
        assert c.coord.dead_ranks == {1}
        reason = str(c.coord.dead_reason(1))
        assert reason.startswith("relay 'host-a' dropped rank 1: it read nothing for "
                                 "write_stall_timeout=3s") or "did not drain" in reason, reason
        ((died_at, _),) = c.log.of(ft.events.RankDeclaredDead)
        assert 3.0 <= died_at - stopped < 7.0
        late = lateness(c.endpoints[0], sent)
        bad = {step: v for step, v in late.items() if v is None or v >= 1.0}
        assert bad == {}, (bad, late)
        assert c.endpoints[0].error is None and c.coord.live_ranks == {0}


async def test_relay_sigstopped_past_heartbeat_timeout_ends_its_ranks_evicted_after_sigcont(
) -> None:
    cfg = ft.CoordinatorConfig(world_size=3, heartbeat_interval=0.25, heartbeat_timeout=2.0,
                               formation_timeout=30)
    patient = ft.RankConfig(coord_liveness_timeout=30)
    async with process_cluster({"host-a": [0], "host-b": [1, 2]}, cfg,
                               rank_config=patient) as c:
        pause(c.relays["host-b"])
        with trio.fail_after(10):
            while c.coord.dead_ranks != {1, 2}:  # noqa: ASYNC110 - state spans objects
                await trio.sleep(0.05)
        await trio.sleep(1.0)
        resume(c.relays["host-b"])
        resumed = trio.current_time()
        with trio.fail_after(5):
            for rank in (1, 2):
                await c.endpoints[rank].done.wait()
            while any(r["connected"] for r in c.coord.state()["relays"]  # noqa: ASYNC110
                      if r["host"] == "host-b"):
                await trio.sleep(0.05)
        for rank in (1, 2):
            ep = c.endpoints[rank]
            assert isinstance(ep.error, ft.RankEvicted), ep.error
            assert ep.error.reason == "heartbeat stale (>2s)"
            assert "declared rank" in str(ep.error) and "dead" in str(ep.error)
            assert ep.ended_at is not None and ep.ended_at - resumed < 5.0
        assert [e.host for e in c.log.events(RelayRetired)] == ["host-b"]
        assert c.endpoints[0].error is None and c.coord.live_ranks == {0}
