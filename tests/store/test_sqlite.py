"""SqliteStore: one SQLite file in WAL mode, leadership by flock on PATH.lock. A second
coordinator on the same file waits as a standby and takes over the moment the leader's process
dies; writes are fenced by the stored generation; a file that is not a flodl-trio store is
refused whole, naming its path."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from flodl_trio import LeadershipLost, StoreCorrupt, StoreUnavailable
from flodl_trio.store import SessionState, SqliteStore

from helpers.store import standing_by, state


async def test_a_restarted_coordinator_loads_what_the_last_one_saved(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    first = SqliteStore(path)
    assert await first.load() is None
    gen1 = await first.acquire(owner="host-a pid 1")
    await first.save(state(gen1, failures=3))
    await first.aclose()
    second = SqliteStore(path)
    gen2 = await second.acquire(owner="host-a pid 2")
    assert gen2 == gen1 + 1
    assert await second.load() == state(gen1, failures=3)
    await second.aclose()
    with sqlite3.connect(path) as db:  # durable settings a user can check from outside
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


async def test_a_second_handle_waits_as_standby_until_the_leader_releases(
        tmp_path: Path) -> None:
    leader, standby = SqliteStore(tmp_path / "s.db"), SqliteStore(tmp_path / "s.db")
    gen1 = await leader.acquire(owner="a")
    async with trio.open_nursery() as nursery:
        won = standing_by(nursery, standby, "b")
        await trio.sleep(0.3)
        assert not won  # the leader still holds it
        released = trio.current_time()
        await leader.release()
        await won.wait(2)
    assert won.value == gen1 + 1
    assert won.at - released < 0.5
    await leader.aclose()
    await standby.aclose()


async def test_a_cancelled_standby_leaves_no_lock_behind(tmp_path: Path) -> None:
    leader, standby = SqliteStore(tmp_path / "s.db"), SqliteStore(tmp_path / "s.db")
    await leader.acquire(owner="a")
    with trio.move_on_after(0.2) as scope:
        await standby.acquire(owner="b")
    assert scope.cancelled_caught
    await leader.release()
    third = SqliteStore(tmp_path / "s.db")
    with trio.fail_after(1):
        assert await third.acquire(owner="c") == 2
    for store in (leader, standby, third):
        await store.aclose()


async def test_a_write_with_a_stale_generation_is_refused_and_writes_nothing(
        tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    gen = await store.acquire(owner="a")
    await store.save(state(gen, failures=1))
    for wrong in (gen - 1, gen + 1):
        with pytest.raises(LeadershipLost, match=f"save as generation {wrong} refused: the "
                           f"stored generation is {gen}"):
            await store.save(state(wrong, failures=9))
    assert await store.load() == state(gen, failures=1)
    reader = SqliteStore(tmp_path / "s.db")  # a handle that never acquired cannot write
    with pytest.raises(LeadershipLost, match="not leading"):
        await reader.save(state(gen, failures=9))
    with pytest.raises(LeadershipLost, match="does not lead"):
        await reader.publish_address([("127.0.0.1", 1)])
    assert await reader.load() == state(gen, failures=1)
    await store.aclose()
    await reader.aclose()


async def test_a_leader_whose_lock_file_was_deleted_is_deposed_and_fenced(
        tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    old, new = SqliteStore(path, check_interval=0.05), SqliteStore(path)
    gen1 = await old.acquire(owner="a")
    await old.save(state(gen1))
    os.unlink(f"{path}.lock")  # an operator's cleanup: the next process locks a new file
    with trio.fail_after(1):
        gen2 = await new.acquire(owner="b")
    assert gen2 == gen1 + 1
    with pytest.raises(LeadershipLost, match=f"generation {gen1} refused: the stored "
                       f"generation is {gen2}"):
        await old.save(state(gen1, failures=7))
    with trio.fail_after(1), pytest.raises(LeadershipLost, match=r"lock file .* deleted"):
        await old.keep_leadership()
    with pytest.raises(LeadershipLost):
        await old.publish_address([("127.0.0.1", 9)])
    assert await new.load() == state(gen1)
    await old.aclose()
    await new.aclose()


async def test_a_leader_whose_database_was_replaced_steps_down(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    store = SqliteStore(path, check_interval=0.05)
    await store.acquire(owner="a")
    stepped_down = []

    async def keep() -> None:
        with pytest.raises(LeadershipLost, match=f"{path} was replaced"):
            await store.keep_leadership()
        stepped_down.append(True)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(keep)
        await trio.sleep(0.2)
        assert stepped_down == []  # nothing changed: it keeps leading
        other = tmp_path / "other.db"
        sqlite3.connect(other).close()
        os.replace(other, path)
    assert stepped_down == [True]
    await store.aclose()


async def test_the_leader_address_is_resolved_only_while_someone_leads(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    leader, relay_view = SqliteStore(path), SqliteStore(path)
    assert await relay_view.resolve_address() == ()
    await leader.acquire(owner="a")
    assert await relay_view.resolve_address() == ()
    await leader.publish_address([("127.0.0.1", 4100), ("::1", 4100)])
    assert await relay_view.resolve_address() == (("127.0.0.1", 4100), ("::1", 4100))
    await leader.release()
    assert await relay_view.resolve_address() == ()
    await leader.aclose()
    await relay_view.aclose()


def _foreign_sqlite(path: Path) -> None:
    path.unlink()  # another application's database where the store should be
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE users (name TEXT)")
        db.execute("INSERT INTO users VALUES ('alice')")


def _damaged_state(path: Path) -> None:
    with sqlite3.connect(path) as db:
        data = bytearray(state(1).encode())
        data[-1] ^= 0xFF
        db.execute("UPDATE flodl_store SET value = ? WHERE key = 'state'", (bytes(data),))


def _text_generation(path: Path) -> None:
    with sqlite3.connect(path) as db:
        db.execute("UPDATE flodl_store SET value = 'seven' WHERE key = 'generation'")


def _garbage_pages(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[100:] = os.urandom(len(data) - 100)  # the header says SQLite, the pages are noise
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("damage", "why"), [
    (lambda p: p.write_bytes(os.urandom(4096)), "not a database"),
    (lambda p: p.write_bytes(b"checkpoint: epoch 3\n" * 50), "not a database"),
    (_foreign_sqlite, "another application"),
    (_damaged_state, "SHA-256 does not match"),
    (_text_generation, "generation to be an unsigned integer, got 'seven'"),
    (_garbage_pages, "malformed|not a database"),
], ids=["random-bytes", "text-file", "another-apps-sqlite", "damaged-state", "text-generation",
        "garbage-pages"])
async def test_a_file_that_is_not_a_sound_store_is_refused_whole_naming_its_path(
        tmp_path: Path, damage: object, why: str) -> None:
    path = tmp_path / "s.db"
    store = SqliteStore(path)
    gen = await store.acquire(owner="a")
    await store.save(state(gen))
    await store.aclose()
    damage(path)  # type: ignore[operator]
    before = path.read_bytes()
    victim = SqliteStore(path)
    with pytest.raises(StoreCorrupt, match=f"{path}.*({why})|({why}).*{path}") as info:
        await victim.load()
    assert "refusing it" in str(info.value)
    assert path.read_bytes() == before  # nothing written into it
    if damage is not _damaged_state:  # the store itself is unusable: no leader either
        with pytest.raises(StoreCorrupt, match=str(path)):
            await victim.acquire(owner="b")
        assert path.read_bytes() == before
    await victim.aclose()


@pytest.mark.parametrize("where", ["missing-dir", "under-a-file", "a-directory"])
async def test_an_unusable_path_is_unavailable_naming_it(tmp_path: Path, where: str) -> None:
    (tmp_path / "plain").write_text("x")
    (tmp_path / "dir.db").mkdir()
    path = {"missing-dir": tmp_path / "nope" / "s.db", "under-a-file": tmp_path / "plain" / "s.db",
            "a-directory": tmp_path / "dir.db"}[where]
    store = SqliteStore(path)
    with pytest.raises(StoreUnavailable, match=f"cannot open {path}"):
        await store.acquire(owner="a")
    with pytest.raises(StoreUnavailable, match=str(path)):
        await store.load()
    await store.aclose()


LEADER = """
import sys, trio
from flodl_trio.store import SqliteStore, SessionState, salt_id
from flodl_trio.wire import SessionSalt

