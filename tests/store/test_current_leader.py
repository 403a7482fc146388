"""``SessionStore.current_leader()``: who leads a store now, asked without waiting for the
leadership and without taking it (what ``flodl-trio coordinator --store`` checks before it
refuses a second coordinator that was not started as a standby)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from flodl_trio import StoreCorrupt
from flodl_trio.store import EtcdStore, MemoryStore, SqliteStore


async def test_memory_store_names_its_leader_until_it_releases() -> None:
    store = MemoryStore()
    other = store.clone()
    assert await other.current_leader() is None
    await store.acquire(owner="coordinator on a pid 1")
    assert await other.current_leader() == "coordinator on a pid 1"
    await store.release()
    assert await other.current_leader() is None


async def test_sqlite_store_names_the_leader_of_another_handle_and_never_takes_it(
        tmp_path: Path) -> None:
    path = tmp_path / "session.db"
    leader, probe = SqliteStore(path), SqliteStore(path)
    try:
        assert await probe.current_leader() is None
        generation = await leader.acquire(owner="coordinator on box pid 42")
        assert await probe.current_leader() == "coordinator on box pid 42"
        assert probe.generation is None  # it asked, it did not lead
        await leader.release()
        assert await probe.current_leader() is None
        assert await probe.acquire(owner="next") == generation + 1
    finally:
        await leader.aclose()
        await probe.aclose()


async def test_sqlite_store_of_a_foreign_file_is_refused_when_asked_for_its_leader(
        tmp_path: Path) -> None:
    path = tmp_path / "not-a-store.db"
    path.write_bytes(b"this is not an SQLite database, just some bytes " * 100)
    store = SqliteStore(path)
    try:
        with pytest.raises(StoreCorrupt, match=r"not-a-store\.db"):
            await store.current_leader()
    finally:
        await store.aclose()


async def test_etcd_store_names_its_leader_and_a_relay_resolves_its_address_without_leading(
        etcd: Any) -> None:
    leader = EtcdStore(etcd.endpoint, "flodl/leader-test", ttl=1.0)
    probe = EtcdStore(etcd.endpoint, "flodl/leader-test", ttl=1.0)
    try:
        assert await probe.current_leader() is None
        assert await probe.resolve_address() == ()
        await leader.acquire(owner="coordinator on box pid 7")
        async with trio.open_nursery() as nursery:
            await nursery.start(leader.keep_leadership)
            await leader.publish_address([("127.0.0.1", 7000)])
            assert await probe.current_leader() == "coordinator on box pid 7"
            assert await probe.resolve_address() == (("127.0.0.1", 7000),)
            assert probe.generation is None
            nursery.cancel_scope.cancel()
        await leader.release()
        assert await probe.current_leader() is None
        assert await probe.resolve_address() == ()  # the address went with the leader's lease
    finally:
        await leader.aclose()
        await probe.aclose()
