"""CBOR payloads of SPEC §2.7: every variant round-trips, the wire shape is the table's, and
decoding is strict.

The strategies below are written from the SPEC tables, not derived from the library's schema, so a
field declared with the wrong type or in the wrong order in ``flodl_trio.wire`` fails here. Each
strategy draws a pair ``(message, expected_cbor_value)``: the message a user builds and the array
the SPEC says goes on the wire.
"""

from __future__ import annotations

import math
from typing import Any

import cbor2
import pytest
from hypothesis import given, settings, strategies as st

from flodl_trio import wire
from flodl_trio._errors import WireError

from helpers.sansio import assert_refused_naming

Pair = tuple[Any, Any]  # (python value, wire value)


def same(s: st.SearchStrategy[Any]) -> st.SearchStrategy[Pair]:
    return s.map(lambda v: (v, v))


U64 = same(st.integers(0, 2**64 - 1))
U32 = same(st.integers(0, 2**32 - 1))
U16 = same(st.integers(0, 2**16 - 1))
U8 = same(st.integers(0, 255))
F64 = same(st.floats(allow_nan=False))  # inf and -inf included; nan is covered separately
F32 = same(st.floats(width=32, allow_nan=False))
TEXT = same(st.text(max_size=12))
BLOB = same(st.binary(max_size=24))
NONCE = same(st.binary(min_size=16, max_size=16))
HOST = same(st.text(min_size=1, max_size=20))


def opt(inner: st.SearchStrategy[Pair]) -> st.SearchStrategy[Pair]:
    return st.just((None, None)) | inner


def seq(inner: st.SearchStrategy[Pair], max_size: int = 3) -> st.SearchStrategy[Pair]:
    return st.lists(inner, max_size=max_size).map(
        lambda items: (tuple(p for p, _ in items), [w for _, w in items])
    )


def text_map(inner: st.SearchStrategy[Pair]) -> st.SearchStrategy[Pair]:
    return st.dictionaries(st.text(max_size=6), inner, max_size=3).map(
        lambda d: ({k: p for k, (p, _) in d.items()}, {k: w for k, (_, w) in d.items()})
    )


def pair(*items: st.SearchStrategy[Pair]) -> st.SearchStrategy[Pair]:
    return st.tuples(*items).map(lambda ps: (tuple(p for p, _ in ps), [w for _, w in ps]))


def struct(cls: type[Any], *fields: st.SearchStrategy[Pair]) -> st.SearchStrategy[Pair]:
    """A plain struct: ``[field_1, ...]``."""
    return st.tuples(*fields).map(lambda ps: (cls(*[p for p, _ in ps]), [w for _, w in ps]))


def enum_of(cls: type[Any]) -> st.SearchStrategy[Pair]:
    return st.sampled_from(list(cls)).map(lambda m: (m, int(m)))


PLAN = struct(wire.EpochPlan, U64, U64, U64)
EPOCH_METRICS = struct(
    wire.EpochMetrics,
    U64, text_map(F64), seq(text_map(F64)), F64, F64,
    seq(F64), seq(F64), seq(F64), seq(F64), seq(F64), seq(U8),
)  # fmt: skip
GPU = struct(wire.GpuSnapshot, U8, TEXT, opt(F32), opt(U64), opt(U64))
RESOURCES = struct(
    wire.ResourceSample, opt(F32), opt(U64), opt(U64), opt(F32), opt(U64), opt(U64), opt(U8),
    seq(GPU, 2),
)  # fmt: skip
METRICS = struct(
    wire.Metrics, U64, U64, F64, U64, F64, U64, F64, F64, F64, text_map(pair(F64, U64)),
    opt(RESOURCES),
)  # fmt: skip

