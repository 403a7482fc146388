"""``Refused`` in the upstream handshake machines, sans-IO (SPEC §2.6, §2.7): the coordinator
answers an authenticated Hello it will not take with ``Refused{nonce, reason}`` where
``HelloAck`` would go; the relay's machine ends in ``RefusalReceived`` with the reason. A
forged, tampered or replayed ``Refused`` is a protocol error like any other bad record."""

from __future__ import annotations

from typing import Any

import cbor2
import pytest

import flodl_trio as ft
from flodl_trio import wire

from helpers.sansio import to_hello

SALT = ft.SessionSalt(bytes(range(16)))
OTHER_SALT = ft.SessionSalt(bytes(range(1, 17)))
REASON = "world_size mismatch: the coordinator's world_size is 3, the relay's is 4"


def hello_received(*, relay_salt: ft.SessionSalt = SALT) -> tuple[Any, Any]:
    """Both ends driven until the coordinator holds the relay's authenticated Hello."""
    relay = wire.RelayHandshake(relay_salt, host="host-a", ranks=(0, 1), world_size=4,
                                coordinator="coord:1")
    coord = wire.CoordinatorHandshake(SALT, peer="10.0.0.7:5000")
    to_hello(relay, coord)
    return relay, coord


def test_refused_is_relay_control_variant_8_with_the_nonce_then_the_reason() -> None:
    msg = wire.Refused(nonce=b"n" * 16, reason=REASON)
    assert cbor2.loads(wire.encode(msg)) == [8, b"n" * 16, REASON]
    assert wire.decode_relay(wire.encode(msg)) == msg
    with pytest.raises(ft.WireError, match=r"Refused\.nonce"):
        wire.decode_relay(cbor2.dumps([8, b"n" * 15, REASON]))
    with pytest.raises(ft.WireError, match=r"Refused\.reason"):
        wire.decode_relay(cbor2.dumps([8, b"n" * 16, b"not text"]))


def test_a_refused_relay_ends_its_handshake_with_the_coordinators_reason_and_sends_nothing(
) -> None:
    relay, coord = hello_received()
    coord.refuse(REASON)
    relay.receive_data(coord.data_to_send())
    event = relay.next_event()
    assert event == wire.RefusalReceived(REASON)
    assert relay.data_to_send() == b""  # no Ready: the relay did not join
    assert relay.failure_category is None
    # Both machines are over: nothing more is read or answered.
    with pytest.raises(ft.HandshakeError, match="already ended"):
        relay.next_event()
    with pytest.raises(ft.HandshakeError, match="already ended"):
        coord.next_event()
    with pytest.raises(ft.HandshakeError, match="accept"):
        coord.accept()


def test_refused_is_sealed_where_the_hello_ack_would_go() -> None:
    relay, coord = hello_received()
    coord.refuse(REASON)
    sealed = coord.data_to_send()
    # hs_key, coordinator → relay, seq 1: after a stand-in for the Challenge (seq 0), an opener
    # on hs_key opens it, and the payload is the CBOR Refused echoing the relay's nonce.
    key = wire.hs_key(SALT, coord.coord_nonce)
    seq0 = wire.RecordSealer(key, wire.COORD_TO_RELAY).seal(wire.RecordKind.CONTROL, 0, b"x")
    _, rec = wire.RecordOpener(key, wire.COORD_TO_RELAY).feed(seq0 + sealed)
    assert rec.kind == wire.RecordKind.CONTROL and rec.rank == 0
    assert wire.decode_relay(rec.payload) == wire.Refused(relay.relay_nonce, REASON)


def test_a_refused_forged_without_the_salt_is_a_bad_mac_not_a_refusal() -> None:
    relay, coord = hello_received()
    # Right place, right seq and direction, but sealed by someone without the session salt.
    forger = wire.RecordSealer(wire.hs_key(OTHER_SALT, coord.coord_nonce), wire.COORD_TO_RELAY)
    forger.seq = 1
    forged = forger.seal(wire.RecordKind.CONTROL, 0,
                         wire.encode(wire.Refused(relay.relay_nonce, "go away")))
    relay.receive_data(forged)
    with pytest.raises(ft.AuthError) as info:
        relay.next_event()
    assert "relay 'host-a'" in str(info.value) and "coord:1" in str(info.value)
    assert relay.failure_category == "bad mac"


