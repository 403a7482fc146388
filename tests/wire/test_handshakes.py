"""The handshakes as sans-IO machines (SPEC §2.3, §2.6): fed bytes, no sockets, no trio.

Both ends of each handshake are driven against each other in memory. Any chunking of a valid
exchange succeeds; any corruption or truncation ends in a ``WireError`` or ``HandshakeError``
(never another exception) and poisons the machine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

import flodl_trio as ft
from flodl_trio import wire

from helpers.sansio import to_hello

SALT = ft.SessionSalt(bytes(range(16)))
OTHER_SALT = ft.SessionSalt(bytes(range(1, 17)))
PROTOCOL_ERRORS = (ft.WireError, ft.HandshakeError)

Chunker = Callable[[bytes], Iterator[bytes]]


def whole(data: bytes) -> Iterator[bytes]:
    if data:
        yield data


def sized(sizes: list[int]) -> Chunker:
    """Split every write into pieces of these sizes, in turn."""

    def split(data: bytes) -> Iterator[bytes]:
        at, i = 0, 0
        while at < len(data):
            size = sizes[i % len(sizes)]
            yield data[at:at + size]
            at, i = at + size, i + 1

    return split


def pump(dialer: Any, acceptor: Any, *, up: Chunker = whole, down: Chunker = whole,
         tamper_up: Callable[[bytes], bytes] = lambda b: b,
         tamper_down: Callable[[bytes], bytes] = lambda b: b) -> dict[str, Any]:
    """Move bytes between the two ends until both finished; ``accept()`` every hello.

    Returns each end's final event by name ("dialer", "acceptor").
    """
    done: dict[str, Any] = {}
    sent = {"up": b"", "down": b""}
    for _ in range(50):
        for name, me, other, chunker, tamper, way in (
                ("dialer", dialer, acceptor, up, tamper_up, "up"),
                ("acceptor", acceptor, dialer, down, tamper_down, "down")):
            if name in done:
                continue
            event = me.next_event()
            if isinstance(event, wire.HelloReceived | wire.RankHelloReceived):
                me.accept()
            elif event is not wire.NEED_DATA:
                done[name] = event
            out = me.data_to_send()
            if out:
                # Tamper with the whole stream so far, so an offset names one byte of it.
                before = len(sent[way])
                sent[way] += out
                for chunk in chunker(tamper(sent[way])[before:]):
                    other.receive_data(chunk)
        if len(done) == 2:
            return done
    raise AssertionError(f"the handshake did not finish: {done}")


def upstream(*, host: str = "host-a", ranks: tuple[int, ...] = (0, 1),
             relay_salt: ft.SessionSalt = SALT) -> tuple[Any, Any]:
    relay = wire.RelayHandshake(relay_salt, host=host, ranks=ranks, world_size=4,
                                model_sigs={"model": b"\x07" * 32}, coordinator="coord:1")
    coord = wire.CoordinatorHandshake(SALT, peer="10.0.0.7:5000")
    return relay, coord


def rank_pair(*, rank: int = 1, world_size: int = 4, salt: ft.SessionSalt = SALT
              ) -> tuple[Any, Any]:
    dialer = wire.RankDialHandshake(salt, rank=rank, world_size=world_size, relay="127.0.0.1:9")
    acceptor = wire.RankAcceptHandshake(SALT, world_size=4, host="host-a",
                                        ranks=frozenset({0, 1}), peer="127.0.0.1:4000")
    return dialer, acceptor


def assert_sealed_pair(a: wire.Established, b: wire.Established) -> None:
    """Records sealed by one end open at the other, in both directions."""
    for src, dst in ((a, b), (b, a)):
        rec = src.sealer.seal(wire.RecordKind.DATA, 3, b"frame")
        assert dst.opener.feed(rec) == [wire.Record(wire.RecordKind.DATA, 3, b"frame")]


# ---------------------------------------------------------------- upstream: valid exchanges


def test_upstream_handshake_ends_in_a_sealer_opener_pair_on_conn_key() -> None:
    relay, coord = upstream()
    done = pump(relay, coord)
    assert isinstance(done["dialer"], wire.Established)
    assert isinstance(done["acceptor"], wire.Established)
    assert coord.hello.host == "host-a" and coord.hello.ranks == (0, 1)
    assert coord.hello.world_size == 4 and coord.hello.model_sigs == {"model": b"\x07" * 32}
    assert coord.hello.nonce == relay.relay_nonce
    # The relay's last handshake record is its Ready; the coordinator's first after it is the
    # welcome, a CoordHeartbeat FANOUT to the relay's ranks, which the relay holds for its pump.
    (welcome,) = done["dialer"].records
    assert welcome.kind == wire.RecordKind.FANOUT
    ranks, frame = wire.decode_fanout(welcome.payload)
    assert ranks == (0, 1)
    assert isinstance(wire.frame_message(wire.decode_frame(SALT, frame)), wire.CoordHeartbeat)
    assert_sealed_pair(done["dialer"], done["acceptor"])
    assert coord.failure_category is None and relay.failure_category is None


@settings(max_examples=60, deadline=None)
@given(up=st.lists(st.integers(1, 40), min_size=1, max_size=8),
       down=st.lists(st.integers(1, 40), min_size=1, max_size=8))
def test_any_chunking_of_a_valid_upstream_handshake_succeeds(up: list[int],
                                                             down: list[int]) -> None:
    relay, coord = upstream()
    done = pump(relay, coord, up=sized(up), down=sized(down))
    assert_sealed_pair(done["dialer"], done["acceptor"])


def test_records_that_arrive_with_the_hello_ack_stay_in_the_relays_opener() -> None:
    relay, coord = upstream()
    relay_out = relay.data_to_send()
    coord.receive_data(relay_out)
    assert coord.next_event() is wire.NEED_DATA  # the Challenge is queued
    relay.receive_data(coord.data_to_send())
    assert relay.next_event() is wire.NEED_DATA  # the Hello is queued
    coord.receive_data(relay.data_to_send())
    assert isinstance(coord.next_event(), wire.HelloReceived)
    coord.accept()
    assert coord.next_event() is wire.NEED_DATA  # FT/2: the coordinator waits for Ready
    relay.receive_data(coord.data_to_send())  # the HelloAck
    assert relay.next_event() is wire.NEED_DATA  # Ready queued; the relay waits for a welcome
    coord.receive_data(relay.data_to_send())
    established = coord.next_event()
    assert isinstance(established, wire.Established)
    # The coordinator writes a DATA record right behind its welcome; one chunk carries both.
    behind = established.sealer.seal(wire.RecordKind.DATA, 1, b"early")
    relay.receive_data(coord.data_to_send() + behind)
    done = relay.next_event()
    assert isinstance(done, wire.Established)
    assert [rec.kind for rec in done.records] == [wire.RecordKind.FANOUT]
    assert done.opener.feed(b"") == [wire.Record(wire.RecordKind.DATA, 1, b"early")]


def test_a_cadence_given_to_accept_follows_the_welcome_in_the_same_flight() -> None:
    # Issue 23: a coordinator that paces its relays tells a joining one its period right
    # behind the welcome, in the welcome's own write.
    relay, coord = hello_received_upstream()
    coord.accept(cadence=wire.Cadence(interval=5.0))
    relay.receive_data(coord.data_to_send())  # the HelloAck
    assert relay.next_event() is wire.NEED_DATA
    coord.receive_data(relay.data_to_send())  # the Ready
    established = coord.next_event()
    assert isinstance(established, wire.Established)
    relay.receive_data(coord.data_to_send())  # one flight: welcome, Cadence
    done = relay.next_event()
    assert isinstance(done, wire.Established)
    assert [rec.kind for rec in done.records] == [wire.RecordKind.FANOUT]
    [cadence] = done.opener.feed(b"")
    assert cadence.kind == wire.RecordKind.CONTROL
    assert wire.decode_relay(cadence.payload) == wire.Cadence(interval=5.0)
    # Both ends go on from the same sequence numbers: the next record opens.
    after = established.sealer.seal(wire.RecordKind.DATA, 1, b"next")
    assert done.opener.feed(after) == [wire.Record(wire.RecordKind.DATA, 1, b"next")]


@pytest.mark.parametrize("interval", [0.0, -1.0, float("nan"), float("inf"), 3601.0])
def test_accept_refuses_a_cadence_no_relay_accepts_naming_it(interval: float) -> None:
    _, coord = hello_received_upstream()
    with pytest.raises(ft.WireError, match=r"Cadence to 10\.0\.0\.7:5000: expected an interval"):
        coord.accept(cadence=wire.Cadence(interval=interval))
    assert coord.refusable  # nothing was answered yet: the Hello can still be refused


def accepted_upstream() -> tuple[Any, Any]:
    """Both ends driven until the coordinator accepted the Hello (its HelloAck is queued)."""
    relay, coord = hello_received_upstream()
    coord.accept()
    return relay, coord


def test_a_relay_whose_connection_ends_before_the_welcome_fails_its_attempt() -> None:
    relay, coord = accepted_upstream()
    relay.receive_data(coord.data_to_send())
    assert relay.next_event() is wire.NEED_DATA
    assert relay.data_to_send()  # its Ready
    relay.receive_data(b"")
    with pytest.raises(ft.WireError, match="welcome") as info:
        relay.next_event()
    assert relay.failure_category == "eof before welcome"
    assert "relay 'host-a'" in str(info.value)


def test_a_coordinator_whose_relay_never_sends_ready_fails_and_names_the_relay() -> None:
    _, coord = accepted_upstream()
    assert coord.next_event() is wire.NEED_DATA
    coord.receive_data(b"")
    with pytest.raises(ft.WireError, match="Ready from relay 'host-a'"):
        coord.next_event()
    assert coord.failure_category == "eof before ready"


def test_something_other_than_ready_after_the_hello_ack_is_refused() -> None:
    relay, coord = accepted_upstream()
    coord.data_to_send()
    # A relay that skips Ready and sends data: sealed right (conn_key, seq 1), but not Ready.
    assert relay.sealer is not None
    key = wire.conn_key(SALT, coord.coord_nonce, relay.relay_nonce)
    sealer = wire.RecordSealer(key, wire.RELAY_TO_COORD)
    sealer.seal(wire.RecordKind.CONTROL, 0, b"")  # seq 0 was the Hello
    coord.receive_data(sealer.seal(wire.RecordKind.DATA, 0, b"frame"))
    with pytest.raises(ft.WireError, match="expected a CONTROL record with Ready"):
        coord.next_event()


def test_coordinator_sends_its_challenge_only_once_the_whole_magic_arrived() -> None:
    relay, coord = upstream()
    magic = relay.data_to_send()
    assert magic == wire.CHANNEL_MAGIC_CONTROL
    coord.receive_data(magic[:1])
    assert coord.next_event() is wire.NEED_DATA
    assert coord.data_to_send() == b""  # no Challenge before the whole magic
    coord.receive_data(magic[1:])
    assert coord.next_event() is wire.NEED_DATA
    assert len(coord.data_to_send()) > wire.RECORD_HEADER_LEN


# ---------------------------------------------------------------- upstream: failures


@pytest.mark.parametrize(("magic", "category", "text"), [
    (wire.CHANNEL_MAGIC_DATA, "wrong leg", "got the data leg's magic"),
    (b"GET ", "bad magic", "got 47455420"),
])
def test_coordinator_rejects_another_magic_naming_what_arrived(magic: bytes, category: str,
                                                              text: str) -> None:
    coord = wire.CoordinatorHandshake(SALT, peer="10.0.0.7:5000")
    coord.receive_data(magic)
    with pytest.raises(ft.HandshakeError, match=text) as info:
        coord.next_event()
    assert "10.0.0.7:5000" in str(info.value)
    assert coord.failure_category == category
    with pytest.raises(ft.HandshakeError) as again:  # poisoned: the same error again
        coord.next_event()
    assert again.value is info.value


def test_relay_of_another_session_is_refused_by_the_coordinator_as_bad_mac() -> None:
    relay, coord = upstream(relay_salt=OTHER_SALT)
    # The relay itself already fails on the Challenge (sealed with the coordinator's salt).
    with pytest.raises(ft.AuthError, match="not of this session") as info:
        pump(relay, coord)
    assert "relay 'host-a'" in str(info.value) and "coord:1" in str(info.value)


def hello_received_upstream() -> tuple[Any, Any]:
    """Both ends driven until the coordinator holds the relay's authenticated Hello."""
    relay, coord = upstream()
    to_hello(relay, coord)
    return relay, coord