# SPEC §2.7 tables: (variant index, class, field strategies in wire order).
CONTROL_TABLE: list[tuple[int, type[Any], list[st.SearchStrategy[Pair]]]] = [
    (0, wire.RequestParams, []),
    (1, wire.Update, [U64, opt(PLAN)]),
    (2, wire.SyncNow, []),
    (3, wire.StartEpoch, [PLAN]),
    (4, wire.ExtendPartition, [U64, U64]),
    (5, wire.DeclareDead, [U64]),
    (6, wire.RequestNewNcclId, []),
    (7, wire.NewNcclSession, [BLOB, U64, U64]),
    (8, wire.Throttle, []),
    (9, wire.SetGlobalStep, [U64]),
    (10, wire.Checkpoint, [U64, U64]),
    (11, wire.ExecuteEvalCallback, [U64, U64, U64]),
    (12, wire.SetEpochCallbackRole, [U64]),
    (13, wire.Shutdown, []),
    (14, wire.ShutdownWithSave, [enum_of(wire.SaveReason)]),
    (15, wire.EpochAggregated, [EPOCH_METRICS]),
    (16, wire.EvalBroadcast, [U64, F64]),
    (17, wire.SaveConsensusModel, [U64]),
    (18, wire.CoordHeartbeat, []),
    (19, wire.StageAdvisory, [seq(U64), seq(pair(U64, seq(pair(U64, U64))))]),
    (20, wire.RelayWaiting, [HOST, TEXT]),
    (21, wire.Fenced, [U64, TEXT]),
    (22, wire.DeclareAlive, [U64]),
    (23, wire.CoordinatorReconnecting, [HOST, TEXT]),
    (24, wire.CoordinatorResumed, [U64]),
    (25, wire.Drain, [HOST, TEXT]),
    (26, wire.Readmitted, [HOST, TEXT]),
]
TIMING_TABLE: list[tuple[int, type[Any], list[st.SearchStrategy[Pair]]]] = [
    (0, wire.Batch, [U64, F64, F64, U64, opt(F64), F64, opt(F64)]),
    (1, wire.SyncAck, [U64, U64, opt(F64), opt(F64), opt(F64)]),
    (2, wire.Exiting, [U64]),
    (3, wire.LrUpdate, [U64, F64]),
    (4, wire.Intent, [U64, enum_of(wire.IntentKind)]),
    (5, wire.Heartbeat, [U64, U64]),
    (6, wire.SnapshotReady, [U64]),
    (7, wire.EvalResult, [U64, U64, U64, F64, F64, opt(TEXT)]),
    (8, wire.CheckpointResult, [U64, U64, F64, opt(TEXT)]),
    (9, wire.NewNcclIdGenerated, [U64, BLOB]),
    (10, wire.EpochFnElapsed, [U64, U64, F64]),
    (11, wire.DashboardRegister, [U64, U16]),
    (12, wire.DashboardSetSvg, [U64, TEXT, opt(TEXT), opt(TEXT)]),
    (13, wire.DashboardSetMetadata, [U64, TEXT]),
    (14, wire.DashboardSetHardware, [U64, TEXT]),
]
RELAY_TABLE: list[tuple[int, type[Any], list[st.SearchStrategy[Pair]]]] = [
    (0, wire.Challenge, [NONCE]),
    (1, wire.Hello, [HOST, U32, text_map(BLOB), seq(U32), NONCE]),
    (2, wire.HelloAck, [NONCE]),
    (3, wire.RankExit, [U32]),
    (4, wire.Ready, []),
    (5, wire.Goodbye, [TEXT]),
    (6, wire.FenceRank, [U32, TEXT]),
    (7, wire.RankDropped, [U32, TEXT]),
    (8, wire.Refused, [NONCE, TEXT]),
    (9, wire.Resume, [HOST, U32, text_map(BLOB), seq(U32), NONCE, U64]),
    (10, wire.Generation, [U64]),
    (11, wire.Liveness, [seq(U32), seq(U64), seq(F64)]),
    (12, wire.Cadence, [F64]),
    (13, wire.Draining, [TEXT]),
]
FAMILIES = [
    ("ControlMsg", wire.ControlMsg, CONTROL_TABLE, wire.decode_control),
    ("TimingMsg", wire.TimingMsg, TIMING_TABLE, wire.decode_timing),
    ("RelayControlMsg", wire.RelayControlMsg, RELAY_TABLE, wire.decode_relay),
]


def variant(index: int, cls: type[Any], fields: list[st.SearchStrategy[Pair]]) -> Any:
    return st.tuples(*fields).map(
        lambda ps: (cls(*[p for p, _ in ps]), [index, *[w for _, w in ps]])
    )


VARIANT_CASES = [
    pytest.param(index, cls, fields, decode, id=cls.__name__)
    for _, _, table, decode in FAMILIES
    for index, cls, fields in table
]


# ---------------------------------------------------------------- round trips and wire shape


@pytest.mark.parametrize(("index", "cls", "fields", "decode"), VARIANT_CASES)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_every_variant_round_trips_as_array_of_index_then_fields(
    data: st.DataObject, index: int, cls: type[Any], fields: Any, decode: Any
) -> None:
    msg, expected = data.draw(variant(index, cls, fields))
    payload = wire.encode(msg)
    on_wire = cbor2.loads(payload)
    assert on_wire == expected
    assert on_wire[0] == index and len(on_wire) == 1 + len(fields)
    assert decode(payload) == msg
    # The SPEC's array, encoded by anyone, decodes to the same message.
    assert decode(cbor2.dumps(expected)) == msg


