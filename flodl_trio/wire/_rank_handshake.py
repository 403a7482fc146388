"""The rank ↔ relay handshake (SPEC §2.3) as two sans-IO state machines, one per end.

Same shape as the upstream machines (``_handshake``): ``receive_data`` (``b""`` is EOF),
``next_event()``, ``data_to_send()``; failures are ``HandshakeError`` or ``WireError`` and
poison the machine. Both end in :class:`RankConfirmed` with the bytes that arrived past the
handshake, which belong to the length-framed stream that follows.
"""

from __future__ import annotations

import attrs

from .._errors import FlodlError, HandshakeError, WireError
from ._constants import RANK_ACK_LEN, RANK_HELLO_LEN
from ._crypto import SessionSalt
from ._frames import decode_rank_hello, encode_rank_ack, encode_rank_hello, verify_rank_ack
from ._handshake import NEED_DATA, NeedData


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
    def __init__(self) -> None:
        self._buf = bytearray()
        self._out = bytearray()
        self._eof = False
        self._error: FlodlError | None = None

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
    """The rank's end: send the 24-byte hello, verify the relay's 16-byte ack.

    Args:
        salt / rank / world_size: the hello's contents.
        relay: the relay's address, named in errors.
    """

    def __init__(self, salt: SessionSalt, *, rank: int, world_size: int, relay: str) -> None:
        super().__init__()
        self.rank = rank
        self.relay = relay
        self._salt = salt
        self._done = False
        self._out += encode_rank_hello(salt, rank, world_size)

    def next_event(self) -> RankHandshakeEvent:
        """NEED_DATA until the ack arrived and verified.

        Raises:
            WireError: EOF before the whole ack. HandshakeError: the ack is not valid.
        """
        self._check()
        if self._done:
            raise HandshakeError(f"rank {self.rank}: the handshake with {self.relay} already "
                                 "ended")
        ack = self._take(RANK_ACK_LEN, f"ack from relay {self.relay}")
        if ack is None:
            return NEED_DATA
        try:
            verify_rank_ack(self._salt, ack)
        except HandshakeError as exc:
            raise self._fail(HandshakeError(f"rank {self.rank}: from relay {self.relay}: "
                                            f"{exc}")) from None
        self._done = True
        leftover = bytes(self._buf)
        self._buf.clear()
        return RankConfirmed(self.rank, leftover)


class RankAcceptHandshake(_RankMachine):
    """The relay's end: validate the hello (magic, version, world_size, MAC, rank of this
    host), then, once the caller ``accept()``\\ s it, send the ack.

    Args:
        salt: the run's session salt.
        world_size: the relay's world size; a hello with another one is refused.
        host / ranks: this relay's host name and the ranks it carries.
        peer: the rank's address, named in errors.
    """

    def __init__(self, salt: SessionSalt, *, world_size: int, host: str,
                 ranks: frozenset[int], peer: str) -> None:
        super().__init__()
        self.peer = peer
        self.rank: int | None = None
        self._salt = salt
        self._world_size = world_size
        self._host = host
        self._ranks = ranks
        self._state = "hello"

    def next_event(self) -> RankHandshakeEvent:
        """``RankHelloReceived`` for a valid hello; ``RankConfirmed`` once accepted.

        Raises:
            WireError: EOF before the whole hello. HandshakeError: the first check that failed.
        """
        self._check()
        if self._state == "hello":
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
        if self._state == "decide":
            return NEED_DATA
        if self._state == "acked":
            assert self.rank is not None
            self._state = "done"
            leftover = bytes(self._buf)
            self._buf.clear()
            return RankConfirmed(self.rank, leftover)
        raise HandshakeError(f"rank hello from {self.peer}: the handshake already ended")

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
