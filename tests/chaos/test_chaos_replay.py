"""Recorded bytes cannot be replayed (SPEC §2.5 sealing, §2.6): a whole recorded session on a new
connection fails the Hello's MAC under the new coordinator nonce, and a record duplicated inside a
live connection ends that connection as an authentication failure."""

from __future__ import annotations

import trio
from _chaos.run_faults import VICTIM_RANKS, duplicated_record, replayed_session

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.events import HandshakeRejected, RelayJoined, RelayLost
from flodl_trio.testing import MemoryNetwork


async def test_replayed_upstream_session_is_rejected_by_mac_and_the_real_relay_stays(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    out = await replayed_session(memory_network)
    # The recording is a real session: the handshake and some heartbeat records after it.
    assert out.details["bytes"] > out.details["recorded_handshake"]
    assert out.decision == "rejected: bad mac"
    assert out.decision_time == 0  # decided from the bytes, no deadline involved
    (_, rejected), = out.log.of(HandshakeRejected)
    assert "tag does not verify" in rejected.reason
    # The coordinator answered with one fresh Challenge (a new nonce), then closed.
    salt = bytes(out.details["salt"])
    fresh = wire.RecordOpener(salt, wire.COORD_TO_RELAY).feed(out.details["received"])
    original = wire.RecordOpener(salt, wire.COORD_TO_RELAY).feed(
        out.details["original_challenge"])
    assert len(fresh) == len(original) == 1
    fresh_challenge = wire.decode_relay(fresh[0].payload)
    original_challenge = wire.decode_relay(original[0].payload)
    assert isinstance(fresh_challenge, wire.Challenge)
    assert isinstance(original_challenge, wire.Challenge)
    assert fresh_challenge.nonce != original_challenge.nonce
    # The genuine host-a was neither superseded nor lost, and formation completed.
    assert out.error is None and out.formed and out.dead == {}
    assert [ev.host for _, ev in out.log.of(RelayJoined)] == ["host-a", "host-b"]
    assert not out.log.of(RelayLost)
    assert all(h.rank_outcome == dict.fromkeys(h.ranks, "ended") for h in out.hosts.values())
    assert out.leaks == []
    memory_network.assert_all_closed()


async def test_record_duplicated_inside_a_live_connection_ends_it_as_an_auth_failure(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    out = await duplicated_record(memory_network)
    assert out.details["duplicated"] is not None
    assert out.error is None and out.formed
    assert set(out.dead) == VICTIM_RANKS
    (_, lost), = out.log.of(RelayLost)
    assert lost.host == "host-a"
    assert lost.reason.startswith("authentication failure: ")
    assert "tag does not verify" in lost.reason
    assert all("authentication failure" in why for why in out.dead.values())
    assert out.decision_time == 0  # the copy was refused as soon as it arrived
    assert out.details["live_at_end"] == {2}
    assert out.hosts["host-b"].rank_outcome == {2: "ended"}
    assert all(isinstance(o, ft.CoordinatorLost)
               for o in out.hosts["host-a"].rank_outcome.values())
    assert out.leaks == []
    memory_network.assert_all_closed()
