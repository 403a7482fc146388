"""The RelayControlMsg family: the CONTROL records of the relay ↔ coordinator leg (SPEC §2.7).

Annotations are the wire types; field order is the wire order. Lists are tuples in Python. Each
variant registers with :data:`RELAY_CONTROL_MSG` on import; ``_messages`` generates the codecs.
"""

from __future__ import annotations

import math

import attrs

from ._msg_timing import Heartbeat
from ._schema import F64, U32, U64, Family, HostName, Nonce, WireMessage, variant

RELAY_CONTROL_MSG = Family("RelayControlMsg")


class RelayControlMsg(WireMessage):
    """Base of the CONTROL records of the relay ↔ coordinator leg."""

    __slots__ = ()


@variant(RELAY_CONTROL_MSG, 0)
@attrs.frozen
class Challenge(RelayControlMsg):
    """Coordinator → relay, first record of the upstream handshake, sealed with the salt itself.

    Attributes:
        nonce: 16 fresh random bytes.
    """
    nonce: Nonce


@variant(RELAY_CONTROL_MSG, 1)
@attrs.frozen
class Hello(RelayControlMsg):
    """Relay → coordinator: who the relay is, sealed with the handshake key.

    Attributes:
        host: the host name (1-255 bytes of UTF-8).
        world_size: the relay's world size (FT/2); a disagreement with the coordinator's is an
            authenticated contradiction that fails formation naming both numbers.
        model_sigs: the relay's model signatures, name -> digest (FT/2, flodl's
            ``model_sigs``; may be empty); relays whose digests for one name differ fail
            formation, naming the hosts and the names.
        ranks: the global ranks it carries, ascending.
        nonce: the relay's 16 fresh random bytes.
    """
    host: HostName
    world_size: U32
    model_sigs: dict[str, bytes]
    ranks: tuple[U32, ...]
    nonce: Nonce


@variant(RELAY_CONTROL_MSG, 2)
@attrs.frozen
class HelloAck(RelayControlMsg):
    """Coordinator → relay: accepted, echoing the relay's nonce; both switch to the connection key.

    Attributes:
        nonce: the relay's nonce.
    """
    nonce: Nonce


@variant(RELAY_CONTROL_MSG, 3)
@attrs.frozen
class RankExit(RelayControlMsg):
    """Relay → coordinator: a local rank's connection ended.

    Attributes:
        rank: the rank.
    """
    rank: U32


@variant(RELAY_CONTROL_MSG, 4)
@attrs.frozen
class Ready(RelayControlMsg):
    """Relay → coordinator (FT/2), the last record of the upstream handshake: the relay
    verified ``HelloAck``. The coordinator counts the relay's ranks as covered only once it
    has verified this; a connection that ends before that un-covers the relay."""


@variant(RELAY_CONTROL_MSG, 5)
@attrs.frozen
class Goodbye(RelayControlMsg):
    """Coordinator → relay (FT/2): the coordinator is shutting down gracefully; sent before
    the half-close, so a relay tells a clean end from a coordinator that died.

    Attributes:
        reason: why the coordinator shut down.
    """

    reason: str


@variant(RELAY_CONTROL_MSG, 6)
@attrs.frozen
class FenceRank(RelayControlMsg):
    """Coordinator → relay (beyond flodl): ``rank`` was declared dead. The relay delivers what
    is queued for it (the ``Fenced`` frame last), half-closes its link, stops forwarding its
    frames and closes the link after ``shutdown_grace``."""

    rank: U32
    reason: str


@variant(RELAY_CONTROL_MSG, 7)
@attrs.frozen
class RankDropped(RelayControlMsg):
    """Relay → coordinator (beyond flodl): the relay dropped a local rank itself (``RankExit``
    with the reason): it did not drain its queue within the relay's ``write_stall_timeout``."""

    rank: U32
    reason: str


@variant(RELAY_CONTROL_MSG, 8)
@attrs.frozen
class Refused(RelayControlMsg):
    """Coordinator → relay (beyond flodl): the coordinator authenticated the relay's ``Hello``
    and refuses it (world size, model signatures, ranks overlapping or out of range, ...).

    Sent instead of ``HelloAck``, where it would go (``hs_key``, seq 1, direction 0x02), then
    the coordinator closes. Like ``HelloAck`` it echoes the relay's nonce, so a recorded
    ``Refused`` replayed on another connection fails. The relay gives up at once
    (:class:`~flodl_trio.JoinRefused`): re-dialing cannot change the answer.

    Attributes:
        nonce: the relay's nonce.
        reason: why, as the coordinator words it.
    """

    nonce: Nonce
    reason: str


@variant(RELAY_CONTROL_MSG, 9)
@attrs.frozen
class Resume(RelayControlMsg):
    """Relay → coordinator (beyond flodl, issue 22): what a relay sends instead of ``Hello``
    when it re-dials a durable coordinator it had joined. Same place, key and checks as
    ``Hello``; answered by ``HelloAck`` (accepted) or ``Refused``, then ``Ready`` and the
    welcome as for ``Hello``.

    Attributes:
        host / world_size / model_sigs / ranks / nonce: as in ``Hello``.
        generation: the highest coordinator generation the relay has seen (``Generation``).
    """
    host: HostName
    world_size: U32
    model_sigs: dict[str, bytes]
    ranks: tuple[U32, ...]
    nonce: Nonce
    generation: U64