@pytest.mark.parametrize(
    ("strategy", "cls", "arity"),
    [
        pytest.param(PLAN, wire.EpochPlan, 3, id="EpochPlan"),
        pytest.param(EPOCH_METRICS, wire.EpochMetrics, 11, id="EpochMetrics"),
        pytest.param(RESOURCES, wire.ResourceSample, 8, id="ResourceSample"),
        pytest.param(GPU, wire.GpuSnapshot, 5, id="GpuSnapshot"),
        pytest.param(METRICS, wire.Metrics, 11, id="Metrics"),
    ],
)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_plain_structs_encode_as_bare_field_arrays(
    data: st.DataObject, strategy: Any, cls: type[Any], arity: int
) -> None:
    msg, expected = data.draw(strategy)
    on_wire = cbor2.loads(wire.encode(msg))
    assert on_wire == expected and len(on_wire) == arity
    if cls is wire.Metrics:
        assert wire.decode_metrics(wire.encode(msg)) == msg
        assert wire.decode_metrics(cbor2.dumps(expected)) == msg


@pytest.mark.parametrize(
    ("name", "base", "table", "decode"), FAMILIES, ids=[f[0] for f in FAMILIES]
)
def test_family_has_exactly_the_spec_variants(
    name: str, base: type[Any], table: Any, decode: Any
) -> None:
    exported = {
        getattr(wire, n) for n in wire.__all__
        if isinstance(getattr(wire, n), type) and issubclass(getattr(wire, n), base)
        and getattr(wire, n) is not base
    }  # fmt: skip
    assert exported == {cls for _, cls, _ in table}


@settings(max_examples=30, deadline=None)
@given(metric=st.floats(allow_nan=True), batch_ms=st.sampled_from([math.nan, math.inf, -math.inf]))
def test_nan_and_infinite_floats_survive_a_round_trip(metric: float, batch_ms: float) -> None:
    msg = wire.Batch(0, batch_ms, metric, 1, math.nan, 0.5, None)
    back = wire.decode_timing(wire.encode(msg))
    # nan != nan, so compare the encodings and the float bits.
    assert wire.encode(back) == wire.encode(msg)
    assert math.isnan(back.param_norm)  # type: ignore[arg-type]
    assert (math.isnan(back.batch_ms) and math.isnan(batch_ms)) or back.batch_ms == batch_ms


def test_user_may_pass_int_for_float_field_but_it_is_sent_as_float() -> None:
    msg = wire.EvalBroadcast(epoch=1, metric=3)
    assert type(msg.metric) is float
    assert wire.encode(msg) == cbor2.dumps([16, 1, 3.0])


def test_lists_are_tuples_in_python_and_arrays_on_the_wire() -> None:
    msg = wire.StageAdvisory(counts=[1, 2], segments=[[7, [[1, 2]]]])
    assert msg.counts == (1, 2) and msg.segments == ((7, ((1, 2),)),)
    assert cbor2.loads(wire.encode(msg)) == [19, [1, 2], [[7, [[1, 2]]]]]


# ---------------------------------------------------------------- strictness


def _metrics_fields(scalars: Any = None) -> list[Any]:
    return [0, 1, 0.5, 2, 3.0, 4, 1.0, 1.0, 1.0, {} if scalars is None else scalars, None]


@pytest.mark.parametrize(
    ("decode", "value", "words"),
    [
        (wire.decode_control, [27], ["ControlMsg", "unknown variant index 27"]),
        (wire.decode_control, [-1], ["ControlMsg", "unknown variant index -1"]),
        (wire.decode_timing, [15, 0], ["TimingMsg", "unknown variant index 15"]),
        (wire.decode_relay, [14, 0], ["RelayControlMsg", "unknown variant index 14"]),
        (wire.decode_control, [True], ["ControlMsg", "variant index"]),
        (wire.decode_control, [], ["ControlMsg", "array"]),
        (wire.decode_control, 5, ["ControlMsg", "array"]),
        (wire.decode_control, {"a": 1}, ["ControlMsg", "array"]),
    ],
    ids=["ctl-27", "ctl-neg", "timing-15", "relay-14", "bool-index", "empty", "int", "map"],
)
def test_bad_variant_index_is_wire_error_naming_the_family(
    decode: Any, value: Any, words: list[str]
) -> None:
    assert_refused_naming(decode, value, words)


