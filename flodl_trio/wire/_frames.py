"""Rank hello/ack, ControlFrame and length framing (SPEC §2.3, §2.4). Sans-IO."""

from __future__ import annotations

import hmac
import struct
from collections.abc import Callable
from functools import partial
from hmac import compare_digest
from typing import Any, NamedTuple

from .._errors import AuthError, FrameTooLarge, HandshakeError, WireError
from ._constants import (
    CONTROL_FRAME_MAGIC,
    FRAME_HEADER_LEN,
    LEN_PREFIX_LEN,
    MAX_CONTROL_PAYLOAD,
    PROTOCOL_VERSION,
    RANK_ACK_LEN,
    RANK_ACK_MAGIC,
    RANK_HELLO_LEN,
    RANK_HELLO_MAGIC,
    MsgKind,
)
from ._crypto import SessionSalt, mac64, shared_mac
from ._messages import (
    ControlMsg,
    Metrics,
    TimingMsg,
    decode_control,
    decode_metrics,
    decode_timing,
    encode,
)
from ._schema import WireMessage

_HELLO = struct.Struct("<IIII")
_ACK = struct.Struct("<II")
_FRAME_HEAD = struct.Struct("<II8sII")
_KIND_LEN = struct.Struct("<II")
_U32 = struct.Struct("<I")
_KNOWN_KINDS = frozenset(int(k) for k in MsgKind)


def _hex(value: int) -> str:
    return f"0x{value:08X}"


# ---------------------------------------------------------------- rank ↔ relay handshake


def encode_rank_hello(salt: SessionSalt, rank: int, world_size: int) -> bytes:
    """The 24-byte hello a rank sends its relay."""
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 32:
            raise HandshakeError(f"rank hello: {name} must be a u32, got {value!r}")
    head = _HELLO.pack(RANK_HELLO_MAGIC, PROTOCOL_VERSION, rank, world_size)
    return head + mac64(bytes(salt), head)


def decode_rank_hello(salt: SessionSalt, data: bytes, *, world_size: int) -> int:
    """Validate a rank hello and return the rank.

    Checks, in order: length, magic, version, world_size equals ours, MAC.

    Raises:
        HandshakeError: the first check that failed, with the expected and the arrived value.
    """
    data = bytes(data)
    if len(data) != RANK_HELLO_LEN:
        raise HandshakeError(
            f"rank hello: expected {RANK_HELLO_LEN} bytes, got {len(data)}"
        )
    magic, version, rank, ws = _HELLO.unpack_from(data)
    if magic != RANK_HELLO_MAGIC:
        raise HandshakeError(
            f"rank hello: bad handshake magic: expected {_hex(RANK_HELLO_MAGIC)}, got {_hex(magic)}"
        )
    if version != PROTOCOL_VERSION:
        raise HandshakeError(
            f"rank hello: handshake version mismatch: expected {_hex(PROTOCOL_VERSION)}, "
            f"got {_hex(version)}"
        )
    if ws != world_size:
        raise HandshakeError(
            f"rank hello from rank {rank}: world_size {ws} != expected {world_size}"
        )
    if not hmac.compare_digest(mac64(bytes(salt), data[:16]), data[16:]):
        raise HandshakeError(
            f"rank hello from rank {rank}: HMAC verification failed (wrong session salt?)"
        )
    return int(rank)


def encode_rank_ack(salt: SessionSalt) -> bytes:
    """The 16-byte ack a relay answers a valid hello with."""
    head = _ACK.pack(RANK_ACK_MAGIC, PROTOCOL_VERSION)
    return head + mac64(bytes(salt), head)


def verify_rank_ack(salt: SessionSalt, data: bytes) -> None:
    """Validate a relay's ack (length, magic, version, MAC).

    Raises:
        HandshakeError: naming the first check that failed.
    """
    data = bytes(data)
    if len(data) != RANK_ACK_LEN:
        raise HandshakeError(f"rank ack: expected {RANK_ACK_LEN} bytes, got {len(data)}")
    magic, version = _ACK.unpack_from(data)
    if magic != RANK_ACK_MAGIC:
        raise HandshakeError(
            f"rank ack: bad handshake magic: expected {_hex(RANK_ACK_MAGIC)}, got {_hex(magic)}"
        )
    if version != PROTOCOL_VERSION:
        raise HandshakeError(
            f"rank ack: handshake version mismatch: expected {_hex(PROTOCOL_VERSION)}, "
            f"got {_hex(version)}"
        )
    if not hmac.compare_digest(mac64(bytes(salt), data[:8]), data[8:]):
        raise HandshakeError("rank ack: HMAC verification failed (wrong session salt?)")


