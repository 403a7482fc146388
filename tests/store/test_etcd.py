"""EtcdStore against a real etcd (Debian's etcd-server, started on free loopback ports): one
leader by lease, a standby that wins only after the leader's lease expired, fenced writes, a
leader that steps down within its lease when etcd goes away, and clear errors for an
unreachable endpoint or a corrupt key."""

from __future__ import annotations

import base64
import itertools
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import trio

from flodl_trio import LeadershipLost, StoreCorrupt, StoreUnavailable
from flodl_trio.store import EtcdStore

from helpers.scripts import load_script
from helpers.store import Flag, keeping, standing_by, state

etcd_helper = load_script("_etcd")
pytestmark = pytest.mark.skipif(etcd_helper.etcd_binary() is None,
                                reason="etcd is not installed (apt-get install etcd-server)")
TTL = 1.0
_prefixes = itertools.count()


def prefix() -> str:
    return f"flodl/test{next(_prefixes)}"


def etcd_call(endpoint: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """What an operator's etcdctl would do, through the gateway."""
    with urllib.request.urlopen(urllib.request.Request(
            f"http://{endpoint}{path}", data=json.dumps(body).encode()), timeout=5) as answer:
        assert answer.status == 200
        doc: dict[str, Any] = json.loads(answer.read())
        return doc


def b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def put_raw(endpoint: str, key: str, value: bytes) -> None:
    etcd_call(endpoint, "/v3/kv/put", {"key": b64(key), "value": b64(value)})


@pytest.mark.slow
async def test_one_leader_a_standby_that_wins_only_after_the_lease_expired_and_fencing(
        shared_etcd: Any) -> None:
    where = prefix()
    leader = EtcdStore(shared_etcd.endpoint, where, ttl=TTL)
    standby = EtcdStore(shared_etcd.endpoint, where, ttl=TTL)
    gen1 = await leader.acquire(owner="coordinator a")
    assert leader.granted_ttl == TTL  # the test member's minimum TTL is 1 s
    await leader.save(state(gen1, failures=2))
    await leader.publish_address([("127.0.0.1", 4100)])
    async with trio.open_nursery() as nursery:
        keeper = keeping(nursery, leader)
        won = standing_by(nursery, standby, "coordinator b")
        await trio.sleep(1.5 * TTL)  # renewals keep it: the standby waits through 1.5 TTLs
        assert not won
        assert await standby.resolve_address() == (("127.0.0.1", 4100),)
        crashed = trio.current_time()
        keeper.cancel()  # the leader stops renewing (a crash, a frozen process)
        await won.wait(4 * TTL)
    gen2, takeover = won.value, won.at - crashed
    print(f"etcd standby takeover after the leader stopped renewing: {takeover:.2f} s "
          f"(TTL {TTL:g} s)")
    assert gen2 == gen1 + 1
    # its last renewal was at most TTL/3 before the crash, and the lease runs a TTL after it
    assert 2 / 3 * TTL - 0.1 <= takeover < TTL + 1.0
    assert await standby.load() == state(gen1, failures=2)
    assert await standby.resolve_address() == ()  # the address went with the old lease
    # the deposed leader can write nothing, and its keeper says so at once
    with pytest.raises(LeadershipLost, match=f"save as generation {gen1} refused: the stored "
                       f"generation is {gen2}"):
        await leader.save(state(gen1, failures=99))
    with pytest.raises(LeadershipLost, match=r"publish_address .* refused"):
        await leader.publish_address([("127.0.0.1", 1)])
    with pytest.raises(LeadershipLost, match=rf"generation {gen1} .* stepping down"):
        await leader.keep_leadership()
    with pytest.raises(LeadershipLost, match=f"generation {gen1} refused"):
        await standby.save(state(gen1))  # the new leader's handle fences the old generation
    await standby.save(state(gen2, failures=3))
    assert await leader.load() == state(gen2, failures=3)
    for store in (leader, standby):
        await store.aclose()


async def test_release_hands_the_leadership_to_a_standby_at_once(shared_etcd: Any) -> None:
    where = prefix()
    leader, standby = (EtcdStore(shared_etcd.endpoint, where, ttl=TTL) for _ in range(2))
    gen1 = await leader.acquire(owner="a")
    async with trio.open_nursery() as nursery:
        keeper = keeping(nursery, leader)
        won = standing_by(nursery, standby, "b")
        await trio.sleep(0.3)
        released = trio.current_time()
        keeper.cancel()  # a coordinator ending cleanly: stop renewing, then give it up
        await leader.release()
        with pytest.raises(LeadershipLost):
            await leader.save(state(gen1))
        await won.wait(2 * TTL)
    assert won.value == gen1 + 1
    assert won.at - released < TTL / 2  # a standby polls every TTL/4: no lease to wait out
    for store in (leader, standby):
        await store.aclose()


@pytest.mark.slow
async def test_the_leader_steps_down_within_its_lease_when_etcd_freezes_and_never_overlaps(
        etcd: Any) -> None:
    where = prefix()
    leader, standby = (EtcdStore(etcd.endpoint, where, ttl=TTL, connect_timeout=0.5)
                       for _ in range(2))
    gen1 = await leader.acquire(owner="a")
    lost = Flag()

    async def lead() -> None:
        with pytest.raises(LeadershipLost, match=f"no renewal succeeded \\(etcd "
                           f"{etcd.endpoint}: no answer"):
            await leader.keep_leadership()
        lost.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(lead)
        won = standing_by(nursery, standby, "b")
        await trio.sleep(0.3)
        frozen = trio.current_time()
        etcd.pause()  # SIGSTOP: connections open, nothing answers
        await lost.wait(2 * TTL)
        assert not won
        etcd.resume()
        await won.wait(4 * TTL)
    print(f"etcd frozen: the leader stepped down after {lost.at - frozen:.2f} s; the standby "
          f"won {won.at - lost.at:.2f} s after that")
    assert lost.at - frozen <= TTL + 0.25  # its step-down deadline is 0.9 TTL after a renewal
    assert won.at > lost.at  # never two leaders
    assert won.value == gen1 + 1
    for store in (leader, standby):
        await store.aclose()


@pytest.mark.slow
async def test_the_leader_steps_down_within_its_lease_when_etcd_stops(etcd: Any) -> None:
    where = prefix()
    leader = EtcdStore(etcd.endpoint, where, ttl=TTL, connect_timeout=0.5)
    gen1 = await leader.acquire(owner="a")
    lost = Flag()

    async def lead(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with pytest.raises(LeadershipLost, match=etcd.endpoint):
            await leader.keep_leadership(task_status=task_status)
        lost.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(lead)
        await trio.sleep(0.4)
        stopped = trio.current_time()
        etcd.stop()  # SIGTERM: connections refused
        await lost.wait(2 * TTL)
    took = lost.at - stopped
    print(f"etcd stopped: the leader stepped down after {took:.2f} s")
    assert took <= TTL + 0.25
    with pytest.raises(LeadershipLost, match=f"save as generation {gen1} refused"):
        await leader.save(state(gen1))  # it stays down
    await leader.aclose()  # a release that cannot reach etcd returns anyway


async def test_an_unreachable_endpoint_at_start_is_refused_quickly_naming_it() -> None:
    dead = f"127.0.0.1:{etcd_helper.free_port()}"  # nothing listens there
    store = EtcdStore(dead, "flodl/x", connect_timeout=0.5)
    with trio.fail_after(2), pytest.raises(StoreUnavailable,
                                           match=f"{dead}: .*connection refused") as info:
        await store.acquire(owner="a")
    assert "\n" not in str(info.value)
    with trio.fail_after(2), pytest.raises(StoreUnavailable, match=dead):
        await store.load()
    await store.aclose()


async def test_an_etcd_without_quorum_is_refused_within_the_connect_timeout(
        tmp_path: Path) -> None:
    with etcd_helper.EtcdServer(tmp_path, without_quorum=True) as lonely:
        store = EtcdStore(lonely.endpoint, "flodl/x", connect_timeout=0.3)
        started = trio.current_time()
        with trio.fail_after(2), pytest.raises(
                StoreUnavailable, match=f"{lonely.endpoint}: no answer to /health within 0.3 s"):
            await store.acquire(owner="a")
        assert trio.current_time() - started < 1.0
        with trio.fail_after(2), pytest.raises(StoreUnavailable, match=lonely.endpoint):
            await store.load()
        await store.aclose()


async def test_a_dead_first_endpoint_is_skipped_for_a_live_one(shared_etcd: Any) -> None:
    dead = f"127.0.0.1:{etcd_helper.free_port()}"
    # two endpoints: the lease TTL defaults to what rides out an etcd election (min_ttl)
    store = EtcdStore([dead, shared_etcd.endpoint], prefix(), connect_timeout=0.5)
    gen = await store.acquire(owner="a")
    await store.save(state(gen))
    assert await store.load() == state(gen)
    await store.aclose()


async def test_a_corrupt_state_or_counter_under_the_prefix_is_refused_naming_the_key(
        shared_etcd: Any) -> None:
    where = prefix()
    store = EtcdStore(shared_etcd.endpoint, where, ttl=TTL)
    for junk in (b"", b"not a state", state(1).encode()[:-1]):
        put_raw(shared_etcd.endpoint, f"{where}/state", junk)
        with pytest.raises(StoreCorrupt, match=f"key '{where}/state'.*refusing it"):
            await store.load()
    put_raw(shared_etcd.endpoint, f"{where}/generation", b"seven")
    with pytest.raises(StoreCorrupt, match=f"key '{where}/generation'.*got b'seven'"):
        await store.acquire(owner="a")
    put_raw(shared_etcd.endpoint, f"{where}/address", b"{not json")
    with pytest.raises(StoreCorrupt, match=f"key '{where}/address'"):
        await store.resolve_address()
    await store.aclose()


@pytest.mark.slow
async def test_saves_race_the_lease_renewals_without_losing_the_leadership(
        shared_etcd: Any) -> None:
    # TTL 2 s: renewals every 0.67 s, with room for a machine loaded by parallel test runs
    store = EtcdStore(shared_etcd.endpoint, prefix(), ttl=2)
    acquired = trio.current_time()
    gen = await store.acquire(owner="a")
    big = {"plans": "x" * 20_000}  # a scheduler checkpoint of some size
    saved: list[int] = []

    async def writer(base: int) -> None:
        for i in range(10):
            await store.save(state(gen, failures=base + i, checkpoint=big))
            saved.append(base + i)
            await trio.sleep(0.15)

    async with trio.open_nursery() as nursery:
        keeper = trio.CancelScope()

        async def keep() -> None:
            with keeper:
                await store.keep_leadership()

        nursery.start_soon(keep)
        async with trio.open_nursery() as writers:
            for base in (0, 100, 200):
                writers.start_soon(writer, base)
        await trio.sleep_until(acquired + 2.7)  # past the first lease: only renewals kept it
        await store.save(state(gen, failures=999, checkpoint=big))
        saved.append(999)
        keeper.cancel()
    assert len(saved) == 31  # writes spanning several renewals, none refused
    loaded = await store.load()
    assert loaded is not None and loaded.failures == saved[-1] and loaded.checkpoint == big
    await store.aclose()


@pytest.mark.parametrize("operator", ["revokes the lease", "deletes the leader key"])
async def test_a_leader_whose_lease_or_key_an_operator_removed_steps_down_at_its_next_renewal(
        shared_etcd: Any, operator: str) -> None:
    where = prefix()
    store = EtcdStore(shared_etcd.endpoint, where, ttl=TTL)
    gen = await store.acquire(owner="a")
    lost = Flag()

    async def lead(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # a revoked lease deletes the key: whichever the renewal sees first
        why = "(says it expired|held by nobody)" if operator == "revokes the lease" \
            else "held by nobody"
        with pytest.raises(LeadershipLost, match=f"generation {gen}\\b.*{why}"):
            await store.keep_leadership(task_status=task_status)
        lost.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(lead)
        leader = etcd_call(shared_etcd.endpoint, "/v3/kv/range", {"key": b64(f"{where}/leader")})
        if operator == "revokes the lease":
            etcd_call(shared_etcd.endpoint, "/v3/lease/revoke", {"ID": leader["kvs"][0]["lease"]})
        else:
            etcd_call(shared_etcd.endpoint, "/v3/kv/deleterange", {"key": b64(f"{where}/leader")})
        removed = trio.current_time()
        await lost.wait(TTL)
    assert lost.at - removed <= TTL / 3 + 0.2  # the next renewal notices
    with pytest.raises(LeadershipLost):
        await store.save(state(gen))
    await store.aclose()
