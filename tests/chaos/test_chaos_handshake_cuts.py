"""A connection cut at any byte of a handshake never fails formation and never leaves a rank dead
(SPEC §2.3, §2.6, §4.2; FT/2).

Every byte offset, both directions, for the first *and the last* relay to join, and for the first
and the last rank of a relay: the cut attempt is never counted as a join (the coordinator waits
for the relay's ``Ready``, the relay for the rank's first frame), the relay (or rank) re-dials by
itself and joins, formation completes with every rank live; nothing leaks. Runs on the
in-memory transport under ``MockClock``.
"""

from __future__ import annotations

import pytest
import trio
from _chaos.handshake_faults import UPSTREAM, rank_cut, upstream_cut
from _chaos.streams import RecordingStream
from _chaos.util import COORD, rank_heartbeat_len, run_host, wait_until

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.events import FormationComplete, HandshakeRejected, RelayJoined, RelayLost
from flodl_trio.testing import MemoryNetwork

UP_CUTS = [("up", k) for k in range(UPSTREAM.up)]
DOWN_CUTS = [("down", k) for k in range(UPSTREAM.down)]
RANK_UP = wire.RANK_HELLO_LEN + rank_heartbeat_len(1)
RANK_CUTS = ([("up", k) for k in range(RANK_UP)]
             + [("down", k) for k in range(wire.RANK_ACK_LEN)])
PRE_AUTH_EOF = {"eof before magic", "eof before hello", "connection error"}
POSITIONS = [pytest.param(False, id="first"), pytest.param(True, id="last")]


def _ids(cases: list[tuple[str, int]]) -> list[str]:
    return [f"{d}@{k}" for d, k in cases]


async def test_recorded_handshakes_have_the_lengths_the_sweeps_cut_at(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    taps: dict[str, RecordingStream] = {}

    async def tapped(name: str) -> trio.abc.Stream:
        taps[name] = RecordingStream(await memory_network.connect(name))
        return taps[name]

    config = ft.CoordinatorConfig(world_size=2, formation_timeout=10)
    async with trio.open_nursery() as nursery:
        host = await nursery.start(lambda task_status: run_host(
            memory_network, "host-a", [0, 1], salt=salt, world=2,
            upstream=lambda: tapped(COORD),
            rank_dialers={0: lambda: tapped("relay:host-a")}, task_status=task_status))
        async with ft.open_coordinator(memory_network.listener(COORD), salt=salt,
                                       config=config):
            await host.relay.wait_connected()  # it has read the HelloAck and the welcome
            # Before any heartbeat (no time passed): only handshake bytes have moved.
            up, down = bytes(taps[COORD].sent), bytes(taps[COORD].received)
            rank_up, rank_down = bytes(taps["relay:host-a"].sent), taps["relay:host-a"].received
        await wait_until(lambda: host.finished, limit=30)
    assert up[:4] == wire.CHANNEL_MAGIC_CONTROL
    assert len(up) == UPSTREAM.up == 4 + UPSTREAM.hello + UPSTREAM.ready
    assert len(down) == UPSTREAM.down + UPSTREAM.welcome
    assert UPSTREAM.down == UPSTREAM.challenge + UPSTREAM.hello_ack
    assert len(rank_up) >= RANK_UP == wire.RANK_HELLO_LEN + rank_heartbeat_len(0)
    assert len(rank_down) >= wire.RANK_ACK_LEN == 16
    wire.verify_rank_ack(salt, bytes(rank_down[:16]))
    memory_network.assert_all_closed()


def _expected_reject(direction: str, offset: int) -> set[str]:
    """How the coordinator files host-a's cut first attempt (it never counts as joined)."""
    if direction == "up":
        if offset < UPSTREAM.magic:
            return {"eof before magic"}
        if offset < UPSTREAM.magic + UPSTREAM.hello:
            return {"eof before hello"} if offset > UPSTREAM.magic else PRE_AUTH_EOF
        return {"no ready"}  # Hello verified, HelloAck sent, Ready cut
    if offset < UPSTREAM.challenge:
        return PRE_AUTH_EOF  # the relay had only part of the Challenge: it hung up
    if offset == UPSTREAM.challenge:  # the whole Challenge, then the cut: its Hello may be lost
        return PRE_AUTH_EOF | {"no ready"}
    return {"no ready"}  # the relay had only part of the HelloAck: it never sent Ready


@pytest.mark.parametrize("last", POSITIONS)
@pytest.mark.parametrize(("direction", "offset"), UP_CUTS + DOWN_CUTS,
                         ids=_ids(UP_CUTS + DOWN_CUTS))
async def test_relay_cut_at_any_upstream_handshake_byte_re_dials_and_every_rank_is_live(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, direction: str, offset: int,
    last: bool,
) -> None:
    out = await upstream_cut(memory_network, direction, offset, last=last)  # type: ignore[arg-type]
    assert out.error is None and out.formed, out.error
    assert out.dead == {}
    assert out.decision.startswith("rejected: "), out.decision
    assert out.decision.removeprefix("rejected: ") in _expected_reject(direction, offset)
    assert not out.log.of(RelayLost)  # never counted, so never lost
    # Noticed at once (EOF), not after a deadline.
    assert out.decision_time is not None and out.decision_time < 0.1
    # host-a re-dialed once, and that connection is the one in the cohort.
    assert out.details["attempts"] == 2
    assert out.details["relays"]["host-a"] == out.details["peers"][1]
    joined = [ev.host for _, ev in out.log.of(RelayJoined)]
    assert joined == (["host-b", "host-a"] if last else ["host-a", "host-b"])
    assert len(out.log.of(FormationComplete)) == 1
    assert all(h.rank_outcome == dict.fromkeys(h.ranks, "ended") for h in out.hosts.values())
    assert out.leaks == []
    memory_network.assert_all_closed()


@pytest.mark.parametrize("last", POSITIONS)
@pytest.mark.parametrize(("direction", "offset"), RANK_CUTS, ids=_ids(RANK_CUTS))
async def test_rank_cut_at_any_rank_handshake_byte_re_dials_and_every_rank_is_live(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, direction: str, offset: int,
    last: bool,
) -> None:
    out = await rank_cut(memory_network, direction, offset, last=last)  # type: ignore[arg-type]
    assert out.error is None and out.formed, out.error
    assert out.dead == {}
    assert out.decision == "rank re-dialed"
    assert out.details["attempts"] == 2
    assert out.details["first_attempt_closed_by_relay"]
    assert out.decision_time is not None and out.decision_time <= 0.6  # one retry interval
    assert not out.log.of(HandshakeRejected)  # the coordinator never saw the rank's trouble
    assert all(h.rank_outcome == dict.fromkeys(h.ranks, "ended") for h in out.hosts.values())
    assert out.leaks == []
    memory_network.assert_all_closed()
