"""Fuzzing every decoder with random and mutated input: the only exceptions that ever escape are
``WireError`` subclasses (``HandshakeError`` for the rank hello/ack), never ``struct.error``,
``KeyError``, ``IndexError``, ``TypeError`` or a cbor2 error.

A helper simply calls the decoder and catches the allowed error type; anything else propagates
and fails the example, and hypothesis shrinks it to a minimal input.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

import cbor2
from hypothesis import HealthCheck, given, settings, strategies as st

from flodl_trio import wire
from flodl_trio._errors import HandshakeError, WireError

SALT = wire.SessionSalt(bytes(range(16)))
KEY = b"K" * 32
# FLODL_FUZZ_EXAMPLES=20000 runs a long campaign; the default keeps this file at a few seconds.
FUZZ = settings(
    max_examples=int(os.environ.get("FLODL_FUZZ_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

PLAN = wire.EpochPlan(1, 2, 3)
GPU = wire.GpuSnapshot(0, "gpu0", 50.0, 1, 2)
SEED_MESSAGES: list[wire.WireMessage] = [
    wire.RequestParams(), wire.Update(3, PLAN), wire.Update(3, None), wire.SyncNow(),
    wire.StartEpoch(PLAN), wire.ExtendPartition(1, 2), wire.DeclareDead(2),
    wire.RequestNewNcclId(), wire.NewNcclSession(b"uid", 1, 2), wire.Throttle(),
    wire.SetGlobalStep(9), wire.Checkpoint(1, 0), wire.ExecuteEvalCallback(1, 2, 3),
    wire.SetEpochCallbackRole(0), wire.Shutdown(),
    wire.ShutdownWithSave(wire.SaveReason.SINGLE_SURVIVOR),
    wire.EpochAggregated(wire.EpochMetrics(
        1, {"loss": 0.5}, ({"loss": 0.4},), 0.5, 10.0, (1.0,), (1.0,), (2.0,), (3.0,), (0.0,),
        (0, 1),
    )),
    wire.EvalBroadcast(1, 0.9), wire.SaveConsensusModel(1), wire.CoordHeartbeat(),
    wire.StageAdvisory((1, 2), ((0, ((1, 2),)),)),
    wire.Batch(0, 1.0, 2.0, 3, None, 0.1, 0.2), wire.SyncAck(0, 1, 0.1, None, 2.0),
    wire.Exiting(0), wire.LrUpdate(0, 0.001), wire.Intent(0, wire.IntentKind.CHECKPOINT_NOW),
    wire.Heartbeat(0, 5), wire.SnapshotReady(0), wire.EvalResult(0, 1, 2, 0.5, 3.0, "oops"),
    wire.CheckpointResult(0, 1, 2.0, None), wire.NewNcclIdGenerated(0, b"id"),
    wire.EpochFnElapsed(0, 1, 2.0), wire.DashboardRegister(0, 8080),
    wire.DashboardSetSvg(0, "<svg/>", "l", None), wire.DashboardSetMetadata(0, "{}"),
    wire.DashboardSetHardware(0, "cpu"),
    wire.Metrics(0, 1, 0.5, 2, 3.0, 4, 1.0, 1.0, 1.0, {"x": (1.0, 2)},
                 wire.ResourceSample(1.0, 2, 3, None, 4, 5, 0, (GPU,))),
    wire.Challenge(b"c" * 16), wire.Hello("host-a", 4, {}, (0, 1, 2), b"r" * 16),
    wire.HelloAck(b"r" * 16), wire.RankExit(2), wire.Cadence(5.0),
]  # fmt: skip
SEED_PAYLOADS = [wire.encode(m) for m in SEED_MESSAGES]
PAYLOAD_DECODERS: list[Callable[[bytes], Any]] = [
    wire.decode_control, wire.decode_timing, wire.decode_metrics, wire.decode_relay,
    wire.decode_fanout,
]  # fmt: skip
FRAMEABLE = [m for m in SEED_MESSAGES if not isinstance(m, wire.RelayControlMsg)]


def only(error: type[Exception], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Call ``fn``; ``error`` is allowed, anything else fails the example."""
    try:
        fn(*args, **kwargs)
    except error:
        pass


