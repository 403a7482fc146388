"""Handshake fault scenarios (SPEC §2.3, §2.6, §4.2), shared by tests and the sweep script.

Every scenario runs one small cluster on a :class:`MemoryNetwork` (run it under ``MockClock``):
relay ``host-a`` (ranks 0, 1) takes the fault on its *first* connection attempt only, relay
``host-b`` (rank 2) is healthy. ``last=False``: host-b's rank starts late, so host-a is the
*first* relay to join; ``last=True``: host-a's ranks start late, so host-a is the *last* relay
and its join completes formation. FT/2 makes both the same story: the coordinator counts host-a
only once its ``Ready`` verified, so a cut anywhere in the handshake leaves host-a uncovered,
host-a re-dials, and formation completes with every rank live.
"""

from __future__ import annotations

from typing import Literal

import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.chaos import FaultPlan
from flodl_trio.events import (
    FormationComplete,
    FormationFailed,
    HandshakeRejected,
    RankDeclaredDead,
    RelayJoined,
    RelayLost,
)
from flodl_trio.testing import MemoryNetwork

from .streams import FaultyFirstDial
from .util import (
    COORD,
    EventLog,
    Outcome,
    category,
    first,
    run_cluster,
    upstream_handshake,
)

Dir = Literal["up", "down"]
UPSTREAM = upstream_handshake("host-a", (0, 1))
HOST_B_LATE = 3.0  # host-b's rank starts this late, so host-b joins after host-a's re-dial

# The Hello record of host-a, field by field (offsets inside the record, SPEC §2.5).
_RECORD_FIELDS = (("magic", 4), ("version", 4), ("kind", 1), ("rank", 4), ("payload_len", 4),
                  ("tag", 8))
assert sum(size for _, size in _RECORD_FIELDS) == wire.RECORD_HEADER_LEN
_PAYLOAD_LEN_AT = 13  # offset of payload_len inside the record header


def hello_field(up_offset: int) -> str:
    """Which field of the upstream bytes (magic, Hello record, Ready record) ``up_offset``
    falls in; the Ready record's fields are prefixed ``ready-``."""
    if up_offset < UPSTREAM.magic:
        return "channel magic"
    at = up_offset - UPSTREAM.magic
    if at >= UPSTREAM.hello:
        at -= UPSTREAM.hello
        for name, size in _RECORD_FIELDS:
            if at < size:
                return f"ready-{name}"
            at -= size
        return "ready-payload"
    for name, size in _RECORD_FIELDS:
        if at < size:
            return name
        at -= size
    return "payload"


def corrupt_hello_categories(up_offset: int) -> set[str]:
    """The reject categories a 0xFF-corrupted byte at ``up_offset`` may produce.

    The header is checked before the MAC (magic, version, kind, length ceiling), everything
    else by the MAC. A corrupted length that stays under the pre-auth ceiling just waits for
    bytes that never come: the coordinator's handshake deadline decides (``timeout``).
    """
    field = hello_field(up_offset)
    if field.startswith("ready-"):
        # After the Hello verified: the coordinator sent HelloAck and waits for Ready, so any
        # damage to it un-covers the relay ("no ready"), at once or at the deadline.
        return {"no ready"}
    if field == "channel magic":
        return {"bad magic"}
    if field in ("magic", "version", "kind"):
        return {"malformed"}
    if field == "payload_len":
        shift = 8 * (up_offset - UPSTREAM.magic - _PAYLOAD_LEN_AT)  # little-endian u32
        declared = (UPSTREAM.hello - wire.RECORD_HEADER_LEN) ^ (0xFF << shift)
        # The pre-auth ceiling is fitted to the largest legal Hello of this world (3 ranks).
        return {"malformed"} if declared > wire.max_hello_payload(3) else {"timeout"}
    return {"bad mac"}  # rank, tag, payload: all covered by the tag


def _hosts(upstream: FaultyFirstDial, *, host_b_late: float = HOST_B_LATE,
           host_a_late: float = 0.0,
           relay_config: ft.RelayConfig | None = None) -> dict[str, dict[str, object]]:
    return {
        "host-a": {"ranks": [0, 1], "upstream": upstream, "relay_config": relay_config,
                   "rank_delay": host_a_late},
        "host-b": {"ranks": [2], "rank_delay": host_b_late},
    }