# ---------------------------------------------------------------- ControlFrame


class Frame(NamedTuple):
    """One verified ControlFrame: its kind and its (still encoded) CBOR payload."""

    kind: int
    payload: bytes


# NamedTuple's generated __new__ is a Python function; a frame is built on every frame opened.
_new_frame: Callable[[tuple[int, bytes]], Frame] = partial(tuple.__new__, Frame)


def kind_of(msg: WireMessage) -> MsgKind:
    if isinstance(msg, ControlMsg):
        return MsgKind.CONTROL
    if isinstance(msg, TimingMsg):
        return MsgKind.TIMING
    if isinstance(msg, Metrics):
        return MsgKind.METRICS
    raise WireError(
        f"encode_frame: expected a ControlMsg, TimingMsg or Metrics, got {type(msg).__name__}"
    )


class FrameCodec:
    """ControlFrame sealing and opening with one salt, keyed once."""

    __slots__ = ("_kinds", "_mac", "max_payload")

    def __init__(self, salt: SessionSalt | bytes, *, max_payload: int = MAX_CONTROL_PAYLOAD):
        self._mac = shared_mac(salt)
        self.max_payload = max_payload
        self._kinds: dict[type[WireMessage], int] = {}  # message class -> its MsgKind

    def seal(self, kind: int, payload: bytes) -> bytes:
        n = len(payload)
        if n > self.max_payload:
            raise FrameTooLarge(
                f"ControlFrame: payload of {n} bytes is over the ceiling of {self.max_payload}"
            )
        tag = self._mac.tag2(_KIND_LEN.pack(kind, n), payload)
        return _FRAME_HEAD.pack(CONTROL_FRAME_MAGIC, PROTOCOL_VERSION, tag, kind, n) + payload

    def encode(self, msg: WireMessage) -> bytes:
        kind = self._kinds.get(type(msg))
        if kind is None:
            kind = self._kinds[type(msg)] = int(kind_of(msg))
        return self.seal(kind, encode(msg))

    def check_header(self, head: bytes | bytearray) -> tuple[bytes, int, int]:
        """Validate a 24-byte header (magic, version, kind, length); return (tag, kind, len)."""
        magic, version, tag, kind, length = _FRAME_HEAD.unpack_from(head)
        if magic != CONTROL_FRAME_MAGIC:
            raise WireError(
                f"ControlFrame: bad magic: expected {_hex(CONTROL_FRAME_MAGIC)}, got {_hex(magic)}"
            )
        if version != PROTOCOL_VERSION:
            raise WireError(
                f"ControlFrame: protocol version mismatch: expected {_hex(PROTOCOL_VERSION)}, "
                f"got {_hex(version)}"
            )
        if kind not in _KNOWN_KINDS:
            raise WireError(f"ControlFrame: unknown kind {kind} (known 1-7)")
        if length > self.max_payload:
            raise FrameTooLarge(
                f"ControlFrame: declared payload of {length} bytes is over the ceiling of "
                f"{self.max_payload}"
            )
        return tag, kind, length

    def open(self, data: bytes | bytearray) -> Frame:
        """Exactly one whole frame."""
        if len(data) < FRAME_HEADER_LEN:
            raise WireError(
                f"ControlFrame: expected at least {FRAME_HEADER_LEN} header bytes, got {len(data)}"
            )
        tag, kind, length = self.check_header(data)
        if len(data) != FRAME_HEADER_LEN + length:
            raise WireError(
                f"ControlFrame: header declares {length} payload bytes, got "
                f"{len(data) - FRAME_HEADER_LEN}"
            )
        payload = bytes(data[FRAME_HEADER_LEN:])
        if not compare_digest(self._mac.tag2(data[16:24], payload), tag):
            raise AuthError(
                f"ControlFrame (kind {kind}): HMAC verification failed (wrong session salt or "
                "tampered frame)"
            )
        return _new_frame((kind, payload))


def encode_frame(salt: SessionSalt, msg: WireMessage) -> bytes:
    """Encode ``msg`` as a ControlFrame; the kind is chosen from the message type."""
    return FrameCodec(salt).encode(msg)