def test_a_refused_with_a_tampered_reason_is_a_bad_mac() -> None:
    relay, coord = hello_received()
    coord.refuse(REASON)
    sealed = bytearray(coord.data_to_send())
    sealed[-3] ^= 0x01  # a byte of the reason text
    relay.receive_data(bytes(sealed))
    with pytest.raises(ft.AuthError):
        relay.next_event()
    assert relay.failure_category == "bad mac"


def test_a_refused_replayed_from_another_connection_does_not_echo_the_relays_nonce() -> None:
    # Connection 1: the coordinator refuses; an attacker records everything it sent, the
    # Challenge (sealed with the salt itself, so replayable) and the Refused.
    relay1 = wire.RelayHandshake(SALT, host="host-a", ranks=(0, 1), world_size=4,
                                 coordinator="coord:1")
    coord1 = wire.CoordinatorHandshake(SALT, peer="10.0.0.7:5000")
    coord1.receive_data(relay1.data_to_send())
    coord1.next_event()
    recorded_challenge = coord1.data_to_send()
    relay1.receive_data(recorded_challenge)
    relay1.next_event()
    coord1.receive_data(relay1.data_to_send())
    coord1.next_event()
    coord1.refuse(REASON)
    recorded_refused = coord1.data_to_send()

    relay2 = wire.RelayHandshake(SALT, host="host-a", ranks=(0, 1), world_size=4,
                                 coordinator="coord:1")
    relay2.receive_data(recorded_challenge)
    assert relay2.next_event() is wire.NEED_DATA  # the replayed Challenge verifies
    relay2.receive_data(recorded_refused)  # same key and seq: the MAC verifies too
    with pytest.raises(ft.AuthError, match="Refused from coord:1 does not echo our nonce"):
        relay2.next_event()
    assert relay2.failure_category == "bad echo"


def test_a_refused_echoing_another_nonce_is_refused_by_the_relay() -> None:
    relay, coord = hello_received()
    forged = coord.sealer.seal(wire.RecordKind.CONTROL, 0,
                               wire.encode(wire.Refused(bytes(16), REASON)))
    relay.receive_data(forged)
    with pytest.raises(ft.AuthError, match="does not echo our nonce"):
        relay.next_event()
    assert relay.failure_category == "bad echo"


def test_refuse_before_an_authenticated_hello_is_an_error_naming_the_peer() -> None:
    coord = wire.CoordinatorHandshake(SALT, peer="10.0.0.7:5000")
    with pytest.raises(ft.HandshakeError, match=r"10\.0\.0\.7:5000: refuse\(\) before"):
        coord.refuse(REASON)
    assert coord.data_to_send() == b""


def test_a_long_reason_is_clipped_so_it_fits_a_console_line() -> None:
    relay, coord = hello_received()
    coord.refuse("x" * 10_000)
    relay.receive_data(coord.data_to_send())
    event = relay.next_event()
    assert isinstance(event, wire.RefusalReceived)
    assert len(event.reason) == wire.MAX_REFUSAL_REASON and event.reason.endswith("...")


def test_a_challenge_that_does_not_verify_with_our_salt_is_a_wrong_salt_failure() -> None:
    relay = wire.RelayHandshake(OTHER_SALT, host="host-a", ranks=(0,), world_size=4,
                                coordinator="coord:1")
    coord = wire.CoordinatorHandshake(SALT, peer="10.0.0.7:5000")
    coord.receive_data(relay.data_to_send())
    coord.next_event()
    relay.receive_data(coord.data_to_send())
    with pytest.raises(ft.AuthError, match="not of this session"):
        relay.next_event()
    # Its own category: open_relay gives up after a few of these in a row (WrongSession).
    assert relay.failure_category == "wrong salt"
