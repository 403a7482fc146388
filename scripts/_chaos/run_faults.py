"""Faults after formation (SPEC §2.5, §4.4, §4.5), shared by tests and the sweep script.

Three relays: ``host-a`` (ranks 0, 1) is the victim, ``host-b`` (2, 3) and ``host-c`` (4) are
healthy. The coordinator broadcasts numbered ``SetGlobalStep`` messages; at one of them host-a's
upstream is cut, reset or stalled. Run under ``MockClock``.
"""

from __future__ import annotations

from typing import Any, Literal

import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.chaos import FaultPlan, FaultyStream
from flodl_trio.events import HandshakeRejected, RankDeclaredDead, RelayJoined
from flodl_trio.testing import MemoryNetwork

from .streams import DuplicateOneSend, FaultyFirstDial, RecordingStream
from .util import (
    COORD,
    EventLog,
    Outcome,
    category,
    first,
    run_cluster,
    upstream_handshake,
    wait_until,
)

Fault = Literal["cut", "reset", "stall-write", "stall-silent"]
FAULTS: tuple[Fault, ...] = ("cut", "reset", "stall-write", "stall-silent")
VICTIM_RANKS = frozenset({0, 1})
SURVIVOR_RANKS = frozenset({2, 3, 4})
WRITE_STALL_TIMEOUT = 2.0
HEARTBEAT_TIMEOUT = 10.0
# A small per-direction buffer, so a relay that stops reading blocks the coordinator's writes
# after a few dozen records (as a full TCP window would).
SMALL_BUFFER = 1024


def network_for(fault: Fault) -> MemoryNetwork:
    """The network a mid-run scenario needs: small buffers to provoke a write stall."""
    return MemoryNetwork(buffer_size=SMALL_BUFFER if fault == "stall-write" else 65536)


def fault_plan(fault: Fault, stream: FaultyStream) -> FaultPlan:
    """A plan that fires at the stream's next send or receive (offsets are the bytes so far)."""
    sent, received = stream.bytes_sent, stream.bytes_received
    if fault == "cut":
        return FaultPlan().cut(sent, "up").cut(received, "down")
    if fault == "reset":
        return FaultPlan().reset(sent, "up").reset(received, "down")
    if fault == "stall-write":  # the relay stops reading: the coordinator's writes block
        return FaultPlan().stall(received, "down")
    return FaultPlan().stall(sent, "up").stall(received, "down")  # silent, link open


async def mid_run(net: MemoryNetwork, fault: Fault, *, fault_at: int = 20, steps: int = 50,
                  interval: float = 0.1) -> Outcome:
    """Broadcast ``SetGlobalStep(1..steps)``; just before step ``fault_at``, fault host-a."""
    salt = ft.SessionSalt.generate()
    out = Outcome(f"mid-run {fault}", EventLog())
    dialer = FaultyFirstDial(net, COORD, FaultPlan())
    config = ft.CoordinatorConfig(
        world_size=5, formation_timeout=30, handshake_timeout=5,
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
        # For stall-silent the coordinator's writes never block (large buffer) anyway.
        write_stall_timeout=WRITE_STALL_TIMEOUT if fault == "stall-write" else 30.0,
    )
    hosts = {
        # Silent: the relay must not give up first (its own write stall would send an EOF).
        "host-a": {"ranks": [0, 1], "upstream": dialer, "relay_config": ft.RelayConfig(
            write_stall_timeout=60 if fault == "stall-silent" else 5)},
        "host-b": {"ranks": [2, 3]},
        "host-c": {"ranks": [4]},
    }
    errors: list[tuple[int, ft.BroadcastError]] = []

    async def body(coord: ft.Coordinator) -> None:
        await wait_until(lambda: all(h.relay is not None for h in out.hosts.values()), limit=1)
        for host in out.hosts.values():
            assert host.relay is not None
            await host.relay.wait_connected()
        for step in range(1, steps + 1):
            if step == fault_at:
                assert dialer.faulty is not None
                dialer.faulty.plan = fault_plan(fault, dialer.faulty)
                out.details["fault_time"] = trio.current_time()
            try:
                await coord.broadcast_control(wire.SetGlobalStep(global_step=step))
            except ft.BroadcastError as exc:
                errors.append((step, exc))
            await trio.sleep(interval)
        await wait_until(lambda: VICTIM_RANKS <= coord.dead_ranks, limit=60)
        survivors = [(h, r) for h in out.hosts.values() for r in h.ranks if r in SURVIVOR_RANKS]
        await wait_until(lambda: all(len(h.steps(r)) >= steps for h, r in survivors), limit=10)
        out.details["live_at_end"] = coord.live_ranks
        out.details["lost_broadcasts"] = coord.lost_broadcasts

    await run_cluster(net, out, hosts, config=config, salt=salt, body=body)
    out.details["broadcast_errors"] = errors
    dead = first(out.log, RankDeclaredDead, lambda ev: ev.rank == 0)
    if dead is not None and "fault_time" in out.details:
        out.decision = f"ranks declared dead: {dead[1].reason}"
        out.decision_time = dead[0] - out.details["fault_time"]
    return out