def decode_frame(salt: SessionSalt, data: bytes) -> Frame:
    """Verify exactly one whole ControlFrame (magic, version, kind, length, MAC)."""
    return FrameCodec(salt).open(data)


_DECODERS: dict[int, Callable[[bytes], WireMessage]] = {
    MsgKind.CONTROL: decode_control,
    MsgKind.TIMING: decode_timing,
    MsgKind.METRICS: decode_metrics,
}


def frame_message(frame: Frame) -> WireMessage | None:
    """Decode a frame's payload by its kind; ``None`` for the reserved kinds 4-7."""
    decode = _DECODERS.get(frame.kind)
    return None if decode is None else decode(frame.payload)


def frames_before(exc: BaseException) -> list[Any]:
    """The whole frames (or blobs, or records) a decoder's ``feed`` decoded before it raised.

    A chunk can hold good frames followed by a bad one. ``feed`` raises at the bad one, and the
    frames before it travel with the error, in order, so the caller can act on them before it ends
    the connection. They come with the first raise only: a poisoned decoder raises the same error
    again with none (``[]``), since that later call decoded nothing.
    """
    frames: list[Any] = getattr(exc, "frames_before", [])
    return frames


class _Poisonable:
    """A decoder that raised stays broken: a stream that lost sync never resynchronises."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._error: WireError | None = None

    @property
    def at_boundary(self) -> bool:
        """True when no partial frame is buffered (EOF here is a clean end)."""
        return not self._buf

    def _poison(self, exc: WireError, frames: list[Any]) -> WireError:
        self._error = exc.carrying(frames)
        self._buf.clear()
        return exc

    def _check_poison(self) -> None:
        if self._error is not None:
            raise self._error.carrying([])

    def eof_error(self, who: str) -> WireError | None:
        """The error for an EOF now, or None when EOF is clean."""
        if self._buf:
            return WireError(f"{who}: peer closed mid-frame ({len(self._buf)} bytes buffered)")
        return None


class FrameDecoder(_Poisonable):
    """Incremental ControlFrame decoder: ``feed(bytes) -> list[Frame]``."""

    def __init__(self, salt: SessionSalt | bytes, *, max_payload: int = MAX_CONTROL_PAYLOAD):
        super().__init__()
        self._codec = FrameCodec(salt, max_payload=max_payload)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Buffer ``data`` and return every frame it completes.

        Raises:
            WireError: at the first invalid frame (``AuthError``, ``FrameTooLarge`` included);
                the frames of this call before it are in :func:`frames_before`. From then on the
                decoder is poisoned: every later ``feed`` raises the same error.
        """
        self._check_poison()
        buf = self._buf
        buf += data
        out: list[Frame] = []
        try:
            while len(buf) >= FRAME_HEADER_LEN:
                # The header is checked before any payload is buffered beyond it.
                _, _, length = self._codec.check_header(buf)
                total = FRAME_HEADER_LEN + length
                if len(buf) < total:
                    break
                out.append(self._codec.open(bytes(buf[:total])))
                del buf[:total]
        except WireError as exc:
            raise self._poison(exc, out) from None
        return out


def len_frame(blob: bytes) -> bytes:
    """``u32 length ‖ blob``."""
    return _U32.pack(len(blob)) + blob


class LenFrameDecoder(_Poisonable):
    """Incremental decoder of ``u32 length ‖ blob`` frames: ``feed(bytes) -> list[bytes]``."""

    def __init__(self, *, max_len: int) -> None:
        super().__init__()
        self.max_len = max_len

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """Buffer ``data`` and return every blob it completes.

        Raises:
            FrameTooLarge: a declared length over ``max_len``; the blobs of this call before it
                are in :func:`frames_before`. From then on every ``feed`` raises the same error.
        """
        self._check_poison()
        buf = self._buf
        buf += data
        out: list[bytes] = []
        while len(buf) >= LEN_PREFIX_LEN:
            (length,) = _U32.unpack_from(buf)
            if length > self.max_len:
                raise self._poison(
                    FrameTooLarge(
                        f"length frame: declared {length} bytes is over the ceiling of "
                        f"{self.max_len}"
                    ),
                    out,
                )
            total = LEN_PREFIX_LEN + length
            if len(buf) < total:
                break
            out.append(bytes(buf[LEN_PREFIX_LEN:total]))
            del buf[:total]
        return out
