"""SessionState's encoding: what a store keeps round-trips, and anything damaged or foreign is
refused whole with where it came from and why."""

import hashlib

import cbor2
import pytest

from flodl_trio import LeadershipLost, StoreCorrupt
from flodl_trio.store import MemoryStore, SessionState, salt_id
from flodl_trio.store._state import STATE_MAGIC
from flodl_trio.wire import SessionSalt

SALT = SessionSalt(bytes(range(16)))


def state(**kw: object) -> SessionState:
    fields: dict[str, object] = dict(
        salt_id=salt_id(SALT), world_size=4, model_sigs={"m": b"\x01"},
        roster=(("a", (0, 1)), ("b", (2, 3))), dead={2: "relay lost"}, exited=frozenset({3}),
        failures=1, generation=7, formed=True, checkpoint={"epoch": 2, "synced": [1, 2]})
    fields.update(kw)
    return SessionState(**fields)  # type: ignore[arg-type]


def test_a_state_round_trips_through_its_bytes() -> None:
    s = state()
    assert SessionState.decode(s.encode(), source="x") == s


def test_the_salt_id_names_the_session_without_revealing_the_salt() -> None:
    assert salt_id(SALT) != salt_id(SessionSalt(bytes(16)))
    assert bytes(SALT) not in salt_id(SALT)


def test_every_flipped_byte_is_refused_whole_naming_the_source() -> None:
    data = state().encode()
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x01
        with pytest.raises(StoreCorrupt, match=r"state at /tmp/s\.db"):
            SessionState.decode(bytes(bad), source="/tmp/s.db")


def test_every_truncation_is_refused() -> None:
    data = state().encode()
    for n in range(len(data)):
        with pytest.raises(StoreCorrupt):
            SessionState.decode(data[:n], source="f")


async def test_a_memory_store_fences_a_deposed_leader() -> None:
    first = MemoryStore()
    gen1 = await first.acquire(owner="a")
    await first.save(state(generation=gen1))
    first.expire()  # its lease ran out
    second = first.clone()
    gen2 = await second.acquire(owner="b")
    assert gen2 == gen1 + 1
    with pytest.raises(LeadershipLost, match=f"generation {gen1}"):
        await first.save(state(generation=gen1))
    await second.save(state(generation=gen2, failures=5))
    loaded = await second.load()
    assert loaded is not None and loaded.failures == 5 and loaded.generation == gen2


def test_the_end_marker_round_trips_and_is_absent_from_a_running_sessions_bytes() -> None:
    ended = state(ended="cluster failure: ALL_RANKS_LOST", ended_at=1_700_000_000.5)
    assert SessionState.decode(ended.encode(), source="x") == ended
    running = state()
    assert running.ended is None and b"ended" not in running.encode()


def test_a_state_written_before_the_end_marker_existed_decodes_as_a_running_session() -> None:
    # The body as the previous version wrote it: the same map without "ended"/"ended_at".
    doc = {"salt_id": salt_id(SALT), "world_size": 4, "model_sigs": {}, "roster": [["a", [0]]],
           "dead": [], "exited": [], "failures": 0, "generation": 3, "formed": True,
           "checkpoint": None}
    body = cbor2.dumps(doc, canonical=True)
    old = SessionState.decode(STATE_MAGIC + hashlib.sha256(body).digest() + body, source="x")
    assert old.generation == 3 and old.ended is None and old.ended_at is None


@pytest.mark.parametrize(("field", "value", "problem"), [
    ("ended", 7, "got 'ended' of type int"),
    ("ended_at", "yesterday", "got 'ended_at' of type str"),
    ("ended_at", True, "got 'ended_at' of type bool"),
])
def test_a_malformed_end_marker_is_refused_whole(field: str, value: object,
                                                 problem: str) -> None:
    doc = cbor2.loads(state(ended="the block exited", ended_at=1.0).encode()[40:])
    doc[field] = value
    body = cbor2.dumps(doc, canonical=True)
    with pytest.raises(StoreCorrupt, match=f"state at /s.db: .*{problem}"):
        SessionState.decode(STATE_MAGIC + hashlib.sha256(body).digest() + body, source="/s.db")
