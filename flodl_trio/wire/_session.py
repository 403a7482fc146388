"""The protocol after the join, sans-IO: one session object per leg and side (SPEC §4.3, §5, §6).

As h11 does for HTTP: the IO loop reads, hands the bytes to ``receive_data`` (``b""`` for the
end of the stream), then takes ``next_event()`` until it returns :data:`NEED_DATA`, and acts on
each event; what it writes comes from ``send``. Every direction rule and every "unknown rank /
wrong direction / foreign rank" decision is made here, never in the loop.

An event is either a message the leg carries (typed: ``TimingMsg``, ``Metrics``, ``RankExit``,
``RankDropped``, ``Goodbye``, ``FenceRank``, a ``ControlMsg``), a :class:`Deliver` /
:class:`RankFrame` (frames the relay forwards without opening them), an :class:`Invalid` (a
frame dropped: counted by the loop, the connection goes on) or the one :class:`EndOfStream`
(returned again by every later call). ``close_reason`` is the one reason the connection ended:
the first of the peer's end (EOF, a protocol error) and what the loop reports with ``close``
(a reset, a write stall, a close on purpose).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from .._errors import AuthError, WireError
from ._constants import FRAME_HEADER_LEN, MsgKind, RecordKind
from ._frames import FrameCodec, frames_before, len_frame
from ._handshake import NEED_DATA
from ._messages import (
    Cadence,
    Draining,
    FenceRank,
    Goodbye,
    Liveness,
    Metrics,
    RankDropped,
    RankExit,
    TimingMsg,
    decode_metrics,
    decode_relay,
    decode_timing,
    encode,
)
from ._msg_relay import cadence_problem
from ._records import Record, RecordOpener, RecordSealer, decode_fanout, encode_fanout
from ._schema import WireMessage

# One read takes what the peer sent since the last one, up to this many bytes; every event in
# it is acted on before the next read. The one read size of every connection after the join.
READ_SIZE = 65536

_DATA = int(RecordKind.DATA)
_CONTROL = int(RecordKind.CONTROL)
_FANOUT = int(RecordKind.FANOUT)
_TIMING = int(MsgKind.TIMING)
_METRICS = int(MsgKind.METRICS)
_RESERVED = (int(MsgKind.RESERVED_4), int(MsgKind.RESERVED_5))
_CONTROL_FRAME = int(MsgKind.CONTROL)
_FRAME_KIND = struct.Struct("<I")  # a frame header's kind field, at offset 16 (SPEC §2.3)


_CONTROL_FRAME_KIND = _FRAME_KIND.pack(_CONTROL_FRAME)


def _wrong_frame(frame: bytes, direction: str) -> WireError:
    """The error for a frame to ranks whose header does not name a ``ControlMsg`` (the only
    kind ranks receive; not verified here, the rank verifies it). Callers test
    ``frame[16:20] != _CONTROL_FRAME_KIND`` (a frame shorter than a header never matches)."""
    kind = _FRAME_KIND.unpack_from(frame, 16)[0] if len(frame) >= FRAME_HEADER_LEN else None
    return WireError(f"{direction} frame: expected a ControlMsg frame (kind {_CONTROL_FRAME}), "
                     f"got {len(frame)} bytes of kind {kind}")


def ranks_text(ranks: Iterable[int]) -> str:
    """A rank list for messages: all of it when short, else first..last and a count."""
    ranks = tuple(ranks)
    if len(ranks) <= 8:
        return str(list(ranks))
    return f"[{ranks[0]}..{ranks[-1]}, {len(ranks)} ranks]"


class Invalid(NamedTuple):
    """A frame the session dropped: the loop counts it; the connection goes on.

    ``category`` is the counter's key ("bad mac", "foreign rank", "wrong direction", ...);
    ``detail`` says what was expected and what arrived; ``rank`` is the rank it names (0 if
    none).
    """

    category: str
    detail: str
    rank: int = 0


class EndOfStream(NamedTuple):
    """The connection ended: ``reason`` is the session's ``close_reason``; ``clean`` is True for
    an end the protocol expects (FT/2: after ``Goodbye`` or ``Shutdown``); ``error`` is the
    protocol error that ended it, if any. Every later ``next_event()`` returns it again."""

    reason: str
    clean: bool
    error: WireError | None = None


class Deliver(NamedTuple):
    """Coordinator → relay: ``blob`` (a length-prefixed frame) goes to each of ``ranks``, all of
    them local (a DATA record names one rank, a FANOUT record several)."""

    ranks: tuple[int, ...]
    blob: bytes


class _Session:
    """What every leg shares: buffered units, the end, the one close reason."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.close_reason: str | None = None
        self._units: list[Any] = []
        self._index = 0
        self._extra: list[Any] = []  # events one unit produced beyond its first
        self._eof = False
        self._fatal: WireError | None = None
        self._end: EndOfStream | None = None

    def receive_data(self, data: bytes | bytearray) -> None:
        """Take what was read; ``b""`` is the end of the stream. Data after the end is ignored
        (the session has ended, nothing more is decided)."""
        if self._eof or self._fatal is not None or self._end is not None:
            return
        if not data:
            self._eof = True
            return
        self._absorb(data)

    def _absorb(self, data: bytes | bytearray) -> None:
        try:
            units = self._decode(data)
        except WireError as exc:
            units = frames_before(exc)  # the whole units before the bad one are still events
            self._fatal = exc
        if self._index >= len(self._units):
            self._units = units
            self._index = 0
        else:
            self._units.extend(units)

    def next_event(self) -> Any:
        """The next event, :data:`NEED_DATA` when the bytes so far are used up, or the
        :class:`EndOfStream` (again and again) once the connection ended."""
        if self._extra:
            return self._extra.pop(0)
        units = self._units
        index = self._index
        end = len(units)
        on_unit = self._event
        while index < end:
            unit = units[index]
            index += 1
            try:
                event = on_unit(unit)
            except WireError as exc:
                self._units, self._index = [], 0
                return self._finish(self._fatal_reason(exc), False, exc)
            if event is not None:
                self._index = index
                return event
        self._index = index
        if self._end is not None:
            return self._end
        if self._fatal is not None:
            return self._finish(self._fatal_reason(self._fatal), False, self._fatal)
        if self._eof:
            reason, clean, error = self._eof_end()
            return self._finish(reason, clean, error)
        return NEED_DATA

    def close(self, reason: str) -> str:
        """The loop's own end (a reset, a stall, a close on purpose); the first reason wins.
        Returns the connection's close reason."""
        if self.close_reason is None:
            self.close_reason = reason
        return self.close_reason

    def _finish(self, reason: str, clean: bool, error: WireError | None) -> EndOfStream:
        # An end the loop reported first (a reset, a stall) is never a clean one.
        clean = clean and self.close_reason is None
        self._end = EndOfStream(self.close(reason), clean, error)
        return self._end

    # Per leg:
    def _decode(self, data: bytes | bytearray) -> list[Any]:
        raise NotImplementedError

    def _event(self, unit: Any) -> Any:
        raise NotImplementedError

    def _fatal_reason(self, exc: WireError) -> str:
        return f"protocol error: {exc}"

    def _eof_end(self) -> tuple[str, bool, WireError | None]:
        raise NotImplementedError


