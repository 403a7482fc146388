"""MuxRecords of the relay ↔ coordinator leg (SPEC §2.5, §2.6): layout, sealing against replay,
reordering, dropping, reflection and splicing, rekeying, and the incremental opener.

Tags and keys are recomputed with ``hmac`` directly, independent of the library.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import cbor2
import pytest
from hypothesis import given, settings, strategies as st

from flodl_trio import wire
from flodl_trio._errors import AuthError, FrameTooLarge, WireError

from helpers.sansio import CUTS, fed_in_pieces

SALT_BYTES = bytes(range(16))
SALT = wire.SessionSalt(SALT_BYTES)
KEY_A = b"A" * 32
KEY_B = b"B" * 32
DATA, CONTROL, FANOUT = wire.RecordKind.DATA, wire.RecordKind.CONTROL, wire.RecordKind.FANOUT
R2C, C2R = wire.RELAY_TO_COORD, wire.COORD_TO_RELAY


def mac64(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()[:8]


def expected_record(
    key: bytes, direction: int, seq: int, kind: int, rank: int, payload: bytes
) -> bytes:
    head = bytes.fromhex("d0170df1 02005446") + bytes([kind])
    head += struct.pack("<II", rank, len(payload))
    tag = mac64(key, bytes([direction]) + struct.pack("<Q", seq) + head + payload)
    return head + tag + payload


def pair(key: bytes = KEY_A, direction: int = R2C) -> tuple[wire.RecordSealer, wire.RecordOpener]:
    return wire.RecordSealer(key, direction), wire.RecordOpener(key, direction)


# ---------------------------------------------------------------- layout and keys


def test_record_is_25_byte_header_with_tag_over_direction_seq_header_payload() -> None:
    sealer = wire.RecordSealer(KEY_A, R2C)
    first = sealer.seal(DATA, 0x0A0B0C0D, b"hello")
    second = sealer.seal(CONTROL, 0, b"")
    assert first == expected_record(KEY_A, 0x01, 0, 1, 0x0A0B0C0D, b"hello")
    assert first[:17] == bytes.fromhex("d0170df1 02005446 01 0d0c0b0a 05000000")
    assert len(first) == 25 + 5
    assert second == expected_record(KEY_A, 0x01, 1, 2, 0, b"")
    assert sealer.seq == 2


def test_coordinator_direction_byte_is_2() -> None:
    sealer = wire.RecordSealer(KEY_A, C2R)
    assert sealer.seal(FANOUT, 0, b"x") == expected_record(KEY_A, 0x02, 0, 5, 0, b"x")
    assert (wire.RELAY_TO_COORD, wire.COORD_TO_RELAY) == (1, 2)


def test_record_kinds_are_the_spec_values() -> None:
    assert (int(DATA), int(CONTROL), int(FANOUT)) == (1, 2, 5)


def test_hs_key_and_conn_key_are_hmac_sha256_of_salt_over_label_and_nonces() -> None:
    coord_nonce, relay_nonce = b"c" * 16, b"r" * 16
    assert (
        wire.hs_key(SALT, coord_nonce)
        == hmac.new(SALT_BYTES, b"flodl-trio/hs/v1" + coord_nonce, hashlib.sha256).digest()
    )
    assert (
        wire.conn_key(SALT, coord_nonce, relay_nonce)
        == hmac.new(
            SALT_BYTES, b"flodl-trio/conn/v1" + coord_nonce + relay_nonce, hashlib.sha256
        ).digest()
    )
    assert len(wire.hs_key(SALT, coord_nonce)) == 32


def test_fanout_payload_is_cbor_pair_of_ascending_ranks_and_frame() -> None:
    payload = wire.encode_fanout([3, 1, 2, 1], b"frame")
    assert payload == bytes.fromhex("82 83 01 02 03 45") + b"frame"
    assert cbor2.loads(payload) == [[1, 2, 3], b"frame"]
    assert wire.decode_fanout(payload) == ((1, 2, 3), b"frame")


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ([[2, 1], b"f"], ["FANOUT.ranks", "ascending"]),
        ([[1, 1], b"f"], ["FANOUT.ranks", "ascending"]),
        ([[1, 2**32], b"f"], ["FANOUT.ranks[1]", "u32"]),
        ([[-1], b"f"], ["FANOUT.ranks[0]", "u32"]),
        ([[1], "f"], ["FANOUT.frame", "bytes"]),
        ([[1]], ["FANOUT", "[ranks, frame]"]),
        ([(1,), b"f", 0], ["FANOUT", "[ranks, frame]"]),
        ([{1: 1}, b"f"], ["FANOUT.ranks", "list[u32]"]),
    ],
    ids=["descending", "duplicate", "u32-overflow", "negative", "str-frame", "arity-1",
         "arity-3", "map-ranks"],
)  # fmt: skip
def test_decode_fanout_is_strict(value: object, words: list[str]) -> None:
    with pytest.raises(WireError) as err:
        wire.decode_fanout(cbor2.dumps(value))
    for word in words:
        assert word in str(err.value), str(err.value)


def test_encode_fanout_refuses_ranks_that_are_not_u32() -> None:
    with pytest.raises(WireError, match=r"FANOUT: ranks must be u32"):
        wire.encode_fanout([2**32], b"f")


# ---------------------------------------------------------------- sealing properties


@settings(max_examples=40, deadline=None)
@given(
    records=st.lists(
        st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=60)), min_size=1, max_size=6
    ),
    direction=st.sampled_from([R2C, C2R]),
)
def test_sealed_data_records_open_in_order(
    records: list[tuple[int, bytes]], direction: int
) -> None:
    sealer, opener = pair(direction=direction)
    stream = b"".join(sealer.seal(DATA, rank, payload) for rank, payload in records)
    assert opener.feed(stream) == [wire.Record(DATA, r, p) for r, p in records]
    assert opener.seq == sealer.seq == len(records) and opener.at_boundary


def _three() -> tuple[wire.RecordOpener, list[bytes]]:
    sealer, opener = pair()
    return opener, [sealer.seal(DATA, i, f"blob {i}".encode()) for i in range(3)]


def test_replayed_record_is_auth_error() -> None:
    opener, recs = _three()
    opener.feed(recs[0])
    with pytest.raises(AuthError, match=r"record #1 .*replayed, reordered, dropped"):
        opener.feed(recs[0])


def test_reordered_records_are_auth_error() -> None:
    opener, recs = _three()
    with pytest.raises(AuthError, match=r"record #0"):
        opener.feed(recs[1] + recs[0])


def test_dropped_record_makes_the_next_one_auth_error() -> None:
    opener, recs = _three()
    assert opener.feed(recs[0]) == [wire.Record(DATA, 0, b"blob 0")]
    with pytest.raises(AuthError, match=r"record #1"):
        opener.feed(recs[2])


def test_record_reflected_back_in_the_other_direction_is_auth_error() -> None:
    sealer = wire.RecordSealer(KEY_A, R2C)
    opener = wire.RecordOpener(KEY_A, C2R)
    with pytest.raises(AuthError, match=r"coordinator→relay"):
        opener.feed(sealer.seal(DATA, 0, b"x"))


def test_tampered_rank_byte_is_auth_error() -> None:
    sealer, opener = pair()
    rec = bytearray(sealer.seal(DATA, 4, b"frame"))
    rec[9] = 5
    with pytest.raises(AuthError, match=r"rank 5"):
        opener.feed(bytes(rec))


@pytest.mark.parametrize(
    "offset", [17, 24, 25, 29], ids=["tag-first", "tag-last", "payload", "payload-last"]
)
def test_any_flipped_tag_or_payload_bit_is_auth_error(offset: int) -> None:
    sealer, opener = pair()
    rec = bytearray(sealer.seal(DATA, 0, b"abcde"))
    rec[offset] ^= 0x80
    with pytest.raises(AuthError):
        opener.feed(bytes(rec))


def test_record_sealed_with_another_key_is_auth_error() -> None:
    with pytest.raises(AuthError, match=r"wrong session salt"):
        wire.RecordOpener(KEY_B, R2C).feed(wire.RecordSealer(KEY_A, R2C).seal(DATA, 0, b"x"))


def test_record_spliced_from_another_connection_is_auth_error() -> None:
    # Same salt, different coordinator nonces: a record cannot move between connections.
    key_1 = wire.conn_key(SALT, b"1" * 16, b"r" * 16)
    key_2 = wire.conn_key(SALT, b"2" * 16, b"r" * 16)
    with pytest.raises(AuthError):
        wire.RecordOpener(key_2, R2C).feed(wire.RecordSealer(key_1, R2C).seal(DATA, 0, b"x"))


def test_rekey_keeps_the_sequence_counting_on_both_sides() -> None:
    sealer, opener = pair(key=KEY_A)
    assert opener.feed(sealer.seal(CONTROL, 0, b"hello")) == [wire.Record(CONTROL, 0, b"hello")]
    sealer.rekey(KEY_B)
    opener.rekey(KEY_B)
    rec = sealer.seal(DATA, 7, b"after")
    assert rec == expected_record(KEY_B, R2C, 1, DATA, 7, b"after")  # seq 1, not 0
    assert opener.feed(rec) == [wire.Record(DATA, 7, b"after")]
    assert sealer.seq == opener.seq == 2


def test_record_sealed_with_the_old_key_after_rekey_is_auth_error() -> None:
    old_sealer, opener = pair(key=KEY_A)
    opener.feed(old_sealer.seal(CONTROL, 0, b"hello"))
    opener.rekey(KEY_B)
    with pytest.raises(AuthError, match=r"record #1"):
        opener.feed(old_sealer.seal(DATA, 0, b"stale key"))


def test_push_and_next_record_let_relay_rekey_between_records_of_one_chunk() -> None:
    # The coordinator's HelloAck (hs_key) and its first DATA record (conn_key) arrive together.
    coord_nonce, relay_nonce = b"c" * 16, b"r" * 16
    hs, conn = wire.hs_key(SALT, coord_nonce), wire.conn_key(SALT, coord_nonce, relay_nonce)
    coord = wire.RecordSealer(bytes(SALT), C2R)
    challenge = coord.seal(CONTROL, 0, wire.encode(wire.Challenge(coord_nonce)))
    coord.rekey(hs)
    chunk = coord.seal(CONTROL, 0, wire.encode(wire.HelloAck(relay_nonce)))
    coord.rekey(conn)
    chunk += coord.seal(DATA, 3, b"frame for rank 3")

    relay = wire.RecordOpener(bytes(SALT), C2R)
    assert wire.decode_relay(relay.feed(challenge)[0].payload) == wire.Challenge(coord_nonce)
    relay.rekey(hs)
    relay.push(chunk)
    ack = relay.next_record()
    assert ack is not None and wire.decode_relay(ack.payload) == wire.HelloAck(relay_nonce)
    assert not relay.at_boundary
    relay.rekey(conn)
    assert relay.next_record() == wire.Record(DATA, 3, b"frame for rank 3")
    assert relay.next_record() is None and relay.at_boundary and relay.seq == 3

    # feed() would open both with hs_key and fail on the second.
    naive = wire.RecordOpener(bytes(SALT), C2R)
    naive.feed(challenge)
    naive.rekey(hs)
    with pytest.raises(AuthError, match=r"record #2"):
        naive.feed(chunk)


# ---------------------------------------------------------------- header checks


def _raw(kind: int = 1, rank: int = 0, payload: bytes = b"", *, magic: int = 0xF10D17D0,
         version: int = 0x46540002, length: int | None = None, seq: int = 0,
         key: bytes = KEY_A) -> bytes:  # fmt: skip
    n = len(payload) if length is None else length
    head = struct.pack("<IIBII", magic, version, kind, rank, n)
    return head + mac64(key, bytes([R2C]) + struct.pack("<Q", seq) + head + payload) + payload


@pytest.mark.parametrize(
    ("record", "error", "words"),
    [
        # Each input fails two checks; the earlier one is reported.
        (_raw(magic=0xF10D17C4, version=2), WireError, ["bad magic", "0xF10D17D0", "0xF10D17C4"]),
        (_raw(version=0x46540001, kind=9), WireError, ["version", "0x46540002", "0x46540001"]),
        (_raw(kind=9, length=2**32 - 1), WireError, ["kind 9"]),
        (_raw(kind=3), WireError, ["reserved kind 3"]),
        (_raw(kind=4), WireError, ["reserved kind 4"]),
        (_raw(length=wire.MAX_RECORD_PAYLOAD + 1, key=KEY_B), FrameTooLarge, ["ceiling"]),
        (_raw(kind=2, rank=5, key=KEY_B), AuthError, ["tag does not verify"]),
        (_raw(kind=2, rank=5), WireError, ["kind 2 must carry rank 0, got 5"]),
        (_raw(kind=5, rank=1), WireError, ["kind 5 must carry rank 0, got 1"]),
    ],
    ids=["magic-before-version", "version-before-kind", "kind-before-length", "reserved-3",
         "reserved-4", "length-before-mac", "mac-before-rank", "control-rank", "fanout-rank"],
)  # fmt: skip
def test_record_header_checks_report_the_first_failure(
    record: bytes, error: type[Exception], words: list[str]
) -> None:
    opener = wire.RecordOpener(KEY_A, R2C)
    with pytest.raises(error) as err:
        opener.feed(record[:25])
        opener.feed(record[25:])
    for word in words:
        assert word in str(err.value), str(err.value)
    if error is WireError:
        assert not isinstance(err.value, AuthError | FrameTooLarge)


def test_control_record_with_nonzero_rank_is_wire_error_even_when_authentic() -> None:
    sealer, opener = pair()
    with pytest.raises(WireError, match=r"record #0: kind 2 must carry rank 0, got 9") as err:
        opener.feed(sealer.seal(CONTROL, 9, b"\x80"))
    assert not isinstance(err.value, AuthError)


def test_opener_refuses_oversized_record_from_the_header_alone() -> None:
    opener = wire.RecordOpener(KEY_A, R2C, max_payload=1000)
    with pytest.raises(FrameTooLarge, match=r"1001 bytes.*ceiling of 1000"):
        opener.feed(_raw(length=1001)[:25])


def test_sealer_refuses_payload_over_its_ceiling() -> None:
    with pytest.raises(FrameTooLarge, match=r"11 bytes.*ceiling of 10"):
        wire.RecordSealer(KEY_A, R2C, max_payload=10).seal(DATA, 0, b"x" * 11)


@pytest.mark.parametrize("direction", [0, 3, 0x101])
def test_direction_must_be_one_of_the_two_spec_values(direction: int) -> None:
    for cls in (wire.RecordSealer, wire.RecordOpener):
        with pytest.raises(WireError, match=r"RELAY_TO_COORD"):
            cls(KEY_A, direction)


# ---------------------------------------------------------------- incremental opener


@settings(max_examples=60, deadline=None)
@given(payloads=st.lists(st.binary(max_size=50), min_size=1, max_size=5), cuts=CUTS)
def test_record_opener_gives_same_records_for_any_chunking(payloads: list[bytes],
                                                           cuts: list[int]) -> None:
    sealer = wire.RecordSealer(KEY_A, C2R)
    stream = b"".join(sealer.seal(DATA, i, p) for i, p in enumerate(payloads))
    expected = [wire.Record(DATA, i, p) for i, p in enumerate(payloads)]
    opener = wire.RecordOpener(KEY_A, C2R)
    assert fed_in_pieces(opener, stream, cuts) == expected and opener.at_boundary


def test_record_opener_byte_at_a_time_is_at_boundary_only_between_records() -> None:
    sealer, opener = pair()
    recs = [sealer.seal(DATA, 1, b"ab"), sealer.seal(CONTROL, 0, b"")]
    stream = b"".join(recs)
    ends = {len(recs[0]), len(stream)}
    got: list[wire.Record] = []
    for i in range(len(stream)):
        got += opener.feed(stream[i : i + 1])
        assert opener.at_boundary is (i + 1 in ends)
    assert got == [wire.Record(DATA, 1, b"ab"), wire.Record(CONTROL, 0, b"")]


def test_record_opener_eof_mid_record_is_wire_error() -> None:
    sealer, opener = pair()
    opener.feed(sealer.seal(DATA, 0, b"abc")[:-1])
    err = opener.eof_error("relay host-a (10.0.0.2:4000)")
    assert isinstance(err, WireError)
    assert "relay host-a (10.0.0.2:4000): peer closed mid-frame (27 bytes buffered)" in str(err)
    assert wire.RecordOpener(KEY_A, R2C).eof_error("x") is None


def test_record_opener_is_poisoned_after_an_error() -> None:
    sealer, opener = pair()
    good = sealer.seal(DATA, 0, b"x")
    with pytest.raises(AuthError) as first:
        opener.feed(good + good)
    for later in (b"", good):
        with pytest.raises(AuthError) as again:
            opener.feed(later)
        assert again.value is first.value
    with pytest.raises(AuthError):
        opener.push(b"")
    with pytest.raises(AuthError):
        opener.next_record()