def test_relay_refuses_a_hello_ack_that_does_not_echo_its_nonce() -> None:
    relay, coord = hello_received_upstream()
    # A HelloAck sealed in the right place with the right key, echoing another nonce: what a
    # replayed coordinator record looks like to this relay.
    forged = coord.sealer.seal(wire.RecordKind.CONTROL, 0, wire.encode(wire.HelloAck(bytes(16))))
    relay.receive_data(forged)
    with pytest.raises(ft.AuthError, match="does not echo our nonce") as info:
        relay.next_event()
    assert "relay 'host-a'" in str(info.value) and "coord:1" in str(info.value)
    assert relay.failure_category == "bad echo"


def clean_upstream_bytes() -> bytes:
    """What a relay sends in a whole handshake: the magic, its Hello and its Ready."""
    relay, coord = upstream()
    sent = bytearray()

    def tap(stream: bytes) -> bytes:
        sent[:] = stream
        return stream

    pump(relay, coord, tamper_up=tap)
    return bytes(sent)


UP_BYTES = clean_upstream_bytes()


HELLO_END = len(UP_BYTES) - wire.RECORD_HEADER_LEN - len(wire.encode(wire.Ready()))


@pytest.mark.parametrize("cut", range(0, HELLO_END))
def test_coordinator_eof_at_any_point_before_the_hello_is_a_wire_error(cut: int) -> None:
    coord = wire.CoordinatorHandshake(SALT, peer="10.0.0.7:5000")
    coord.receive_data(UP_BYTES[:cut])
    coord.receive_data(b"")
    with pytest.raises(ft.WireError, match="closed") as info:
        coord.next_event()
    assert "10.0.0.7:5000" in str(info.value)
    expected = "eof before magic" if cut < 4 else "eof before hello"
    assert coord.failure_category == expected


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_any_corrupted_byte_of_either_direction_is_a_protocol_error(data: Any) -> None:
    relay, coord = upstream()
    direction = data.draw(st.sampled_from(["up", "down"]))
    offset = data.draw(st.integers(0, 150))
    xor = data.draw(st.integers(1, 255))
    flipped: list[int] = []

    def flip(stream: bytes) -> bytes:
        if offset >= len(stream):
            return stream
        flipped.append(offset)
        return stream[:offset] + bytes([stream[offset] ^ xor]) + stream[offset + 1:]

    def keep(stream: bytes) -> bytes:
        return stream

    try:
        pump(relay, coord, tamper_up=flip if direction == "up" else keep,
             tamper_down=flip if direction == "down" else keep)
    except PROTOCOL_ERRORS:
        assert flipped
        return
    except AssertionError:
        # A length corrupted to stay under the ceiling waits for bytes that never come:
        # NEED_DATA is right, and the caller's deadline decides.
        assert flipped and relay.failure_category is None and coord.failure_category is None
        return
    assert not flipped, "a corrupted handshake byte went unnoticed"


