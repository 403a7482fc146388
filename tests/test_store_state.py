"""SessionState's encoding: what a store keeps round-trips, and anything damaged or foreign is
refused whole with where it came from and why."""

import pytest

from flodl_trio import LeadershipLost, StoreCorrupt
from flodl_trio.store import MemoryStore, SessionState, salt_id
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
