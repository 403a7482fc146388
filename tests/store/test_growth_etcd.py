"""Issue 34 against a real etcd (one member on loopback, tests/helpers/store.py's state): over a
run of many syncs the coordinator adds a bounded number of revisions, and its ``/state.json`` and
``/metrics`` report the store's size as etcd does; the leader compacts the history up to an older
revision of its own state key, no further; etcd's alarms show up as problems."""

from __future__ import annotations

import base64
import itertools
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import trio

import flodl_trio as ft
from flodl_trio.scheduler import SyncScheduler
from flodl_trio.sim import SimulatedRank
from flodl_trio.status import fetch_state
from flodl_trio.store import EtcdStore
from flodl_trio.testing import open_local_cluster

from helpers.scripts import load_script
from helpers.store import state

etcd_helper = load_script("_etcd")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(etcd_helper.etcd_binary() is None,
                                 reason="etcd is not installed (apt-get install etcd-server)")]
_prefixes = itertools.count()


def etcd_call(endpoint: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """What an operator's etcdctl would do, through the gateway (an error answer is returned
    as ``{"error": ..., "code": ...}``)."""
    request = urllib.request.Request(f"http://{endpoint}{path}", data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            doc: dict[str, Any] = json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        doc = json.loads(exc.read())
    return doc


def http_get(address: tuple[str, int], path: str) -> str:
    with urllib.request.urlopen(f"http://{address[0]}:{address[1]}{path}", timeout=5) as answer:
        return str(answer.read().decode())


async def test_a_run_of_many_syncs_adds_a_bounded_number_of_revisions_and_reports_the_size(
    shared_etcd: Any
) -> None:
    store = EtcdStore(shared_etcd.endpoint, f"flodl/growth{next(_prefixes)}", ttl=1)
    config = ft.CoordinatorConfig(world_size=2, store_write_rate=4)

    async def rank_main(ep: ft.RankEndpoint) -> Any:
        return await SimulatedRank(ep, batch_size=2, batch_ms=4.0, seed=ep.rank).run()

    try:
        async with open_local_cluster({"h": [0, 1]}, transport="tcp", coord_config=config,
                                      store=store, rank_main=rank_main) as local:
            coord = local.coord
            before, began = shared_etcd.status()["revision"], trio.current_time()
            summary = await SyncScheduler(
                coord, total_samples=320, batch_size=2, num_epochs=2).run()
            elapsed = trio.current_time() - began
            revisions = shared_etcd.status()["revision"] - before
            doc = await fetch_state(coord.address, timeout=5)
            metrics = await trio.to_thread.run_sync(http_get, coord.address, "/metrics")
            db_size = shared_etcd.status()["db_size"]
    finally:
        await store.aclose()
    # One write per paced interval (0.25 s) and per epoch boundary, not one per sync (the
    # code before issue 34 wrote one per sync: ``revisions`` was about ``summary.syncs``).
    assert summary.syncs >= 40
    assert revisions <= elapsed * 4 + summary.epochs_completed + 2, (revisions, elapsed)
    assert revisions * 4 <= summary.syncs, (revisions, summary.syncs)
    store_doc = doc["store"]
    assert store_doc["kind"] == "etcd" and store_doc["description"] == store.description
    assert 0 < store_doc["size_bytes"] <= db_size < 64 << 20  # as etcd says, asked <= 5 s ago
    assert 0 < store_doc["revision"] <= before + revisions
    assert store_doc["writes"] >= 3 and store_doc["problems"] == []
    assert f'flodl_trio_store_size_bytes{{kind="etcd"}} {store_doc["size_bytes"]}' in metrics
    assert 'flodl_trio_store_revision{kind="etcd"} ' in metrics


async def test_the_leader_compacts_the_history_up_to_an_older_revision_of_its_own_state(
    shared_etcd: Any
) -> None:
    store = EtcdStore(shared_etcd.endpoint, f"flodl/growth{next(_prefixes)}", ttl=1)
    store.compact_every = 0.3
    key = base64.b64encode(f"{store.prefix}/state".encode()).decode()
    revisions = []
    try:
        generation = await store.acquire(owner="test")
        async with trio.open_nursery() as nursery:
            await nursery.start(store.keep_leadership)
            for n in range(12):
                await store.save(state(generation, checkpoint={"n": n}))
                doc = etcd_call(shared_etcd.endpoint, "/v3/kv/range", {"key": key})
                revisions.append(int(doc["kvs"][0]["mod_revision"]))
                await trio.sleep(0.1)
            nursery.cancel_scope.cancel()
        loaded = await store.load()
    finally:
        await store.aclose()
    compacted = store.compacted_to
    assert compacted is not None and compacted in revisions  # one of our own state's
    assert compacted <= revisions[-4]  # at least 0.3 s of history kept
    old = etcd_call(shared_etcd.endpoint, "/v3/kv/range",
                    {"key": key, "revision": str(compacted - 1)})
    assert "compacted" in old.get("error", ""), old
    kept = etcd_call(shared_etcd.endpoint, "/v3/kv/range",
                     {"key": key, "revision": str(compacted)})
    assert int(kept["kvs"][0]["mod_revision"]) == compacted  # nothing newer than ours went
    assert loaded is not None and loaded.checkpoint == {"n": 11}


async def test_without_compaction_the_history_stays_and_an_alarm_is_a_problem(
    tmp_path: Path
) -> None:
    with etcd_helper.EtcdServer(tmp_path) as own:
        store = EtcdStore(own.endpoint, "flodl/alarmed", ttl=1)
        store.compact_every = None
        try:
            generation = await store.acquire(owner="test")
            for n in range(3):
                await store.save(state(generation, checkpoint={"n": n}))
            first = etcd_call(own.endpoint, "/v3/kv/range", {
                "key": base64.b64encode(b"flodl/alarmed/state").decode(), "revision": "2"})
            assert "error" not in first  # nothing compacted
            member = etcd_call(own.endpoint, "/v3/maintenance/status", {})["header"]["member_id"]
            etcd_call(own.endpoint, "/v3/maintenance/alarm", {
                "action": "ACTIVATE", "memberID": member, "alarm": "NOSPACE"})
            usage = await store.usage()
            with pytest.raises(ft.StoreUnavailable, match="database space exceeded"):
                await store.save(state(generation))
        finally:
            await store.aclose()
    assert store.compacted_to is None
    assert len(usage.problems) == 1 and "alarm:NOSPACE" in usage.problems[0], usage.problems
    assert usage.problems[0].startswith(f"etcd {own.endpoint}: memberID:")