def fed_junk(machine: Any, data: bytes, *, eof: bool) -> None:
    """``data`` (then EOF) into a handshake machine: only a protocol error may come out, and
    then the machine says which category of failure it was."""
    try:
        machine.receive_data(data)
        machine.next_event()
        if eof:
            machine.receive_data(b"")
            machine.next_event()
    except PROTOCOL_ERRORS:
        assert machine.failure_category is not None


@settings(max_examples=200, deadline=None)
@given(junk=st.binary(min_size=0, max_size=300), eof=st.booleans())
def test_arbitrary_bytes_at_the_coordinator_never_raise_anything_but_protocol_errors(
        junk: bytes, eof: bool) -> None:
    coord = wire.CoordinatorHandshake(SALT, peer="10.0.0.7:5000")
    fed_junk(coord, wire.CHANNEL_MAGIC_CONTROL + junk, eof=eof)


@settings(max_examples=200, deadline=None)
@given(junk=st.binary(min_size=0, max_size=300), eof=st.booleans())
def test_arbitrary_bytes_at_the_relay_never_raise_anything_but_protocol_errors(
        junk: bytes, eof: bool) -> None:
    relay = wire.RelayHandshake(SALT, host="h", ranks=(0,), world_size=1, coordinator="c:1")
    fed_junk(relay, junk, eof=eof)


