"""The codec's fast paths (SPEC §13) decide exactly what the labelled reference paths decide.

Generated per-class loaders check a decoded CBOR array without building error labels and hand
any mismatch to the labelled path; strict CBOR loading reuses decoders; the MAC is built from two
precomputed SHA-256 states. Each is checked here against the slow, obvious version.
"""

from __future__ import annotations

import hmac
import itertools
import math
import threading
from typing import Any

import cbor2
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from flodl_trio import wire
from flodl_trio._errors import WireError
from flodl_trio.wire import _cbor, _crypto, _messages
from flodl_trio.wire._specs import Mismatch

from helpers.sansio import assert_refused_naming

PLAN = wire.EpochPlan(1, 2, 3)
GPU = wire.GpuSnapshot(0, "gpu0", 50.0, 1, 2)
SEEDS: list[wire.WireMessage] = [
    wire.Update(3, PLAN), wire.Update(3, None), wire.StartEpoch(PLAN), wire.DeclareDead(2),
    wire.NewNcclSession(b"uid", 1, 2), wire.ShutdownWithSave(wire.SaveReason.SINGLE_SURVIVOR),
    wire.EpochAggregated(wire.EpochMetrics(
        1, {"loss": 0.5}, ({"loss": 0.4},), 0.5, 10.0, (1.0,), (1.0,), (2.0,), (3.0,), (0.0,),
        (0, 1),
    )),
    wire.EvalBroadcast(1, 0.9), wire.StageAdvisory((1, 2), ((0, ((1, 2),)),)),
    wire.Batch(0, 1.0, 2.0, 3, None, 0.1, 0.2), wire.SyncAck(0, 1, 0.1, None, 2.0),
    wire.Intent(0, wire.IntentKind.CHECKPOINT_NOW), wire.EvalResult(0, 1, 2, 0.5, 3.0, "oops"),
    wire.DashboardRegister(0, 8080), wire.DashboardSetSvg(0, "<svg/>", "l", None),
    wire.Metrics(0, 1, 0.5, 2, 3.0, 4, 1.0, 1.0, 1.0, {"x": (1.0, 2)},
                 wire.ResourceSample(1.0, 2, 3, None, 4, 5, 0, (GPU,))),
    wire.Hello("host-a", 4, {}, (0, 1, 2), b"r" * 16), wire.RankExit(2), wire.Challenge(b"c" * 16),
]  # fmt: skip

# Values a field may be replaced with: the near misses of every wire type.
NEAR_MISSES = (
    st.sampled_from([
        None, True, False, 0, 1, -1, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1, 2**64,
        0.0, 1.0, -0.0, math.inf, -math.inf, math.nan, 3.4028234663852886e38, 3.5e38, 1e39,
        "", "h", "x" * 256, b"", b"n" * 16, b"n" * 15, [], [0], [1.0, 2], [1.0, 2, 3], {},
        {"a": 1.0}, {"a": 1}, {1: 1.0}, {"a": [1.0, 2]}, {"a": [1.0, -2]}, [[1, [[1, 2]]]],
    ])
    | st.integers(-(2**65), 2**65) | st.floats() | st.text(max_size=4) | st.binary(max_size=17)
)  # fmt: skip


def _replace(value: Any, path: list[int], new: Any) -> Any:
    if not path or not isinstance(value, list) or not value:
        return new
    i = path[0] % len(value)
    return [*value[:i], _replace(value[i], path[1:], new), *value[i + 1 :]]


def _reference(msg_cls: type[Any], value: Any) -> Any:
    """The labelled path's verdict: a message, or the WireError it raised."""
    try:
        if msg_cls._family is None:
            return msg_cls._load_fields(value, msg_cls.__name__)
        return msg_cls._family.load_labelled(value)
    except WireError as exc:
        return exc


def _fast(msg_cls: type[Any], value: Any) -> Any:
    try:
        if msg_cls._family is None:
            return msg_cls._fast_load(value)
        return msg_cls._family.fast[msg_cls._index](value)
    except Mismatch as exc:
        return exc


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.sampled_from(SEEDS), path=st.lists(st.integers(0, 20), min_size=1, max_size=5),
       new=NEAR_MISSES)  # fmt: skip
