"""What every session store does alike (MemoryStore, SqliteStore, EtcdStore on a real etcd), so
that a coordinator written against one behaves the same on the others."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from flodl_trio import LeadershipLost
from flodl_trio.store import EtcdStore, MemoryStore, SessionStore, SqliteStore

from helpers.store import state

_prefixes = itertools.count()


@pytest.fixture(params=["memory", "sqlite", "etcd"])
async def two_handles(request: pytest.FixtureRequest,
                      tmp_path: Path) -> AsyncIterator[tuple[SessionStore, SessionStore]]:
    """Two handles on one store: two coordinators' views of it."""
    first: SessionStore
    second: SessionStore
    if request.param == "memory":
        first = MemoryStore()
        second = first.clone()  # type: ignore[attr-defined]
    elif request.param == "sqlite":
        first, second = SqliteStore(tmp_path / "s.db"), SqliteStore(tmp_path / "s.db")
    else:
        endpoint = request.getfixturevalue("shared_etcd").endpoint
        where = f"flodl/contract{next(_prefixes)}"
        first, second = (EtcdStore(endpoint, where, ttl=1) for _ in range(2))
    yield first, second
    for store in (first, second):
        await store.aclose()
        await store.aclose()  # idempotent


async def test_generations_grow_and_the_state_passes_to_the_next_leader(
        two_handles: tuple[SessionStore, SessionStore]) -> None:
    first, second = two_handles
    assert await second.load() is None
    gen1 = await first.acquire(owner="a")
    assert gen1 >= 1
    await first.save(state(gen1, failures=4))
    await first.release()
    await first.release()  # idempotent
    with trio.fail_after(2):
        gen2 = await second.acquire(owner="b")
    assert gen2 == gen1 + 1
    assert await second.load() == state(gen1, failures=4)
    with pytest.raises(LeadershipLost):
        await first.save(state(gen1, failures=5))  # released: fenced like a deposed leader
    assert await second.load() == state(gen1, failures=4)


async def test_the_address_is_published_by_the_leader_only_and_gone_after_it_released(
        two_handles: tuple[SessionStore, SessionStore]) -> None:
    first, second = two_handles
    with pytest.raises(LeadershipLost):
        await first.publish_address([("127.0.0.1", 1)])  # not leading yet
    assert await second.resolve_address() == ()
    await first.acquire(owner="a")
    await first.publish_address([("127.0.0.1", 4100), ("10.0.0.1", 4100)])
    assert await second.resolve_address() == (("127.0.0.1", 4100), ("10.0.0.1", 4100))
    await first.release()
    assert await second.resolve_address() == ()


async def test_keeping_a_leadership_never_acquired_or_released_raises(
        two_handles: tuple[SessionStore, SessionStore]) -> None:
    first, _ = two_handles
    with trio.fail_after(2), pytest.raises(LeadershipLost):
        await first.keep_leadership()
    await first.acquire(owner="a")
    await first.release()
    with trio.fail_after(2), pytest.raises(LeadershipLost):
        await first.keep_leadership()


