"""The scaled relay cadence (issue 23): a coordinator of many relays paces the relay ↔
coordinator heartbeat exchange (``heartbeat_period``) and tells the relays (``Cadence``); the
relays send their ``Liveness`` records at that pace, ranks still beat every second, and a silent
rank is declared at its relay's first report after ``heartbeat_timeout`` from its last
heartbeat (within one period of it). All on ``MockClock``:
8 one-rank relays at ``relay_heartbeat_rate=2`` stand for 2,048 relays at the default 300 (a
period of some seconds)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import pytest
import trio
import trio.testing

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.events import RankDeclaredDead
from flodl_trio.testing import EventLog, MemoryNetwork, open_local_cluster

from helpers import COORD, Recorder, start_host, wait_until
from helpers.raw import raw_relay_handshake, read_one_record

CONTROL = int(wire.RecordKind.CONTROL)
EIGHT = {f"host-{r}": [r] for r in range(8)}


def paced(**kw: Any) -> ft.CoordinatorConfig:
    """8 relays at 2 exchanges a second: a 4 s period (under heartbeat_timeout / 4 = 7.5 s)."""
    return ft.CoordinatorConfig(world_size=8, formation_timeout=10,
                                relay_heartbeat_rate=kw.pop("relay_heartbeat_rate", 2.0), **kw)


async def beat_times(coord: ft.Coordinator, rank: int, seconds: float) -> list[float]:
    """When ``coord.timing`` got a Heartbeat of ``rank`` in the next ``seconds`` (what it
    holds already is dropped first)."""
    for _ in range(100_000):
        try:
            coord.timing.receive_nowait()
        except trio.WouldBlock:
            break
    times: list[float] = []
    with trio.move_on_after(seconds):
        while True:
            msg = await coord.timing.receive()
            if isinstance(msg, wire.Heartbeat) and msg.rank == rank:
                times.append(trio.current_time())
    return times


def gaps(times: Sequence[float]) -> list[float]:
    return [round(b - a, 6) for a, b in itertools.pairwise(times)]


@pytest.mark.parametrize(("relays", "rate", "stale_after", "period"), [
    (8, 2.0, 30.0, 4.0),  # relays / rate
    (8, 0.5, 30.0, 7.5),  # capped at heartbeat_timeout / 4
    (8, 1.0, 12.0, 3.0),
    (8, 16.0, 30.0, 1.0),  # never faster than heartbeat_interval
    (8, math.inf, 30.0, 1.0),  # inf: today's behaviour
])
async def test_the_period_is_relays_over_rate_between_the_interval_and_a_quarter_of_the_timeout(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, relays: int, rate: float,
        stale_after: float, period: float) -> None:
    cfg = ft.CoordinatorConfig(world_size=relays, formation_timeout=10,
                               heartbeat_timeout=stale_after, relay_heartbeat_rate=rate)
    async with open_local_cluster({f"host-{r}": [r] for r in range(relays)},
                                  network=memory_network, coord_config=cfg) as c:
        await trio.sleep(12)
        assert c.coord.heartbeat_period == period
        assert c.coord.dead_ranks == frozenset()


async def test_paced_relays_report_every_period_and_a_silent_rank_is_declared_within_one_period(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    log = EventLog()
    rec = Recorder(raw={1: 1.0})  # rank 1 beats every second, by hand, until the test stops it
    async with open_local_cluster(EIGHT, network=memory_network, timeline=log, rank_main=rec,
                                  raw_ranks=rec.raw_mains, coord_config=paced()) as c:
        await wait_until(lambda: c.coord.heartbeat_period == 4.0, limit=5)
        await trio.sleep(8)  # every relay had a tick at the new pace
        # Each relay's Liveness (one Heartbeat per rank on coord.timing) every 4 s, not 1 s.
        times = await beat_times(c.coord, 0, 17)
        assert 4 <= len(times) <= 5
        assert all(g == pytest.approx(4.0, abs=0.01) for g in gaps(times)), gaps(times)
        rec.raw[1].go_silent()
        await trio.sleep(0.5)  # a heartbeat due at this very moment may have been on its way
        silent_since = rec.raw[1].last_heartbeat()
        await wait_until(lambda: 1 in c.coord.dead_ranks, limit=40)
        ((declared_at, event),) = log.of(RankDeclaredDead)
        # The record that carried its last heartbeat came up to 4 s later, with its age: the
        # coordinator counts the rank as seen when its relay verified that heartbeat. It is
        # declared at its relay's first report after that deadline (SPEC §4.5: on evidence),
        # which names no rank: within one period.
        assert silent_since + 30 <= declared_at <= silent_since + 30 + 4
        assert event.reason == "heartbeat stale (>30s)"
        assert c.coord.live_ranks == {0, 2, 3, 4, 5, 6, 7}


async def test_at_an_infinite_rate_every_relay_reports_every_second_as_before(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    async with open_local_cluster(EIGHT, network=memory_network,
                                  coord_config=paced(relay_heartbeat_rate=math.inf)) as c:
        await trio.sleep(8)
        times = await beat_times(c.coord, 0, 10.5)
        assert c.coord.heartbeat_period == 1.0
        assert 10 <= len(times) <= 11
        assert all(g == pytest.approx(1.0, abs=0.01) for g in gaps(times)), gaps(times)


class Freezable(trio.abc.HalfCloseableStream):
    """A relay's upstream that can be frozen like a SIGSTOPped host: once ``frozen``, nothing
    more is sent or read (the calls block, cancellably), and the connection stays open."""

    def __init__(self, stream: trio.abc.HalfCloseableStream) -> None:
        self.stream = stream
        self.frozen = trio.Event()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self.frozen.is_set():
            await trio.sleep_forever()
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = await self.stream.receive_some(max_bytes)
        if self.frozen.is_set():
            await trio.sleep_forever()
        return data

    async def aclose(self) -> None:
        await self.stream.aclose()


async def test_a_frozen_relays_ranks_are_declared_at_most_a_period_and_a_second_early(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    salt = ft.SessionSalt.generate()
    log = EventLog()
    frozen: list[Freezable] = []

    async def dial_freezable() -> trio.abc.Stream:
        stream = Freezable(await memory_network.connect(COORD))
        frozen.append(stream)
        return stream

    async def frozen_host() -> None:
        # The relay and its rank never give up first: only the coordinator's staleness acts.
        async with ft.open_relay(dial_freezable, salt=salt, host="host-5", ranks=[5],
                                 world_size=8, rank_listen=memory_network.listener("relay:host-5"),
                                 config=ft.RelayConfig(write_stall_timeout=300)) as r, \
                ft.open_rank(lambda: memory_network.connect("relay:host-5"), salt=salt, rank=5,
                             world_size=8, config=ft.RankConfig(coord_liveness_timeout=300)):
            await r.wait_closed()

    async with trio.open_nursery() as nursery:
        for r in (0, 1, 2, 3, 4, 6, 7):
            await start_host(nursery, memory_network, f"host-{r}", [r], salt=salt, world=8)
        nursery.start_soon(frozen_host)
        async with ft.open_coordinator(memory_network.listener(COORD), salt=salt,
                                       config=paced(), timeline=log) as coord:
            await wait_until(lambda: coord.heartbeat_period == 4.0, limit=5)
            await trio.sleep(9.5)
            frozen_at = trio.current_time()
            frozen[0].frozen.set()
            await wait_until(lambda: coord.dead_ranks, limit=40)
            ((declared_at, event),) = log.of(RankDeclaredDead)
            assert event.rank == 5 and event.reason == "heartbeat stale (>30s)"
            # Its last record was up to a period old, its last heartbeat up to a second more.
            assert frozen_at + 30 - (4 + 1) <= declared_at <= frozen_at + 30
            assert coord.live_ranks == {0, 1, 2, 3, 4, 6, 7}
            nursery.cancel_scope.cancel()


async def test_a_relay_that_joins_late_gets_the_period_right_after_its_welcome(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    salt = ft.SessionSalt.generate()
    seen: list[Any] = []

    async def late_relay() -> None:
        await trio.sleep(6)  # the seven others' are paced for the world's 8 relays: 4 s
        raw = await raw_relay_handshake(await memory_network.connect(COORD), salt, "host-7",
                                        [7], world_size=8)
        assert raw.acked  # the welcome came before anything else: the join is confirmed
        try:
            for _ in range(3):
                got = await read_one_record(raw.stream, raw.opener)
                if got is None:
                    return
                seen.append(wire.decode_relay(got.payload) if got.kind == CONTROL else got.kind)
        finally:
            await trio.aclose_forcefully(raw.stream)

    async with trio.open_nursery() as nursery:
        for r in range(7):
            await start_host(nursery, memory_network, f"host-{r}", [r], salt=salt, world=8)
        nursery.start_soon(late_relay)
        async with ft.open_coordinator(memory_network.listener(COORD), salt=salt,
                                       config=paced()) as coord:
            assert coord.heartbeat_period == 4.0
            await wait_until(lambda: len(seen) == 3, limit=10)
            nursery.cancel_scope.cancel()
    assert seen[0] == wire.Cadence(interval=4.0)


async def test_tcp_relays_learn_the_world_s_period_in_their_welcome_s_write_once_each(
        autojump_clock: trio.abc.Clock) -> None:
    # Plain TCP (the coordinator's handshake hub). While forming, the period is paced for the
    # relays the world will have (8 one-rank relays at 2 a second: 4 s) from the first join,
    # and each relay's Cadence rides in its welcome's write: it has it the moment its join
    # is confirmed, without another read, and no round of Cadence records follows.
    salt = ft.SessionSalt.generate()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    raws: list[Any] = []

    async def relay(r: int) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        raws.append(await raw_relay_handshake(stream, salt, f"host-{r}", [r], world_size=8))

    async with trio.open_nursery() as nursery:
        for r in range(7):
            nursery.start_soon(relay, r)

        async def late_relay() -> None:
            await trio.sleep(6)  # several of the coordinator's heartbeat periods later
            await relay(7)

        nursery.start_soon(late_relay)
        async with ft.open_coordinator(listeners, salt=salt, config=paced()) as coord:
            assert coord.heartbeat_period == 4.0
            assert len(raws) == 8
            for raw in raws:
                assert raw.acked
                [cadence] = raw.opener.feed(b"")  # already here: it came with the welcome
                assert cadence.kind == CONTROL
                assert wire.decode_relay(cadence.payload) == wire.Cadence(interval=4.0)
            await trio.sleep(10)  # no later Cadence: only CoordHeartbeat fan-outs arrive
            for raw in raws:
                with trio.move_on_after(0.5):
                    while True:
                        data = await raw.stream.receive_some(65536)
                        assert data
                        for rec in raw.opener.feed(data):
                            assert rec.kind != CONTROL, wire.decode_relay(rec.payload)
            nursery.cancel_scope.cancel()
    for raw in raws:
        await trio.aclose_forcefully(raw.stream)
