"""Edges of the wire API that used to escape as the wrong error or lose data: bad arguments to
``RecordSealer.seal`` and ``encode_fanout``, strs without a UTF-8 encoding, bools given as
deadlines, and the whole frames that precede a bad one in the same chunk."""

from __future__ import annotations

import struct
from typing import Any

import pytest

from flodl_trio import wire
from flodl_trio._config import CoordinatorConfig, RankConfig, RelayConfig
from flodl_trio._errors import AuthError, ConfigError, FrameTooLarge, WireError

KEY = b"K" * 32
SALT = wire.SessionSalt(bytes(range(16)))
DATA, CONTROL, FANOUT = wire.RecordKind.DATA, wire.RecordKind.CONTROL, wire.RecordKind.FANOUT


# ---------------------------------------------------------------- RecordSealer.seal arguments


@pytest.mark.parametrize(
    ("kind", "rank", "payload", "words"),
    [
        (3, 0, b"x", ["kind", "DATA (1), CONTROL (2) or FANOUT (5)", "got 3"]),
        (0, 0, b"x", ["kind", "got 0"]),
        (256, 0, b"x", ["kind", "got 256"]),
        (True, 0, b"x", ["kind", "got True"]),
        ("1", 0, b"x", ["kind", "got '1'"]),
        (DATA, -1, b"x", ["rank must be a u32", "got -1"]),
        (DATA, 2**32, b"x", ["rank must be a u32", "got 4294967296"]),
        (DATA, True, b"x", ["rank must be a u32", "got True"]),
        (DATA, 1.0, b"x", ["rank must be a u32", "got 1.0"]),
        (DATA, None, b"x", ["rank must be a u32", "got None"]),
        (DATA, 0, "text", ["payload must be bytes", "got str"]),
        (DATA, 0, None, ["payload must be bytes", "got NoneType"]),
        (DATA, 0, 5, ["payload must be bytes", "got int"]),
    ],
)  # fmt: skip
def test_seal_refuses_bad_arguments_with_wire_error_naming_them(
    kind: Any, rank: Any, payload: Any, words: list[str]
) -> None:
    sealer = wire.RecordSealer(KEY, wire.RELAY_TO_COORD)
    with pytest.raises(WireError) as err:
        sealer.seal(kind, rank, payload)
    for word in words:
        assert word in str(err.value), str(err.value)
    assert sealer.seq == 0  # nothing was sealed, so the sequence did not advance


def test_seal_accepts_every_bytes_like_payload_and_plain_int_kinds() -> None:
    records = []
    for kind, payload in [(DATA, b"abc"), (1, bytearray(b"abc")), (int(DATA), memoryview(b"abc"))]:
        records.append(wire.RecordSealer(KEY, wire.RELAY_TO_COORD).seal(kind, 7, payload))
    assert records[0] == records[1] == records[2]
    opened = wire.RecordOpener(KEY, wire.RELAY_TO_COORD).feed(records[0])
    assert opened == [wire.Record(DATA, 7, b"abc")]


# ---------------------------------------------------------------- encode_fanout arguments


@pytest.mark.parametrize(
    ("ranks", "frame", "words"),
    [
        ([1, "a"], b"f", ["FANOUT", "u32", "'a'"]),
        (["a", 1], b"f", ["FANOUT", "u32", "'a'"]),
        ([1, None], b"f", ["FANOUT", "u32", "None"]),
        ([1, 2.0], b"f", ["FANOUT", "u32", "2.0"]),
        ([True], b"f", ["FANOUT", "u32", "True"]),
        ([-1], b"f", ["FANOUT", "u32", "-1"]),
        (5, b"f", ["FANOUT", "iterable", "int"]),
        ([1], "frame", ["FANOUT", "frame must be bytes", "str"]),
        ([1], 3, ["FANOUT", "frame must be bytes", "int"]),
    ],
)  # fmt: skip
def test_encode_fanout_refuses_bad_arguments_with_wire_error(
    ranks: Any, frame: Any, words: list[str]
) -> None:
    with pytest.raises(WireError) as err:
        wire.encode_fanout(ranks, frame)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_encode_fanout_sorts_dedups_and_takes_any_bytes_like_frame() -> None:
    payload = wire.encode_fanout(iter([3, 1, 3]), bytearray(b"frame"))
    assert wire.decode_fanout(payload) == ((1, 3), b"frame")