@pytest.mark.parametrize(
    ("decode", "value", "words"),
    [
        (wire.decode_control, [2, 0], ["SyncNow", "0 field(s), got 1"]),
        (wire.decode_control, [5], ["DeclareDead", "1 field(s), got 0"]),
        (wire.decode_control, [4, 1, 2, 3], ["ExtendPartition", "2 field(s), got 3"]),
        (wire.decode_control, [3, [1, 2]], ["StartEpoch.plan", "3 field(s), got 2"]),
        (wire.decode_timing, [0, 0, 1.0, 1.0, 1, None, 1.0], ["Batch", "7 field(s), got 6"]),
        (wire.decode_metrics, _metrics_fields()[:-1], ["Metrics", "11 field(s), got 10"]),
        (wire.decode_metrics, _metrics_fields({"x": [1.0]}), ["Metrics.scalars['x']"]),
        (wire.decode_relay, [1, "h", 2, {}, [1]], ["Hello", "5 field(s), got 4"]),
    ],
    ids=["SyncNow+1", "DeclareDead-1", "ExtendPartition+1", "EpochPlan-1", "Batch-1",
         "Metrics-1", "scalar-pair-1", "Hello-1"],
)  # fmt: skip
def test_wrong_arity_is_wire_error_naming_message(
    decode: Any, value: Any, words: list[str]
) -> None:
    assert_refused_naming(decode, value, words)


GPU_OK = [0, "gpu", None, None, None]
RES_OK = [None, None, None, None, None, None, None, []]
EM_OK = [1, {}, [], 1.0, 1.0, [], [], [], [], [], []]


