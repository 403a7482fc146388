"""A coordinator with a session store (SPEC §4.7, issue 22), on the in-memory transport under
MockClock, with raw relays driven by the test: a fresh run saves its session at formation, a
second coordinator on the same store adopts it (generation + 1, entered at once, the dead set,
the failure count and the checkpoint restored), a foreign or damaged state is refused whole, a
standby waits for the leader, and a deposed coordinator steps down without one more byte to a
relay. (Relays resuming: tests/coordinator/test_adopted_relays_resume.py.)
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

import flodl_trio as ft
from flodl_trio.events import ClusterFailed
from flodl_trio.store import SessionState, salt_id
from flodl_trio.testing import EventLog, MemoryNetwork

from helpers import wait_until
from helpers.durable import ROSTER, SIGS, cluster, stored


async def test_fresh_run_saves_its_roster_at_formation_before_the_block_is_entered(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with cluster(memory_network) as c:
        async with c.coordinator("coord-1") as coord:
            assert (coord.generation, coord.resumed) == (1, False)
            state = await c.store.clone().load()
            assert state is not None
            assert state.formed
            assert state.roster == ROSTER
            assert (state.generation, state.world_size) == (1, 4)
            assert state.salt_id == salt_id(c.salt)
            assert dict(state.model_sigs) == SIGS
            assert (dict(state.dead), state.failures, state.checkpoint) == ({}, 0, None)


async def test_second_coordinator_adopts_the_running_session_and_is_entered_at_once(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with cluster(memory_network) as c:
        await c.crashed_first_run()
        began = trio.current_time()
        async with c.adopting() as coord:
            assert trio.current_time() == began  # no formation: nobody was waited for
            assert (coord.generation, coord.resumed) == (2, True)
            assert coord.phase == "running"
            assert coord.live_ranks == {0, 1, 2, 3}
            assert coord.dead_ranks == frozenset()
            assert [(r.host, r.ranks) for r in coord.relays] == list(ROSTER)
            state = await c.store.clone().load()
            assert state is not None and state.generation == 2 and state.formed


async def test_dead_set_and_failure_count_survive_the_failover(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with cluster(memory_network) as c:
        await c.crashed_first_run(c.lose_rank_1)
        log = EventLog()
        with pytest.raises(ft.ClusterFailure) as failure:
            async with c.adopting(timeline=log,
                                  max_failure=ft.MaxFailure.absolute(2)) as coord:
                assert coord.dead_ranks == {1}
                assert "oom" in (coord.dead_reason(1) or "")
                assert coord.live_ranks == {0, 2, 3}
                await coord.declare_dead(3, "segfault")  # the second death of the run
                await trio.sleep_forever()
        assert failure.value.reason is ft.wire.SaveReason.MAX_FAILURE_EXCEEDED
        assert failure.value.dead == {1, 3}
        assert [ev.dead for ev in log.events_of(ClusterFailed)] == [(1, 3)]


async def test_checkpoint_is_durable_when_save_checkpoint_returns_and_survives_the_failover(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    saved = {"epoch": 3, "synced": {"0": [1, 2]}, "blob": b"\x00\x01"}

    async def checkpoint(coord: Any) -> None:
        await coord.save_checkpoint(saved)
        assert (await stored(c.store)).checkpoint == saved  # durable before it returned

    async with cluster(memory_network) as c:
        await c.crashed_first_run(checkpoint)
        async with c.adopting() as coord:
            assert coord.checkpoint == saved


async def test_checkpoint_cbor_cannot_encode_is_refused_and_nothing_is_recorded(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with cluster(memory_network) as c, c.coordinator("coord-1") as coord:
        with pytest.raises(ft.ConfigError, match="expected a map CBOR can encode"):
            await coord.save_checkpoint({"plan": object()})
        with pytest.raises(ft.ConfigError, match="expected a map with str keys"):
            await coord.save_checkpoint({1: "x"})
        assert coord.checkpoint is None
        assert coord.failure is None


@pytest.mark.parametrize(("other_salt", "world", "expected"), [
    (True, 4, "another salt"),
    (False, 8, "world size 8, not 4"),
], ids=["salt", "world-size"])
async def test_foreign_state_is_refused_whole_naming_the_store_and_both_values(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, other_salt: bool,
    world: int, expected: str,
) -> None:
    async with cluster(memory_network) as c:
        salt = ft.SessionSalt.generate() if other_salt else c.salt
        foreign = SessionState(salt_id=salt_id(salt), world_size=world,
                               roster=(("elsewhere", (0,)),), formed=True, generation=7)
        c.store.corrupt(foreign.encode())
        with pytest.raises(ft.ForeignSession) as refused:  # a StoreCorrupt
            async with c.coordinator("coord-1", form=False):
                pytest.fail("a foreign session was adopted")
        text = str(refused.value)
        assert text.startswith("store memory:memory: expected this run's session")
        assert refused.value.why == expected and refused.value.generation == 7
        assert (f"got another run's unfinished session (generation 7, salt id "
                f"{salt_id(salt).hex()}, world size {world})") in text
        assert f"(salt id {salt_id(c.salt).hex()}, world size 4)" in text
        assert text.endswith("open the coordinator with fresh=True (flodl-trio coordinator "
                             "--fresh), or use another store path or prefix")
        assert await stored(c.store) == foreign  # untouched
        with trio.fail_after(1):  # the leadership was released: the next one does not wait
            assert await c.store.clone().acquire(owner="test") == 2


async def test_damaged_state_is_refused_with_the_store_named(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with cluster(memory_network) as c:
        c.store.corrupt(b"FLDLST\x00\x01" + bytes(40))
        with pytest.raises(ft.StoreCorrupt, match=r"memory:memory.*does not match"):
            async with c.coordinator("coord-1", form=False):
                pytest.fail("a damaged state was loaded")


async def test_standby_waits_in_acquire_until_the_leader_crashed_then_adopts(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with cluster(memory_network) as c:
        standby_entered: list[float] = []

        async def standby() -> None:
            async with c.adopting() as coord:
                standby_entered.append(trio.current_time())
                assert (coord.generation, coord.resumed) == (2, True)

        async def lead_then_crash(coord: Any) -> None:
            nonlocal ended
            c.nursery.start_soon(standby)
            await trio.sleep(100)
            assert standby_entered == []
            assert coord.generation == 1
            ended = trio.current_time()

        ended = 0.0
        await c.crashed_first_run(lead_then_crash)  # a graceful end: tests/store/test_run_life
        await wait_until(lambda: standby_entered, limit=1)
        assert standby_entered == [ended]


async def test_deposed_coordinator_steps_down_without_one_more_byte_to_any_relay(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with cluster(memory_network) as c:
        log = EventLog()
        body_cancelled = False
        with pytest.raises(ft.LeadershipLost, match="expected to lead as generation 1"):
            async with c.coordinator("coord-1", timeline=log, heartbeat_interval=0.5) as coord:
                await trio.sleep(2)  # heartbeats flow
                before = {host: r.received for host, r in c.relays.items()}
                assert all(before.values())
                c.store.expire()  # the lease ran out: another coordinator may lead now
                try:
                    while True:  # the body keeps trying to talk to the relays
                        await coord.broadcast_control(ft.wire.SyncNow())
                        await trio.sleep(0.1)
                except trio.Cancelled:
                    body_cancelled = True
                    raise
        assert body_cancelled
        for host, relay in c.relays.items():
            with trio.fail_after(1):
                await relay.eof.wait()  # closed abruptly
            assert relay.received == before[host], host  # no Goodbye, no Shutdown, nothing
        assert coord.lost_broadcasts == 0
        assert log.events_of(ClusterFailed) == []
