"""A run's life in its session store (issues 34 and 39), on the in-memory transport under
MockClock with raw relays: a coordinator that ends without being deposed records the end; a
standby waiting for that session raises SessionEnded at once (it used to adopt the finished
session and fail resume_timeout later with ALL_RANKS_LOST); a new coordinator on the store starts
a new session with the next generation, whatever its salt; ``fresh=True`` discards an unfinished
one; and a leader that wakes up with its lease lapsed steps down before it declares anyone dead.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import trio

import flodl_trio as ft
from flodl_trio.events import ClusterFailed, RankDeclaredDead
from flodl_trio.status import fetch_state
from flodl_trio.store import EtcdStore, MemoryStore, SessionState
from flodl_trio.testing import EventLog, MemoryNetwork

from helpers.durable import ROSTER, cluster, stored


async def test_a_graceful_end_is_recorded_in_the_store_before_the_leadership_is_released(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with cluster(memory_network) as c:
        async with c.coordinator("coord-1"):
            assert (await stored(c.store)).ended is None  # running: for a successor to adopt
        state = await stored(c.store)
        assert state.ended == "the block exited" and state.ended_at is not None
        assert state.generation == 1 and state.roster == ROSTER
        assert await c.store.clone().current_leader() is None  # released after the marker


@pytest.mark.parametrize("how", ["cancelled", "cluster failure", "the block raised"])
async def test_every_end_that_shuts_the_cohort_down_ends_the_session(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, how: str
) -> None:
    async with cluster(memory_network) as c:
        with trio.move_on_after(1000):
            try:
                async with c.coordinator("coord-1") as coord:
                    if how == "cancelled":
                        await trio.sleep_forever()
                    if how == "cluster failure":
                        for rank in range(4):
                            await coord.declare_dead(rank, "lost in the test")
                        await trio.sleep_forever()
                    raise ValueError("the orchestrator's own bug")
            except (ft.ClusterFailure, ValueError):
                pass
        ended = (await stored(c.store)).ended
        assert ended is not None and ended.startswith(how), ended
        for relay in c.relays.values():
            with trio.fail_after(1):
                await relay.eof.wait()
            assert relay.messages[-1:] == ["Goodbye"]  # the cohort was told: nothing to adopt


async def test_a_standby_raises_session_ended_as_soon_as_the_session_it_waits_for_ends(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with cluster(memory_network) as c:
        outcome: list[tuple[float, BaseException]] = []
        done = trio.Event()

        async def standby() -> None:
            try:
                async with c.adopting():
                    pytest.fail("the standby adopted a session that had ended")
            except ft.SessionEnded as exc:
                outcome.append((trio.current_time(), exc))
            done.set()

        async with c.coordinator("coord-1"):
            c.nursery.start_soon(standby)
            await trio.sleep(100)
            assert outcome == []  # it waits while the leader runs
            ended_at = trio.current_time()
        with trio.fail_after(1):
            await done.wait()
        (at, exc), = outcome
        assert at == pytest.approx(ended_at, abs=0.1)  # at once, not resume_timeout later
        assert isinstance(exc, ft.SessionEnded) and exc.generation == 1
        assert exc.outcome == "the block exited" and exc.store == "memory:memory"
        assert str(exc).startswith("store memory:memory: the session waited for (generation "
                                   "1) ended (the block exited)")
        state = await stored(c.store)
        assert state.ended == "the block exited" and state.generation == 1  # untouched
        assert await c.store.clone().current_leader() is None  # and released


async def test_standby_true_stands_by_for_the_stores_run_even_one_that_ended_before_it_came(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    """``flodl-trio coordinator --standby`` started just after its leader's run ended (or
    restarted then): it is a standby, not the first coordinator of a new run."""
    async with cluster(memory_network) as c:
        with pytest.raises(ft.ConfigError, match="expected one of them, got both"):
            async with c.coordinator("coord-0", fresh=True, standby=True, form=False):
                pass
        async with c.coordinator("coord-1", standby=True) as coord:  # an empty store: leads
            assert (coord.generation, coord.resumed) == (1, False)
        with pytest.raises(ft.SessionEnded, match=r"\(generation 1\) ended \(the block exited\)"):
            async with c.adopting(standby=True):
                pytest.fail("a standby started a new session")
        assert (await stored(c.store)).generation == 1  # untouched


@pytest.mark.parametrize("same_salt", [True, False], ids=["same-salt", "new-salt"])
async def test_a_new_coordinator_on_an_ended_session_starts_a_new_one_with_the_next_generation(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, same_salt: bool
) -> None:
    async with cluster(memory_network) as c:
        async with c.coordinator("coord-1") as coord:
            await coord.declare_dead(1, "exited in the first run")  # not carried over
        if not same_salt:
            c.salt = ft.SessionSalt.generate()
        async with c.coordinator("coord-2", store=c.store.clone()) as coord:
            assert (coord.generation, coord.resumed) == (2, False)  # counting on: fencing
            assert coord.live_ranks == {0, 1, 2, 3} and coord.dead_ranks == frozenset()
            assert all(r.raw.acked and r.generation == 2 for r in c.relays.values())
            state = await stored(c.store)
            assert state.ended is None and state.generation == 2 and state.dead == {}
        assert (await stored(c.store)).ended == "the block exited"


@pytest.mark.parametrize("same_salt", [True, False], ids=["same-salt", "another-run"])
async def test_fresh_discards_an_unfinished_session_and_starts_a_new_one(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, same_salt: bool
) -> None:
    async with cluster(memory_network) as c:
        await c.crashed_first_run()
        assert (await stored(c.store)).ended is None  # there is a session to adopt
        if not same_salt:
            c.salt = ft.SessionSalt.generate()
        async with c.coordinator("coord-2", store=c.store.clone(), fresh=True) as coord:
            assert (coord.generation, coord.resumed) == (2, False)
            assert coord.live_ranks == {0, 1, 2, 3}
        with pytest.raises(ft.ConfigError, match="fresh=True is about the session in a store: "
                           "expected store=, got none"):
            async with ft.open_coordinator(memory_network.listener("x"), salt=c.salt,
                                           config=ft.CoordinatorConfig(world_size=4), fresh=True):
                pass  # the listener it was given is closed (the network checks at teardown)


async def test_a_leader_woken_with_its_lease_lapsed_steps_down_and_declares_nobody_dead(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork,
    flodl_log: pytest.LogCaptureFixture
) -> None:
    """Issue 34 item 4: woken after a long SIGSTOP, the deposed leader read its relays' EOFs
    first and logged every rank declared dead and ``cluster failure: ALL_RANKS_LOST`` before
    its lease renewal said it no longer led. Here its lease lapses unnoticed (``lapse``: the
    renewal task is not woken) and then every relay closes."""
    store = MemoryStore()
    async with cluster(memory_network, store) as c:
        log = EventLog()
        with pytest.raises(ft.LeadershipLost, match="its lease ran out") as lost:
            async with c.coordinator("coord-1", timeline=log):
                await trio.sleep(5)
                store.lapse()
                for relay in c.relays.values():
                    await trio.aclose_forcefully(relay.raw.stream)
                await trio.sleep_forever()
        assert "stepping down" in str(lost.value)
        assert log.events_of(RankDeclaredDead) == [] and log.events_of(ClusterFailed) == []
        said = [r.getMessage() for r in flodl_log.records if r.levelno >= logging.WARNING]
        assert said and all("stepping down" in line for line in said), said
        assert (await stored(store)).ended is None  # deposed: the successor's to adopt


async def test_a_waiting_standby_serves_phase_standby_whom_it_waits_for_and_its_generation(
) -> None:
    """Issue 34 item 7: its state.json said ``phase forming, covered 0``."""
    net = ft.testing.MemoryNetwork()
    async with cluster(net) as c:
        async with c.coordinator("coord-1"):
            bound = await ft.bind_coordinator(("127.0.0.1", 0))
            ended = trio.Event()

            async def standby() -> None:
                with pytest.raises(ft.SessionEnded):
                    async with ft.open_coordinator(bound, salt=c.salt, store=c.store.clone(),
                                                   config=ft.CoordinatorConfig(world_size=4)):
                        pass
                ended.set()

            c.nursery.start_soon(standby)
            state: dict[str, Any] = {}
            with trio.fail_after(10):
                while state.get("phase") != "standby":
                    await trio.sleep(0.02)
                    try:
                        state = await fetch_state(bound.address, timeout=5)
                    except ft.FlodlError:
                        pass
            assert state["covered"] == 0
            assert state["standby"]["store"] == "memory:memory"
            assert state["standby"]["leader"].startswith("coordinator on ")
            assert state["standby"]["would_lead_as"] == 2
            board = await get_json(bound.address, "/board.json")  # the status page's
            assert board["phase"] == "standby" and board["standby"] == state["standby"]
        with trio.fail_after(10):
            await ended.wait()


async def get_json(address: tuple[str, int], path: str) -> Any:
    """One HTTP/1.0 GET of a JSON document (the status port closes after the response)."""
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(f"GET {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
        data = b""
        with trio.fail_after(5):
            while chunk := await stream.receive_some(65536):
                data += chunk
    return json.loads(data.partition(b"\r\n\r\n")[2])


async def test_an_etcd_leader_whose_lease_deadline_passed_knows_it_lost_without_asking(
        etcd: Any) -> None:
    """What a leader woken after a pause asks first: no request to etcd (it may be slow to
    answer), and a lease known lost is not revoked on release."""
    store = EtcdStore(etcd.endpoint, "flodl/lapsed", ttl=1)
    standby = EtcdStore(etcd.endpoint, "flodl/lapsed", ttl=1)
    try:
        assert await store.acquire(owner="a") == 1
        assert store.lost_leadership() is None  # within its lease
        await trio.sleep(store.granted_ttl or 1)  # no keep_leadership: nobody renews
        lost = store.lost_leadership()
        assert lost is not None and "lease's deadline passed" in str(lost)
        assert store.generation is None  # it no longer leads: its writes are refused
        with pytest.raises(ft.LeadershipLost):
            await store.save(SessionState(salt_id=bytes(16), world_size=1, generation=1))
        with trio.fail_after(5):  # the lease runs out in etcd too: the standby wins
            assert await standby.acquire(owner="b") == 2
    finally:
        await store.aclose()
        await standby.aclose()


@pytest.mark.parametrize("send", ["broadcast", "send_control", "heartbeat"])
async def test_a_leader_woken_with_its_lease_lapsed_sends_no_record_before_it_steps_down(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, send: str
) -> None:
    """Issue 35's nemesis: a coordinator stopped past its lease, once woken, broadcast
    ``SyncNow`` and ``SetGlobalStep`` (its scheduler's next move) before it noticed that its
    lease was gone; the relays had not seen the newer generation yet, so every rank was handed
    a deposed coordinator's commands. Whatever it sends first after waking -- a broadcast, one
    rank's command, its own heartbeat -- it steps down instead, and no relay gets a record."""
    store = MemoryStore()
    async with cluster(memory_network, store) as c:
        with pytest.raises(ft.LeadershipLost, match="its lease ran out"):
            async with c.coordinator("coord-1") as coord:
                await trio.sleep(5)
                store.lapse()
                heard = {host: len(relay.messages) for host, relay in c.relays.items()}
                if send == "broadcast":
                    await coord.broadcast_control(ft.SyncNow())
                elif send == "send_control":
                    await coord.send_control(0, ft.SetGlobalStep(global_step=7))
                else:
                    await trio.sleep(60)  # its CoordHeartbeat is due every second
                pytest.fail(f"the deposed coordinator's {send} returned")
        for host, relay in c.relays.items():
            with trio.fail_after(1):
                await relay.eof.wait()
            assert relay.messages[heard[host]:] == [], (host, relay.messages[heard[host]:])