# ---------------------------------------------------------------- str fields without UTF-8


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: wire.Hello("host\udc80", 4, {}, (0,), b"n" * 16), "Hello.host"),
        (lambda: wire.EvalResult(0, 1, 2, 0.5, 1.0, "bad \ud800"), "EvalResult.error"),
        (lambda: wire.DashboardSetSvg(0, "\udfff<svg/>"), "DashboardSetSvg.svg"),
        (lambda: wire.GpuSnapshot(0, "gpu\udc80"), "GpuSnapshot.name"),
        (lambda: wire.Metrics(0, 1, 0.5, 2, 3.0, 4, 1.0, 1.0, 1.0, {"\udc80": (1.0, 2)}),
         "Metrics.scalars key"),
    ],
    ids=["hello-host", "optional-str", "str", "nested-str", "map-key"],
)  # fmt: skip
def test_str_with_a_lone_surrogate_fails_at_construction(make: Any, field: str) -> None:
    with pytest.raises(WireError) as err:
        make()
    assert field in str(err.value) and "not valid UTF-8" in str(err.value), str(err.value)


def test_non_ascii_strs_are_still_fine() -> None:
    hello = wire.Hello("hôte-é", 4, {}, (0,), b"n" * 16)
    assert wire.decode_relay(wire.encode(hello)) == hello


# ---------------------------------------------------------------- deadlines are not bools


@pytest.mark.parametrize("flag", [True, False])
@pytest.mark.parametrize(
    ("cls", "field"),
    [
        (CoordinatorConfig, "heartbeat_timeout"),
        (CoordinatorConfig, "formation_timeout"),
        (CoordinatorConfig, "heartbeat_interval"),
        (RelayConfig, "rank_accept_timeout"),
        (RankConfig, "coord_liveness_timeout"),
        (RankConfig, "heartbeat_interval"),
    ],
)
def test_a_bool_given_as_seconds_is_a_config_error(cls: Any, field: str, flag: bool) -> None:
    extra = {"world_size": 2} if cls is CoordinatorConfig else {}
    with pytest.raises(ConfigError) as err:
        cls(**extra, **{field: flag})
    assert f"{cls.__name__}.{field}" in str(err.value) and str(flag) in str(err.value)


# ---------------------------------------------------------------- good frames before a bad one


def _frame(msg: wire.WireMessage) -> bytes:
    return wire.encode_frame(SALT, msg)


def test_frame_decoder_error_carries_the_frames_before_it_once() -> None:
    good = [_frame(wire.SyncNow()), _frame(wire.DeclareDead(3))]
    bad = bytearray(_frame(wire.Shutdown()))
    bad[-1] ^= 1
    dec = wire.FrameDecoder(SALT)
    with pytest.raises(AuthError) as err:
        dec.feed(b"".join(good) + bytes(bad) + good[0])
    assert [wire.frame_message(f) for f in wire.frames_before(err.value)] == [
        wire.SyncNow(), wire.DeclareDead(3)]
    # Poisoned: the same error again, with nothing new before it.
    with pytest.raises(AuthError) as again:
        dec.feed(good[0])
    assert again.value is err.value and wire.frames_before(again.value) == []


def test_frame_decoder_error_on_the_first_frame_carries_none() -> None:
    with pytest.raises(WireError) as err:
        wire.FrameDecoder(SALT).feed(b"\0" * 30)
    assert wire.frames_before(err.value) == []


def test_len_frame_decoder_error_carries_the_blobs_before_it() -> None:
    dec = wire.LenFrameDecoder(max_len=10)
    chunk = wire.len_frame(b"one") + wire.len_frame(b"two") + struct.pack("<I", 11)
    with pytest.raises(FrameTooLarge) as err:
        dec.feed(chunk)
    assert wire.frames_before(err.value) == [b"one", b"two"]
    with pytest.raises(FrameTooLarge) as again:
        dec.feed(wire.len_frame(b"ok"))
    assert again.value is err.value and wire.frames_before(again.value) == []


def test_record_opener_error_carries_the_records_before_it() -> None:
    sealer = wire.RecordSealer(KEY, wire.RELAY_TO_COORD)
    first, second = sealer.seal(DATA, 1, b"a"), sealer.seal(CONTROL, 0, b"b")
    replayed = first
    opener = wire.RecordOpener(KEY, wire.RELAY_TO_COORD)
    with pytest.raises(AuthError, match=r"record #2") as err:
        opener.feed(first + second + replayed)
    assert wire.frames_before(err.value) == [wire.Record(DATA, 1, b"a"),
                                             wire.Record(CONTROL, 0, b"b")]
    for call in (lambda: opener.feed(b""), opener.next_record, lambda: opener.push(b"x")):
        with pytest.raises(AuthError) as again:
            call()
        assert again.value is err.value and wire.frames_before(again.value) == []


def test_record_opener_next_record_error_carries_none() -> None:
    opener = wire.RecordOpener(KEY, wire.RELAY_TO_COORD)
    opener.push(wire.RecordSealer(b"other", wire.RELAY_TO_COORD).seal(DATA, 0, b"x"))
    with pytest.raises(AuthError) as err:
        opener.next_record()
    assert wire.frames_before(err.value) == []


def test_frames_before_of_an_unrelated_error_is_empty() -> None:
    assert wire.frames_before(WireError("elsewhere")) == []
    assert wire.frames_before(ValueError("not ours")) == []