@pytest.mark.parametrize(
    ("decode", "value", "field", "expected"),
    [
        # wrong type
        (wire.decode_control, [16, 1, 2], "EvalBroadcast.metric", "f64"),
        (wire.decode_control, [5, 1.0], "DeclareDead.rank", "u64"),
        (wire.decode_control, [5, True], "DeclareDead.rank", "u64"),
        (wire.decode_control, [5, "1"], "DeclareDead.rank", "u64"),
        (wire.decode_control, [5, None], "DeclareDead.rank", "u64"),
        (wire.decode_control, [7, "uid", 1, 2], "NewNcclSession.uid", "bytes"),
        (wire.decode_timing, [13, 0, b"{}"], "DashboardSetMetadata.json", "str"),
        (wire.decode_timing, [3, 0, 1], "LrUpdate.lr", "f64"),
        (wire.decode_timing, [7, 0, 1, 1, 1.0, 1.0, 5], "EvalResult.error", "expected str"),
        (wire.decode_control, [15, [*EM_OK[:1], {"a": 1}, *EM_OK[2:]]],
         "EpochAggregated.metrics.scalars['a']", "f64"),
        (wire.decode_control, [15, [*EM_OK[:1], [], *EM_OK[2:]]],
         "EpochAggregated.metrics.scalars", "map[str, f64]"),
        (wire.decode_control, [15, [*EM_OK[:1], {1: 1.0}, *EM_OK[2:]]],
         "EpochAggregated.metrics.scalars", "text map keys"),
        (wire.decode_control, [19, (1,), [[1, [[1.0, 2]]]]],
         "StageAdvisory.segments[0][1][0][0]", "u64"),
        (wire.decode_metrics, [*_metrics_fields()[:-1], [*RES_OK[:-1], [[0, 5, *GPU_OK[2:]]]]],
         "Metrics.resources.gpus[0].name", "str"),
        (wire.decode_metrics, [*_metrics_fields()[:-1], [1, *RES_OK[1:]]],
         "Metrics.resources.cpu_percent", "f32"),
        # out of range
        (wire.decode_control, [5, -1], "DeclareDead.rank", "u64"),
        (wire.decode_control, [14, 256], "ShutdownWithSave.reason", "u8"),
        (wire.decode_control, [15, [*EM_OK[:-1], [1, 256]]],
         "EpochAggregated.metrics.device_indices[1]", "u8"),
        (wire.decode_timing, [11, 0, 65536], "DashboardRegister.port", "u16"),
        (wire.decode_timing, [11, 0, -1], "DashboardRegister.port", "u16"),
        (wire.decode_relay, [1, "h", 2, {}, [0, 2**32], b"n" * 16], "Hello.ranks[1]", "u32"),
        (wire.decode_relay, [3, 2**32], "RankExit.rank", "u32"),
        (wire.decode_metrics, [*_metrics_fields()[:-1], [*RES_OK[:6], 256, []]],
         "Metrics.resources.aggregate_rank", "u8"),
        (wire.decode_metrics, [*_metrics_fields()[:-1], [1e39, *RES_OK[1:]]],
         "Metrics.resources.cpu_percent", "f32"),
        # enums
        (wire.decode_timing, [4, 0, 2], "Intent.kind", "IntentKind"),
        (wire.decode_timing, [4, 0, 1.0], "Intent.kind", "u32"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)  # fmt: skip
def test_wrong_type_or_out_of_range_field_is_wire_error_naming_field(
    decode: Any, value: Any, field: str, expected: str
) -> None:
    with pytest.raises(WireError) as err:
        decode(cbor2.dumps(value))
    msg = str(err.value)
    assert field in msg and expected in msg, msg


def test_u64_bounds_are_inclusive_of_zero_and_2_pow_64_minus_1() -> None:
    assert wire.decode_control(cbor2.dumps([5, 0])) == wire.DeclareDead(0)
    assert wire.decode_control(cbor2.dumps([5, 2**64 - 1])) == wire.DeclareDead(2**64 - 1)
    assert wire.decode_timing(cbor2.dumps([11, 0, 65535])) == wire.DashboardRegister(0, 65535)


def _nested(depth: int) -> bytes:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return cbor2.dumps(value)


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (bytes.fromhex("d9d9f7") + cbor2.dumps([2]), ["ControlMsg", "tag 55799", "not allowed"]),
        (cbor2.dumps([5, cbor2.CBORTag(1, 5)]), ["ControlMsg", "tag 1", "not allowed"]),
        (bytes.fromhex("8205c24101"), ["ControlMsg", "tag 2", "not allowed"]),
        (cbor2.dumps([5, 2**64]), ["ControlMsg", "tag 2"]),
        (bytes.fromhex("9f02ff"), ["ControlMsg", "indefinite"]),
        (bytes.fromhex("82059f01ff"), ["ControlMsg", "indefinite"]),
        (bytes.fromhex("8307") + bytes.fromhex("5f4161ff") + bytes.fromhex("0102"),
         ["ControlMsg", "indefinite"]),
        (_nested(17), ["ControlMsg", "depth"]),
        (_nested(40), ["ControlMsg", "depth"]),
        (cbor2.dumps([2]) + b"\x00", ["ControlMsg", "1 trailing byte"]),
        (cbor2.dumps([2]) * 2, ["ControlMsg", "trailing"]),
        (b"", ["ControlMsg", "invalid CBOR"]),
        (cbor2.dumps([5, 1000])[:-1], ["ControlMsg", "invalid CBOR"]),
        (bytes.fromhex("f7"), ["ControlMsg", "simple value"]),
        (bytes.fromhex("9bffffffffffffffff"), ["ControlMsg", "invalid CBOR"]),
    ],
    ids=["tag55799", "tag1", "tag2-bignum", "u64+1-bignum", "indef-array", "indef-inner",
         "indef-bytes", "depth17", "depth40", "trailing", "two-items", "empty", "truncated",
         "undefined", "huge-length"],
)  # fmt: skip
def test_cbor_level_violations_are_wire_errors_naming_message(raw: bytes, words: list[str]) -> None:
    with pytest.raises(WireError) as err:
        wire.decode_control(raw)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_nesting_of_exactly_16_is_allowed_and_17_refused() -> None:
    # 16 levels decode (then fail the schema, not the CBOR layer); 17 fail at the CBOR layer.
    with pytest.raises(WireError, match=r"variant index"):
        wire.decode_control(_nested(16))
    with pytest.raises(WireError, match=r"depth"):
        wire.decode_control(_nested(17))


def test_duplicate_map_key_is_wire_error() -> None:
    fields = [cbor2.dumps(v) for v in _metrics_fields()[:9]]
    dup_map = bytes.fromhex("a2") + (cbor2.dumps("loss") + cbor2.dumps([1.0, 1])) * 2
    raw = bytes.fromhex("8b") + b"".join(fields) + dup_map + cbor2.dumps(None)
    with pytest.raises(WireError) as err:
        wire.decode_metrics(raw)
    assert "Metrics" in str(err.value) and "uplicate" in str(err.value)