@variant(RELAY_CONTROL_MSG, 10)
@attrs.frozen
class Generation(RelayControlMsg):
    """Coordinator → relay (beyond flodl, issue 22): a coordinator that runs with a session
    store sends it as its first record after ``Ready`` verified, just before the welcome, on
    every join or resume. A relay that received it knows the coordinator is durable; a relay
    that already saw a higher generation fails the attempt (a deposed coordinator's) and
    never delivers a record from it.

    Attributes:
        generation: the coordinator's generation (its fencing token).
    """
    generation: U64


@variant(RELAY_CONTROL_MSG, 11)
@attrs.frozen
class Liveness(RelayControlMsg):
    """Relay → coordinator (beyond flodl): the local ranks the relay heard a verified
    ``Heartbeat`` from since its last ``Liveness``, with the step count of each one's latest.

    The relay opens each rank's ``Heartbeat`` (salt-verified, its ``rank`` field the link's
    rank) instead of forwarding it, and sends one of these per ``heartbeat_interval``; the
    coordinator refreshes those ranks' liveness as if each ``Heartbeat`` had arrived, so it
    costs one sealed record per relay per interval instead of one frame per rank. A rank's
    pending ``Liveness`` is sent before any other record of that rank (its frames, its
    ``RankExit``), so it never arrives after them. Every record carries every heartbeat the
    relay held when it sealed it, so it is also the coordinator's evidence that the ranks it
    does not name are silent, not held back; a tick with none pending sends one naming no rank.

    Attributes:
        ranks: local ranks, ascending, without duplicates; none in a tick that had none.
        steps: ``steps[i]`` is the ``step_count`` of ``ranks[i]``'s latest ``Heartbeat``.
        ages: ``ages[i]`` is how long ago, in seconds (≥ 0), the relay verified that
            ``Heartbeat`` when it sealed this record: the coordinator counts the rank as seen
            that long before the record arrived, so coalescing does not delay the detection
            of a rank that went silent.
    """

    ranks: tuple[U32, ...]
    steps: tuple[U64, ...]
    ages: tuple[F64, ...]


@variant(RELAY_CONTROL_MSG, 12)
@attrs.frozen
class Cadence(RelayControlMsg):
    """Coordinator → relay (beyond flodl, issue 23): how often the coordinator wants this
    relay's ``Liveness`` record. A coordinator of many relays paces the relay ↔ coordinator
    exchange (its ``heartbeat_period``) so that its cost stays under
    ``CoordinatorConfig.relay_heartbeat_rate`` exchanges a second; it sends this after the
    welcome to a relay that joins while the period is not ``heartbeat_interval``, and to every
    relay when the period moves by more than 10 %. The relay then sends its ``Liveness`` every
    ``max(RelayConfig.heartbeat_interval, interval)`` seconds, from its next one, on this
    connection. An interval that is not finite, ≤ 0 or over :data:`MAX_CADENCE` seconds is a
    protocol error.

    Attributes:
        interval: seconds between two ``Liveness`` records of the relay.
    """

    interval: F64


@variant(RELAY_CONTROL_MSG, 13)
@attrs.frozen
class Draining(RelayControlMsg):
    """Relay → coordinator (beyond flodl, issue 37): the relay's host leaves the run on
    purpose; its ranks were told to finish their current sync and exit (``Drain``). The
    coordinator retires each of them as it exits cleanly (as long as the world keeps its
    minimum), without counting it as a failure; a rank of it that dies meanwhile dies as any.
    A second one on the same connection is ignored.

    Attributes:
        reason: why the host leaves.
    """

    reason: str


MAX_CADENCE = 3600.0  # seconds: a Cadence above this is a coordinator's bug, not a wish


def cadence_problem(interval: float) -> str | None:
    """Why ``interval`` is no ``Cadence`` (not finite, ≤ 0 or over :data:`MAX_CADENCE`
    seconds), or None."""
    if math.isfinite(interval) and 0 < interval <= MAX_CADENCE:
        return None
    return f"expected an interval in (0, {MAX_CADENCE:g}] seconds, got {interval!r}"


_new = object.__new__
_set_rank = Heartbeat.__dict__["rank"].__set__  # a frozen slots class, filled without __init__
_set_step = Heartbeat.__dict__["step_count"].__set__


def liveness_heartbeat(rank: int, step_count: int) -> Heartbeat:
    """The ``Heartbeat`` a ``Liveness`` record reports for ``rank`` (what the relay verified),
    built without re-checking fields the record's decoding checked already: the coordinator
    delivers one per rank to ``coord.timing`` at a third of the cost of the constructor."""
    beat = _new(Heartbeat)
    _set_rank(beat, rank)
    _set_step(beat, step_count)
    return beat
