"""The relay ↔ rank leg after the handshake, sans-IO (SPEC §5, §6): length-prefixed frames.

The relay forwards a rank's frames unopened (the coordinator verifies them); it only cuts the
stream into frames and stops forwarding those of a fenced rank. The one exception is the rank's
own ``Heartbeat``: given the session's codec, the relay verifies it and reports it as a
:class:`RankHeartbeat`, which the relay coalesces with its siblings' into one ``Liveness``
record per interval (issue 23). The rank opens what the relay
forwards: ``ControlMsg`` frames, verified with the session salt. See :mod:`._session` for the
event loop every session shares.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .._errors import WireError
from ._constants import MAX_LEN_FRAME, MsgKind
from ._frames import FrameCodec, LenFrameDecoder, len_frame
from ._messages import (
    Heartbeat,
    Metrics,
    Shutdown,
    ShutdownWithSave,
    TimingMsg,
    decode_control,
    decode_timing,
)
from ._session import _CONTROL_FRAME_KIND, _FRAME_KIND, Invalid, _Session, _wrong_frame

_CONTROL_KIND = int(MsgKind.CONTROL)
_TIMING_FRAME_KIND = _FRAME_KIND.pack(int(MsgKind.TIMING))
# A Heartbeat's CBOR payload starts [5, ...]: an array of 3, variant index 5 (SPEC §2.7). Only
# frames that start so are opened by the relay; every other frame goes through untouched.
_HEARTBEAT_HEAD = b"\x83\x05"
# An Exiting's starts [2, rank]: an array of 2, variant index 2. The relay keeps the last one
# a rank sent, to tell a coordinator again that the rank left cleanly (issue 35, the nemesis:
# the leader it was written to may have been frozen).
_EXITING_HEAD = b"\x82\x02"


class RankFrame(NamedTuple):
    """Rank → relay: one frame of ``rank``, forwarded upstream as it is (a DATA record)."""

    rank: int
    blob: bytes


class RankHeartbeat(NamedTuple):
    """Rank → relay: the rank's own ``Heartbeat``, verified with the salt (its ``rank`` field is
    the link's rank); the relay reports it in its next ``Liveness`` record instead of
    forwarding the frame."""

    rank: int
    step_count: int


class RankLinkSession(_Session):
    """The relay's side of one local rank: the rank's frames in, length-framed blobs out.

    Events: :class:`RankFrame` (none once the rank is fenced), :class:`RankHeartbeat` (with a
    ``codec``: a ``Heartbeat`` of this rank that verified; one that does not verify, or that
    speaks for another rank, is a :class:`RankFrame` like any other frame, for the coordinator
    to judge), :class:`EndOfStream` (clean at a frame boundary; a declared length over
    ``max_len`` ends it with the error).
    """

    def __init__(self, rank: int, *, host: str, max_len: int = MAX_LEN_FRAME,
                 codec: FrameCodec | None = None) -> None:
        super().__init__(f"rank {rank} (relay {host!r})")
        self.rank = rank
        self.host = host
        self.codec = codec
        self.fenced: str | None = None  # the coordinator's reason, once it fenced the rank
        # The rank's ``Exiting`` frame as it was forwarded (unverified: the coordinator
        # verifies it), once it sent one.
        self.exiting_frame: bytes | None = None
        self._decoder = LenFrameDecoder(max_len=max_len)

    def fence(self, reason: str) -> None:
        """The coordinator fenced the rank: its frames are no longer forwarded."""
        if self.fenced is None:
            self.fenced = reason

    def readmit(self) -> None:
        """The coordinator took the fenced rank back (its relay re-joined with it, issue 37):
        its frames are forwarded again."""
        self.fenced = None

    def send(self, frame: bytes) -> bytes:
        """The length-prefixed blob of one ``ControlMsg`` frame for the rank (the relay's own
        notices; what the coordinator sends comes length-prefixed in a ``Deliver`` already).

        Raises:
            WireError: a frame of another kind (ranks send those, they never receive them).
        """
        if frame[16:20] != _CONTROL_FRAME_KIND:
            raise _wrong_frame(frame, f"relay {self.host!r}→rank {self.rank}")
        return len_frame(frame)

    def _decode(self, data: bytes | bytearray) -> list[bytes]:
        return self._decoder.feed(data)

    def _event(self, blob: bytes) -> Any:
        if self.fenced is not None:
            return None
        if blob[16:20] == _TIMING_FRAME_KIND:
            head = blob[24:26]
            if head == _EXITING_HEAD:
                self.exiting_frame = blob
            elif self.codec is not None and head == _HEARTBEAT_HEAD:
                try:
                    msg = decode_timing(self.codec.open(blob).payload)
                except WireError:  # forwarded: the coordinator verifies, counts, reports it
                    return RankFrame(self.rank, blob)
                if type(msg) is Heartbeat and msg.rank == self.rank:
                    return RankHeartbeat(self.rank, msg.step_count)
        return RankFrame(self.rank, blob)

    def _fatal_reason(self, exc: WireError) -> str:
        return f"rank {self.rank} sent a bad length frame ({exc})"

    def _eof_end(self) -> tuple[str, bool, WireError | None]:
        err = self._decoder.eof_error(self.peer)
        if err is not None:
            return str(err), False, err
        return f"rank {self.rank} closed its link", True, None


class RankSession(_Session):
    """The rank's side of its relay (SPEC §6): the coordinator's ``ControlMsg`` frames in,
    ``TimingMsg`` / ``Metrics`` frames out.

    Events: each ``ControlMsg`` (``CoordHeartbeat`` and the relay's ``RelayWaiting`` too: the
    loop absorbs them; the relay's ``CoordinatorReconnecting`` / ``CoordinatorResumed``, which
    the loop delivers), :class:`Invalid` ("invalid frame": it did not verify, so it is not a
    sign of life; "wrong direction" and "undecodable": it verified), :class:`EndOfStream`
    (clean only after ``Shutdown`` or ``ShutdownWithSave``).
    """

    def __init__(self, codec: FrameCodec, *, rank: int, relay: str) -> None:
        super().__init__(f"relay {relay}")
        self.codec = codec
        self.rank = rank
        self.relay = relay
        self.shutdown_seen = False
        self._decoder = LenFrameDecoder(max_len=MAX_LEN_FRAME)

    def send(self, msg: TimingMsg | Metrics) -> bytes:
        """The length-prefixed frame of ``msg`` (rank → coordinator: TimingMsg, Metrics)."""
        if not isinstance(msg, TimingMsg | Metrics):
            raise WireError(f"rank {self.rank} → coordinator frame: expected a TimingMsg or "
                            f"Metrics, got {type(msg).__name__}")
        return len_frame(self.codec.encode(msg))

    def _decode(self, data: bytes | bytearray) -> list[bytes]:
        return self._decoder.feed(data)

    def _event(self, blob: bytes) -> Any:
        try:
            frame = self.codec.open(blob)
        except WireError as exc:
            return Invalid("invalid frame", str(exc), self.rank)
        if frame.kind != _CONTROL_KIND:
            return Invalid("wrong direction", f"frame of kind {frame.kind} is not for ranks",
                           self.rank)
        try:
            msg = decode_control(frame.payload)
        except WireError as exc:
            return Invalid("undecodable", str(exc), self.rank)
        if isinstance(msg, Shutdown | ShutdownWithSave):
            self.shutdown_seen = True
        return msg

    def _fatal_reason(self, exc: WireError) -> str:
        return f"protocol error on the link: {exc}"

    def _eof_end(self) -> tuple[str, bool, WireError | None]:
        if self.shutdown_seen:
            return f"link to {self.peer} ended after Shutdown", True, None
        return f"link to {self.peer} ended without Shutdown", False, None