def test_hello_over_the_pre_auth_ceiling_is_refused_from_its_header() -> None:
    coord = wire.CoordinatorHandshake(SALT, peer="p", max_hello=64)
    relay = wire.RelayHandshake(SALT, host="h" * 200, ranks=(0,), world_size=1, coordinator="c")
    with pytest.raises(ft.FrameTooLarge, match="over the ceiling of 64"):
        pump(relay, coord)
    assert coord.failure_category == "malformed"


# ---------------------------------------------------------------- rank ↔ relay


def test_rank_handshake_ends_with_both_ends_confirmed_and_the_rank_named() -> None:
    dialer, acceptor = rank_pair()
    done = pump(dialer, acceptor)
    # FT/2: each end holds the other's first frame: the rank's Heartbeat, the relay's notice.
    heartbeat = wire.len_frame(wire.encode_frame(SALT, wire.Heartbeat(rank=1, step_count=0)))
    assert done["acceptor"] == wire.RankConfirmed(1, heartbeat)
    assert done["dialer"].rank == 1
    notice = wire.frame_message(wire.decode_frame(SALT, done["dialer"].leftover[4:]))
    assert isinstance(notice, wire.RelayWaiting) and notice.host == "host-a"


@settings(max_examples=60, deadline=None)
@given(up=st.lists(st.integers(1, 30), min_size=1, max_size=6),
       down=st.lists(st.integers(1, 20), min_size=1, max_size=6))