async def main():
    store = SqliteStore(sys.argv[1])
    gen = await store.acquire(owner="leader process")
    await store.save(SessionState(salt_id=salt_id(SessionSalt(bytes(range(16)))), world_size=2,
                                  generation=gen, failures=gen))
    await store.publish_address([("127.0.0.1", 4000 + gen)])
    print(gen, flush=True)
    await trio.sleep_forever()

trio.run(main)
"""


@pytest.mark.slow
async def test_a_standby_takes_over_within_half_a_second_of_the_leaders_sigkill(
        tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    proc = await trio.lowlevel.open_process([sys.executable, "-c", LEADER, str(path)],
                                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = b""
        with trio.fail_after(20):
            while not line.endswith(b"\n"):
                chunk = await proc.stdout.receive_some(64)
                assert chunk, "the leader process ended before it led"
                line += chunk
        gen1 = int(line)
        standby = SqliteStore(path)
        assert await standby.resolve_address() == (("127.0.0.1", 4000 + gen1),)
        async with trio.open_nursery() as nursery:
            won = standing_by(nursery, standby, "standby")
            await trio.sleep(0.3)
            assert not won  # a live leader process holds the lock
            killed = trio.current_time()
            os.kill(proc.pid, signal.SIGKILL)
            await won.wait(5)
        takeover = won.at - killed
        print(f"sqlite standby takeover after SIGKILL: {takeover:.3f} s")
        assert won.value == gen1 + 1
        assert takeover < 0.5
        loaded = await standby.load()
        assert loaded is not None and loaded.failures == gen1  # what the killed leader saved
        assert await standby.resolve_address() == ()  # its address went with it
        with pytest.raises(LeadershipLost, match=f"generation {gen1} refused"):
            await standby.save(loaded)  # a write fenced on the killed leader's generation
        await standby.save(SessionState(salt_id=loaded.salt_id, world_size=2,
                                        generation=won.value))
        await standby.aclose()
    finally:
        if proc.returncode is None:
            proc.kill()
        with trio.move_on_after(5):
            await proc.wait()
        if proc.stdout is not None:
            await proc.stdout.aclose()
