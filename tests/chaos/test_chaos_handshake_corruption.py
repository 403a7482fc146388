"""One corrupted byte anywhere in a relay's magic or Hello is a pre-auth reject, never a crash
(SPEC §2.5, §2.6, §4.2); a corrupted Challenge makes the relay give up with ``AuthError``."""

from __future__ import annotations

import pytest
import trio
from _handshake_faults import UPSTREAM, corrupt_hello_categories, corrupt_upstream, hello_field

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.events import FormationFailed, HandshakeRejected
from flodl_trio.testing import MemoryNetwork

HELLO_OFFSETS = list(range(UPSTREAM.up))


@pytest.mark.parametrize("offset", HELLO_OFFSETS,
                         ids=[f"{k}-{hello_field(k)}" for k in HELLO_OFFSETS])
async def test_corrupt_byte_of_magic_or_hello_is_rejected_pre_auth_and_the_re_dial_forms(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, offset: int
) -> None:
    out = await corrupt_upstream(memory_network, "up", offset)
    assert out.error is None and out.formed, out.error
    assert out.dead == {}
    assert out.decision.startswith("rejected: ")
    reason = out.decision.removeprefix("rejected: ")
    assert reason in corrupt_hello_categories(offset)
    # A header or MAC failure is decided at once; only a length that grew waits for the deadline.
    expected_wait = 2.0 if reason == "timeout" else 0.0
    assert out.decision_time == pytest.approx(expected_wait, abs=1e-6)
    (_, rejected), = out.log.of(HandshakeRejected)
    assert rejected.peer == out.details["first_peer"]
    if reason == "bad mac":
        assert "tag does not verify" in rejected.reason
    assert out.details["attempts"] == 2
    assert out.details["relays"]["host-a"] == out.details["peers"][1]
    assert all(h.rank_outcome == dict.fromkeys(h.ranks, "ended") for h in out.hosts.values())
    assert out.leaks == []
    memory_network.assert_all_closed()


async def test_corrupt_challenge_makes_the_relay_fail_with_auth_error_as_from_a_wrong_session(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    nonce_byte = wire.RECORD_HEADER_LEN + 5  # inside the Challenge's nonce: only the MAC sees it
    out = await corrupt_upstream(memory_network, "down", nonce_byte)
    host_a = out.hosts["host-a"]
    assert isinstance(host_a.relay_exit, ft.AuthError)
    assert "not of this session" in str(host_a.relay_exit)
    assert "host-a" in str(host_a.relay_exit)
    assert out.details["attempts"] == 1  # an AuthError is final: no re-dial
    # The coordinator saw an EOF before any Hello, and timed out formation without host-a.
    assert out.decision == "rejected: eof before hello"
    assert isinstance(out.error, ft.FormationTimeout)
    assert "1/3 ranks covered" in str(out.error)
    assert "host-b [2]" in str(out.error)
    assert len(out.log.of(FormationFailed)) == 1
    # host-a's ranks learnt that their relay is gone.
    assert all(isinstance(o, ft.CoordinatorLost) for o in host_a.rank_outcome.values())
    assert out.leaks == []
    memory_network.assert_all_closed()