class _RecordSession(_Session):
    """A leg of sealed records (relay ↔ coordinator, SPEC §2.5)."""

    rank_set: frozenset[int]  # the ranks the relay carries

    def __init__(self, opener: RecordOpener, sealer: RecordSealer, peer: str) -> None:
        super().__init__(peer)
        self.opener = opener
        self.sealer = sealer
        if opener.buffered:  # what came in the same read as the handshake's last record
            self._absorb(b"")

    def _decode(self, data: bytes | bytearray) -> list[Record]:
        return self.opener.feed(data)

    def _send_control(self, msg: object, allowed: tuple[type[WireMessage], ...],
                      direction: str) -> bytes:
        if not isinstance(msg, allowed):
            raise WireError(f"{direction} CONTROL record: expected one of "
                            f"{', '.join(t.__name__ for t in allowed)}, got "
                            f"{type(msg).__name__} (to {self.peer})")
        return self.sealer.seal(_CONTROL, 0, encode(msg))

    def _not_carried(self, direction: str, what: str, ranks: Iterable[int]) -> WireError:
        return WireError(f"{direction} {what}: expected ranks of {self.peer} "
                         f"{ranks_text(sorted(self.rank_set))}, got {ranks_text(ranks)}")

    def _eof_end(self) -> tuple[str, bool, WireError | None]:
        err = self.opener.eof_error(self.peer)
        if err is not None:
            return str(err), False, err
        return self._clean_eof()

    def _clean_eof(self) -> tuple[str, bool, WireError | None]:
        raise NotImplementedError


