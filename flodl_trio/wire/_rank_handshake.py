"""The rank ↔ relay handshake (SPEC §2.3, FT/2) as two sans-IO state machines, one per end.

Same shape as the upstream machines (``_handshake``): ``receive_data`` (``b""`` is EOF),
``next_event()``, ``data_to_send()``; failures are ``HandshakeError`` or ``WireError`` and
poison the machine. Both end in :class:`RankConfirmed` with the bytes that arrived past the
handshake, which belong to the length-framed stream that follows.

FT/2 confirms the join on both sides: the rank answers a verified ack with its first frame at
once (a ``Heartbeat``), and the relay counts the rank as connected only once that whole frame
arrived; it then answers with a ``RelayWaiting`` notice, and the rank counts itself connected
only once that whole frame arrived. A connection that ends before that is, for both, a failed
attempt: the relay frees the rank's slot and the rank re-dials.
"""

from __future__ import annotations

import attrs

from .._errors import FlodlError, HandshakeError, WireError
from ._constants import LEN_PREFIX_LEN, MAX_LEN_FRAME, RANK_ACK_LEN, RANK_HELLO_LEN
from ._crypto import SessionSalt
from ._frames import (
    decode_rank_hello,
    encode_frame,
    encode_rank_ack,
    encode_rank_hello,
    len_frame,
    verify_rank_ack,
)
from ._handshake import NEED_DATA, NeedData
from ._messages import Heartbeat, RelayWaiting


@attrs.frozen
class RankHelloReceived:
    """Relay side: a valid hello from one of this host's ranks; ``accept()`` or hang up."""

    rank: int


@attrs.frozen
class RankConfirmed:
    """The handshake is done; ``leftover`` starts the length-framed stream."""

    rank: int
    leftover: bytes


RankHandshakeEvent = NeedData | RankHelloReceived | RankConfirmed


class _RankMachine:
    def __init__(self, state: str) -> None:
        self._buf = bytearray()
        self._out = bytearray()
        self._eof = False
        self._error: FlodlError | None = None
        self._state = state

    def receive_data(self, data: bytes) -> None:
        """Feed received bytes; ``b""`` means the peer closed its side."""
        self._check()
        if data:
            self._buf += data
        else:
            self._eof = True

    def data_to_send(self) -> bytes:
        """The bytes to write now (possibly empty); each call returns them once."""
        out = bytes(self._out)
        self._out.clear()
        return out

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _fail(self, exc: FlodlError) -> FlodlError:
        self._error = exc
        return exc

    def _first_frame(self, what: str) -> bool:
        """True once one whole length-framed blob is buffered (it stays in the buffer)."""
        if len(self._buf) >= LEN_PREFIX_LEN:
            n = int.from_bytes(self._buf[:LEN_PREFIX_LEN], "little")
            if n > MAX_LEN_FRAME:
                raise self._fail(WireError(f"{what}: expected a length-framed blob of at most "
                                           f"{MAX_LEN_FRAME} bytes, got a length of {n}"))
            if len(self._buf) >= LEN_PREFIX_LEN + n:
                return True
        if self._eof:
            raise self._fail(WireError(
                f"{what}: peer closed the connection after {len(self._buf)} bytes of it"))
        return False

    def _confirm(self, rank: int) -> RankConfirmed:
        """The handshake is done: the bytes buffered start the length-framed stream."""
        self._state = "done"
        leftover = bytes(self._buf)
        self._buf.clear()
        return RankConfirmed(rank, leftover)

    def _take(self, n: int, what: str) -> bytes | None:
        """The first ``n`` buffered bytes, or None while they have not all arrived."""
        if len(self._buf) >= n:
            head = bytes(self._buf[:n])
            del self._buf[:n]
            return head
        if self._eof:
            if self._buf:
                raise self._fail(WireError(
                    f"{what}: peer closed mid-frame after {len(self._buf)} of {n} bytes"))
            raise self._fail(WireError(f"{what}: peer closed the connection before sending "
                                       "anything"))
        return None


