"""What a coordinator keeps in its session store (SPEC §4.7): :class:`SessionState`, and its
byte encoding, which refuses a damaged or foreign state whole.

Encoding: ``STATE_MAGIC`` (8 bytes) ‖ SHA-256 of the body (32 bytes) ‖ body, where the body is
one CBOR map with text keys. Decoding checks the magic, the digest, then every field's type; a
state that fails any check raises :class:`~flodl_trio.StoreCorrupt` naming where it came from
and why. Nothing here does IO: the stores move the bytes.

The end marker (``ended``, ``ended_at``) is written only into the state of a session that ended,
so a running session's state encodes as it did before the marker existed, and a state written
before it (no such keys) decodes as a running session. Likewise an elastic world's range and its
retired ranks (``min_world_size``, ``retired``, issue 37) are written only when there is one:
a fixed world's state encodes as before, and an older state decodes as a fixed world.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from typing import Any

import attrs
import cbor2

from .._errors import StoreCorrupt
from ..wire import SessionSalt

STATE_MAGIC = b"FLDLST\x00\x01"
SALT_ID_LEN = 16


def salt_id(salt: SessionSalt) -> bytes:
    """16 bytes that identify the session without revealing its salt (a store may be shared or
    read by operators; the salt is the run's secret)."""
    return hmac.new(bytes(salt), b"flodl-trio/store/v1", hashlib.sha256).digest()[:SALT_ID_LEN]


@attrs.frozen
class SessionState:
    """The durable part of a running session; written at each change that matters (formation,
    a death, a rejoin, the failure count, a scheduler checkpoint), never per frame.

    Attributes:
        salt_id: :func:`salt_id` of the session's salt.
        world_size: the run's world size.
        model_sigs: the model signatures the cohort agreed on (name -> digest).
        roster: ``(host, ranks)`` of every relay that joined, in join order (ranks ascending).
        dead: rank -> the reason it was declared dead (ranks that rejoined are not in it).
        exited: ranks that exited cleanly.
        failures: deaths counted by the failure policy so far.
        generation: the coordinator generation that wrote it (the fencing token; a new leader
            writes ``generation + 1``).
        formed: True once formation completed (every rank covered).
        checkpoint: the scheduler's checkpoint (a CBOR-encodable map), or None.
        ended: how the session ended (``"the block exited"``, ``"cluster failure: ..."``),
            written by its coordinator as it shut the cohort down; None while it runs (or
            when its coordinator died: that session is for a new leader to adopt).
        ended_at: when it ended (Unix time), or None.
        min_world_size: an elastic world's minimum (its maximum is ``world_size``), or None
            for a fixed world.
        retired: rank -> why it was retired from the elastic world (ranks that joined again
            since are not in it).
    """

    salt_id: bytes
    world_size: int
    model_sigs: Mapping[str, bytes] = attrs.field(factory=dict)
    roster: tuple[tuple[str, tuple[int, ...]], ...] = ()
    dead: Mapping[int, str] = attrs.field(factory=dict)
    exited: frozenset[int] = frozenset()
    failures: int = 0
    generation: int = 0
    formed: bool = False
    checkpoint: Mapping[str, Any] | None = None
    ended: str | None = None
    ended_at: float | None = None
    min_world_size: int | None = None
    retired: Mapping[int, str] = attrs.field(factory=dict)

    def encode(self) -> bytes:
        doc: dict[str, Any] = {
            "salt_id": self.salt_id,
            "world_size": self.world_size,
            "model_sigs": dict(self.model_sigs),
            "roster": [[host, list(ranks)] for host, ranks in self.roster],
            "dead": [[rank, reason] for rank, reason in sorted(self.dead.items())],
            "exited": sorted(self.exited),
            "failures": self.failures,
            "generation": self.generation,
            "formed": self.formed,
            "checkpoint": None if self.checkpoint is None else dict(self.checkpoint),
        }
        if self.ended is not None:
            doc["ended"] = self.ended
            doc["ended_at"] = self.ended_at
        if self.min_world_size is not None:
            doc["min_world_size"] = self.min_world_size
        if self.retired:
            doc["retired"] = [[rank, why] for rank, why in sorted(self.retired.items())]
        body = cbor2.dumps(doc, canonical=True)
        return STATE_MAGIC + hashlib.sha256(body).digest() + body

    @classmethod
    def decode(cls, data: bytes, *, source: str) -> SessionState:
        """Parse :meth:`encode`'s bytes.

        Args:
            source: where the bytes came from (a path, an etcd key), for the error message.

        Raises:
            StoreCorrupt: not a flodl-trio state, a digest that does not match, or a field of
                the wrong type; the message names ``source`` and the first problem found.
        """
        def bad(why: str) -> StoreCorrupt:
            return StoreCorrupt(f"session state at {source}: expected a flodl-trio session "
                                f"state, {why}; refusing it (nothing was loaded)")

        if len(data) < len(STATE_MAGIC) + 32 or not data.startswith(STATE_MAGIC):
            raise bad(f"got {len(data)} bytes starting {bytes(data[:8])!r}")
        digest, body = data[8:40], data[40:]
        if not hmac.compare_digest(digest, hashlib.sha256(body).digest()):
            raise bad("got a body whose SHA-256 does not match its header (damaged)")
        try:
            doc = cbor2.loads(body)
        except Exception as exc:  # cbor2 raises several types for bad input
            raise bad(f"got an undecodable body ({exc})") from None
        return _from_doc(doc, bad)


def _from_doc(doc: Any, bad: Any) -> SessionState:
    if not isinstance(doc, dict):
        raise bad(f"got a body of type {type(doc).__name__}, not a map")

    def field(name: str, kind: type | tuple[type, ...]) -> Any:
        if name not in doc:
            raise bad(f"got no {name!r} field")
        value = doc[name]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
            raise bad(f"got {name!r} of type {type(value).__name__}")
        return value

    def uint(value: Any, what: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise bad(f"got {what} = {value!r}, not an unsigned integer")
        return value

    sid = field("salt_id", bytes)
    if len(sid) != SALT_ID_LEN:
        raise bad(f"got a salt_id of {len(sid)} bytes")
    world = uint(field("world_size", int), "world_size")
    if world == 0:
        raise bad("got world_size 0")
    sigs = field("model_sigs", dict)
    if not all(isinstance(k, str) and isinstance(v, bytes) for k, v in sigs.items()):
        raise bad("got model_sigs that are not a map of text to bytes")
    roster: list[tuple[str, tuple[int, ...]]] = []
    for entry in field("roster", list):
        if (not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[0], str)
                or not isinstance(entry[1], list)):
            raise bad(f"got a roster entry {entry!r:.80}")
        ranks = tuple(uint(r, "a roster rank") for r in entry[1])
        if any(r >= world for r in ranks):
            raise bad(f"got roster ranks {list(ranks)} outside [0, {world})")
        roster.append((entry[0], ranks))
    dead: dict[int, str] = {}
    for entry in field("dead", list):
        if not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[1], str):
            raise bad(f"got a dead entry {entry!r:.80}")
        dead[uint(entry[0], "a dead rank")] = entry[1]
    exited = frozenset(uint(r, "an exited rank") for r in field("exited", list))
    checkpoint = doc.get("checkpoint")
    if checkpoint is not None and not isinstance(checkpoint, dict):
        raise bad(f"got a checkpoint of type {type(checkpoint).__name__}")
    formed = field("formed", bool)
    ended, ended_at = _end_marker(doc, bad)
    least, retired = _elastic_world(doc, bad, world)
    return SessionState(
        salt_id=sid, world_size=world, model_sigs=sigs, roster=tuple(roster), dead=dead,
        exited=exited, failures=uint(field("failures", int), "failures"),
        generation=uint(field("generation", int), "generation"), formed=formed,
        checkpoint=checkpoint, ended=ended, ended_at=ended_at, min_world_size=least,
        retired=retired)


