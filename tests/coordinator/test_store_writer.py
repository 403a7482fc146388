"""The session store writer and the ways a coordinator loses its store (SPEC §4.7, issue 22):
one write at a time, a burst of changes coalesced with the latest state winning,
``save_checkpoint`` durable when it returns; a fenced save or a lease lost during formation
deposes the coordinator without a word to its relays; a session saved mid-formation is adopted
and completed by relays that resume and relays never seen. One run over real TCP on loopback:
the address the leader publishes is where the relays re-dial.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
import trio

import flodl_trio as ft
from flodl_trio.store import MemoryStore, SessionState

from helpers import wait_until
from helpers.durable import ROSTER, cluster, crash, stored, until_stored


class SlowStore(MemoryStore):
    """A MemoryStore whose saves take ``delay`` seconds; it records every state written and
    how many saves were ever in flight at once."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.saved: list[SessionState] = []
        self.started: list[float] = []
        self.writing = 0
        self.most_at_once = 0

    async def save(self, state: SessionState) -> None:
        self.writing += 1
        self.most_at_once = max(self.most_at_once, self.writing)
        self.started.append(trio.current_time())
        try:
            await trio.sleep(self.delay)
            await super().save(state)
        finally:
            self.writing -= 1
        self.saved.append(state)


class FlakyStore(MemoryStore):
    """A MemoryStore that cannot be written ``failures`` times before it can."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def save(self, state: SessionState) -> None:
        if self.failures:
            self.failures -= 1
            raise ft.StoreUnavailable(f"store {self.description}: disk full (test)")
        await super().save(state)


class UnawareStore(MemoryStore):
    """A MemoryStore whose leader never hears that its lease ran out (a paused process): only a
    fenced save tells it."""

    async def keep_leadership(self, *, task_status: trio.TaskStatus[None]
                              = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()

    def lost_leadership(self) -> ft.LeadershipLost | None:
        return None  # it does not know, even when asked


async def test_burst_of_deaths_is_saved_one_write_at_a_time_and_the_latest_state_wins(
    autojump_clock: trio.abc.Clock, memory_network: ft.testing.MemoryNetwork
) -> None:
    store = SlowStore(delay=1.0)
    async with cluster(memory_network, store) as c, c.coordinator("coord-1") as coord:
        before = len(store.saved)
        for rank in (0, 1, 2):
            await coord.declare_dead(rank, "burst")
        await trio.sleep(5)
        burst = store.saved[before:]
        assert 1 <= len(burst) <= 2, [sorted(s.dead) for s in burst]  # not one per death
        assert set(burst[-1].dead) == {0, 1, 2}
        assert burst[-1].failures == 3
        assert store.most_at_once == 1


async def test_changes_one_at_a_time_keep_the_store_busy_at_most_half_the_time(
    autojump_clock: trio.abc.Clock, memory_network: ft.testing.MemoryNetwork
) -> None:
    store = SlowStore(delay=0.1)
    async with cluster(memory_network, store) as c, c.coordinator("coord-1") as coord:
        await trio.sleep(1)
        first = len(store.started)
        for rank in range(3):  # a death every 0.12 s: faster than a save and its pause
            await coord.declare_dead(rank, "one at a time")
            await trio.sleep(0.12)
        await trio.sleep(1)
        starts = store.started[first:]
        assert len(starts) >= 2
        # Without the pause they would start 0.12 s apart, one per death.
        assert all(b - a >= 0.2 - 1e-9 for a, b in itertools.pairwise(starts))
        assert set(store.saved[-1].dead) == {0, 1, 2}


async def test_save_checkpoint_returns_once_its_own_write_is_durable_not_an_earlier_one(
    autojump_clock: trio.abc.Clock, memory_network: ft.testing.MemoryNetwork
) -> None:
    store = SlowStore(delay=1.0)
    async with cluster(memory_network, store) as c, c.coordinator("coord-1") as coord:
        await trio.sleep(3)  # the writer is idle (its pause after a save is over)
        await coord.declare_dead(0, "starts a write")  # in flight until +1 s
        await trio.sleep(0.5)
        began = trio.current_time()
        await coord.save_checkpoint({"epoch": 1})
        # The write in flight did not hold it; its own write (after that one) did.
        assert trio.current_time() - began == pytest.approx(1.5)
        assert (await stored(store)).checkpoint == {"epoch": 1}


async def test_store_that_cannot_be_written_is_tried_again_and_the_run_goes_on(
    autojump_clock: trio.abc.Clock, memory_network: ft.testing.MemoryNetwork
) -> None:
    store = FlakyStore(failures=3)
    async with cluster(memory_network, store) as c, c.coordinator("coord-1") as coord:
        began = trio.current_time()
        await coord.save_checkpoint({"epoch": 2})
        assert trio.current_time() - began <= 3  # retried every second until written
        state = await stored(store)
        assert state.checkpoint == {"epoch": 2} and state.formed
        assert coord.failure is None and coord.live_ranks == {0, 1, 2, 3}


async def test_fenced_save_deposes_a_coordinator_that_missed_its_lease(
    autojump_clock: trio.abc.Clock, memory_network: ft.testing.MemoryNetwork
) -> None:
    store = UnawareStore()
    async with cluster(memory_network, store) as c:
        with pytest.raises(ft.LeadershipLost, match="save as generation 1 refused: the latest "
                           "generation is 2"):
            async with c.coordinator("coord-1") as coord:
                store.expire()
                assert await store.clone().acquire(owner="the new leader") == 2
                await coord.declare_dead(3, "seen by the deposed one")  # its save is fenced
                await trio.sleep_forever()
        for relay in c.relays.values():
            with trio.fail_after(1):
                await relay.eof.wait()
            assert "Goodbye" not in relay.messages and "Shutdown" not in relay.messages
        assert (await stored(store)).generation == 1  # nothing of the deposed one was written


async def test_lease_lost_during_formation_raises_leadership_lost_and_says_nothing(
    autojump_clock: trio.abc.Clock, memory_network: ft.testing.MemoryNetwork
) -> None:
    async with cluster(memory_network) as c:
        async def one_relay_then_expiry() -> None:
            await c.dial("coord-1", "host-a", (0, 1))
            await trio.sleep(1)
            c.store.expire()

        c.nursery.start_soon(one_relay_then_expiry)
        with pytest.raises(ft.LeadershipLost):
            async with c.coordinator("coord-1", form=False):
                pytest.fail("entered without formation")
        host_a = c.relays["host-a"]
        with trio.fail_after(1):
            await host_a.eof.wait()
        assert host_a.messages == ["CoordHeartbeat"]  # the welcome, then nothing


async def test_session_saved_mid_formation_is_completed_by_a_resume_and_a_new_relay(
    autojump_clock: trio.abc.Clock, memory_network: ft.testing.MemoryNetwork
) -> None:
    async with cluster(memory_network) as c:
        # The first coordinator dies during formation (its lease runs out: it steps down).
        c.nursery.start_soon(c.dial, "coord-1", "host-a", (0, 1))
        async def kill_once_saved() -> None:
            await until_stored(c.store, lambda state: state.roster == ROSTER[:1])
            c.store.expire()
        c.nursery.start_soon(kill_once_saved)
        with pytest.raises(ft.LeadershipLost):
            async with c.coordinator("coord-1", form=False):
                pytest.fail("formed with one relay of two")
        assert not (await stored(c.store)).formed

        async def join_later() -> None:
            await trio.sleep(2)
            assert (await c.dial("coord-2", "host-a", (0, 1), generation=1)).raw.acked
            assert (await c.dial("coord-2", "host-b", (2, 3))).raw.acked  # never seen

        began = trio.current_time()
        c.nursery.start_soon(join_later)
        async with c.adopting() as coord:
            assert trio.current_time() - began == pytest.approx(2)
            assert coord.resumed and coord.generation == 2
            assert [(r.host, r.ranks) for r in coord.relays] == list(ROSTER)
            assert coord.live_ranks == {0, 1, 2, 3}
            state = await stored(c.store)
            assert state.formed and state.roster == ROSTER and state.generation == 2


async def test_relays_redial_the_published_address_and_resume_over_tcp() -> None:
    store = MemoryStore()
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=10, heartbeat_interval=3600,
                               heartbeat_timeout=3600, resume_timeout=10)

    published: list[tuple[tuple[str, int], ...]] = [()]

    async def dial_all(c: object, generation: int | None) -> None:
        for _ in range(1000):  # until the new leader published its own address
            addresses = await store.clone().resolve_address()
            if addresses not in published:
                break
            await trio.sleep(0.01)
        published.append(addresses)
        host, port = addresses[0]
        assert host == "127.0.0.1"
        for name, ranks in ROSTER:
            stream = await trio.open_tcp_stream(host, port)
            relay = await cluster_.handshake(stream, f"{host}:{port}", name, ranks,
                                             generation=generation)
            assert relay.raw.acked, relay.raw.refused
            assert relay.generation == (generation or 0) + 1

    async with cluster(ft.testing.MemoryNetwork(), store) as cluster_:
        for generation in (None, 1):  # a fresh run, then the coordinator that adopts it
            cluster_.nursery.start_soon(dial_all, cluster_, generation)
            async def check(coord: ft.Coordinator, generation: int | None = generation) -> None:
                assert coord.generation == (generation or 0) + 1
                await wait_until(lambda: all(
                    r.peer.startswith("127.0.0.1:") for r in coord.relays), limit=10)
                assert coord.live_ranks == {0, 1, 2, 3}

            opened = ft.open_coordinator(("127.0.0.1", 0), salt=cluster_.salt, config=cfg,
                                         store=store.clone())
            await crash(opened, check, store)  # the coordinator goes away


class UnpublishableOnce(MemoryStore):
    """A MemoryStore whose first publish_address fails as an unreachable store would."""

    failed = False

    async def publish_address(self, addresses: Sequence[tuple[str, int]]) -> None:
        if not self.failed:
            self.failed = True
            raise ft.StoreUnavailable(f"store {self.description}: unreachable (test)")
        await super().publish_address(addresses)


async def test_address_publication_that_fails_is_tried_again_and_the_run_goes_on() -> None:
    store = UnpublishableOnce()
    cfg = ft.CoordinatorConfig(world_size=1, formation_timeout=10)
    async with trio.open_nursery() as nursery:
        # The coordinator never forms (nobody joins): it only has to publish its address.
        entered = False

        async def coordinator() -> None:
            nonlocal entered
            async with ft.open_coordinator(("127.0.0.1", 0), salt=ft.SessionSalt.generate(),
                                           config=cfg, store=store):
                entered = True

        nursery.start_soon(coordinator)
        for _ in range(300):  # bounded: 3 s at most (one retry after 1 s)
            if await store.resolve_address():
                break
            await trio.sleep(0.01)
        (host, _port), = await store.resolve_address()
        assert store.failed and host == "127.0.0.1"
        nursery.cancel_scope.cancel()
    assert not entered


async def test_checkpoint_saved_after_the_coordinator_shut_down_fails_instead_of_hanging(
    autojump_clock: trio.abc.Clock, memory_network: ft.testing.MemoryNetwork
) -> None:
    async with cluster(memory_network) as c:
        async with c.coordinator("coord-1") as coord:
            await coord.save_checkpoint({"epoch": 1})
        with trio.fail_after(1), pytest.raises(ft.StoreUnavailable, match="has shut down"):
            await coord.save_checkpoint({"epoch": 2})
        assert (await stored(c.store)).checkpoint == {"epoch": 1}