async def replayed_session(net: MemoryNetwork, *, replay_after: float = 2.0) -> Outcome:
    """Replay, byte for byte on a new connection, what host-a sent on its live connection."""
    salt = ft.SessionSalt.generate()
    out = Outcome("replayed upstream session", EventLog())
    taps: list[RecordingStream] = []

    async def recorded_dial() -> trio.abc.Stream:
        taps.append(RecordingStream(await net.connect(COORD)))
        return taps[-1]

    replay: dict[str, Any] = {}

    async def replayer() -> None:
        await wait_until(lambda: first(out.log, RelayJoined) is not None, limit=5)
        await trio.sleep(replay_after)  # let the session carry heartbeats (DATA records) too
        recorded = bytes(taps[0].sent)
        replay["bytes"] = len(recorded)
        stream = await net.connect(COORD)
        replay["peer"] = f"mem:{COORD}:{stream.connection.index}"
        replay["sent_at"] = trio.current_time()
        received = bytearray()
        try:
            await stream.send_all(recorded)
            with trio.fail_after(10):
                while chunk := await stream.receive_some(65536):
                    received += chunk
        except trio.BrokenResourceError:
            pass  # the coordinator closed while the replay was still being written
        finally:
            replay["received"] = bytes(received)
            await stream.aclose()

    config = ft.CoordinatorConfig(world_size=3, formation_timeout=60, handshake_timeout=5)
    hosts = {"host-a": {"ranks": [0, 1], "upstream": recorded_dial},
             "host-b": {"ranks": [2], "rank_delay": replay_after + 2}}
    await run_cluster(net, out, hosts, config=config, salt=salt, side_tasks=[replayer])
    rejected = first(out.log, HandshakeRejected, lambda ev: ev.peer == replay.get("peer"))
    if rejected is not None:
        out.decision = f"rejected: {category(rejected[1].reason)}"
        out.decision_time = rejected[0] - replay["sent_at"]
    out.details.update(replay)
    lengths = upstream_handshake("host-a", (0, 1))
    out.details["recorded_handshake"] = lengths.up
    out.details["salt"] = salt
    out.details["original_challenge"] = bytes(taps[0].received[:lengths.challenge])
    return out


async def duplicated_record(net: MemoryNetwork) -> Outcome:
    """After host-a's handshake, its first batch of records is written twice on its connection."""
    salt = ft.SessionSalt.generate()
    out = Outcome("duplicated record", EventLog())
    handshake = upstream_handshake("host-a", (0, 1)).up
    wrappers: list[DuplicateOneSend] = []

    async def duplicating_dial() -> trio.abc.Stream:
        wrappers.append(DuplicateOneSend(await net.connect(COORD), after=handshake))
        return wrappers[-1]

    async def body(coord: ft.Coordinator) -> None:
        await wait_until(lambda: VICTIM_RANKS <= coord.dead_ranks, limit=10)
        out.details["live_at_end"] = coord.live_ranks

    config = ft.CoordinatorConfig(world_size=3, formation_timeout=60, handshake_timeout=5)
    hosts = {"host-a": {"ranks": [0, 1], "upstream": duplicating_dial},
             "host-b": {"ranks": [2]}}
    await run_cluster(net, out, hosts, config=config, salt=salt, body=body)
    out.details["duplicated"] = wrappers[0].duplicated if wrappers else None
    dead = first(out.log, RankDeclaredDead, lambda ev: ev.rank == 0)
    if dead is not None and wrappers and wrappers[0].duplicated_at is not None:
        out.decision = f"ranks declared dead: {dead[1].reason}"
        out.decision_time = dead[0] - wrappers[0].duplicated_at
    return out