# ---------------------------------------------------------------- input strategies


@st.composite
def mutated(draw: st.DrawFn, seeds: st.SearchStrategy[bytes]) -> bytes:
    """A valid input with a few byte-level mutations (flip, insert, delete, truncate, splice)."""
    data = bytearray(draw(seeds))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "dup"]))
        pos = draw(st.integers(0, len(data)))
        if op in ("flip", "set") and data:
            i = pos % len(data)
            data[i] = (
                data[i] ^ (1 << draw(st.integers(0, 7)))
                if op == "flip"
                else draw(
                    st.sampled_from(
                        [0x00, 0xFF, 0x7F, 0x80, 0x9F, 0xBF, 0x5F, 0x7F, 0xC2, 0xD9, 0xF7]
                    )
                )
            )
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=9))
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[pos:]
        else:
            data += data[pos : pos + draw(st.integers(1, 30))]
    return bytes(data)


CBOR_LEAVES = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8) | st.just(cbor2.undefined)
    | st.builds(cbor2.CBORTag, st.sampled_from([0, 1, 2, 3, 28, 29, 55799, 258]), st.integers())
)  # fmt: skip
CBOR_VALUES = st.recursive(
    CBOR_LEAVES,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.text(max_size=4) | st.integers(0, 9), inner, max_size=3)
    ),
    max_leaves=25,
)


def _replace_leaf(value: Any, path: list[int], new: Any) -> Any:
    """``value`` with the element reached by following ``path`` (indices modulo) replaced."""
    if not path or not isinstance(value, list) or not value:
        return new
    i = path[0] % len(value)
    return [*value[:i], _replace_leaf(value[i], path[1:], new), *value[i + 1 :]]


@st.composite
def structurally_mutated(draw: st.DrawFn) -> bytes:
    """A valid message's CBOR with one element (at any depth) replaced by a random value."""
    value = cbor2.loads(draw(st.sampled_from(SEED_PAYLOADS)))
    path = draw(st.lists(st.integers(0, 20), min_size=1, max_size=5))
    return cbor2.dumps(_replace_leaf(value, path, draw(CBOR_VALUES)))


PAYLOADS = (
    st.binary(max_size=64)
    | mutated(st.sampled_from(SEED_PAYLOADS))
    | CBOR_VALUES.map(cbor2.dumps)
    | structurally_mutated()
)


# ---------------------------------------------------------------- payload decoders


@FUZZ
@given(payload=PAYLOADS)
def test_payload_decoders_only_raise_wire_error(payload: bytes) -> None:
    for decode in PAYLOAD_DECODERS:
        only(WireError, decode, payload)


@FUZZ
@given(payload=structurally_mutated())
def test_decoded_messages_re_encode_to_an_equivalent_message(payload: bytes) -> None:
    # Whatever the strict decoder accepts is a valid message: it re-encodes and decodes equal.
    for decode in PAYLOAD_DECODERS[:4]:
        try:
            msg = decode(payload)
        except WireError:
            continue
        again = decode(wire.encode(msg))
        assert wire.encode(again) == wire.encode(msg)


# ---------------------------------------------------------------- frames


FRAMES = st.sampled_from(FRAMEABLE).map(lambda m: wire.encode_frame(SALT, m))


@st.composite
def authentic_frames_with_bad_payloads(draw: st.DrawFn) -> bytes:
    """A correctly MACed frame whose payload is mutated, so the payload decoder is reached."""
    kind = draw(st.sampled_from([1, 2, 3]))
    payload = draw(PAYLOADS)
    return wire.FrameCodec(SALT).seal(kind, payload)


FRAME_INPUTS = st.binary(max_size=80) | mutated(FRAMES) | authentic_frames_with_bad_payloads()


@FUZZ
@given(data=FRAME_INPUTS)
def test_decode_frame_and_frame_message_only_raise_wire_error(data: bytes) -> None:
    try:
        frame = wire.decode_frame(SALT, data)
    except WireError:
        return
    only(WireError, wire.frame_message, frame)


