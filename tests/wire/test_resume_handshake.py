"""``Resume`` and ``Generation`` in the upstream handshake machines, sans-IO (issue 22): a relay
that re-dials a durable coordinator it had joined sends ``Resume`` (its Hello plus the highest
coordinator generation it saw) where ``Hello`` goes; a coordinator that runs with a store sends
``Generation{g}`` just before its welcome; a relay that already saw a higher generation fails
the attempt before any record of that deposed coordinator is delivered."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

import flodl_trio as ft
from flodl_trio import wire

from helpers.sansio import to_hello, to_ready

SALT = ft.SessionSalt(bytes(range(16)))
SIGS = {"model": b"\x07" * 32}
PROTOCOL_ERRORS = (ft.WireError, ft.HandshakeError)


def machines(*, seen: int | None = None, coord_generation: int | None = None
             ) -> tuple[wire.RelayHandshake, wire.CoordinatorHandshake]:
    relay = wire.RelayHandshake(SALT, host="host-a", ranks=(0, 1), world_size=4,
                                model_sigs=SIGS, coordinator="coord:1", generation=seen)
    coord = wire.CoordinatorHandshake(SALT, peer="10.0.0.7:5000", generation=coord_generation)
    return relay, coord


def run(relay: Any, coord: Any, *, chunk: int = 0, cut_down: int | None = None,
        tamper_down: Callable[[bytes], bytes] = lambda b: b) -> tuple[Any, Any, bytes, bytes]:
    """Drive both ends (the coordinator accepts); ``chunk`` > 0 feeds that many bytes at a time;
    ``cut_down`` ends the coordinator→relay stream after that many bytes (then EOF);
    ``tamper_down`` rewrites the whole coordinator→relay stream so far (one offset, one byte).

    Returns (relay's last event, coordinator's last event, bytes up, bytes down).
    """
    up, down = bytearray(), bytearray()
    fed = {"up": 0, "down": 0}
    events: dict[str, Any] = {"relay": wire.NEED_DATA, "coord": wire.NEED_DATA}
    eof_sent = False
    for _ in range(40):
        if isinstance(events["coord"], wire.NeedData):
            events["coord"] = coord.next_event()
            if isinstance(events["coord"], wire.HelloReceived):
                coord.accept()
                events["coord"] = coord.next_event()
        down += coord.data_to_send()
        if isinstance(events["relay"], wire.NeedData):
            events["relay"] = relay.next_event()
        up += relay.data_to_send()
        limit = len(down) if cut_down is None else min(cut_down, len(down))
        seen_down = tamper_down(bytes(down))
        for name, stream, me in (("up", up, coord), ("down", seen_down, relay)):
            end = limit if name == "down" else len(stream)
            while fed[name] < end:
                step = chunk or end - fed[name]
                me.receive_data(bytes(stream[fed[name]:min(end, fed[name] + step)]))
                fed[name] = min(end, fed[name] + step)
        if cut_down is not None and fed["down"] >= cut_down and not eof_sent \
                and len(down) > cut_down:
            relay.receive_data(b"")
            eof_sent = True
        if not isinstance(events["relay"], wire.NeedData) and \
                not isinstance(events["coord"], wire.NeedData):
            break
    return events["relay"], events["coord"], bytes(up), bytes(down)


# ---------------------------------------------------------------- valid exchanges


def test_a_relay_given_a_generation_resumes_and_the_coordinator_sees_which_it_was() -> None:
    relay, coord = machines(seen=3, coord_generation=4)
    done_relay, done_coord, _, _ = run(relay, coord)
    assert isinstance(done_relay, wire.Established) and isinstance(done_coord, wire.Established)
    assert coord.resume == wire.Resume(host="host-a", world_size=4, model_sigs=SIGS,
                                       ranks=(0, 1), nonce=relay.relay_nonce, generation=3)
    # Its Hello fields are where the coordinator's admission code reads a Hello's.
    assert coord.hello == wire.Hello("host-a", 4, SIGS, (0, 1), relay.relay_nonce)
    assert done_relay.generation == 4 and relay.coordinator_generation == 4
    assert done_coord.generation == 4


def test_hello_received_says_resumed_and_the_generation_only_for_a_resume() -> None:
    for seen, resumed, generation in ((None, False, None), (7, True, 7)):
        relay, coord = machines(seen=seen)
        event = to_hello(relay, coord)
        assert event.resumed is resumed and event.generation == generation
        assert event.hello.host == "host-a" and event.hello.ranks == (0, 1)


def test_a_durable_coordinator_sends_its_generation_just_before_the_welcome() -> None:
    relay, coord = machines(coord_generation=9)
    to_ready(relay, coord)
    coord.receive_data(relay.data_to_send())
    assert isinstance(coord.next_event(), wire.Established)
    after_ready = coord.data_to_send()
    # Exactly Generation{9} then the welcome, sealed on conn_key at seq 2 and 3 (the Challenge
    # and the HelloAck were 0 and 1).
    twin = wire.RecordSealer(wire.conn_key(SALT, coord.coord_nonce, relay.relay_nonce),
                             wire.COORD_TO_RELAY)
    twin.seq = 2
    welcome = wire.encode_fanout((0, 1), wire.encode_frame(SALT, wire.CoordHeartbeat()))
    assert after_ready == (
        twin.seal(wire.RecordKind.CONTROL, 0, wire.encode(wire.Generation(9)))
        + twin.seal(wire.RecordKind.FANOUT, 0, welcome))
    # The relay keeps the generation and hands on only the welcome.
    relay.receive_data(after_ready)
    done_relay = relay.next_event()
    assert isinstance(done_relay, wire.Established)
    assert [r.kind for r in done_relay.records] == [wire.RecordKind.FANOUT]
    assert done_relay.generation == 9 and relay.coordinator_generation == 9


def test_a_coordinator_without_a_store_sends_no_generation_and_a_joining_relay_takes_it() -> None:
    relay, coord = machines()
    done_relay, done_coord, _, _ = run(relay, coord)
    assert isinstance(done_relay, wire.Established) and done_relay.generation is None
    assert done_coord.generation is None and coord.resume is None


@pytest.mark.parametrize(("seen", "theirs"), [(5, 5), (5, 6), (1, 1_000_000)])
def test_a_coordinator_as_new_as_the_one_seen_or_newer_is_resumed(seen: int, theirs: int) -> None:
    relay, coord = machines(seen=seen, coord_generation=theirs)
    done_relay, _, _, _ = run(relay, coord)
    assert isinstance(done_relay, wire.Established) and done_relay.generation == theirs


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 13])
def test_any_chunking_of_a_resume_with_a_generation_succeeds(chunk: int) -> None:
    relay, coord = machines(seen=2, coord_generation=3)
    done_relay, done_coord, _, _ = run(relay, coord, chunk=chunk)
    assert isinstance(done_relay, wire.Established) and done_relay.generation == 3
    assert isinstance(done_coord, wire.Established)
    rec = done_relay.sealer.seal(wire.RecordKind.DATA, 1, b"frame")
    assert done_coord.opener.feed(rec) == [wire.Record(wire.RecordKind.DATA, 1, b"frame")]


def test_a_refused_resume_ends_in_the_coordinators_reason() -> None:
    relay, coord = machines(seen=4, coord_generation=5)
    to_hello(relay, coord)
    assert coord.resume is not None
    coord.refuse("host-a is not in the adopted roster")
    relay.receive_data(coord.data_to_send())
    assert relay.next_event() == wire.RefusalReceived("host-a is not in the adopted roster")


# ---------------------------------------------------------------- a deposed coordinator


def test_an_older_generation_fails_the_attempt_naming_both_and_delivers_nothing() -> None:
    relay, coord = machines(seen=5, coord_generation=4)
    with pytest.raises(ft.HandshakeError) as info:
        run(relay, coord)
    text = str(info.value)
    assert "generation 4 < 5 already seen: a deposed coordinator" in text
    assert "relay 'host-a'" in text and "coord:1" in text
    assert relay.failure_category == "deposed"
    with pytest.raises(ft.HandshakeError) as again:  # poisoned: never Established later
        relay.next_event()
    assert again.value is info.value


def test_the_deposed_check_fires_on_the_generation_before_the_welcome_arrives() -> None:
    relay, coord = machines(seen=5, coord_generation=4)
    to_ready(relay, coord)
    coord.receive_data(relay.data_to_send())
    coord.next_event()
    after_ready = coord.data_to_send()
    generation_len = wire.RECORD_HEADER_LEN + len(wire.encode(wire.Generation(4)))
    # Only the Generation record, not one byte of the welcome.
    relay.receive_data(after_ready[:generation_len])
    with pytest.raises(ft.HandshakeError, match="generation 4 < 5"):
        relay.next_event()


def test_a_resume_answered_without_a_generation_is_a_deposed_coordinator() -> None:
    relay, coord = machines(seen=2, coord_generation=None)
    with pytest.raises(ft.HandshakeError,
                       match=r"generation 0 \(it sent no Generation\) < 2 already seen"):
        run(relay, coord)
    assert relay.failure_category == "deposed"


def test_a_second_generation_before_the_welcome_is_malformed() -> None:
    relay, coord = machines(seen=None, coord_generation=None)
    to_ready(relay, coord)
    sealer = coord.sealer
    two = b"".join(sealer.seal(wire.RecordKind.CONTROL, 0, wire.encode(wire.Generation(g)))
                   for g in (3, 4))
    relay.receive_data(two)
    with pytest.raises(ft.WireError, match=r"a second Generation \(4\) before the welcome"):
        relay.next_event()
    assert relay.failure_category == "malformed"


def test_another_control_record_before_the_welcome_is_malformed() -> None:
    relay, coord = machines()
    to_ready(relay, coord)
    relay.receive_data(coord.sealer.seal(wire.RecordKind.CONTROL, 0,
                                         wire.encode(wire.Goodbye("bye"))))
    with pytest.raises(ft.WireError, match="expected Generation, got Goodbye"):
        relay.next_event()


def test_a_generation_that_cannot_go_on_the_wire_is_refused_when_the_machine_is_built() -> None:
    with pytest.raises(ft.WireError, match=r"Generation\.generation"):
        wire.CoordinatorHandshake(SALT, peer="p", generation=-1)
    with pytest.raises(ft.WireError, match="u64"):
        wire.CoordinatorHandshake(SALT, peer="p", generation=1 << 64)


# ---------------------------------------------------------------- cut and corrupted streams


def _resume_streams() -> tuple[bytes, bytes]:
    relay, coord = machines(seen=6, coord_generation=7)
    _, _, up, down = run(relay, coord)
    return up, down


UP, DOWN = _resume_streams()


@pytest.mark.parametrize("cut", range(0, len(DOWN)))
def test_a_relay_cut_off_anywhere_before_the_welcome_ends_fails_its_resume(cut: int) -> None:
    relay, coord = machines(seen=6, coord_generation=7)
    with pytest.raises(ft.WireError, match="closed") as info:
        run(relay, coord, cut_down=cut)
    assert "relay 'host-a'" in str(info.value) or "coord:1" in str(info.value)
    assert relay.failure_category in {"eof before challenge", "eof before helloack",
                                      "eof before welcome"}


@pytest.mark.parametrize("cut", range(0, len(UP)))
def test_a_coordinator_cut_off_anywhere_in_a_resume_fails_naming_the_peer(cut: int) -> None:
    coord = wire.CoordinatorHandshake(SALT, peer="10.0.0.7:5000", generation=7)
    relay = wire.RelayHandshake(SALT, host="host-a", ranks=(0, 1), world_size=4,
                                model_sigs=SIGS, coordinator="coord:1", generation=6)
    # Real bytes of this pair up to the cut: replay the exchange until `cut` bytes went up.
    sent = 0
    for _ in range(10):
        out = relay.data_to_send()
        take = out[:max(0, cut - sent)]
        if take:
            coord.receive_data(take)
            sent += len(take)
        if sent >= cut:
            break
        event = coord.next_event()
        if isinstance(event, wire.HelloReceived):
            coord.accept()
        relay.receive_data(coord.data_to_send())
        relay.next_event()
    coord.receive_data(b"")
    with pytest.raises(ft.WireError, match="closed") as info:
        for _ in range(3):
            event = coord.next_event()
            if isinstance(event, wire.HelloReceived):
                coord.accept()
    assert "10.0.0.7:5000" in str(info.value)
    assert coord.failure_category in {"eof before magic", "eof before hello",
                                      "eof before ready"}


@settings(max_examples=150, deadline=None)
@given(offset=st.integers(0, len(DOWN) - 1), xor=st.integers(1, 255))
def test_any_corrupted_byte_of_a_durable_coordinators_answer_is_a_protocol_error(
        offset: int, xor: int) -> None:
    relay, coord = machines(seen=6, coord_generation=7)

    def flip(stream: bytes) -> bytes:
        if offset >= len(stream):
            return stream
        return stream[:offset] + bytes([stream[offset] ^ xor]) + stream[offset + 1:]

    try:
        done_relay, _, _, _ = run(relay, coord, tamper_down=flip)
    except PROTOCOL_ERRORS:
        assert relay.failure_category is not None
        return
    # A length corrupted to stay under the ceiling waits for bytes that never come: NEED_DATA
    # is right (the caller's deadline decides); it never ends Established.
    assert done_relay is wire.NEED_DATA and relay.failure_category is None
