"""Rank hello/ack, ControlFrame, length framing and the session salt (SPEC §2.1-2.4).

Expected bytes are written out by hand and MACs recomputed with ``hmac``/``hashlib`` directly, so
these tests pin the wire layout independently of the library's own helpers.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import pytest
from hypothesis import given, settings, strategies as st

from flodl_trio import wire
from flodl_trio._errors import AuthError, ConfigError, FrameTooLarge, HandshakeError, WireError

from helpers.sansio import CUTS, fed_in_pieces

SALT_BYTES = bytes(range(16))
SALT = wire.SessionSalt(SALT_BYTES)
VERSION_LE = bytes.fromhex("02005446")  # 0x46540002, "FT" 2


def mac64(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()[:8]


def raw_frame(
    kind: int, payload: bytes, *, magic: bytes = bytes.fromhex("c4170df1"),
    version: bytes = VERSION_LE, key: bytes = SALT_BYTES, length: int | None = None,
) -> bytes:  # fmt: skip
    n = len(payload) if length is None else length
    kind_len = struct.pack("<II", kind, n)
    return magic + version + mac64(key, kind_len + payload) + kind_len + payload


# ---------------------------------------------------------------- constants


def test_protocol_version_and_channel_magics_are_the_spec_bytes() -> None:
    assert wire.PROTOCOL_VERSION == 0x4654_0002
    assert wire.CHANNEL_MAGIC_RENDEZVOUS == bytes.fromhex("e0170df1")
    assert wire.CHANNEL_MAGIC_DATA == bytes.fromhex("e1170df1")
    assert wire.CHANNEL_MAGIC_CONTROL == bytes.fromhex("e2170df1")
    assert wire.CHANNEL_MAGIC_JOIN == bytes.fromhex("e3170df1")
    assert wire.STATUS_PREFIXES == (b"GET ", b"POST")
    assert wire.MAX_CONTROL_PAYLOAD == 16 * 1024 * 1024
    assert wire.MAX_RECORD_PAYLOAD == 64 * 1024 * 1024
    assert wire.MAX_LEN_FRAME == wire.MAX_CONTROL_PAYLOAD + 24


def test_mac64_is_first_8_bytes_of_hmac_sha256() -> None:
    assert wire.mac64(b"key", b"data") == hmac.new(b"key", b"data", "sha256").digest()[:8]


# ---------------------------------------------------------------- rank hello / ack


def test_rank_hello_is_24_bytes_magic_version_rank_world_then_mac() -> None:
    hello = wire.encode_rank_hello(SALT, 7, 0x01020304)
    head = bytes.fromhex("c2170df1") + VERSION_LE + bytes.fromhex("07000000 04030201")
    assert hello == head + mac64(SALT_BYTES, head)
    assert len(hello) == 24
    assert wire.decode_rank_hello(SALT, hello, world_size=0x01020304) == 7


def test_rank_ack_is_16_bytes_magic_version_then_mac() -> None:
    ack = wire.encode_rank_ack(SALT)
    head = bytes.fromhex("c3170df1") + VERSION_LE
    assert ack == head + mac64(SALT_BYTES, head)
    wire.verify_rank_ack(SALT, ack)


def _hello(
    *, magic: int = 0xF10D17C2, version: int = 0x46540002, rank: int = 3, world: int = 8,
    key: bytes = SALT_BYTES,
) -> bytes:  # fmt: skip
    head = struct.pack("<IIII", magic, version, rank, world)
    return head + mac64(key, head)


@pytest.mark.parametrize(
    ("hello", "words"),
    [
        # Each input fails two checks; the earlier one in SPEC order is reported.
        (_hello(magic=0xF10D17C3, version=1), ["magic", "0xF10D17C2", "0xF10D17C3"]),
        (_hello(version=0x46540001, world=9), ["version", "0x46540002", "0x46540001"]),
        (_hello(world=9, key=b"x" * 16), ["world_size 9", "expected 8"]),
        (_hello(key=b"x" * 16), ["rank 3", "HMAC"]),
        (_hello()[:23], ["24 bytes", "got 23"]),
    ],
    ids=["magic-before-version", "version-before-world", "world-before-mac", "mac", "short"],
)
def test_rank_hello_reports_the_first_failed_check_in_spec_order(
    hello: bytes, words: list[str]
) -> None:
    with pytest.raises(HandshakeError) as err:
        wire.decode_rank_hello(SALT, hello, world_size=8)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_rank_hello_mac_covers_rank_so_a_rewritten_rank_fails() -> None:
    hello = bytearray(wire.encode_rank_hello(SALT, 1, 4))
    hello[8] = 2
    with pytest.raises(HandshakeError, match=r"rank 2.*HMAC"):
        wire.decode_rank_hello(SALT, bytes(hello), world_size=4)


def test_rank_hello_from_another_session_fails_the_mac() -> None:
    other = wire.SessionSalt(b"\xff" * 16)
    with pytest.raises(HandshakeError, match=r"HMAC verification failed"):
        wire.decode_rank_hello(SALT, wire.encode_rank_hello(other, 0, 1), world_size=1)


def test_rank_hello_failure_never_reveals_the_expected_tag() -> None:
    hello = _hello(key=b"x" * 16)
    with pytest.raises(HandshakeError) as err:
        wire.decode_rank_hello(SALT, hello, world_size=8)
    good = mac64(SALT_BYTES, hello[:16])
    assert good.hex() not in str(err.value).lower() and repr(good) not in str(err.value)


@pytest.mark.parametrize(("rank", "world"), [(-1, 1), (0, 2**32), (True, 1)])
def test_encode_rank_hello_refuses_values_that_are_not_u32(rank: int, world: int) -> None:
    with pytest.raises(HandshakeError, match=r"must be a u32"):
        wire.encode_rank_hello(SALT, rank, world)


@pytest.mark.parametrize(
    ("ack", "words"),
    [
        (struct.pack("<II", 0xF10D17C2, 1) + b"\0" * 8, ["magic", "0xF10D17C3"]),
        (struct.pack("<II", 0xF10D17C3, 0x46540001) + b"\0" * 8, ["version", "0x46540001"]),
        (struct.pack("<II", 0xF10D17C3, 0x46540002) + b"\0" * 8, ["HMAC"]),
        (b"\0" * 15, ["16 bytes", "got 15"]),
    ],
    ids=["magic", "version", "mac", "short"],
)
def test_rank_ack_reports_the_first_failed_check(ack: bytes, words: list[str]) -> None:
    with pytest.raises(HandshakeError) as err:
        wire.verify_rank_ack(SALT, ack)
    for word in words:
        assert word in str(err.value), str(err.value)


# ---------------------------------------------------------------- ControlFrame layout


def test_control_frame_header_is_magic_version_tag_kind_len_then_payload() -> None:
    msg = wire.SyncNow()
    payload = wire.encode(msg)
    frame = wire.encode_frame(SALT, msg)
    kind_len = bytes.fromhex("01000000") + struct.pack("<I", len(payload))
    expected = (
        bytes.fromhex("c4170df1") + VERSION_LE + mac64(SALT_BYTES, kind_len + payload)
        + kind_len + payload
    )  # fmt: skip
    assert frame == expected
    assert wire.decode_frame(SALT, frame) == wire.Frame(wire.MsgKind.CONTROL, payload)
    assert wire.frame_message(wire.decode_frame(SALT, frame)) == msg


@pytest.mark.parametrize(
    ("msg", "kind"),
    [
        (wire.CoordHeartbeat(), 1),
        (wire.Heartbeat(rank=2, step_count=9), 2),
        (wire.Metrics(0, 1, 0.5, 2, 3.0, 4, 1.0, 1.0, 1.0, {"x": (1.0, 2)}), 3),
    ],
    ids=["control", "timing", "metrics"],
)
def test_encode_frame_chooses_kind_from_message_type(msg: wire.WireMessage, kind: int) -> None:
    frame = wire.encode_frame(SALT, msg)
    assert struct.unpack_from("<I", frame, 16)[0] == kind
    assert wire.frame_message(wire.decode_frame(SALT, frame)) == msg


def test_encode_frame_refuses_relay_control_messages() -> None:
    with pytest.raises(WireError, match=r"ControlMsg, TimingMsg or Metrics.*HelloAck"):
        wire.encode_frame(SALT, wire.HelloAck(b"n" * 16))


@pytest.mark.parametrize("kind", [4, 5, 6, 7])
def test_reserved_frame_kinds_verify_but_carry_no_message(kind: int) -> None:
    frame = wire.decode_frame(SALT, raw_frame(kind, b"\x80"))
    assert frame.kind == kind and wire.frame_message(frame) is None


def test_frame_codec_reuses_one_key_and_matches_encode_frame() -> None:
    codec = wire.FrameCodec(SALT)
    msg = wire.Batch(1, 2.0, 3.0, 4, None, 0.5)
    assert codec.encode(msg) == wire.encode_frame(SALT, msg)
    assert wire.frame_message(codec.open(codec.encode(msg))) == msg


BIG = wire.MAX_CONTROL_PAYLOAD + 1


@pytest.mark.parametrize(
    ("frame", "error", "words"),
    [
        # Each input fails two checks; the earlier one in SPEC order is reported.
        (raw_frame(1, b"\x82", magic=b"\0\0\0\0", version=b"\0\0\0\0"), WireError,
         ["bad magic", "0xF10D17C4", "0x00000000"]),
        (raw_frame(99, b"\x82", version=bytes.fromhex("01005446")), WireError,
         ["version", "0x46540002", "0x46540001"]),
        (raw_frame(99, b"", length=BIG), WireError, ["unknown kind 99"]),
        (raw_frame(1, b"", length=BIG, key=b"x" * 16), FrameTooLarge,
         [f"{BIG} bytes", "ceiling"]),
        (raw_frame(1, b"\xff", key=b"x" * 16), AuthError, ["HMAC", "kind 1"]),
    ],
    ids=["magic-before-version", "version-before-kind", "kind-before-length",
         "length-before-mac", "mac"],
)  # fmt: skip
def test_control_frame_reports_the_first_failed_check_in_spec_order(
    frame: bytes, error: type[Exception], words: list[str]
) -> None:
    with pytest.raises(error) as err:
        wire.decode_frame(SALT, frame)
    for word in words:
        assert word in str(err.value), str(err.value)
    if error is WireError:
        assert not isinstance(err.value, AuthError | FrameTooLarge)


def test_frame_payload_is_decoded_only_after_the_mac_verifies() -> None:
    garbage = raw_frame(1, b"\xff\xff")  # authentic frame, invalid CBOR
    frame = wire.decode_frame(SALT, garbage)
    with pytest.raises(WireError, match=r"ControlMsg: invalid CBOR"):
        wire.frame_message(frame)
    with pytest.raises(AuthError):
        wire.decode_frame(SALT, raw_frame(1, b"\xff\xff", key=b"y" * 16))


def test_frame_mac_covers_kind_so_retyping_a_frame_fails() -> None:
    frame = bytearray(wire.encode_frame(SALT, wire.Heartbeat(0, 1)))
    frame[16] = 1  # TIMING → CONTROL
    with pytest.raises(AuthError):
        wire.decode_frame(SALT, bytes(frame))


def test_decode_frame_refuses_trailing_bytes_and_short_headers() -> None:
    frame = wire.encode_frame(SALT, wire.SyncNow())
    with pytest.raises(WireError, match=r"header declares 2 payload bytes, got 3"):
        wire.decode_frame(SALT, frame + b"\0")
    with pytest.raises(WireError, match=r"header declares 2 payload bytes, got 1"):
        wire.decode_frame(SALT, frame[:-1])
    with pytest.raises(WireError, match=r"at least 24 header bytes, got 23"):
        wire.decode_frame(SALT, frame[:23])


def test_frame_codec_refuses_to_seal_over_its_ceiling() -> None:
    codec = wire.FrameCodec(SALT, max_payload=8)
    with pytest.raises(FrameTooLarge, match=r"9 bytes.*ceiling of 8"):
        codec.seal(1, b"x" * 9)


# ---------------------------------------------------------------- FrameDecoder


def _frame_stream(payloads: list[bytes]) -> tuple[bytes, list[wire.Frame]]:
    codec = wire.FrameCodec(SALT)
    frames = [wire.Frame(1 + i % 3, p) for i, p in enumerate(payloads)]
    return b"".join(codec.seal(f.kind, f.payload) for f in frames), frames


@settings(max_examples=60, deadline=None)
@given(payloads=st.lists(st.binary(max_size=40), min_size=1, max_size=5), cuts=CUTS)
def test_frame_decoder_gives_same_frames_for_any_chunking(payloads: list[bytes],
                                                          cuts: list[int]) -> None:
    stream, frames = _frame_stream(payloads)
    whole = wire.FrameDecoder(SALT)
    assert whole.feed(stream) == frames and whole.at_boundary
    dec = wire.FrameDecoder(SALT)
    assert fed_in_pieces(dec, stream, cuts) == frames and dec.at_boundary


def test_frame_decoder_byte_at_a_time_is_at_boundary_only_between_frames() -> None:
    one = wire.encode_frame(SALT, wire.SyncNow())
    two = wire.encode_frame(SALT, wire.DeclareDead(5))
    dec = wire.FrameDecoder(SALT)
    assert dec.at_boundary and dec.eof_error("rank 0") is None
    got: list[wire.Frame] = []
    for i, byte in enumerate(one + two):
        got += dec.feed(bytes([byte]))
        ends_frame = i + 1 in (len(one), len(one) + len(two))
        assert dec.at_boundary is ends_frame
    assert [wire.frame_message(f) for f in got] == [wire.SyncNow(), wire.DeclareDead(5)]


def test_frame_decoder_eof_mid_frame_is_wire_error_naming_peer() -> None:
    dec = wire.FrameDecoder(SALT)
    dec.feed(wire.encode_frame(SALT, wire.SyncNow())[:1])
    err = dec.eof_error("rank 3 at 127.0.0.1:5000")
    assert isinstance(err, WireError)
    assert "rank 3 at 127.0.0.1:5000" in str(err) and "peer closed mid-frame" in str(err)
    assert "1 bytes buffered" in str(err)


def test_frame_decoder_refuses_oversized_frame_from_the_header_alone() -> None:
    dec = wire.FrameDecoder(SALT, max_payload=100)
    header = raw_frame(2, b"", length=101)
    assert len(header) == 24
    with pytest.raises(FrameTooLarge, match=r"101 bytes.*ceiling of 100"):
        dec.feed(header)  # not a single payload byte was sent


def test_frame_decoder_accepts_payload_at_exactly_its_ceiling() -> None:
    dec = wire.FrameDecoder(SALT, max_payload=5)
    assert dec.feed(raw_frame(2, b"12345")) == [wire.Frame(2, b"12345")]


def test_frame_decoder_rejects_bad_header_before_the_payload_arrives() -> None:
    dec = wire.FrameDecoder(SALT)
    with pytest.raises(WireError, match=r"unknown kind 8"):
        dec.feed(raw_frame(8, b"abc")[:24])


def test_frame_decoder_is_poisoned_after_an_error() -> None:
    dec = wire.FrameDecoder(SALT)
    good = wire.encode_frame(SALT, wire.SyncNow())
    tampered = bytearray(good)
    tampered[-1] ^= 1
    with pytest.raises(AuthError) as first:
        dec.feed(bytes(tampered))
    for later in (good, b"", b"\x00"):
        with pytest.raises(AuthError) as again:
            dec.feed(later)
        assert again.value is first.value


def test_frame_decoder_returns_frames_before_an_error_in_a_later_feed() -> None:
    dec = wire.FrameDecoder(SALT)
    good = wire.encode_frame(SALT, wire.SyncNow())
    assert len(dec.feed(good + good[:10])) == 1
    assert not dec.at_boundary
    with pytest.raises(WireError, match=r"unknown kind 0"):
        dec.feed(b"\0" * 30)  # completes a header whose kind bytes are zero


# ---------------------------------------------------------------- length framing


def test_len_frame_is_u32_le_length_then_blob() -> None:
    assert wire.len_frame(b"abc") == bytes.fromhex("03000000") + b"abc"
    assert wire.len_frame(b"") == b"\0\0\0\0"


@settings(max_examples=60, deadline=None)
@given(blobs=st.lists(st.binary(max_size=30), min_size=1, max_size=6), cuts=CUTS)
def test_len_frame_decoder_gives_same_blobs_for_any_chunking(blobs: list[bytes],
                                                             cuts: list[int]) -> None:
    stream = b"".join(wire.len_frame(b) for b in blobs)
    assert wire.LenFrameDecoder(max_len=30).feed(stream) == blobs
    dec = wire.LenFrameDecoder(max_len=30)
    assert fed_in_pieces(dec, stream, cuts) == blobs and dec.at_boundary


def test_len_frame_decoder_byte_at_a_time_tracks_boundaries() -> None:
    stream = wire.len_frame(b"ab") + wire.len_frame(b"")
    dec = wire.LenFrameDecoder(max_len=10)
    got: list[bytes] = []
    boundaries = []
    for i in range(len(stream)):
        got += dec.feed(stream[i : i + 1])
        boundaries.append(dec.at_boundary)
    assert got == [b"ab", b""]
    assert boundaries == [False] * 5 + [True] + [False] * 3 + [True]


def test_len_frame_decoder_refuses_oversized_length_from_the_prefix_alone() -> None:
    dec = wire.LenFrameDecoder(max_len=wire.MAX_LEN_FRAME)
    with pytest.raises(FrameTooLarge, match=rf"{wire.MAX_LEN_FRAME + 1} bytes.*ceiling"):
        dec.feed(struct.pack("<I", wire.MAX_LEN_FRAME + 1))
    with pytest.raises(FrameTooLarge):
        dec.feed(wire.len_frame(b"ok"))  # poisoned


def test_len_frame_decoder_eof_mid_frame_is_wire_error() -> None:
    dec = wire.LenFrameDecoder(max_len=10)
    dec.feed(b"\x05\x00")
    err = dec.eof_error("relay host-a")
    assert isinstance(err, WireError) and "relay host-a: peer closed mid-frame" in str(err)
    dec.feed(b"\x00\x00abcde")
    assert dec.eof_error("relay host-a") is None


# ---------------------------------------------------------------- session salt


def test_session_salt_generate_is_16_fresh_random_bytes() -> None:
    a, b = wire.SessionSalt.generate(), wire.SessionSalt.generate()
    assert len(bytes(a)) == 16 and a != b


def test_session_salt_hex_round_trip_is_lowercase_and_parsing_is_forgiving() -> None:
    salt = wire.SessionSalt(bytes.fromhex("00112233445566778899aabbccddeeff"))
    assert salt.hex() == "00112233445566778899aabbccddeeff"
    assert wire.SessionSalt.from_hex("  00112233445566778899AABBCCDDEEFF\n") == salt
    assert bytes(wire.SessionSalt.from_hex(salt.hex())) == bytes(salt)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("0" * 31, ["32 hex characters", "got 31"]),
        ("0" * 33, ["32 hex characters", "got 33"]),
        ("", ["got 0"]),
        ("0" * 31 + "g", ["hex digits", "'g'", "position 31"]),
        ("00 11" + "0" * 27, ["hex digits", "' '", "position 2"]),
        ("0x" + "0" * 30, ["hex digits", "'x'", "position 1"]),
    ],
    ids=["31", "33", "empty", "non-hex", "inner-space", "0x-prefix"],
)
def test_session_salt_from_hex_rejects_bad_text_naming_the_problem(
    text: str, words: list[str]
) -> None:
    with pytest.raises(ConfigError) as err:
        wire.SessionSalt.from_hex(text)
    for word in words:
        assert word in str(err.value), str(err.value)


@pytest.mark.parametrize("raw", [b"x" * 15, b"x" * 17, "x" * 16])
def test_session_salt_must_be_exactly_16_bytes(raw: bytes) -> None:
    with pytest.raises(ConfigError, match=r"16 bytes"):
        wire.SessionSalt(raw)


def test_session_salt_repr_and_str_do_not_leak_the_secret() -> None:
    salt = wire.SessionSalt.generate()
    for text in (repr(salt), str(salt), f"{salt}", repr([salt])):
        assert salt.hex() not in text.lower()
        assert repr(bytes(salt)) not in text
    assert "SessionSalt" in repr(salt)