def _first_connection_fate(out: Outcome, dialer: FaultyFirstDial) -> None:
    """Fill ``decision`` / ``decision_time``: how the coordinator dealt with attempt 0."""
    if not dialer.attempts:
        out.decision = "never dialed"
        return
    peer, dialed = dialer.peer(0), dialer.dialed_at[0]
    rejected = first(out.log, HandshakeRejected, lambda ev: ev.peer == peer)
    joined = first(out.log, RelayJoined, lambda ev: ev.peer == peer)
    if rejected is not None:
        out.decision = f"rejected: {category(rejected[1].reason)}"
        out.decision_time = rejected[0] - dialed
    elif joined is not None:
        lost = first(out.log, RelayLost, lambda ev: ev.host == "host-a")
        if lost is None:
            out.decision = "joined"
        else:
            # Which came first in the timeline: host-a's loss or the end of formation.
            order = [ev for _, ev in out.log.entries if isinstance(ev, FormationComplete)
                     or (isinstance(ev, RelayLost) and ev.host == "host-a")]
            during = isinstance(order[0], RelayLost)
            out.decision = f"relay lost {'during' if during else 'after'} formation"
            out.decision_time = lost[0] - dialed
    else:
        out.decision = "undecided"
    out.details["attempts"] = len(dialer.attempts)
    out.details["first_peer"] = peer
    out.details["peers"] = [dialer.peer(i) for i in range(len(dialer.attempts))]


def _relays_at_end(out: Outcome) -> None:
    coord = out.details.get("coord")
    if coord is not None:
        out.details["relays"] = {info.host: info.peer for info in coord.relays}


async def upstream_fault(net: MemoryNetwork, plan: FaultPlan, *, name: str,
                         handshake_timeout: float = 5.0, formation_timeout: float = 60.0,
                         relay_config: ft.RelayConfig | None = None,
                         host_b_late: float = HOST_B_LATE, host_a_late: float = 0.0) -> Outcome:
    """host-a's first upstream connection runs ``plan``; host-a re-dials on its own."""
    salt = ft.SessionSalt.generate()
    out = Outcome(name, EventLog())
    dialer = FaultyFirstDial(net, COORD, plan)
    config = ft.CoordinatorConfig(world_size=3, formation_timeout=formation_timeout,
                                  handshake_timeout=handshake_timeout)
    await run_cluster(net, out, _hosts(dialer, relay_config=relay_config,
                                       host_b_late=host_b_late, host_a_late=host_a_late),
                      config=config, salt=salt)
    _first_connection_fate(out, dialer)
    _relays_at_end(out)
    return out


async def upstream_cut(net: MemoryNetwork, direction: Dir, offset: int, *,
                       last: bool = False) -> Outcome:
    """Cut host-a's first upstream connection after ``offset`` bytes of ``direction``; host-a
    is the first relay to join, or (``last``) the one whose join completes formation."""
    where = "last" if last else "first"
    return await upstream_fault(net, FaultPlan().cut(offset, direction),
                                name=f"upstream cut {direction}@{offset} ({where} relay)",
                                host_b_late=0.0 if last else HOST_B_LATE,
                                host_a_late=1.0 if last else 0.0)


def corrupt_decision_wait(up_offset: int, reason: str, handshake_timeout: float) -> float:
    """How long after the dial the coordinator decides on a corrupted byte at ``up_offset``:
    at once, except for a length that grew but stays under its ceiling (then the deadline)."""
    if reason == "timeout":
        return handshake_timeout
    field = hello_field(up_offset)
    if field == "ready-payload_len":
        at = up_offset - UPSTREAM.magic - UPSTREAM.hello - _PAYLOAD_LEN_AT
        declared = (UPSTREAM.ready - wire.RECORD_HEADER_LEN) ^ (0xFF << (8 * at))
        return handshake_timeout if declared <= wire.MAX_RECORD_PAYLOAD else 0.0
    return 0.0


async def corrupt_upstream(net: MemoryNetwork, direction: Dir, offset: int) -> Outcome:
    """XOR 0xFF one byte of host-a's first upstream connection.

    The relay's own handshake deadline (4 s) is longer than the coordinator's (2 s), so a
    corrupted length field is decided by the coordinator.
    """
    return await upstream_fault(
        net, FaultPlan().corrupt(offset, direction), name=f"corrupt {direction}@{offset}",
        handshake_timeout=2.0, formation_timeout=20.0,
        relay_config=ft.RelayConfig(handshake_timeout=4.0))


async def slow_upstream(net: MemoryNetwork, plan: FaultPlan, *, name: str) -> Outcome:
    """A drip or stall on host-a's first connection; host-b joins at once, in parallel.

    The coordinator's handshake deadline (5 s) is shorter than the relay's (8 s).
    """
    return await upstream_fault(net, plan, name=name, handshake_timeout=5.0,
                                relay_config=ft.RelayConfig(handshake_timeout=8.0),
                                host_b_late=0.0)