def test_generated_loader_accepts_exactly_what_the_labelled_path_accepts(
    seed: wire.WireMessage, path: list[int], new: Any
) -> None:
    value = _replace(cbor2.loads(wire.encode(seed)), path, new)
    if type(seed)._family is not None and (
        not isinstance(value, list) or not value or type(value[0]) is not int
        or value[0] != type(seed)._index
    ):  # fmt: skip
        return  # the family dispatch would not pick this loader (checked separately below)
    fast, reference = _fast(type(seed), value), _reference(type(seed), value)
    if isinstance(fast, Mismatch):
        # Refused by the fast path: the labelled path must refuse it too and say why, except
        # where it applies a documented fallback (an unknown SaveReason byte).
        if isinstance(reference, wire.ShutdownWithSave):
            assert reference.reason is wire.SaveReason.GRACEFUL_SHUTDOWN
        else:
            assert isinstance(reference, WireError), (value, reference)
    else:
        assert not isinstance(reference, WireError), (value, reference)
        # Same message; compare encodings so that nan fields compare equal.
        assert type(fast) is type(reference) and wire.encode(fast) == wire.encode(reference)


@pytest.mark.parametrize("seed", SEEDS, ids=lambda m: type(m).__name__)
def test_generated_loader_builds_the_same_message_as_construction(seed: wire.WireMessage) -> None:
    value = cbor2.loads(wire.encode(seed))
    assert _fast(type(seed), value) == seed
    assert _reference(type(seed), value) == seed


@pytest.mark.parametrize(
    ("decode", "value", "words"),
    [
        (wire.decode_timing, [0, 1, 1.0, 2, 3, None, 0.5, None], ["Batch.data_ms", "f64", "int 2"]),
        (wire.decode_timing, [0, True, 1.0, 2.0, 3, None, 0.5, None], ["Batch.rank", "bool"]),
        (wire.decode_relay, [1, "h", 2, {}, [0, 1.5], b"n" * 16], ["Hello.ranks[1]", "u32"]),
        (wire.decode_control, [1, 3, [1, 2]], ["Update.next_plan", "3 field(s), got 2"]),
        (wire.decode_metrics, [0, 1, 0.5, 2, 3.0, 4, 1.0, 1.0, 1.0, {"x": [1.0, -2]}, None],
         ["Metrics.scalars['x'][1]", "u64"]),
    ],
    ids=["float-field-int", "u64-bool", "seq-item", "nested-arity", "pair-item"],
)  # fmt: skip
def test_a_refused_field_is_still_named_after_the_fast_path_bails(
    decode: Any, value: Any, words: list[str]
) -> None:
    assert_refused_naming(decode, value, words)


def test_generated_source_is_readable_from_the_class() -> None:
    source = wire.Batch._loader_source
    assert "def _load_Batch" in source and "raise Mismatch" in source
    assert "f_rank" in source and "Batch." not in source  # no error label on the fast path


# ---------------------------------------------------------------- strict CBOR with reused readers

BAD_PAYLOADS = [
    bytes.fromhex("c10105"),  # tag
    bytes.fromhex("9f02ff"),  # indefinite array
    cbor2.dumps([5, 1000])[:-1],  # truncated inside an item
    cbor2.dumps([2]) + b"\x00",  # trailing byte
    cbor2.dumps([[[[[[[[[[[[[[[[[0]]]]]]]]]]]]]]]]]),  # depth 17
    bytes.fromhex("a2616101616102"),  # duplicate key
    bytes.fromhex("82 0d 62ffff"),  # invalid UTF-8
    b"",
]


@pytest.mark.parametrize("bad", BAD_PAYLOADS, ids=range(len(BAD_PAYLOADS)))
def test_every_decode_after_a_failed_one_starts_clean(bad: bytes) -> None:
    # A failed decode leaves read-ahead in its decoder; the next payload must not see it.
    long_msg = wire.EvalResult(0, 1, 2, 0.5, 3.0, "x" * 5000)
    for _ in range(3):
        with pytest.raises(WireError):
            wire.decode_control(bad)
        assert wire.decode_control(cbor2.dumps([5, 7])) == wire.DeclareDead(7)
        with pytest.raises(WireError, match=r"1 trailing byte"):
            wire.decode_control(cbor2.dumps([5, 7]) + b"\x01")
        assert wire.decode_timing(wire.encode(long_msg)) == long_msg
        assert wire.decode_control(cbor2.dumps([2])) == wire.SyncNow()


def test_trailing_bytes_are_found_in_payloads_longer_than_the_read_ahead() -> None:
    msg = wire.NewNcclIdGenerated(0, b"u" * 10_000)
    assert wire.decode_timing(wire.encode(msg)) == msg
    with pytest.raises(WireError, match=r"2 trailing byte"):
        wire.decode_timing(wire.encode(msg) + b"\x00\x00")