def _elastic_world(doc: dict[Any, Any], bad: Any, world: int) -> tuple[int | None, dict[int, str]]:
    """The optional range and retired ranks of an elastic world: absent from a fixed world's
    state (and from every state written before elastic membership)."""
    least = doc.get("min_world_size")
    if least is not None and (isinstance(least, bool) or not isinstance(least, int)
                              or not 1 <= least <= world):
        raise bad(f"got min_world_size = {least!r}, not an integer in [1, {world}]")
    retired: dict[int, str] = {}
    entries = doc.get("retired", [])
    if not isinstance(entries, list):
        raise bad(f"got 'retired' of type {type(entries).__name__}")
    for entry in entries:
        if (not isinstance(entry, list) or len(entry) != 2 or isinstance(entry[0], bool)
                or not isinstance(entry[0], int) or not 0 <= entry[0] < world
                or not isinstance(entry[1], str)):
            raise bad(f"got a retired entry {entry!r:.80}")
        retired[entry[0]] = entry[1]
    return least, retired


def _end_marker(doc: dict[Any, Any], bad: Any) -> tuple[str | None, float | None]:
    """The optional end marker: absent in a running session's state (and in every state
    written before the marker existed)."""
    ended = doc.get("ended")
    if ended is not None and not isinstance(ended, str):
        raise bad(f"got 'ended' of type {type(ended).__name__}")
    ended_at = doc.get("ended_at")
    if ended_at is not None and (isinstance(ended_at, bool)
                                 or not isinstance(ended_at, int | float)):
        raise bad(f"got 'ended_at' of type {type(ended_at).__name__}")
    return ended, None if ended_at is None else float(ended_at)
