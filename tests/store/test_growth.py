"""Issue 34: the session store stays small. The coordinator's writer paces the changes that can
wait to ``store_write_rate`` (a burst of checkpoints is a few writes, not one each) and writes a
durable checkpoint at once; a death is durable within one interval; ``/state.json`` and
``/metrics`` say how big the store is and how often it was written; SQLite's write-ahead log
stays under its limit. MockClock and MemoryStore, except the SQLite test (a real file). The real
etcd part (revisions per sync, compaction) is tests/store/test_growth_etcd.py.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from flodl_trio.status import render_prometheus
from flodl_trio.store import MemoryStore, SessionState, SqliteStore
from flodl_trio.store._sqlite import WAL_LIMIT
from flodl_trio.testing import MemoryNetwork, open_local_cluster, wait_until

from helpers.durable import cluster, stored
from helpers.store import state


class TimedStore(MemoryStore):
    """A MemoryStore that records when each save began and what it wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[tuple[float, SessionState]] = []

    async def save(self, state: SessionState) -> None:
        self.writes.append((trio.current_time(), state))
        await super().save(state)


@asynccontextmanager
async def paced(net: MemoryNetwork) -> AsyncIterator[tuple[TimedStore, Any]]:
    """A coordinator formed a second ago that writes at most 2 paced changes a second to a
    :class:`TimedStore`: the store and the coordinator."""
    store = TimedStore()
    async with cluster(net, store) as c, c.coordinator("coord-1", store_write_rate=2) as coord:
        await trio.sleep(1)
        yield store, coord


async def test_a_burst_of_paced_checkpoints_is_a_write_per_interval_and_the_last_one_wins(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with paced(memory_network) as (store, coord):
        began, before = trio.current_time(), len(store.writes)
        for n in range(500):  # a checkpoint every 10 ms for 5 s: a sync's pace
            called = trio.current_time()
            await coord.save_checkpoint({"n": n}, durable=False)
            assert trio.current_time() == called  # it never waits for the store
            assert coord.checkpoint == {"n": n}
            await trio.sleep(0.01)
        await trio.sleep(0.5)
        starts = [at for at, _ in store.writes[before:]]
        assert all(b - a >= 0.5 for a, b in itertools.pairwise(starts)), starts
        assert len(starts) <= (trio.current_time() - began) * 2 + 1  # 11 writes, not 500
        assert (await stored(store)).checkpoint == {"n": 499}


async def test_a_durable_checkpoint_is_written_at_once_and_paced_changes_wait_after_it(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with paced(memory_network) as (store, coord):
        await coord.save_checkpoint({"epoch": 0}, durable=False)  # written at once: idle
        await trio.sleep(0.1)
        began = trio.current_time()
        await coord.save_checkpoint({"epoch": 1})  # not held back by the 0.5 s pacing
        assert trio.current_time() == began
        assert store.writes[-1] == (began, await stored(store))
        await coord.declare_dead(3, "after the durable one")
        await trio.sleep(1)
        assert store.writes[-1][0] == pytest.approx(began + 0.5)  # paced from the durable one
        assert set(store.writes[-1][1].dead) == {3}


async def test_a_death_is_durable_within_one_interval_of_the_previous_write(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    store = TimedStore()
    async with cluster(memory_network, store) as c, c.coordinator("coord-1") as coord:
        await trio.sleep(1)
        await coord.declare_dead(0, "first")
        await wait_until(lambda: 0 in store.writes[-1][1].dead, step=0.001)
        first = store.writes[-1][0]
        await trio.sleep(0.2)
        await coord.declare_dead(1, "second")  # 0.2 s after a write: waits out the 1 s
        await trio.sleep(2)
        at, last = store.writes[-1]
        assert at == pytest.approx(first + 1.0)  # the default store_write_rate, 1/s
        assert set(last.dead) == {0, 1} and last.failures == 2


async def test_state_json_and_metrics_report_the_stores_size_writes_and_last_write(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    store = TimedStore()
    async with cluster(memory_network, store) as c, c.coordinator("coord-1") as coord:
        await coord.save_checkpoint({"epoch": 3, "note": "x" * 1000})
        await trio.sleep(6)  # the size is asked for every 5 s
        doc = coord.state()["store"]
        size = len((await stored(store)).encode())
        assert doc["kind"] == "memory" and doc["description"] == "memory:memory"
        assert doc["size_bytes"] == size > 1000
        assert doc["writes"] == len(store.writes) and doc["generation"] == 1
        assert doc["last_write_age_s"] == pytest.approx(6, abs=0.01)
        assert doc["write_rate"] == 1.0 and doc["problems"] == []
        metrics = render_prometheus(coord.state())
        assert f'flodl_trio_store_size_bytes{{kind="memory"}} {size}\n' in metrics
        assert f'flodl_trio_store_writes_total{{kind="memory"}} {len(store.writes)}\n' in metrics
        assert "# TYPE flodl_trio_store_writes_total counter" in metrics
        assert 'flodl_trio_store_last_write_age_seconds{kind="memory"} 6.0' in metrics


async def test_without_a_store_the_status_has_no_store_figures(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with open_local_cluster({"h": [0]}, network=memory_network) as local:
        assert local.coord.state()["store"] is None
        assert "store" not in render_prometheus(local.coord.state())


async def test_sqlites_write_ahead_log_stays_under_its_limit_however_many_saves(
    tmp_path: Path
) -> None:
    store = SqliteStore(tmp_path / "s.db")
    generation = await store.acquire(owner="test")
    try:
        size = 0
        for n in range(120):  # 12 MB of states, each a new 96 KiB
            saved = state(generation, checkpoint={"n": n, "blob": os.urandom(96 * 1024)})
            size = len(saved.encode())
            await store.save(saved)
        wal = os.stat(tmp_path / "s.db-wal").st_size
        db = os.stat(tmp_path / "s.db").st_size
        # SQLite's defaults left a 4 MiB log; cut back to WAL_LIMIT at each checkpoint, it is
        # at most that plus the transaction that crossed it; the database, about two states.
        assert wal <= WAL_LIMIT + 2 * size, wal
        assert db <= 3 * size, db
        usage = await store.usage()
    finally:
        await store.aclose()
    assert usage.kind == "sqlite" and usage.revision is None
    assert usage.size_bytes is not None and usage.size_bytes >= size
    assert set(usage.detail) == {"db_bytes", "wal_bytes"}
    assert usage.detail["wal_bytes"] <= WAL_LIMIT + 2 * size
