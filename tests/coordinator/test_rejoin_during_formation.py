"""The formation window (issue 26), on the in-memory transport under MockClock: a relay lost after
its Ready while formation still runs is uncovered, and its restart simply joins; a different host
takes its ranks only with takeover; a rank declared dead during formation is not "already
announced" any more: its host (or, with takeover, a spare) brings it back, and formation completes
with every rank alive. A rejoin that ends without joining leaves no connection open."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.coordinator import formation
from flodl_trio.events import (
    ClusterFailed,
    FormationComplete,
    FormationFailed,
    HandshakeRejected,
    RankDeclaredDead,
    RankRejoined,
    RankTakenOver,
    RelayJoined,
    RelayLost,
)
from flodl_trio.testing import EventLog, MemoryNetwork
from flodl_trio.wire import RankDropped, RecordKind, encode

from helpers import COORD, wait_until
from helpers.raw import RawRelay, drain_and_close, raw_relay_handshake, read_one_record
from helpers.rejoin import SIGS, RawCohort, quiet_config, raw_cohort
from helpers.streams import Relayed


@attrs.define(eq=False)
class Forming(RawCohort):
    """A coordinator still forming (world 4); the test dials raw relays and hangs them up."""

    done: trio.Event = attrs.Factory(trio.Event)

    async def join(self, host: str, ranks: list[int]) -> RawRelay:
        """A relay whose join completes (Ready verified, welcome read)."""
        joined = len(self.timeline.events_of(RelayJoined))
        raw = await self.dial(host, ranks)
        assert raw.acked, f"{host} {ranks} was refused: {self.refusals()}"
        await wait_until(lambda: len(self.timeline.events_of(RelayJoined)) > joined, limit=1)
        return raw

    async def kill(self, raw: RawRelay) -> None:
        """The relay's process dies: its connection ends; wait until the coordinator saw it."""
        lost = len(self.timeline.events_of(RelayLost))
        await raw.stream.aclose()
        await wait_until(lambda: len(self.timeline.events_of(RelayLost)) > lost, limit=1)

    async def drop_rank(self, raw: RawRelay, rank: int) -> None:
        """The relay reports that it dropped one of its ranks (the rank is declared dead)."""
        record = raw.sealer.seal(int(RecordKind.CONTROL), 0,
                                 encode(RankDropped(rank=rank, reason="killed by the test")))
        await raw.stream.send_all(record)
        await wait_until(lambda: any(ev.rank == rank for ev in
                                     self.timeline.events_of(RankDeclaredDead)), limit=1)

    async def join_dropping(self, host: str, ranks: list[int], rank: int) -> RawRelay:
        """A relay whose join completes, then reports that it dropped ``rank``."""
        raw = await self.join(host, ranks)
        await self.drop_rank(raw, rank)
        return raw

    async def formed(self) -> Any:
        await wait_until(lambda: self.coord is not None, limit=1)
        assert self.timeline.events_of(FormationFailed) == []
        return self.coord


@asynccontextmanager
async def forming(net: MemoryNetwork, **config: Any) -> AsyncIterator[Forming]:
    cfg = quiet_config(**config)
    async with raw_cohort(net, Forming) as run:

        async def coordinator() -> None:
            async with ft.open_coordinator(net.listener(COORD), salt=run.salt, config=cfg,
                                           timeline=run.timeline) as coord:
                run.coord = coord
                await run.done.wait()

        run.nursery.start_soon(coordinator)
        await trio.sleep(0.01)
        yield run
        run.done.set()
        await wait_until(lambda: run.coord is None or run.coord.phase == "closed", limit=30)


