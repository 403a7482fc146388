"""MuxRecords of the relay ↔ coordinator leg, sealed against replay and reordering (SPEC §2.5).

Each direction of a connection has its own sequence counter; the tag of a record covers the
direction byte, the sequence number, the header and the payload, so a record that is replayed,
reordered, dropped, reflected or moved to another connection fails to verify.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from functools import partial
from hmac import compare_digest
from typing import Any, NamedTuple

from .._errors import AuthError, FrameTooLarge, WireError
from ._cbor import cbor_dumps, cbor_loads
from ._constants import (
    COORD_TO_RELAY,
    MAX_RECORD_PAYLOAD,
    PROTOCOL_VERSION,
    RECORD_HEADER_LEN,
    RECORD_MAGIC,
    RELAY_TO_COORD,
    RecordKind,
)
from ._crypto import Mac64, mac_of
from ._specs import describe

_HEAD = struct.Struct("<IIBII")  # 17 bytes: magic, version, kind, rank, payload_len
_SEQ = struct.Struct("<BQ")  # direction byte, sequence number
_KINDS = {int(RecordKind.DATA), int(RecordKind.CONTROL), int(RecordKind.FANOUT)}
_DIRECTIONS = {RELAY_TO_COORD: "relay→coordinator", COORD_TO_RELAY: "coordinator→relay"}
_U32_LIMIT = 1 << 32
_DATA = int(RecordKind.DATA)
_KIND_TYPES = (int, RecordKind)  # exactly these: True == 1 would otherwise pass as DATA


class Record(NamedTuple):
    """One verified record."""

    kind: int
    rank: int
    payload: bytes


# NamedTuple's generated __new__ is a Python function; a record is built per record opened.
_new_record: Any = partial(tuple.__new__, Record)


def _check_direction(direction: int) -> int:
    if direction not in _DIRECTIONS:
        raise WireError(
            f"record direction: expected RELAY_TO_COORD (1) or COORD_TO_RELAY (2), got "
            f"{direction!r}"
        )
    return direction


class _RecordKeys:
    """What both ends of one direction hold: its key, the direction, the payload ceiling and the
    sequence number of the next record."""

    __slots__ = ("_mac", "direction", "max_payload", "seq")

    def __init__(
        self, key: bytes, direction: int, *, max_payload: int = MAX_RECORD_PAYLOAD
    ) -> None:
        self._mac = mac_of(bytes(key))
        self.direction = _check_direction(direction)
        self.max_payload = max_payload
        self.seq = 0

    def rekey(self, key: bytes | Mac64, *, max_payload: int | None = None) -> None:
        """Switch keys for the next record (and, given ``max_payload``, the payload ceiling:
        the handshake's is lower); the sequence number keeps counting. ``key`` may be the
        other direction's :attr:`mac` (both directions use one key from the Hello on: its MAC
        state is then keyed once)."""
        self._mac = key if isinstance(key, Mac64) else mac_of(bytes(key))
        if max_payload is not None:
            self.max_payload = max_payload

    @property
    def mac(self) -> Mac64:
        """The MAC state of the current key (never changed once keyed: it can be shared)."""
        return self._mac


class RecordSealer(_RecordKeys):
    """Seals the records one side sends: ``seal(kind, rank, payload) -> bytes``."""

    __slots__ = ()

    def seal(self, kind: int, rank: int, payload: bytes | bytearray | memoryview) -> bytes:
        """One sealed record: header, tag, payload; the sequence number advances by one.

        Raises:
            WireError: ``kind`` is not DATA, CONTROL or FANOUT, ``rank`` is not a u32, or
                ``payload`` is not bytes-like (``FrameTooLarge``: over ``max_payload``).
        """
        if (type(kind) not in _KIND_TYPES or kind not in _KINDS or type(rank) is not int
                or not 0 <= rank < _U32_LIMIT or type(payload) is not bytes):  # fmt: skip
            kind, rank, payload = _checked_seal_args(kind, rank, payload)
        n = len(payload)
        if n > self.max_payload:
            raise FrameTooLarge(
                f"record: payload of {n} bytes is over the ceiling of {self.max_payload}"
            )
        head = _HEAD.pack(RECORD_MAGIC, PROTOCOL_VERSION, kind, rank, n)
        tag = self._mac.tag(_SEQ.pack(self.direction, self.seq), head, payload)
        self.seq += 1
        return head + tag + payload


def _checked_seal_args(kind: Any, rank: Any, payload: Any) -> tuple[int, int, bytes]:
    """The slow path of ``seal``: accept what is valid but unusual, name what is not."""
    if isinstance(kind, bool) or not isinstance(kind, int) or kind not in _KINDS:
        raise WireError(
            f"record: kind must be RecordKind.DATA (1), CONTROL (2) or FANOUT (5), got {kind!r}"
        )
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < _U32_LIMIT:
        raise WireError(f"record: rank must be a u32 (0 to 2**32-1), got {rank!r}")
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise WireError(
            f"record: payload must be bytes, bytearray or memoryview, got "
            f"{type(payload).__name__}"
        )
    return int(kind), int(rank), bytes(payload)


class RecordOpener(_RecordKeys):
    """Incremental opener of the records one side receives.

    ``feed(data)`` buffers and returns every complete record. When the key changes between two
    records (the relay after ``HelloAck``), use ``push(data)`` and ``next_record()`` to take them
    one at a time and ``rekey`` in between.
    """

    def __init__(
        self, key: bytes, direction: int, *, max_payload: int = MAX_RECORD_PAYLOAD
    ) -> None:
        super().__init__(key, direction, max_payload=max_payload)
        self._buf = bytearray()
        self._pos = 0
        self._error: WireError | None = None

    @property
    def at_boundary(self) -> bool:
        """True when no partial record is buffered (EOF here is a clean end)."""
        return self._pos >= len(self._buf)

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._pos

    def eof_error(self, who: str) -> WireError | None:
        """The error for an EOF now, or None when EOF is clean."""
        if not self.at_boundary:
            return WireError(f"{who}: peer closed mid-frame ({self.buffered} bytes buffered)")
        return None

    def push(self, data: bytes | bytearray | memoryview) -> None:
        """Buffer bytes without opening anything.

        Raises:
            WireError: the opener is poisoned (an earlier record failed); the same error again.
        """
        if self._error is not None:
            raise self._error.carrying([])
        if self._pos and self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        self._buf += data

    def feed(self, data: bytes | bytearray | memoryview) -> list[Record]:
        """Buffer ``data`` and open every record it completes.

        Raises:
            WireError: at the first record that fails (``AuthError``: its tag does not verify;
                ``FrameTooLarge``: its declared length); the records this call opened before it
                are in :func:`~flodl_trio.wire.frames_before`. From then on the opener is
                poisoned: every later call raises the same error.
        """
        if self._error is not None:
            raise self._error.carrying([])
        if self._pos < len(self._buf):
            # A partial record is waiting: complete it in the buffer.
            self._buf += data
            buf: bytes | bytearray = self._buf
            pos = self._pos
        else:
            # Nothing buffered (the common case): open the records straight from ``data`` and
            # buffer only an incomplete tail, instead of copying every chunk into the buffer.
            buf = data if type(data) is bytes else bytes(data)
            pos = 0
        out: list[Record] = []
        size = len(buf)
        try:
            # (pos < size: a read that ends on a record's end, the usual one, costs no call)
            while pos < size and (rec := self._open(buf, pos)) is not None:
                out.append(rec)
                pos += RECORD_HEADER_LEN + len(rec.payload)
        except WireError as exc:
            raise self._poison(exc, out) from None
        if buf is self._buf:
            self._pos = pos
            self._compact()
        elif pos < len(buf):
            self._buf = bytearray(buf[pos:])  # the incomplete tail waits for the next chunk
            self._pos = 0
        elif self._buf:
            self._buf.clear()  # consumed bytes of an earlier next_record()
            self._pos = 0
        return out

    def next_record(self) -> Record | None:
        """Open the next complete buffered record, or None if none is complete yet.

        Raises:
            WireError: as :meth:`feed`; the opener is poisoned from then on.
        """
        if self._error is not None:
            raise self._error.carrying([])
        try:
            rec = self._open(self._buf, self._pos)
        except WireError as exc:
            raise self._poison(exc, []) from None
        if rec is None:
            self._compact()
            return None
        self._pos += RECORD_HEADER_LEN + len(rec.payload)
        return rec

    def _open(self, buf: bytes | bytearray, pos: int) -> Record | None:
        """Verify the record at ``buf[pos:]`` and count it; None if it is not complete yet."""
        if len(buf) - pos < RECORD_HEADER_LEN:
            return None
        magic, version, kind, rank, length = _HEAD.unpack_from(buf, pos)
        if magic != RECORD_MAGIC:
            raise WireError(
                f"record: bad magic: expected 0x{RECORD_MAGIC:08X}, got 0x{magic:08X}"
            )
        if version != PROTOCOL_VERSION:
            raise WireError(
                f"record: protocol version mismatch: expected 0x{PROTOCOL_VERSION:08X}, "
                f"got 0x{version:08X}"
            )
        if kind not in _KINDS:
            raise WireError(
                f"record: unknown or reserved kind {kind} (expected DATA 1, CONTROL 2 or "
                "FANOUT 5)"
            )
        # The declared length is checked before a byte of the payload is waited for.
        if length > self.max_payload:
            raise FrameTooLarge(
                f"record: declared payload of {length} bytes is over the ceiling of "
                f"{self.max_payload}"
            )
        end = pos + RECORD_HEADER_LEN + length
        if len(buf) < end:
            return None
        head = buf[pos : pos + 17]
        tag = buf[pos + 17 : pos + RECORD_HEADER_LEN]
        payload = bytes(buf[pos + RECORD_HEADER_LEN : end])
        seq = _SEQ.pack(self.direction, self.seq)
        if not compare_digest(self._mac.tag(seq, head, payload), tag):
            raise AuthError(
                f"record #{self.seq} ({_DIRECTIONS[self.direction]}, kind {kind}, rank "
                f"{rank}): tag does not verify (wrong session salt, replayed, reordered, "
                "dropped or tampered record)"
            )
        if kind != _DATA and rank != 0:
            raise WireError(f"record #{self.seq}: kind {kind} must carry rank 0, got {rank}")
        self.seq += 1
        rec: Record = _new_record((kind, rank, payload))
        return rec

    def _poison(self, exc: WireError, before: list[Record]) -> WireError:
        self._error = exc.carrying(before)
        self._buf = bytearray()
        self._pos = 0
        return exc

    def _compact(self) -> None:
        # Drop consumed bytes lazily so a burst of small records costs O(n), not O(n^2).
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0


def encode_fanout(ranks: Iterable[int], frame: bytes | bytearray | memoryview) -> bytes:
    """FANOUT payload: CBOR ``[ranks ascending, frame]`` (duplicates dropped).

    Raises:
        WireError: a rank that is not a u32, ``ranks`` not iterable, or ``frame`` not bytes-like.
    """
    if type(frame) is bytes and isinstance(ranks, list | tuple) and ranks:
        # The broadcast hot path (one payload per relay per broadcast): ranks that are already
        # strictly ascending u32s are written straight into the CBOR cbor2 would produce
        # (tests/wire/test_fast_paths.py checks the bytes are the same), about 3x cheaper.
        prev = -1
        for r in ranks:
            if type(r) is not int or r <= prev:
                break
            prev = r
        else:
            if prev < _U32_LIMIT:
                return b"".join([b"\x82", _cbor_head(0x80, len(ranks)),
                                 *[_cbor_head(0, r) for r in ranks],
                                 _cbor_head(0x40, len(frame)), frame])
    try:
        listed = list(ranks)
    except TypeError:
        raise WireError(
            f"FANOUT: ranks must be an iterable of u32, got {type(ranks).__name__}"
        ) from None
    # Checked before sorting: sorted() of mixed types raises TypeError, not our error.
    for r in listed:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < _U32_LIMIT:
            raise WireError(f"FANOUT: ranks must be u32, got {r!r}")
    if not isinstance(frame, bytes | bytearray | memoryview):
        raise WireError(f"FANOUT: frame must be bytes, got {type(frame).__name__}")
    return cbor_dumps([sorted({int(r) for r in listed}), bytes(frame)])


def _cbor_head(major: int, n: int) -> bytes:
    """A CBOR item head with its argument ``n`` in the fewest bytes (as cbor2 writes it)."""
    if n < 24:
        return bytes((major | n,))
    if n < 0x100:
        return bytes((major | 24, n))
    if n < 0x10000:
        return bytes((major | 25,)) + n.to_bytes(2, "big")
    if n < 0x100000000:
        return bytes((major | 26,)) + n.to_bytes(4, "big")
    return bytes((major | 27,)) + n.to_bytes(8, "big")


def decode_fanout(payload: bytes) -> tuple[tuple[int, ...], bytes]:
    """Strictly decode a FANOUT payload into (ranks, frame)."""
    value = cbor_loads(payload, "FANOUT")
    if type(value) is not list or len(value) != 2:
        raise WireError(f"FANOUT: expected [ranks, frame], got {describe(value)}")
    ranks, frame = value
    if type(ranks) is not list:
        raise WireError(f"FANOUT.ranks: expected list[u32], got {describe(ranks)}")
    prev = -1
    for i, r in enumerate(ranks):
        if type(r) is not int or not 0 <= r < 1 << 32:
            raise WireError(f"FANOUT.ranks[{i}]: expected u32, got {describe(r)}")
        if r <= prev:
            raise WireError(f"FANOUT.ranks: expected strictly ascending ranks, got {ranks[:8]}")
        prev = r
    if type(frame) is not bytes:
        raise WireError(f"FANOUT.frame: expected bytes, got {describe(frame)}")
    return tuple(ranks), frame