def test_indefinite_map_and_text_are_wire_errors() -> None:
    fields = b"".join(cbor2.dumps(v) for v in _metrics_fields()[:9])
    with pytest.raises(WireError, match=r"Metrics.*indefinite"):
        wire.decode_metrics(bytes.fromhex("8b") + fields + bytes.fromhex("bfff f6"))
    with pytest.raises(WireError, match=r"TimingMsg.*indefinite"):
        wire.decode_timing(bytes.fromhex("830d00 7f6161ff"))


def test_invalid_utf8_text_is_wire_error() -> None:
    with pytest.raises(WireError, match=r"TimingMsg"):
        wire.decode_timing(bytes.fromhex("830d00 62ffff"))


@pytest.mark.parametrize("byte", [5, 77, 255])
def test_unknown_save_reason_byte_decodes_as_graceful_shutdown(byte: int) -> None:
    msg = wire.decode_control(cbor2.dumps([14, byte]))
    assert msg == wire.ShutdownWithSave(wire.SaveReason.GRACEFUL_SHUTDOWN)


def test_unknown_intent_kind_is_wire_error_listing_the_known_kinds() -> None:
    with pytest.raises(WireError) as err:
        wire.decode_timing(cbor2.dumps([4, 3, 7]))
    assert "Intent.kind" in str(err.value) and "EVAL_NOW" in str(err.value)
    assert "got 7" in str(err.value)


@pytest.mark.parametrize(
    ("host", "nonce", "words"),
    [
        ("", b"n" * 16, ["Hello.host", "1-255", "got 0 bytes"]),
        ("a" * 256, b"n" * 16, ["Hello.host", "got 256 bytes"]),
        ("é" * 128, b"n" * 16, ["Hello.host", "got 256 bytes"]),  # 128 chars, 256 UTF-8 bytes
        ("h", b"n" * 15, ["Hello.nonce", "bytes(16)", "got 15 bytes"]),
        ("h", b"n" * 17, ["Hello.nonce", "got 17 bytes"]),
    ],
    ids=["empty", "256-ascii", "256-utf8", "nonce-15", "nonce-17"],
)
def test_hello_host_and_nonce_limits_hold_on_construction_and_decode(
    host: str, nonce: bytes, words: list[str]
) -> None:
    with pytest.raises(WireError) as built:
        wire.Hello(host, 4, {}, (0,), nonce)
    with pytest.raises(WireError) as decoded:
        wire.decode_relay(cbor2.dumps([1, host, 4, {}, [0], nonce]))
    for word in words:
        assert word in str(built.value) and word in str(decoded.value)


def test_hello_host_of_255_utf8_bytes_is_accepted() -> None:
    host = "é" * 127 + "a"
    msg = wire.Hello(host, 4, {}, (0, 1), b"n" * 16)
    assert wire.decode_relay(wire.encode(msg)) == msg


@pytest.mark.parametrize("cls", [wire.Challenge, wire.HelloAck])
def test_challenge_and_ack_nonce_must_be_16_bytes(cls: type[Any]) -> None:
    with pytest.raises(WireError, match=rf"{cls.__name__}\.nonce.*got 8 bytes"):
        cls(b"n" * 8)
    with pytest.raises(WireError, match=rf"{cls.__name__}\.nonce"):
        wire.decode_relay(cbor2.dumps([0 if cls is wire.Challenge else 2, b"n" * 8]))


def test_construction_validates_field_types_like_the_decoder() -> None:
    with pytest.raises(WireError, match=r"DeclareDead.rank.*u64"):
        wire.DeclareDead(-1)
    with pytest.raises(WireError, match=r"DashboardRegister.port.*u16"):
        wire.DashboardRegister(0, 70000)
    with pytest.raises(WireError, match=r"EvalBroadcast.metric.*f64"):
        wire.EvalBroadcast(1, "high")


def test_encode_refuses_non_messages() -> None:
    with pytest.raises(WireError, match=r"encode.*dict"):
        wire.encode({"kind": "SyncNow"})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("obj", "label"),
    [
        (wire.SyncNow(), "SyncNow"),
        (wire.ShutdownWithSave(wire.SaveReason.REDUCE_STALL), "ShutdownWithSave"),
        (wire.Heartbeat(1, 2), "Heartbeat"),
        (wire.RankExit(3), "RankExit"),
        (wire.EpochPlan(0, 0, 0), "EpochPlan"),
        (None, "NoneType"),
        (42, "int"),
        (b"\x00", "bytes"),
        (object(), "object"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_control_label_returns_class_name_for_any_object(obj: object, label: str) -> None:
    assert wire.control_label(obj) == label
