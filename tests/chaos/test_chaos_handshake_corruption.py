"""One corrupted byte anywhere in a relay's magic, Hello or Ready is a reject, never a crash and
never a join (SPEC §2.5, §2.6, §4.2); a corrupted Challenge is, for the relay, a failed attempt
(FT/2): it re-dials and joins."""

from __future__ import annotations

import pytest
import trio
from _chaos.handshake_faults import (
    UPSTREAM,
    corrupt_decision_wait,
    corrupt_hello_categories,
    corrupt_upstream,
    hello_field,
)

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.events import HandshakeRejected, RelayLost
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
    expected_wait = corrupt_decision_wait(offset, reason, 2.0)
    assert out.decision_time == pytest.approx(expected_wait, abs=1e-6)
    (_, rejected), = out.log.of(HandshakeRejected)
    assert rejected.peer == out.details["first_peer"]
    if reason == "bad mac" or hello_field(offset) in ("ready-rank", "ready-tag",
                                                      "ready-payload"):
        assert "tag does not verify" in rejected.reason
    assert not out.log.of(RelayLost)  # never counted as joined
    assert out.details["attempts"] == 2
    assert out.details["relays"]["host-a"] == out.details["peers"][1]
    assert all(h.rank_outcome == dict.fromkeys(h.ranks, "ended") for h in out.hosts.values())
    assert out.leaks == []
    memory_network.assert_all_closed()


async def test_corrupt_challenge_is_a_failed_attempt_and_the_relays_re_dial_joins(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    nonce_byte = wire.RECORD_HEADER_LEN + 5  # inside the Challenge's nonce: only the MAC sees it
    out = await corrupt_upstream(memory_network, "down", nonce_byte)
    # The relay could not tell a forged Challenge from another session's: it hung up and, as
    # for any failure before the welcome (FT/2), re-dialed within its connect_timeout.
    assert out.error is None and out.formed, out.error
    assert out.dead == {}
    assert out.details["attempts"] == 2
    assert out.decision == "rejected: eof before hello"
    assert out.details["relays"]["host-a"] == out.details["peers"][1]
    assert all(h.rank_outcome == dict.fromkeys(h.ranks, "ended") for h in out.hosts.values())
    assert out.leaks == []
    memory_network.assert_all_closed()


async def test_relay_that_only_meets_forged_challenges_gives_up_after_three_naming_the_salt(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    # Every attempt meets a coordinator of another session: the relay gives up after three
    # Challenges in a row that do not verify (about 1 s), not at its connect_timeout; the
    # last attempt's failure is the error's cause.
    salt, other = ft.SessionSalt.generate(), ft.SessionSalt.generate()
    started = trio.current_time()
    listener = memory_network.listener("coordinator")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_serve_wrong_challenges, listener, other)
        with pytest.raises(ft.WrongSession) as info:
            async with ft.open_relay(lambda: memory_network.connect("coordinator"), salt=salt,
                                     host="host-a", ranks=[0], world_size=1,
                                     rank_listen=memory_network.listener("relay:a"),
                                     config=ft.RelayConfig(connect_timeout=30,
                                                           rank_accept_timeout=5)) as relay:
                async with ft.open_rank(lambda: memory_network.connect("relay:a"), salt=salt,
                                        rank=0, world_size=1):
                    await relay.wait_closed()
        nursery.cancel_scope.cancel()
    assert trio.current_time() - started == pytest.approx(1.0)  # attempts at 0, 0.5 and 1 s
    text = str(info.value)
    assert "relay 'host-a'" in text and "salt differs" in text
    assert "not of this session" in str(info.value.__cause__)


async def _serve_wrong_challenges(listener: trio.abc.Listener[trio.abc.Stream],
                                  salt: ft.SessionSalt) -> None:
    from flodl_trio.net._handshake_io import run_handshake

    async with listener:
        for _ in range(100):
            stream = await listener.accept()
            machine = wire.CoordinatorHandshake(salt, peer="test")
            with trio.move_on_after(5):
                try:
                    await run_handshake(stream, machine)
                except (ft.FlodlError, trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            await trio.aclose_forcefully(stream)


ACK_OFFSETS = list(range(UPSTREAM.challenge, UPSTREAM.challenge + UPSTREAM.hello_ack))


@pytest.mark.parametrize("offset", ACK_OFFSETS)
async def test_a_forged_hello_ack_at_any_byte_is_a_failed_attempt_and_the_re_dial_joins(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, offset: int
) -> None:
    # FT/1 relays gave up for good after one forged or replayed HelloAck. FT/2: the relay
    # hangs up, the coordinator (which never got Ready) un-covers it, and its re-dial joins.
    out = await corrupt_upstream(memory_network, "down", offset)
    assert out.error is None and out.formed, out.error
    assert out.dead == {}
    assert out.decision == "rejected: no ready"
    assert not out.log.of(RelayLost)
    assert out.details["attempts"] == 2
    assert out.details["relays"]["host-a"] == out.details["peers"][1]
    assert all(h.rank_outcome == dict.fromkeys(h.ranks, "ended") for h in out.hosts.values())
    assert out.leaks == []
    memory_network.assert_all_closed()