class CoordinatorSession(_RecordSession):
    """The coordinator's side of one relay (SPEC §4.3): TIMING and METRICS frames of the ranks
    the relay carries, its ``RankExit`` / ``RankDropped`` notices and ``Liveness`` records;
    ``Goodbye``, ``FenceRank`` and ``Cadence`` go the other way.

    Events: ``TimingMsg``, ``Metrics``, ``RankExit``, ``RankDropped``, ``Liveness`` (each for
    ranks the relay carries; a ``Liveness`` whose ranks are not ascending, not the relay's, or
    not one step count each is an :class:`Invalid`), ``Draining`` (the relay's host leaves),
    :class:`Invalid`, :class:`EndOfStream`.
    """

    def __init__(self, opener: RecordOpener, sealer: RecordSealer, codec: FrameCodec, *,
                 host: str, ranks: Iterable[int]) -> None:
        super().__init__(opener, sealer, f"relay {host!r}")
        self.codec = codec
        self.host = host
        self.ranks = tuple(ranks)
        self.rank_set = frozenset(self.ranks)
        # The last FANOUT payload: the same frame to the same ranks (the CoordHeartbeat every
        # interval) is encoded once, then only sealed.
        self._fanout: tuple[list[int], bytes, bytes] | None = None
        self._liveness_ranks: tuple[int, ...] = ()  # the last Liveness ranks that checked out

    def send(self, msg: Goodbye | FenceRank | Cadence) -> bytes:
        """The sealed CONTROL record of ``msg``: a Goodbye, a FenceRank of a rank the relay
        carries, or a Cadence the relay accepts (WireError for anything else; nothing is
        sealed)."""
        if type(msg) is FenceRank and int(msg.rank) not in self.rank_set:
            raise self._not_carried("coordinator→relay", "FenceRank", (int(msg.rank),))
        if type(msg) is Cadence:  # the coordinator's pacing, not one of the relay's notices
            if (problem := cadence_problem(msg.interval)) is not None:
                raise WireError(f"coordinator→relay Cadence to {self.peer}: {problem}")
            return self.sealer.seal(_CONTROL, 0, encode(msg))
        return self._send_control(msg, (Goodbye, FenceRank), "coordinator→relay")

    def send_frame(self, rank: int, frame: bytes) -> bytes:
        """The sealed DATA record of one ``ControlMsg`` frame for ``rank``, which the relay
        carries (WireError otherwise, or for a frame of another kind; nothing is sealed)."""
        if rank not in self.rank_set:
            raise self._not_carried("coordinator→relay", "DATA record", (rank,))
        if frame[16:20] != _CONTROL_FRAME_KIND:
            raise _wrong_frame(frame, f"coordinator→{self.peer}")
        return self.sealer.seal(_DATA, rank, frame)

    def send_fanout(self, ranks: Sequence[int], frame: bytes) -> bytes:
        """The sealed FANOUT record of one ``ControlMsg`` frame for ``ranks`` (at least one;
        otherwise as :meth:`send_frame`)."""
        last = self._fanout
        if last is not None and last[1] == frame and last[0] == ranks:
            return self.sealer.seal(_FANOUT, 0, last[2])
        if not ranks or not self.rank_set.issuperset(ranks):
            raise self._not_carried("coordinator→relay", "FANOUT record", ranks)
        if frame[16:20] != _CONTROL_FRAME_KIND:
            raise _wrong_frame(frame, f"coordinator→{self.peer}")
        payload = encode_fanout(ranks, frame)
        self._fanout = (list(ranks), bytes(frame), payload)
        return self.sealer.seal(_FANOUT, 0, payload)

    def _event(self, rec: Record) -> Any:
        # The ingest hot path (SPEC §13): one call per record, no helper below it.
        if rec.kind != _DATA:
            if rec.kind == _CONTROL:
                return self._control(rec.payload)
            return Invalid("wrong direction", f"record of kind {rec.kind}, which only flows "
                           "coordinator→relay", rec.rank)
        try:
            frame = self.codec.open(rec.payload)
        except AuthError as exc:
            return Invalid("bad mac", str(exc), rec.rank)
        except WireError as exc:
            return Invalid("malformed", str(exc), rec.rank)
        kind = frame.kind
        msg: TimingMsg | Metrics
        try:
            if kind == _TIMING:
                msg = decode_timing(frame.payload)
            elif kind == _METRICS:
                msg = decode_metrics(frame.payload)
            elif kind in _RESERVED:
                return None  # reserved for later versions: skipped, not an error
            else:
                return Invalid("wrong direction", f"frame of kind {kind} is not for this "
                               "direction", rec.rank)
        except WireError as exc:
            return Invalid("undecodable", str(exc), rec.rank)
        if msg.rank not in self.rank_set:
            return Invalid("foreign rank", f"{type(msg).__name__} speaks for rank {msg.rank}, "
                           f"which relay {self.host!r} does not carry {ranks_text(self.ranks)}",
                           msg.rank)
        return msg

    def _control(self, payload: bytes) -> Any:
        try:
            msg = decode_relay(payload)
        except WireError as exc:
            return Invalid("undecodable", f"relay control record: {exc}")
        if type(msg) is Liveness:
            return self._liveness(msg)
        if type(msg) is Draining:
            return msg  # the relay's host leaves on purpose (issue 37)
        if not isinstance(msg, RankExit | RankDropped):
            return Invalid("unexpected control", f"{type(msg).__name__} after the handshake")
        rank = int(msg.rank)
        if rank not in self.rank_set:
            return Invalid("foreign rank", f"{type(msg).__name__} for rank {rank}, which relay "
                           f"{self.host!r} does not carry", rank)
        return msg

    def _liveness(self, msg: Liveness) -> Any:
        ranks = msg.ranks
        if not len(ranks) == len(msg.steps) == len(msg.ages):
            return Invalid("malformed", f"Liveness: expected a step count and an age for each "
                           f"rank; got {len(ranks)} ranks, {len(msg.steps)} step counts, "
                           f"{len(msg.ages)} ages")
        if not ranks:
            return msg  # a tick with no heartbeat pending: the relay is alive, holds nothing
        ages = msg.ages  # NaN compares false both ways: only the sum shows it
        if ranks == self._liveness_ranks:  # an idle relay lists the same ranks every period
            if not min(ages) >= 0 or (total := sum(ages)) != total:
                return Invalid("malformed", f"Liveness: expected ages ≥ 0 s, got {ages}",
                               ranks[0])
            return msg
        if not self.rank_set.issuperset(ranks):
            foreign = sorted(set(ranks) - self.rank_set)
            return Invalid("foreign rank", f"Liveness for ranks {ranks_text(foreign)}, which "
                           f"relay {self.host!r} does not carry {ranks_text(self.ranks)}",
                           foreign[0])
        if not min(ages) >= 0 or (total := sum(ages)) != total:
            return Invalid("malformed", f"Liveness: expected ages ≥ 0 s, got {ages}", ranks[0])
        if list(ranks) != sorted(set(ranks)):  # C loops: once per relay per interval
            return Invalid("malformed", f"Liveness: expected ranks ascending without "
                           f"duplicates, got {ranks_text(ranks)}", ranks[0])
        self._liveness_ranks = ranks  # carried, ascending, no duplicate: checked once
        return msg

    def _fatal_reason(self, exc: WireError) -> str:
        if isinstance(exc, AuthError):
            return f"authentication failure: {exc}"
        return f"protocol error: {exc}"

    def _clean_eof(self) -> tuple[str, bool, WireError | None]:
        # A relay ends by closing after its last RankExit: every end is the relay's choice.
        return "connection closed by the relay (EOF)", True, None