class RankDialHandshake(_RankMachine):
    """The rank's end: send the 24-byte hello, verify the relay's 16-byte ack, send a first
    ``Heartbeat`` at once, then wait for the relay's first frame (FT/2).

    Args:
        salt / rank / world_size: the hello's contents.
        relay: the relay's address, named in errors.
    """

    def __init__(self, salt: SessionSalt, *, rank: int, world_size: int, relay: str) -> None:
        super().__init__("ack")
        self.rank = rank
        self.relay = relay
        self._salt = salt
        self._out += encode_rank_hello(salt, rank, world_size)

    def next_event(self) -> RankHandshakeEvent:
        """NEED_DATA until the ack verified and the relay's first frame arrived.

        Raises:
            WireError: EOF before the whole ack or the relay's first frame.
            HandshakeError: the ack is not valid.
        """
        self._check()
        if self._state == "ack" and not self._verify_ack():
            return NEED_DATA
        if self._state == "confirm":
            if not self._first_frame(f"rank {self.rank}: the relay {self.relay}'s first frame "
                                     "after its ack"):
                return NEED_DATA
            return self._confirm(self.rank)
        raise HandshakeError(f"rank {self.rank}: the handshake with {self.relay} already ended")

    def _verify_ack(self) -> bool:
        """Verify the relay's ack and answer it with a first ``Heartbeat``; False while the ack
        has not all arrived."""
        ack = self._take(RANK_ACK_LEN, f"ack from relay {self.relay}")
        if ack is None:
            return False
        try:
            verify_rank_ack(self._salt, ack)
        except HandshakeError as exc:
            raise self._fail(HandshakeError(f"rank {self.rank}: from relay {self.relay}: "
                                            f"{exc}")) from None
        # The relay counts us only once this whole frame arrived (FT/2).
        self._out += len_frame(encode_frame(self._salt,
                                            Heartbeat(rank=self.rank, step_count=0)))
        self._state = "confirm"
        return True


class RankAcceptHandshake(_RankMachine):
    """The relay's end: validate the hello (magic, version, world_size, MAC, rank of this
    host), then, once the caller ``accept()``\\ s it, send the ack and wait for the rank's first
    whole frame (FT/2); answer it with a ``RelayWaiting`` notice.

    Args:
        salt: the run's session salt.
        world_size: the relay's world size; a hello with another one is refused.
        host / ranks: this relay's host name and the ranks it carries.
        peer: the rank's address, named in errors.
    """

    def __init__(self, salt: SessionSalt, *, world_size: int, host: str,
                 ranks: frozenset[int], peer: str) -> None:
        super().__init__("hello")
        self.peer = peer
        self.rank: int | None = None
        self._salt = salt
        self._world_size = world_size
        self._host = host
        self._ranks = ranks

    def next_event(self) -> RankHandshakeEvent:
        """``RankHelloReceived`` for a valid hello; ``RankConfirmed`` once accepted.

        Raises:
            WireError: EOF before the whole hello. HandshakeError: the first check that failed.
        """
        self._check()
        if self._state == "hello":
            return self._validate_hello()
        if self._state == "decide":
            return NEED_DATA
        if self._state == "acked":
            assert self.rank is not None
            # The ack may not have reached the rank: it counts only once its first frame did.
            if not self._first_frame(f"rank {self.rank} at {self.peer}: its first frame after "
                                     "the ack"):
                return NEED_DATA
            notice = RelayWaiting(host=self._host, detail=f"relay {self._host!r} confirmed "
                                  f"rank {self.rank}; waiting for the cohort to form")
            self._out += len_frame(encode_frame(self._salt, notice))
            return self._confirm(self.rank)
        raise HandshakeError(f"rank hello from {self.peer}: the handshake already ended")

    def _validate_hello(self) -> RankHandshakeEvent:
        """``RankHelloReceived`` once the whole hello arrived and is one of this host's ranks'
        (NEED_DATA before)."""
        data = self._take(RANK_HELLO_LEN, f"rank hello from {self.peer}")
        if data is None:
            return NEED_DATA
        try:
            rank = decode_rank_hello(self._salt, data, world_size=self._world_size)
        except HandshakeError as exc:
            raise self._fail(HandshakeError(f"{exc} (from {self.peer})")) from None
        if rank not in self._ranks:
            raise self._fail(HandshakeError(
                f"rank hello from {self.peer}: rank {rank} does not belong to host "
                f"{self._host!r} (its ranks are {sorted(self._ranks)})"))
        self.rank = rank
        self._state = "decide"
        return RankHelloReceived(rank)

    def accept(self) -> None:
        """Send the ack."""
        self._check()
        if self._state != "decide":
            raise HandshakeError(f"rank hello from {self.peer}: accept() before a valid hello")
        self._out += encode_rank_ack(self._salt)
        self._state = "acked"


__all__ = [
    "RankAcceptHandshake",
    "RankConfirmed",
    "RankDialHandshake",
    "RankHandshakeEvent",
    "RankHelloReceived",
]