@FUZZ
@given(
    pieces=st.lists(FRAME_INPUTS, min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 400), max_size=6),
)
def test_frame_decoder_feed_only_raises_wire_error(pieces: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(pieces)
    dec = wire.FrameDecoder(SALT, max_payload=4096)
    edges = [0, *sorted(c % (len(stream) + 1) for c in cuts), len(stream)]
    try:
        for a, b in itertools.pairwise(edges):
            for frame in dec.feed(stream[a:b]):
                only(WireError, wire.frame_message, frame)
    except WireError:
        return
    assert isinstance(dec.eof_error("peer"), WireError | None)


@FUZZ
@given(data=st.binary(max_size=60) | mutated(FRAMES.map(wire.len_frame)))
def test_len_frame_decoder_feed_only_raises_wire_error(data: bytes) -> None:
    dec = wire.LenFrameDecoder(max_len=64)
    only(WireError, dec.feed, data)
    only(WireError, dec.feed, data)


# ---------------------------------------------------------------- records


def _record_stream(items: list[tuple[int, bytes]]) -> bytes:
    sealer = wire.RecordSealer(KEY, wire.RELAY_TO_COORD)
    kinds = [wire.RecordKind.DATA, wire.RecordKind.CONTROL, wire.RecordKind.FANOUT]
    return b"".join(
        sealer.seal(kinds[i % 3], rank if i % 3 == 0 else 0, payload)
        for i, (rank, payload) in enumerate(items)
    )


RECORD_STREAMS = st.lists(
    st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=30)), min_size=1, max_size=4
).map(_record_stream)


@FUZZ
@given(
    data=st.binary(max_size=80) | mutated(RECORD_STREAMS),
    cuts=st.lists(st.integers(0, 400), max_size=6),
)
def test_record_opener_feed_only_raises_wire_error(data: bytes, cuts: list[int]) -> None:
    opener = wire.RecordOpener(KEY, wire.RELAY_TO_COORD, max_payload=4096)
    edges = [0, *sorted(c % (len(data) + 1) for c in cuts), len(data)]
    try:
        for a, b in itertools.pairwise(edges):
            for record in opener.feed(data[a:b]):
                if record.kind == wire.RecordKind.CONTROL:
                    only(WireError, wire.decode_relay, record.payload)
                elif record.kind == wire.RecordKind.FANOUT:
                    only(WireError, wire.decode_fanout, record.payload)
    except WireError:
        return


@FUZZ
@given(
    ranks=st.lists(st.integers(-5, 2**33), max_size=5) | st.lists(st.integers(0, 99), max_size=5),
    frame=st.binary(max_size=10),
)
def test_decode_fanout_only_raises_wire_error_on_hand_built_pairs(
    ranks: list[int], frame: bytes
) -> None:
    only(WireError, wire.decode_fanout, cbor2.dumps([ranks, frame]))


# ---------------------------------------------------------------- rank handshake


HELLOS = st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)).map(
    lambda rw: wire.encode_rank_hello(SALT, *rw)
)


@FUZZ
@given(data=st.binary(max_size=40) | mutated(HELLOS), world=st.integers(0, 2**32 - 1))
def test_decode_rank_hello_only_raises_handshake_error(data: bytes, world: int) -> None:
    only(HandshakeError, wire.decode_rank_hello, SALT, data, world_size=world)


@FUZZ
@given(data=st.binary(max_size=30) | mutated(st.just(wire.encode_rank_ack(SALT))))
def test_verify_rank_ack_only_raises_handshake_error(data: bytes) -> None:
    only(HandshakeError, wire.verify_rank_ack, SALT, data)


def test_seed_corpus_is_valid() -> None:
    # The mutations above start from valid inputs; make sure they really are.
    for msg, payload in zip(SEED_MESSAGES, SEED_PAYLOADS, strict=True):
        if isinstance(msg, wire.ControlMsg):
            assert wire.decode_control(payload) == msg
        elif isinstance(msg, wire.TimingMsg):
            assert wire.decode_timing(payload) == msg
        elif isinstance(msg, wire.RelayControlMsg):
            assert wire.decode_relay(payload) == msg
        else:
            assert wire.decode_metrics(payload) == msg
    assert len({type(m) for m in SEED_MESSAGES}) == 20 + 15 + 1 + 5