class UpstreamSession(_RecordSession):
    """The relay's side of the coordinator (SPEC §5): frames for its local ranks, ``Goodbye``,
    ``FenceRank`` and ``Cadence``; ``RankExit`` / ``RankDropped`` / ``Liveness`` and the ranks'
    frames go the other way.

    Events: :class:`Deliver`, ``Goodbye``, ``FenceRank`` (of a local rank), ``Cadence`` (a
    finite interval in (0, ``MAX_CADENCE``] seconds; any other ends the connection with a
    protocol error naming the coordinator and the value), :class:`Invalid`,
    :class:`EndOfStream` (clean only after a ``Goodbye``: FT/2 tells a coordinator that shut
    down from one that died).
    """

    def __init__(self, opener: RecordOpener, sealer: RecordSealer, *, host: str,
                 ranks: Iterable[int]) -> None:
        super().__init__(opener, sealer, f"the coordinator (relay {host!r})")
        self.host = host
        self.rank_set = frozenset(ranks)
        self.goodbye: str | None = None  # the coordinator's Goodbye reason, once it came

    def feed_opened(self, records: Iterable[Record]) -> None:
        """Records the handshake opened already (the coordinator's welcome); events first."""
        self._units[self._index:self._index] = list(records)

    def send(self, msg: RankExit | RankDropped | Liveness | Draining) -> bytes:
        """The sealed CONTROL record of ``msg`` (relay → coordinator: RankExit, RankDropped,
        Liveness of local ranks, Draining)."""
        if type(msg) is Liveness and not self.rank_set.issuperset(msg.ranks):
            raise self._not_carried("relay→coordinator", "Liveness", msg.ranks)
        return self._send_control(msg, (RankExit, RankDropped, Liveness, Draining),
                                  "relay→coordinator")

    def send_frame(self, rank: int, frame: bytes) -> bytes:
        """The sealed DATA record of a frame of local ``rank`` (WireError for another rank),
        forwarded unopened: the coordinator verifies it and drops one of the wrong kind."""
        if rank not in self.rank_set:
            raise self._not_carried("relay→coordinator", "DATA record", (rank,))
        return self.sealer.seal(_DATA, rank, frame)

    def _event(self, rec: Record) -> Any:
        if rec.kind == _DATA:
            if rec.rank not in self.rank_set:
                return Invalid("not local", f"frame for rank {rec.rank}, which is not local",
                               rec.rank)
            return Deliver((rec.rank,), len_frame(rec.payload))
        if rec.kind == _FANOUT:
            ranks, frame = decode_fanout(rec.payload)  # a bad list ends the connection
            local = tuple(r for r in ranks if r in self.rank_set)
            self._extra.extend(Invalid("not local", f"fanout frame for rank {r}, which is not "
                                       "local", r) for r in ranks if r not in self.rank_set)
            if not local:
                return self._extra.pop(0) if self._extra else None
            return Deliver(local, len_frame(frame))
        return self._control(rec.payload)

    def _control(self, payload: bytes) -> Any:
        try:
            msg = decode_relay(payload)
        except WireError as exc:
            return Invalid("undecodable", f"control record from the coordinator: {exc}")
        if isinstance(msg, Goodbye):
            self.goodbye = msg.reason
            return msg
        if type(msg) is Cadence:
            problem = cadence_problem(msg.interval)
            if problem is not None:  # a coordinator's bug: nothing sane to pace by
                raise WireError(f"Cadence from {self.peer}: {problem}")
            return msg
        if not isinstance(msg, FenceRank):
            return Invalid("unexpected control", f"{type(msg).__name__} from the coordinator")
        if int(msg.rank) not in self.rank_set:
            return Invalid("not local", f"FenceRank for rank {msg.rank}, which is not local",
                           int(msg.rank))
        return msg

    def _fatal_reason(self, exc: WireError) -> str:
        return f"upstream protocol error: {exc}"

    def _eof_end(self) -> tuple[str, bool, WireError | None]:
        # Only a Goodbye before the EOF makes it a clean end (FT/2); a bare EOF, or one in the
        # middle of a record, is a coordinator that died or dropped this relay.
        if self.goodbye is not None:
            return f"coordinator said Goodbye: {self.goodbye}", True, None
        return ("coordinator closed the connection without a Goodbye (it died, or dropped "
                "this relay)", False, None)

