"""A coordinator with a session store (SPEC §4.7, issue 22), on the in-memory transport under
MockClock, with raw relays driven by the test: a fresh run saves its session at formation, a
second coordinator on the same store adopts it (generation + 1, entered at once, the dead set,
the failure count and the checkpoint restored), the ranks of a relay that never resumes are
declared dead after ``resume_timeout`` and not before, a foreign state is refused whole, a standby
waits for the leader, and a deposed coordinator steps down without one more byte to a relay.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.events import ClusterFailed, RankDeclaredDead, RankRejoined
from flodl_trio.net._handshake_io import run_handshake
from flodl_trio.store import MemoryStore, SessionState, salt_id
from flodl_trio.testing import EventLog, MemoryNetwork

from helpers import RawRelay, wait_until

SIGS = {"model": bytes(range(32))}
ROSTER = (("host-a", (0, 1)), ("host-b", (2, 3)))


def config(**overrides: Any) -> ft.CoordinatorConfig:
    fields: dict[str, Any] = dict(world_size=4, formation_timeout=60, heartbeat_interval=3600,
                                  heartbeat_timeout=3600, resume_timeout=30)
    fields.update(overrides)
    return ft.CoordinatorConfig(**fields)


@attrs.define(eq=False)
class Counted:
    """A raw relay after its join: the bytes and the messages it received (``"Name"``, or
    ``"Name(rank)"`` for DeclareDead / DeclareAlive), until EOF."""

    raw: RawRelay
    salt: ft.SessionSalt
    generation: int | None = None  # the coordinator's Generation, None if it sent none
    received: int = 0
    messages: list[str] = attrs.Factory(list)
    eof: trio.Event = attrs.Factory(trio.Event)

    async def read(self) -> None:
        opener = self.raw.opener
        try:
            while data := await self.raw.stream.receive_some(65536):
                self.received += len(data)
                opener.push(data)
                while (rec := opener.next_record()) is not None:
                    self.messages.append(_label(self.salt, rec))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        self.eof.set()
        await trio.aclose_forcefully(self.raw.stream)


def _label(salt: ft.SessionSalt, rec: Any) -> str:
    if rec.kind == wire.RecordKind.CONTROL:
        return type(wire.decode_relay(rec.payload)).__name__
    frame = rec.payload
    if rec.kind == wire.RecordKind.FANOUT:
        _, frame = wire.decode_fanout(rec.payload)
    msg = wire.frame_message(wire.decode_frame(salt, frame))
    name = type(msg).__name__
    return f"{name}({msg.rank})" if isinstance(msg, wire.DeclareDead | wire.DeclareAlive) else name


@attrs.define(eq=False)
class Cluster:
    """One store and its session salt; coordinators come and go on it."""

    net: MemoryNetwork
    nursery: trio.Nursery
    salt: ft.SessionSalt = attrs.Factory(ft.SessionSalt.generate)
    store: MemoryStore = attrs.Factory(MemoryStore)
    relays: dict[str, Counted] = attrs.Factory(dict)

    async def dial(self, where: str, host: str, ranks: tuple[int, ...], *,
                   generation: int | None = None) -> Counted:
        """One relay's handshake: a join (Hello), or with ``generation`` a resume (Resume);
        a relay that joined keeps reading until EOF."""
        stream = await self.net.connect(where)
        machine = wire.RelayHandshake(self.salt, host=host, ranks=ranks, world_size=4,
                                      model_sigs=SIGS, coordinator=where,
                                      generation=generation)
        try:
            done = await run_handshake(stream, machine)
        except ft.FlodlError as exc:  # closed, or a deposed coordinator
            await trio.aclose_forcefully(stream)
            raw = RawRelay(stream, machine.sealer, machine.opener, acked=False,
                           refused=f"failed: {exc}")
            self.relays[host] = Counted(raw, self.salt)
            return self.relays[host]
        if isinstance(done, wire.RefusalReceived):
            await trio.aclose_forcefully(stream)
            raw = RawRelay(stream, machine.sealer, machine.opener, acked=False,
                           refused=done.reason)
            self.relays[host] = Counted(raw, self.salt)
            return self.relays[host]
        assert isinstance(done, wire.Established)
        counted = Counted(RawRelay(stream, done.sealer, done.opener, acked=True), self.salt,
                          generation=done.generation)
        counted.messages += [_label(self.salt, rec) for rec in done.records]
        self.nursery.start_soon(counted.read)
        self.relays[host] = counted
        return counted

    @asynccontextmanager
    async def coordinator(self, where: str, *, store: MemoryStore | None = None,
                          form: bool = True, timeline: EventLog | None = None,
                          **overrides: Any) -> AsyncIterator[Any]:
        """A coordinator listening at ``where``; with ``form``, the raw relays of ROSTER
        dial it (a fresh run's formation)."""
        if form:
            async def formation() -> None:
                for host, ranks in ROSTER:
                    await self.dial(where, host, ranks)
            self.nursery.start_soon(formation)
        async with ft.open_coordinator(
            self.net.listener(where), salt=self.salt, config=config(**overrides),
            store=self.store if store is None else store,
            timeline=timeline if timeline is not None else EventLog(),
        ) as coord:
            yield coord

    async def crashed_first_run(self, body: Callable[[Any], Any] | None = None) -> None:
        """A first coordinator forms, runs ``body``, and is gone (cancelled; its lease then
        runs out)."""
        with trio.CancelScope() as scope:
            async with self.coordinator("coord-1") as coord:
                if body is not None:
                    await body(coord)
                scope.cancel()
        self.store.expire()


@asynccontextmanager
async def cluster(net: MemoryNetwork) -> AsyncIterator[Cluster]:
    async with trio.open_nursery() as nursery:
        yield Cluster(net, nursery)
        nursery.cancel_scope.cancel()


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
        async with c.coordinator("coord-2", store=c.store.clone(), form=False) as coord:
            assert trio.current_time() == began  # no formation: nobody was waited for
            assert (coord.generation, coord.resumed) == (2, True)
            assert coord.phase == "running"
            assert coord.live_ranks == {0, 1, 2, 3}
            assert coord.dead_ranks == frozenset()
            assert [(r.host, r.ranks) for r in coord.relays] == list(ROSTER)
            state = await c.store.clone().load()
            assert state is not None and state.generation == 2 and state.formed


async def test_relays_that_resume_are_attached_without_a_death_or_declare_alive(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with cluster(memory_network) as c:
        await c.crashed_first_run()
        assert {host: r.generation for host, r in c.relays.items()} == {
            "host-a": 1, "host-b": 1}  # a durable coordinator says so at the join
        log = EventLog()
        async with c.coordinator("coord-2", store=c.store.clone(), form=False,
                                 timeline=log) as coord:
            for host, ranks in ROSTER:
                relay = await c.dial("coord-2", host, ranks, generation=1)
                assert relay.raw.acked and relay.generation == 2
            await wait_until(lambda: all(r.peer != "(not resumed)" for r in coord.relays),
                             limit=1)
            assert [(r.host, r.ranks) for r in coord.relays] == list(ROSTER)
            result = await coord.broadcast_control(wire.SyncNow())
            assert result.delivered == {0, 1, 2, 3}
            await wait_until(lambda: all("SyncNow" in r.messages for r in c.relays.values()),
                             limit=1)
            await trio.sleep(60)  # far past resume_timeout: nobody is declared dead
            assert coord.live_ranks == {0, 1, 2, 3}
            assert coord.rejoins == {}
            assert log.events_of(RankDeclaredDead) == []
            assert log.events_of(RankRejoined) == []
            for relay in c.relays.values():
                assert relay.messages[:1] == ["CoordHeartbeat"]  # the welcome
                assert not [m for m in relay.messages if m.startswith(("DeclareAlive",
                                                                       "DeclareDead"))]


async def test_ranks_of_a_relay_that_never_resumes_die_after_resume_timeout_and_not_before(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with cluster(memory_network) as c:
        await c.crashed_first_run()
        log = EventLog()
        async with c.coordinator("coord-2", store=c.store.clone(), form=False, timeline=log,
                                 resume_timeout=20) as coord:
            began = trio.current_time()
            await trio.sleep(5)
            host_b = await c.dial("coord-2", "host-b", (2, 3), generation=1)
            await trio.sleep(14.9)
            assert coord.live_ranks == {0, 1, 2, 3}
            await wait_until(lambda: coord.dead_ranks == {0, 1}, limit=1)
            deaths = log.of(RankDeclaredDead)
            assert [ev.rank for _, ev in deaths] == [0, 1]
            assert all(at - began == pytest.approx(20) for at, _ in deaths)
            reason = coord.dead_reason(0) or ""
            assert "relay 'host-a' did not resume within resume_timeout=20s" in reason
            assert "memory:memory" in reason
            await wait_until(lambda: {"DeclareDead(0)", "DeclareDead(1)"} <= set(
                host_b.messages), limit=1)
            await until_stored(c.store, lambda state: set(state.dead) == {0, 1})
            assert coord.live_ranks == {2, 3}


async def test_broadcast_after_a_failover_waits_for_the_resumes_and_reaches_who_came_back(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with cluster(memory_network) as c:
        await c.crashed_first_run()
        async with c.coordinator("coord-2", store=c.store.clone(), form=False,
                                 resume_timeout=20) as coord:
            async def resume_b_later() -> None:
                await trio.sleep(3)
                await c.dial("coord-2", "host-b", (2, 3), generation=1)

            c.nursery.start_soon(resume_b_later)
            began = trio.current_time()
            result = await coord.broadcast_control(wire.SyncNow())
            assert trio.current_time() - began == pytest.approx(20)  # host-a's timeout
            assert result.delivered == {2, 3}  # host-a's ranks died meanwhile: not attempted
            await wait_until(lambda: "SyncNow" in c.relays["host-b"].messages, limit=1)
            assert coord.dead_ranks == {0, 1}


async def test_dead_rank_that_resumes_rejoins_with_declare_alive(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async def lose_rank_1(coord: Any) -> None:
        await coord.declare_dead(1, "oom")
        await until_stored(c.store, lambda state: set(state.dead) == {1})

    async with cluster(memory_network) as c:
        await c.crashed_first_run(lose_rank_1)
        log = EventLog()
        async with c.coordinator("coord-2", store=c.store.clone(), form=False,
                                 timeline=log) as coord:
            host_b = await c.dial("coord-2", "host-b", (2, 3), generation=1)
            assert host_b.raw.acked
            await wait_until(lambda: "DeclareDead(1)" in host_b.messages, limit=1)
            host_a = await c.dial("coord-2", "host-a", (0, 1), generation=1)
            assert host_a.raw.acked
            await wait_until(lambda: coord.live_ranks == {0, 1, 2, 3}, limit=1)
            assert log.events_of(RankRejoined) == [RankRejoined(rank=1, host="host-a")]
            await wait_until(lambda: "DeclareAlive(1)" in host_b.messages, limit=1)
            assert not [m for m in host_b.messages if m.startswith("DeclareAlive(0")]
            assert coord.rejoins == {1: 1}
            await until_stored(c.store, lambda state: dict(state.dead) == {})


async def test_resume_that_would_be_refused_as_a_hello_is_refused_the_same_way(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with cluster(memory_network) as c:
        await c.crashed_first_run()
        async with c.coordinator("coord-2", store=c.store.clone(), form=False) as coord:
            stranger = await c.dial("coord-2", "host-c", (0,), generation=1)
            assert not stranger.raw.acked
            assert stranger.raw.refused is not None
            assert "expected every rank it names to be dead, but rank 0 is alive on relay " \
                   "'host-a'" in stranger.raw.refused
            assert coord.state()["rejected_handshakes"] == {"rejoin refused": 1}
            assert coord.live_ranks == {0, 1, 2, 3}


async def test_resume_from_a_relay_that_follows_a_newer_coordinator_is_closed_not_refused(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with cluster(memory_network) as c:
        await c.crashed_first_run()
        async with c.coordinator("coord-2", store=c.store.clone(), form=False) as coord:
            ahead = await c.dial("coord-2", "host-a", (0, 1), generation=5)
            assert not ahead.raw.acked
            refused = ahead.raw.refused or ""
            assert refused.startswith("failed: "), refused  # an EOF: it may try elsewhere
            assert coord.state()["rejected_handshakes"] == {"newer generation": 1}


async def test_dead_set_and_failure_count_survive_the_failover(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async def lose_rank_1(coord: Any) -> None:
        await coord.declare_dead(1, "oom")
        await until_stored(c.store, lambda state: set(state.dead) == {1})

    async with cluster(memory_network) as c:
        await c.crashed_first_run(lose_rank_1)
        log = EventLog()
        with pytest.raises(ft.ClusterFailure) as failure:
            async with c.coordinator("coord-2", store=c.store.clone(), form=False,
                                     timeline=log, max_failure=ft.MaxFailure.absolute(2)
                                     ) as coord:
                assert coord.dead_ranks == {1}
                assert "oom" in (coord.dead_reason(1) or "")
                assert coord.live_ranks == {0, 2, 3}
                await coord.declare_dead(3, "segfault")  # the second death of the run
                await trio.sleep_forever()
        assert failure.value.reason is ft.wire.SaveReason.MAX_FAILURE_EXCEEDED
        assert failure.value.dead == {1, 3}
        assert [ev.dead for ev in log.events_of(ClusterFailed)] == [(1, 3)]


async def stored(store: MemoryStore) -> SessionState:
    """What the store holds now, read through another handle (as the next coordinator)."""
    state = await store.clone().load()
    assert state is not None
    return state


async def until_stored(store: MemoryStore, check: Callable[[SessionState], bool]) -> None:
    for _ in range(100):
        if check(await stored(store)):
            return
        await trio.sleep(0.01)
    raise AssertionError(f"never stored: {await stored(store)}")


async def test_checkpoint_is_durable_when_save_checkpoint_returns_and_survives_the_failover(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    saved = {"epoch": 3, "synced": {"0": [1, 2]}, "blob": b"\x00\x01"}

    async def checkpoint(coord: Any) -> None:
        await coord.save_checkpoint(saved)
        assert (await stored(c.store)).checkpoint == saved  # durable before it returned

    async with cluster(memory_network) as c:
        await c.crashed_first_run(checkpoint)
        async with c.coordinator("coord-2", store=c.store.clone(), form=False) as coord:
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
    (True, 4, "expected the session of salt id "),
    (False, 8, "expected world size 4, got 8"),
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
        with pytest.raises(ft.StoreCorrupt) as refused:
            async with c.coordinator("coord-1", form=False):
                pytest.fail("a foreign session was adopted")
        text = str(refused.value)
        assert "memory:memory" in text and expected in text
        if other_salt:
            assert salt_id(c.salt).hex() in text and salt_id(salt).hex() in text
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


async def test_standby_waits_in_acquire_until_the_leader_ends_then_adopts(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with cluster(memory_network) as c:
        standby_entered: list[float] = []

        async def standby() -> None:
            async with c.coordinator("coord-2", store=c.store.clone(), form=False) as coord:
                standby_entered.append(trio.current_time())
                assert (coord.generation, coord.resumed) == (2, True)

        async with c.coordinator("coord-1") as coord:
            c.nursery.start_soon(standby)
            await trio.sleep(100)
            assert standby_entered == []
            assert coord.generation == 1
            ended = trio.current_time()
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