async def test_relay_lost_after_ready_and_restarted_before_formation_completes_simply_joins(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with forming(memory_network) as run:
        a = await run.join("host-a", [0, 1])
        await run.kill(a)
        assert run.coord is None  # uncovered again, not complete
        await run.join("host-a", [0, 1])
        await run.join("host-b", [2, 3])
        coord = await run.formed()
        assert coord.live_ranks == {0, 1, 2, 3} and coord.dead_ranks == frozenset()
        assert run.refusals() == []
        assert run.timeline.events_of(RankDeclaredDead) == []
        assert [ev.host for ev in run.timeline.events_of(RelayJoined)] == [
            "host-a", "host-a", "host-b"]
        (done,) = run.timeline.events_of(FormationComplete)
        assert done.relays == 2
        await coord.send_control(0, ft.wire.SyncNow())  # rank 0 is on the new connection


async def test_spare_taking_a_lost_relays_ranks_during_formation_is_admitted_with_takeover(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with forming(memory_network, allow_rank_takeover=True) as run:
        await run.kill(await run.join("host-a", [0, 1]))
        await run.join("host-x", [0, 1])
        await run.join("host-b", [2, 3])
        coord = await run.formed()
        assert coord.live_ranks == {0, 1, 2, 3}
        assert run.timeline.events_of(RankTakenOver) == [
            RankTakenOver(rank=0, host="host-x", previous_host="host-a"),
            RankTakenOver(rank=1, host="host-x", previous_host="host-a")]
        assert run.timeline.events_of(RankRejoined) == []  # they never died
        assert run.refusals() == []


async def test_spare_taking_a_lost_relays_ranks_during_formation_is_refused_without_takeover(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with forming(memory_network) as run:
        await run.kill(await run.join("host-a", [0, 1]))
        spare = await run.dial("host-x", [1])
        assert not spare.acked
        (reason,) = run.refusals()
        assert reason.startswith("rejoin refused: ")
        assert "relay 'host-x'" in reason
        assert "rank 1 was announced by host 'host-a', whose relay was lost" in reason
        assert "allow_rank_takeover" in reason
        # Not a formation failure: host-a itself comes back and the cohort forms.
        await run.join("host-a", [0, 1])
        await run.join("host-b", [2, 3])
        coord = await run.formed()
        assert coord.live_ranks == {0, 1, 2, 3}
        assert run.timeline.events_of(RankTakenOver) == []


async def test_rank_dropped_during_formation_comes_back_with_its_restarted_relay(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with forming(memory_network) as run:
        a = await run.join_dropping("host-a", [0, 1], 1)
        await run.kill(a)  # its relay restarts: both ranks are new endpoints
        await trio.sleep(1)
        assert run.timeline.events_of(ClusterFailed) == []  # no live rank, but still forming
        await run.join("host-a", [0, 1])
        await run.join("host-b", [2, 3])
        coord = await run.formed()
        assert coord.live_ranks == {0, 1, 2, 3} and coord.dead_ranks == frozenset()
        assert run.timeline.events_of(RankRejoined) == [RankRejoined(rank=1, host="host-a")]
        assert coord.state()["rejoins"] == {"1": 1}
        assert run.refusals() == []


async def test_rank_dropped_during_formation_is_not_already_announced_its_host_brings_it_back(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with forming(memory_network) as run:
        await run.join_dropping("host-a", [0, 1], 1)
        await run.join("host-a", [1])  # a new relay of host-a for rank 1; rank 0 stays on a
        await run.join("host-b", [2, 3])
        coord = await run.formed()
        assert coord.live_ranks == {0, 1, 2, 3} and coord.dead_ranks == frozenset()
        assert run.timeline.events_of(RankRejoined) == [RankRejoined(rank=1, host="host-a")]
        assert run.refusals() == []
        await coord.send_control(0, ft.wire.SyncNow())  # still on the first connection
        await coord.send_control(1, ft.wire.SyncNow())


@pytest.mark.parametrize("takeover", [True, False])
async def test_rank_dropped_during_formation_goes_to_a_spare_only_with_takeover(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, takeover: bool
) -> None:
    async with forming(memory_network, allow_rank_takeover=takeover) as run:
        await run.join_dropping("host-a", [0, 1], 1)
        spare = await run.dial("host-x", [1])
        assert spare.acked is takeover
        await run.join("host-b", [2, 3])
        coord = await run.formed()  # formation never fails for it
        if takeover:
            assert coord.live_ranks == {0, 1, 2, 3}
            assert run.timeline.events_of(RankTakenOver) == [
                RankTakenOver(rank=1, host="host-x", previous_host="host-a")]
            assert run.refusals() == []
        else:
            assert coord.live_ranks == {0, 2, 3} and coord.dead_ranks == {1}
            (reason,) = run.refusals()
            assert "rank 1 was announced by host 'host-a'" in reason
            assert "allow_rank_takeover" in reason


async def test_a_live_rank_named_during_formation_still_fails_formation_as_already_announced(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=60)
    salt = ft.SessionSalt.generate()
    async with trio.open_nursery() as nursery:
        async def relays() -> None:
            for host, ranks in (("host-a", [0, 1]), ("host-x", [1])):
                raw = await raw_relay_handshake(await memory_network.connect(COORD), salt, host,
                                                ranks, world_size=4, model_sigs=SIGS)
                nursery.start_soon(drain_and_close, raw.stream)

        nursery.start_soon(relays)
        with pytest.raises(ft.FormationError, match="rank 1 was already announced by relay "
                                                    "'host-a'"):
            async with ft.open_coordinator(memory_network.listener(COORD), salt=salt,
                                           config=cfg):
                pass
        nursery.cancel_scope.cancel()


class HeldReady(Relayed):
    """A relay's stream whose Ready waits for ``release`` (the magic and the Hello go at once)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.sends = 0
        self.release = trio.Event()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.sends += 1
        if self.sends > 2:
            await self.release.wait()
        await self.inner.send_all(data)


@pytest.fixture
def rejoin_conns(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every connection object the coordinator makes for a relay, in order."""
    made: list[Any] = []
    new_conn = formation.Formation.new_conn

    def recording(self: Any, *args: Any) -> Any:
        conn = new_conn(self, *args)
        made.append(conn)
        return conn

    monkeypatch.setattr(formation.Formation, "new_conn", recording)
    return made


class ReleaseOn(EventLog):
    """An EventLog that sets ``release`` when an event of class ``kind`` is recorded."""

    def __init__(self, kind: type[Any], release: trio.Event) -> None:
        super().__init__()
        self.kind = kind
        self.release = release

    def event(self, ev: Any) -> Any:
        stamped = super().event(ev)
        if isinstance(ev, self.kind):
            self.release.set()
        return stamped


async def test_rejoin_refused_after_its_ready_closes_its_whole_connection(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, rejoin_conns: list[Any]
) -> None:
    # host-a's rejoin waits for its Ready; meanwhile host-b dies and the failure policy stops
    # the run, so the Ready arrives at a run with nothing to rejoin.
    salt = ft.SessionSalt.generate()
    cfg = quiet_config(max_failure=ft.MaxFailure.absolute(3))
    release = trio.Event()
    log = ReleaseOn(ClusterFailed, release)
    outcome: list[bool] = []
    async with trio.open_nursery() as nursery:
        raws: dict[str, RawRelay] = {}

        async def form() -> None:
            for host, ranks in (("host-a", [0, 1]), ("host-b", [2]), ("host-c", [3])):
                raws[host] = await raw_relay_handshake(await memory_network.connect(COORD),
                                                       salt, host, ranks, world_size=4,
                                                       model_sigs=SIGS)
                nursery.start_soon(drain_and_close, raws[host].stream)

        nursery.start_soon(form)
        with pytest.raises(ft.ClusterFailure, match="MAX_FAILURE_EXCEEDED"):
            await failing_run(memory_network, salt, cfg, log, raws, outcome, release, nursery)
        await wait_until(lambda: outcome != [], limit=5)
        nursery.cancel_scope.cancel()
    assert outcome == [True]  # the relay's connection ended (it re-dials and is refused)
    refusals = [ev.reason for ev in log.events_of(HandshakeRejected)]
    assert any(r.startswith("rejoin refused: ") and "expected a running cohort to rejoin, but"
               in r for r in refusals), refusals
    assert log.events_of(RankRejoined) == []
    refused = rejoin_conns[-1]
    assert refused.host == "host-a" and refused.ranks == (0, 1)
    assert refused.closed and not refused.alive


async def failing_run(net: MemoryNetwork, salt: ft.SessionSalt, cfg: ft.CoordinatorConfig,
                      log: EventLog, raws: dict[str, RawRelay], outcome: list[bool],
                      release: trio.Event, nursery: trio.Nursery) -> None:
    """host-a dies, its rejoin's Ready is held (until ``release``), then host-b dies."""
    async with ft.open_coordinator(net.listener(COORD), salt=salt, config=cfg,
                                   timeline=log) as coord:
        await raws["host-a"].stream.aclose()
        await wait_until(lambda: coord.dead_ranks == {0, 1}, limit=1)
        stream = HeldReady(await net.connect(COORD))
        stream.release = release

        async def rejoin() -> None:
            await raw_relay_handshake(stream, salt, "host-a", [0, 1], world_size=4,
                                      model_sigs=SIGS)
            outcome.append(await drain_and_close(stream, limit=5))

        nursery.start_soon(rejoin)
        await wait_until(lambda: stream.sends == 3, limit=1)  # its Hello went; Ready held
        await raws["host-b"].stream.aclose()
        await trio.sleep(30)  # cancelled by the failure policy


async def test_rejoin_still_waiting_for_its_ready_at_shutdown_leaves_nothing_open(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, rejoin_conns: list[Any]
) -> None:
    async with forming(memory_network) as run:
        await run.join_dropping("host-a", [0, 1], 1)
        await run.join("host-b", [2, 3])
        coord = await run.formed()
        assert coord.dead_ranks == {1}
        stream = HeldReady(await run.net.connect(COORD))

        async def rejoin() -> None:
            try:
                await raw_relay_handshake(stream, run.salt, "host-a", [1], world_size=4,
                                          model_sigs=SIGS)
            finally:
                await trio.aclose_forcefully(stream)

        run.nursery.start_soon(rejoin)
        await wait_until(lambda: stream.sends == 3, limit=1)  # Hello went, Ready held
        assert len(rejoin_conns) == 3
    pending = rejoin_conns[2]
    assert pending.ranks == (1,)
    assert pending.closed and not pending.alive


async def test_max_failure_reached_during_formation_stops_the_run_once_it_formed(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    cfg = quiet_config(max_failure=ft.MaxFailure.absolute(1))
    body_ran = False
    async with raw_cohort(memory_network, Forming) as run:
        log = run.timeline

        async def relays() -> None:
            await run.join_dropping("host-a", [0, 1], 1)
            await trio.sleep(1)
            assert log.events_of(ClusterFailed) == []  # not while forming
            await run.join("host-b", [2, 3])

        run.nursery.start_soon(relays)
        with pytest.raises(ft.ClusterFailure, match="MAX_FAILURE_EXCEEDED"):
            async with ft.open_coordinator(memory_network.listener(COORD), salt=run.salt,
                                           config=cfg, timeline=log):
                body_ran = True
                await trio.sleep(30)
    assert body_ran
    (failed,) = log.events_of(ClusterFailed)
    assert failed.dead == (1,)


async def test_relay_joining_during_formation_is_told_the_deaths_declared_before_it(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with forming(memory_network) as run:
        await run.join_dropping("host-a", [0, 1], 1)
        b = await raw_relay_handshake(await run.net.connect(COORD), run.salt, "host-b", [2, 3],
                                      world_size=4, model_sigs=SIGS)
        assert b.acked
        told: list[tuple[tuple[int, ...], Any]] = []
        with trio.move_on_after(5):
            while not told:
                rec = await read_one_record(b.stream, b.opener)
                assert rec is not None
                if rec.kind == wire.RecordKind.FANOUT:
                    ranks, frame = wire.decode_fanout(rec.payload)
                    msg = wire.decode_control(wire.decode_frame(run.salt, frame).payload)
                    if isinstance(msg, wire.DeclareDead):
                        told.append((ranks, msg))
        run.nursery.start_soon(drain_and_close, b.stream)
        assert told == [((2, 3), wire.DeclareDead(rank=1))]
        await run.formed()


async def test_relay_redialing_before_its_old_connection_ended_brings_its_dropped_rank_back(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    # The old connection is still open (its end not seen yet): the re-dial of the same host
    # with the same ranks replaces it, as any re-dial during formation does.
    async with forming(memory_network) as run:
        await run.join_dropping("host-a", [0, 1], 1)
        await run.join("host-a", [0, 1])
        await run.join("host-b", [2, 3])
        coord = await run.formed()
        assert coord.live_ranks == {0, 1, 2, 3} and coord.dead_ranks == frozenset()
        assert run.timeline.events_of(RankRejoined) == [RankRejoined(rank=1, host="host-a")]
        assert run.refusals() == []
        assert [r["host"] for r in coord.state()["relays"]] == ["host-a", "host-b"]
