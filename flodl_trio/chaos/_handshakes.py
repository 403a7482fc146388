"""Where each step of a handshake lies in the byte stream, so a fault can be aimed at a step
(``FaultPlan().cut(*hs.after("Hello"))``) instead of at a guessed offset.

The lengths come from the wire constants and the CBOR encoder, as the bytes themselves do; a
nonce's value never changes a length, only its size (16 bytes). They are the plain bytes a
:class:`~flodl_trio.chaos.FaultyStream` or the chaos proxy counts on a connection without TLS
(over TLS the proxy counts TLS records).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from .._errors import ConfigError
from ..wire import (
    CHANNEL_MAGIC_CONTROL,
    RANK_ACK_LEN,
    RANK_HELLO_LEN,
    RECORD_HEADER_LEN,
    Challenge,
    CoordHeartbeat,
    Heartbeat,
    Hello,
    HelloAck,
    Ready,
    SessionSalt,
    encode,
    encode_fanout,
    encode_frame,
    len_frame,
)
from ._plan import Direction

_NONCE = bytes(16)  # lengths depend on the nonce's size only


def _steps(lengths: Sequence[tuple[str, int]]) -> dict[str, range]:
    out: dict[str, range] = {}
    at = 0
    for name, size in lengths:
        out[name] = range(at, at + size)
        at += size
    return out


@attrs.frozen
class HandshakeBytes:
    """The byte ranges of one leg's handshake, step by step, in each direction.

    ``"up"`` is the dialer's bytes (the relay's to its coordinator, a rank's to its relay),
    ``"down"`` the other side's, each counted from the first byte of that direction, as
    :class:`~flodl_trio.chaos.FaultPlan` counts them.

    Attributes:
        up: step name -> the offsets of its bytes, in order (``range(4, 107)``).
        down: the same for the other direction.
    """

    up: Mapping[str, range]
    down: Mapping[str, range]

    def after(self, step: str) -> tuple[int, Direction]:
        """``(offset, direction)`` just past ``step``: ``FaultPlan().cut(*hs.after("Hello"))``
        lets the whole step through and nothing after it.

        Raises:
            ConfigError: no step of that name (the message lists them).
        """
        return self._where(step).stop, self._direction(step)

    def before(self, step: str) -> tuple[int, Direction]:
        """``(offset, direction)`` of ``step``'s first byte: a cut there lets nothing of it
        through; ``FaultPlan().corrupt(*hs.before("Ready"))`` damages its first byte."""
        return self._where(step).start, self._direction(step)

    def _where(self, step: str) -> range:
        found = self.up.get(step, self.down.get(step))
        if found is None:
            raise ConfigError(f"handshake step: expected one of {[*self.up, *self.down]}, got "
                              f"{step!r}")
        return found

    def _direction(self, step: str) -> Direction:
        return "up" if step in self.up else "down"


def upstream_handshake_bytes(*, host: str, ranks: Sequence[int], world_size: int,
                             model_sigs: Mapping[str, bytes] | None = None) -> HandshakeBytes:
    """The relay ↔ coordinator handshake of one relay (:doc:`/protocol`), as its ``open_relay``
    arguments make it.

    ``up`` (relay → coordinator): ``"magic"`` (the control channel's 4 bytes), ``"Hello"``,
    ``"Ready"``. ``down`` (coordinator → relay): ``"Challenge"``, ``"HelloAck"`` and
    ``"welcome"``, the first record of the run, which confirms the join to the relay; a
    coordinator with a session store sends its ``Generation`` record before it, and one that
    paces a large world a ``Cadence`` record after it (neither is counted here).

    >>> hs = upstream_handshake_bytes(host="host-a", ranks=[0, 1], world_size=2)
    >>> hs.up["magic"], hs.after("Hello")
    (range(0, 4), (60, 'up'))
    """
    def record(message: object) -> int:
        return RECORD_HEADER_LEN + len(encode(message))  # type: ignore[arg-type]

    hello = Hello(host=host, world_size=world_size, model_sigs=dict(model_sigs or {}),
                  ranks=tuple(ranks), nonce=_NONCE)
    welcome = encode_fanout(tuple(ranks), encode_frame(SessionSalt(_NONCE), CoordHeartbeat()))
    return HandshakeBytes(
        up=_steps([("magic", len(CHANNEL_MAGIC_CONTROL)), ("Hello", record(hello)),
                   ("Ready", record(Ready()))]),
        down=_steps([("Challenge", record(Challenge(_NONCE))),
                     ("HelloAck", record(HelloAck(_NONCE))),
                     ("welcome", RECORD_HEADER_LEN + len(welcome))]),
    )


def rank_handshake_bytes(*, rank: int) -> HandshakeBytes:
    """The rank ↔ relay handshake of one rank (:doc:`/protocol`).

    ``up`` (rank → relay): ``"rank Hello"`` (24 bytes), then ``"first Heartbeat"``, the frame
    that confirms the rank to its relay (FT/2). ``down`` (relay → rank): ``"ack"`` (16 bytes).

    >>> rank_handshake_bytes(rank=3).after("rank Hello")
    (24, 'up')
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ConfigError(f"rank_handshake_bytes: expected a rank >= 0, got {rank!r}")
    heartbeat = len_frame(encode_frame(SessionSalt(_NONCE), Heartbeat(rank=rank, step_count=0)))
    return HandshakeBytes(up=_steps([("rank Hello", RANK_HELLO_LEN),
                                     ("first Heartbeat", len(heartbeat))]),
                          down=_steps([("ack", RANK_ACK_LEN)]))
