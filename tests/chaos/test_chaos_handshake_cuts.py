"""A connection cut at any byte of a handshake never fails formation (SPEC §2.3, §2.6, §4.2).

The relay (or rank) whose first connection is cut is rejected or lost *during formation*, re-dials
by itself and joins; nothing leaks. Runs on the in-memory transport under ``MockClock``.
"""

from __future__ import annotations

import pytest
import trio
from _handshake_faults import (
    UPSTREAM,
    last_relay_hello_ack_cut,
    rank_cut,
    rank_fault,
    upstream_cut,
)
from _streams import RecordingStream
from _util import COORD, run_host, wait_until

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.chaos import FaultPlan
from flodl_trio.events import FormationComplete, HandshakeRejected, RelayJoined, RelayLost
from flodl_trio.testing import MemoryNetwork

UP_CUTS = [("up", k) for k in range(UPSTREAM.up)]
DOWN_CUTS = [("down", k) for k in range(UPSTREAM.down)]
RANK_CUTS = ([("up", k) for k in range(wire.RANK_HELLO_LEN)]
             + [("down", k) for k in range(wire.RANK_ACK_LEN)])
PRE_AUTH_EOF = {"eof before magic", "eof before hello", "connection error"}


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
            await host.relay.wait_connected()  # it has read the HelloAck
            # Before any heartbeat (no time passed): only handshake bytes have moved.
            up, down = bytes(taps[COORD].sent), bytes(taps[COORD].received)
            rank_up, rank_down = bytes(taps["relay:host-a"].sent), taps["relay:host-a"].received
        await wait_until(lambda: host.finished, limit=30)
    assert up[:4] == wire.CHANNEL_MAGIC_CONTROL
    assert len(up) == UPSTREAM.up == 4 + UPSTREAM.hello
    assert len(down) == UPSTREAM.down == UPSTREAM.challenge + UPSTREAM.hello_ack
    assert len(rank_up) == wire.RANK_HELLO_LEN == 24
    assert len(rank_down) >= wire.RANK_ACK_LEN == 16
    wire.verify_rank_ack(salt, bytes(rank_down[:16]))
    memory_network.assert_all_closed()


@pytest.mark.parametrize(("direction", "offset"), UP_CUTS + DOWN_CUTS,
                         ids=_ids(UP_CUTS + DOWN_CUTS))
async def test_relay_cut_at_any_upstream_handshake_byte_is_dropped_and_its_re_dial_forms(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, direction: str, offset: int
) -> None:
    out = await upstream_cut(memory_network, direction, offset)  # type: ignore[arg-type]
    assert out.error is None and out.formed, out.error
    assert out.dead == {}
    if direction == "down" and offset > UPSTREAM.challenge:
        # The HelloAck left the coordinator whole; the relay got a part and re-dialed.
        assert out.decision == "relay lost during formation"
        (_, lost), = out.log.of(RelayLost)
        assert lost.host == "host-a" and "EOF" in lost.reason
    else:
        assert out.decision.startswith("rejected: ")
        reason = out.decision.removeprefix("rejected: ")
        if direction == "up" and offset < UPSTREAM.magic:
            assert reason == "eof before magic"
        elif direction == "up" and offset > UPSTREAM.magic:
            assert reason == "eof before hello"  # a partial Hello, then EOF
        else:
            assert reason in PRE_AUTH_EOF
        assert not out.log.of(RelayLost)
    # Noticed at once (EOF), not after a deadline.
    assert out.decision_time is not None and out.decision_time < 0.1
    # host-a re-dialed once, and that connection is the one in the cohort.
    assert out.details["attempts"] == 2
    assert out.details["relays"]["host-a"] == out.details["peers"][1]
    assert len(out.log.of(FormationComplete)) == 1
    assert all(h.rank_outcome == dict.fromkeys(h.ranks, "ended") for h in out.hosts.values())
    assert out.leaks == []
    memory_network.assert_all_closed()


@pytest.mark.parametrize(("direction", "offset"), RANK_CUTS, ids=_ids(RANK_CUTS))
async def test_rank_cut_at_any_rank_handshake_byte_re_dials_and_formation_completes(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, direction: str, offset: int
) -> None:
    out = await rank_cut(memory_network, direction, offset)  # type: ignore[arg-type]
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


async def test_last_relay_whose_hello_ack_is_cut_completes_formation_and_its_ranks_die(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    out = await last_relay_hello_ack_cut(memory_network, 10)
    # The HelloAck write completed formation; the EOF came right after, so it is a death.
    assert out.error is None and out.formed
    assert out.decision == "relay lost after formation"
    assert sorted(out.dead) == [0, 1]
    assert all("relay 'host-a'" in why and "EOF" in why for why in out.dead.values())
    # Its re-dials are refused (the cohort is formed) until its connect_timeout.
    refused = [ev for _, ev in out.log.of(HandshakeRejected)]
    assert refused and all(ev.reason.startswith("cohort formed") for ev in refused)
    host_a = out.hosts["host-a"]
    assert isinstance(host_a.relay_exit, ft.HandshakeError)
    assert "relay 'host-a'" in str(host_a.relay_exit)
    assert [ev.host for _, ev in out.log.of(RelayJoined)] == ["host-b", "host-a"]
    assert out.hosts["host-b"].rank_outcome == {2: "ended"}
    assert out.leaks == []
    memory_network.assert_all_closed()


async def test_last_rank_whose_ack_is_cut_is_declared_dead_once_its_relay_joins(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    out = await rank_fault(memory_network, FaultPlan().cut(8, "down"), name="last rank",
                           faulty_is_last=True)
    # The relay moved on when the last ack was written; the link's EOF is then a RankExit.
    assert out.error is None and out.formed
    assert list(out.dead) == [1]
    assert "rank 1's connection ended without Exiting" in out.dead[1]
    assert isinstance(out.hosts["host-a"].rank_outcome[1], ft.HandshakeError)
    assert out.hosts["host-a"].rank_outcome[0] == "ended"
    assert out.leaks == []
    memory_network.assert_all_closed()