def test_any_chunking_of_a_valid_rank_handshake_succeeds(up: list[int], down: list[int]) -> None:
    dialer, acceptor = rank_pair()
    done = pump(dialer, acceptor, up=sized(up), down=sized(down))
    assert done["acceptor"].rank == 1


def test_frames_behind_the_rank_hello_are_handed_on_as_leftover() -> None:
    dialer, acceptor = rank_pair()
    frame = wire.len_frame(wire.encode_frame(SALT, wire.Heartbeat(rank=1, step_count=0)))
    acceptor.receive_data(dialer.data_to_send() + frame)
    assert acceptor.next_event() == wire.RankHelloReceived(1)
    acceptor.accept()
    assert acceptor.next_event() == wire.RankConfirmed(1, frame)


RANK_HEARTBEAT_LEN = len(wire.len_frame(wire.encode_frame(SALT, wire.Heartbeat(rank=1,
                                                                               step_count=0))))


@pytest.mark.parametrize("cut", range(wire.RANK_HELLO_LEN,
                                      wire.RANK_HELLO_LEN + RANK_HEARTBEAT_LEN))
def test_relay_frees_a_rank_whose_first_frame_never_arrives_whole(cut: int) -> None:
    dialer, acceptor = rank_pair()
    acceptor.receive_data(dialer.data_to_send())
    acceptor.next_event()
    acceptor.accept()
    dialer.receive_data(acceptor.data_to_send())
    assert dialer.next_event() is wire.NEED_DATA  # ack verified, heartbeat queued
    first = dialer.data_to_send()
    assert len(first) > cut - wire.RANK_HELLO_LEN
    acceptor.receive_data(first[:cut - wire.RANK_HELLO_LEN])
    acceptor.receive_data(b"")
    with pytest.raises(ft.WireError, match="first frame after the ack"):
        acceptor.next_event()


def test_rank_eof_before_the_relays_first_frame_is_a_wire_error_so_it_re_dials() -> None:
    dialer, acceptor = rank_pair()
    acceptor.receive_data(dialer.data_to_send())
    acceptor.next_event()
    acceptor.accept()
    dialer.receive_data(acceptor.data_to_send())
    assert dialer.next_event() is wire.NEED_DATA
    dialer.receive_data(b"")
    with pytest.raises(ft.WireError, match="first frame after its ack"):
        dialer.next_event()


@pytest.mark.parametrize(("kwargs", "text"), [
    ({"salt": OTHER_SALT}, "HMAC verification failed"),
    ({"world_size": 5}, "world_size 5 != expected 4"),
    ({"rank": 2}, "rank 2 does not belong to host 'host-a'"),
])
def test_relay_refuses_a_bad_rank_hello_naming_the_check_and_the_peer(kwargs: dict[str, Any],
                                                                      text: str) -> None:
    dialer, acceptor = rank_pair(**kwargs)
    with pytest.raises(ft.HandshakeError, match=text) as info:
        pump(dialer, acceptor)
    assert "127.0.0.1:4000" in str(info.value)


@pytest.mark.parametrize("cut", range(wire.RANK_ACK_LEN))
def test_rank_eof_inside_the_ack_is_a_wire_error_so_the_rank_re_dials(cut: int) -> None:
    dialer, acceptor = rank_pair()
    acceptor.receive_data(dialer.data_to_send())
    acceptor.next_event()
    acceptor.accept()
    ack = acceptor.data_to_send()
    dialer.receive_data(ack[:cut])
    dialer.receive_data(b"")
    with pytest.raises(ft.WireError, match="closed"):
        dialer.next_event()


@settings(max_examples=200, deadline=None)
@given(offset=st.integers(0, wire.RANK_HELLO_LEN + wire.RANK_ACK_LEN - 1),
       xor=st.integers(1, 255))
def test_any_corrupted_rank_handshake_byte_is_a_handshake_error(offset: int, xor: int) -> None:
    dialer, acceptor = rank_pair()

    def flip_at(at: int) -> Callable[[bytes], bytes]:
        def flip(stream: bytes) -> bytes:
            if at >= len(stream):
                return stream
            return stream[:at] + bytes([stream[at] ^ xor]) + stream[at + 1:]
        return flip

    up = offset < wire.RANK_HELLO_LEN
    tamper = flip_at(offset if up else offset - wire.RANK_HELLO_LEN)
    with pytest.raises(ft.HandshakeError):
        if up:
            pump(dialer, acceptor, tamper_up=tamper)
        else:
            pump(dialer, acceptor, tamper_down=tamper)