async def rank_fault(net: MemoryNetwork, plan: FaultPlan, *, name: str,
                     faulty_is_last: bool = False) -> Outcome:
    """Rank 1's first connection to relay host-a runs ``plan``; rank 1 re-dials on its own.

    Rank 0 connects 1 s later, so rank 1 is not the relay's last rank (``faulty_is_last``
    swaps that). FT/2: the relay counts a rank only once its first frame after the ack
    arrived, so a cut anywhere in the rank's handshake frees the slot, last rank included.
    """
    salt = ft.SessionSalt.generate()
    out = Outcome(name, EventLog())
    dialer = FaultyFirstDial(net, "relay:host-a", plan)
    delays = {1: 1.0} if faulty_is_last else {0: 1.0}
    config = ft.CoordinatorConfig(world_size=3, formation_timeout=60, handshake_timeout=5)
    hosts = {
        "host-a": {"ranks": [0, 1], "rank_dialers": {1: dialer}, "rank_delays": delays},
        "host-b": {"ranks": [2], "rank_delay": HOST_B_LATE},
    }
    await run_cluster(net, out, hosts, config=config, salt=salt)
    out.details["attempts"] = len(dialer.attempts)
    if len(dialer.attempts) > 1:
        out.decision = "rank re-dialed"
        out.decision_time = dialer.dialed_at[1] - dialer.dialed_at[0]
    else:
        out.decision = "no re-dial"
    dead = first(out.log, RankDeclaredDead, lambda ev: ev.rank == 1)
    if dead is not None:
        out.decision = f"rank 1 declared dead: {dead[1].reason}"
        out.decision_time = dead[0] - dialer.dialed_at[0]
    out.details["first_attempt_closed_by_relay"] = (
        bool(dialer.attempts) and not dialer.attempts[0].connection.server.is_open)
    return out


async def rank_cut(net: MemoryNetwork, direction: Dir, offset: int, *,
                   last: bool = False) -> Outcome:
    """Cut rank 1's first connection to its relay after ``offset`` bytes of ``direction``;
    rank 1 is its relay's first rank, or (``last``) the one that completes the relay's set."""
    where = "last" if last else "first"
    return await rank_fault(net, FaultPlan().cut(offset, direction),
                            name=f"rank cut {direction}@{offset} ({where} rank)",
                            faulty_is_last=last)


async def silent_dialer(net: MemoryNetwork, *, handshake_timeout: float = 5.0) -> Outcome:
    """A connection that sends nothing, next to two healthy relays."""
    salt = ft.SessionSalt.generate()
    out = Outcome("silent dialer", EventLog())
    config = ft.CoordinatorConfig(world_size=3, formation_timeout=60,
                                  handshake_timeout=handshake_timeout)
    silent: dict[str, object] = {}

    async def dial_and_say_nothing() -> None:
        stream = await net.connect(COORD)
        silent["peer"] = f"mem:{COORD}:{stream.connection.index}"
        silent["dialed_at"] = trio.current_time()
        try:
            with trio.fail_after(handshake_timeout + 5):
                silent["read"] = await stream.receive_some(100)  # b"": the coordinator closed it
                silent["closed_at"] = trio.current_time()
        finally:
            await stream.aclose()

    hosts = {"host-a": {"ranks": [0, 1]}, "host-b": {"ranks": [2], "rank_delay": 8.0}}
    await run_cluster(net, out, hosts, config=config, salt=salt,
                      side_tasks=[dial_and_say_nothing])
    rejected = first(out.log, HandshakeRejected, lambda ev: ev.peer == silent.get("peer"))
    if rejected is not None:
        out.decision = f"rejected: {category(rejected[1].reason)}"
        out.decision_time = rejected[0] - float(silent["dialed_at"])  # type: ignore[arg-type]
    out.details.update(silent)
    return out


async def world_mismatch(net: MemoryNetwork, *, relay_world: int) -> Outcome:
    """host-a (and its ranks) believe the world has ``relay_world`` ranks, the coordinator 3:
    formation must fail at host-a's Hello, naming both numbers (FT/2)."""
    salt = ft.SessionSalt.generate()
    out = Outcome(f"world-size mismatch: coordinator 3, relay {relay_world}", EventLog())
    config = ft.CoordinatorConfig(world_size=3, formation_timeout=60, handshake_timeout=5)
    hosts: dict[str, dict[str, object]] = {
        "host-a": {"ranks": [0, 1], "world": relay_world,
                   "relay_config": ft.RelayConfig(connect_timeout=5)},
        "host-b": {"ranks": [2]},
    }
    started = trio.current_time()
    await run_cluster(net, out, hosts, config=config, salt=salt)
    failed = first(out.log, FormationFailed)
    if failed is not None:
        out.decision = f"formation failed: {failed[1].reason}"
        out.decision_time = failed[0] - started
    return out