def test_a_large_payload_is_not_kept_alive_after_its_decode() -> None:
    msg = wire.NewNcclIdGenerated(0, b"u" * 100_000)
    assert wire.decode_timing(wire.encode(msg)) == msg
    assert all(reader.fp.getvalue() == b"" for reader in _cbor._IDLE)


def test_threads_decoding_at_once_each_get_their_own_payloads() -> None:
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(2000):
                msg = wire.Heartbeat(t, i)
                assert wire.decode_timing(wire.encode(msg)) == msg
        except BaseException as exc:  # reported below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []


def test_family_dispatch_does_not_take_a_float_or_bool_index_for_an_int() -> None:
    # 1.0 == 1 and True == 1 as dict keys; the index must be an int on the wire.
    for index in (1.0, True):
        with pytest.raises(WireError, match=r"integer variant index"):
            _messages.TIMING_MSG.load([index, 0, 0])


# ---------------------------------------------------------------- MAC


@pytest.mark.parametrize("key_len", [0, 1, 16, 32, 63, 64, 65, 200])
@pytest.mark.parametrize("parts", [(b"",), (b"abc", b""), (b"\x01" * 9, b"x" * 1000, b"yz")])
def test_mac64_equals_truncated_hmac_sha256_for_every_key_length(
    key_len: int, parts: tuple[bytes, ...]
) -> None:
    key = bytes(range(256))[:key_len] if key_len <= 256 else b""
    expected = hmac.digest(key, b"".join(parts), "sha256")[:8]
    mac = wire.Mac64(key)
    assert mac.tag(*parts) == expected and mac.verify(expected, *parts)
    if len(parts) == 2:
        assert mac.tag2(*parts) == expected
    # The precomputed states are copied, never consumed: the same tag again.
    assert mac.tag(*parts) == expected


def test_the_salt_mac_is_keyed_once_and_shared_and_its_tags_stay_exact() -> None:
    """Issue 38: the session salt's MAC state is built once per process and shared by every
    connection (its Challenge record, every ControlFrame); its tags are HMAC-SHA256's, a
    record keyed with the salt verifies whether or not the shared state exists yet, and the
    table stays bounded however many salts a process sees."""
    salt = wire.SessionSalt.generate()
    fresh = wire.RecordSealer(bytes(salt), wire.COORD_TO_RELAY).seal(2, 0, b"challenge")
    shared = _crypto.shared_mac(salt)
    assert _crypto.shared_mac(bytes(salt)) is shared
    assert shared.tag(b"x") == hmac.digest(bytes(salt), b"x", "sha256")[:8]
    assert wire.RecordSealer(bytes(salt), wire.COORD_TO_RELAY).seal(2, 0, b"challenge") == fresh
    opener = wire.RecordOpener(bytes(salt), wire.COORD_TO_RELAY)
    assert opener.feed(fresh) == [wire.Record(2, 0, b"challenge")]
    other = bytes(32)  # a key nobody shared: its own state, the same tags
    assert _crypto.mac_of(other) is not _crypto.mac_of(other)
    for _ in range(100):
        _crypto.shared_mac(wire.SessionSalt.generate())
    assert len(_crypto._SHARED_MACS) <= _crypto._SHARED_MAX
    frame = wire.encode_frame(salt, wire.CoordHeartbeat())
    assert wire.decode_frame(salt, frame).kind == 1


# ---------------------------------------------------------------- records opened from the chunk


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=8),
       cuts=st.lists(st.integers(0, 3000), max_size=10),
       wrappers=st.lists(st.sampled_from([bytes, bytearray, memoryview]), min_size=1),
       use_next=st.booleans())  # fmt: skip
def test_record_opener_gives_the_same_records_however_the_stream_is_cut(
    sizes: list[int], cuts: list[int], wrappers: list[Any], use_next: bool
) -> None:
    key = b"K" * 32
    sealer = wire.RecordSealer(key, wire.RELAY_TO_COORD)
    expected = [wire.Record(1, i, bytes([i % 256]) * n) for i, n in enumerate(sizes)]
    stream = b"".join(sealer.seal(r.kind, r.rank, r.payload) for r in expected)
    bounds = sorted({0, len(stream), *(c % (len(stream) + 1) for c in cuts)})
    opener = wire.RecordOpener(key, wire.RELAY_TO_COORD)
    got: list[wire.Record] = []
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        chunk = wrappers[i % len(wrappers)](stream[a:b])
        if use_next and i % 2:  # the one-at-a-time API, interleaved with feed()
            opener.push(chunk)
            while (rec := opener.next_record()) is not None:
                got.append(rec)
        else:
            got += opener.feed(chunk)
    assert got == expected and opener.at_boundary and opener.seq == len(expected)
