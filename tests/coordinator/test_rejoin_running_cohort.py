"""Who may rejoin a running cohort (issue 26), on the in-memory transport under MockClock: a relay
whose named ranks are all dead is admitted and they are alive again; one naming a rank alive on
another host, a rank of another host (takeover off), another world size or another model is
refused at once, with the reason recorded, and the run goes on untouched. (The same host naming
its own live ranks supersedes its old connection: tests/test_rejoin_supersede.py.)"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio

import flodl_trio as ft
from flodl_trio.events import (
    ClusterFailed,
    HandshakeRejected,
    RankRejoined,
    RankTakenOver,
    RelayJoined,
)
from flodl_trio.testing import EventLog, MemoryNetwork

from helpers import COORD, wait_until
from helpers.raw import RawRelay, drain_and_close, raw_relay_handshake

SIGS = {"model": bytes(range(32))}


@attrs.define(eq=False)
class Run:
    """A running coordinator whose relays are raw peers the test dials and hangs up."""

    net: MemoryNetwork
    salt: ft.SessionSalt
    nursery: trio.Nursery
    timeline: EventLog
    coord: Any = None
    relays: dict[str, RawRelay] = attrs.Factory(dict)

    async def dial(self, host: str, ranks: list[int], *, world_size: int = 4,
                   model_sigs: dict[str, bytes] | None = None) -> RawRelay:
        """One relay's full handshake; an admitted one keeps reading until :meth:`hang_up`."""
        raw = await raw_relay_handshake(await self.net.connect(COORD), self.salt, host, ranks,
                                        world_size=world_size,
                                        model_sigs=SIGS if model_sigs is None else model_sigs)
        self.nursery.start_soon(drain_and_close, raw.stream)
        return raw

    async def hang_up(self, raw: RawRelay, dead: set[int]) -> None:
        """Close a relay's connection (a crash, as the coordinator sees it); wait for the
        deaths it causes."""
        await raw.stream.aclose()
        await wait_until(lambda: dead <= self.coord.dead_ranks, limit=5)

    def refusals(self) -> list[str]:
        return [ev.reason for ev in self.timeline.events_of(HandshakeRejected)]


class Recording(trio.abc.HalfCloseableStream):
    """A stream that keeps a copy of every byte sent through it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sent = bytearray()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.sent += data
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some(max_bytes)

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()


@asynccontextmanager
async def running(net: MemoryNetwork, **config: Any) -> AsyncIterator[Run]:
    """host-a carries ranks 0 and 1, host-b ranks 2 and 3; formed; yields the run."""
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=60, heartbeat_interval=3600,
                               heartbeat_timeout=3600, **config)
    async with trio.open_nursery() as nursery:
        run = Run(net, ft.SessionSalt.generate(), nursery, EventLog())

        async def form() -> None:
            for host, ranks in (("host-a", [0, 1]), ("host-b", [2, 3])):
                run.relays[host] = await run.dial(host, ranks)

        nursery.start_soon(form)
        async with ft.open_coordinator(net.listener(COORD), salt=run.salt, config=cfg,
                                       timeline=run.timeline) as coord:
            run.coord = coord
            await wait_until(lambda: len(run.relays) == 2, limit=1)
            yield run
            assert coord.failure is None
            assert run.timeline.events_of(ClusterFailed) == []
        nursery.cancel_scope.cancel()


async def test_relay_whose_ranks_are_all_dead_is_admitted_and_they_are_alive_again(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with running(memory_network) as run:
        await run.hang_up(run.relays["host-a"], {0, 1})
        assert run.coord.live_ranks == {2, 3}
        again = await run.dial("host-a", [0, 1])
        assert again.acked
        await wait_until(lambda: run.coord.live_ranks == {0, 1, 2, 3}, limit=1)
        assert run.coord.dead_ranks == frozenset()
        assert run.timeline.events_of(RankRejoined) == [
            RankRejoined(rank=0, host="host-a"), RankRejoined(rank=1, host="host-a")]
        assert [ev.host for ev in run.timeline.events_of(RelayJoined)] == [
            "host-a", "host-b", "host-a"]
        assert run.refusals() == []
        assert run.coord.state()["rejoins"] == {"0": 1, "1": 1}
        # The new connection is the one addressed: a send to a rejoined rank goes through.
        await run.coord.send_control(0, ft.wire.SyncNow())


async def test_relay_of_another_host_naming_a_live_rank_is_refused_at_once_with_the_reason(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with running(memory_network) as run:
        # host-a is alive: a stranger may not claim its ranks (its own double supersedes it
        # since issue 26b: tests/test_rejoin_supersede.py).
        started = trio.current_time()
        stranger = await run.dial("host-c", [1])
        assert not stranger.acked
        assert trio.current_time() - started == pytest.approx(0)
        reasons = run.refusals()
        assert len(reasons) == 1
        assert reasons[0].startswith("rejoin refused: "), reasons
        assert "relay 'host-c'" in reasons[0]
        assert "expected every rank it names to be dead, but rank 1 is alive on relay " \
               "'host-a'" in reasons[0]
        assert run.coord.live_ranks == {0, 1, 2, 3}
        assert run.coord.state()["rejected_handshakes"] == {"rejoin refused": 1}


async def test_same_host_naming_one_dead_and_one_live_rank_supersedes_its_connection(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with running(memory_network) as run:
        await run.coord.declare_dead(0, "gpu fell off the bus")
        # Another host naming them is refused (rank 1 is alive on host-a; no takeover).
        assert not (await run.dial("host-c", [0, 1])).acked
        assert "rank 0 was announced by host 'host-a'" in run.refusals()[0]
        # host-a itself restarted: its old connection (rank 1 alive on it) is superseded.
        assert (await run.dial("host-a", [0, 1])).acked
        await wait_until(lambda: run.coord.live_ranks == {0, 1, 2, 3}, limit=1)
        assert run.timeline.events_of(RankRejoined) == [RankRejoined(rank=0, host="host-a"),
                                                        RankRejoined(rank=1, host="host-a")]
        assert len(run.refusals()) == 1


async def test_takeover_by_another_host_is_refused_by_default(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with running(memory_network) as run:
        await run.hang_up(run.relays["host-a"], {0, 1})
        assert not (await run.dial("spare", [0, 1])).acked
        (reason,) = run.refusals()
        assert "rank 0 was announced by host 'host-a'" in reason
        assert "allow_rank_takeover=True" in reason
        assert run.coord.dead_ranks == {0, 1}


async def test_takeover_by_a_spare_host_is_admitted_when_allowed_and_recorded(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with running(memory_network, allow_rank_takeover=True) as run:
        await run.hang_up(run.relays["host-a"], {0, 1})
        assert (await run.dial("spare", [0, 1])).acked
        await wait_until(lambda: run.coord.live_ranks == {0, 1, 2, 3}, limit=1)
        assert run.timeline.events_of(RankTakenOver) == [
            RankTakenOver(rank=0, host="spare", previous_host="host-a"),
            RankTakenOver(rank=1, host="spare", previous_host="host-a")]
        assert [ev.host for ev in run.timeline.events_of(RankRejoined)] == ["spare", "spare"]
        hosts = [r["host"] for r in run.coord.state()["relays"]]
        assert hosts == ["host-b", "spare"]  # the crashed connection left the roster


@pytest.mark.parametrize(("world_size", "sigs", "expected"), [
    (5, SIGS, "world_size mismatch: the coordinator's world_size is 4, the relay's is 5"),
    (4, {"model": bytes(32)}, "model signature mismatch"),
], ids=["world-size", "model-signature"])
async def test_rejoin_with_another_world_or_model_is_refused(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, world_size: int,
    sigs: dict[str, bytes], expected: str,
) -> None:
    async with running(memory_network) as run:
        await run.hang_up(run.relays["host-a"], {0, 1})
        assert not (await run.dial("host-a", [0, 1], world_size=world_size,
                                   model_sigs=sigs)).acked
        (reason,) = run.refusals()
        assert expected in reason and "relay 'host-a'" in reason
        assert run.coord.dead_ranks == {0, 1}


async def test_rank_that_exited_cleanly_never_rejoins(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with running(memory_network) as run:
        b = run.relays["host-b"]
        frame = ft.wire.FrameCodec(run.salt).encode(ft.wire.Exiting(rank=3))
        await b.stream.send_all(b.sealer.seal(int(ft.wire.RecordKind.DATA), 3, frame))
        await wait_until(lambda: run.coord.exited_ranks == {3}, limit=1)
        await run.hang_up(b, {2})
        assert not (await run.dial("host-b", [2, 3])).acked
        assert "rank 3 exited cleanly and does not rejoin" in run.refusals()[0]
        assert (await run.dial("host-b", [2])).acked
        await wait_until(lambda: run.coord.live_ranks == {0, 1, 2}, limit=1)


async def test_a_recorded_rejoin_replayed_on_a_new_connection_is_refused(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with running(memory_network) as run:
        await run.hang_up(run.relays["host-a"], {0, 1})
        recording = Recording(await run.net.connect(COORD))
        genuine = await raw_relay_handshake(recording, run.salt, "host-a", [0, 1], world_size=4,
                                            model_sigs=SIGS)
        assert genuine.acked
        await wait_until(lambda: run.coord.live_ranks == {0, 1, 2, 3}, limit=1)
        await run.hang_up(genuine, {0, 1})
        # Everything the genuine relay sent (its magic, Hello, Ready), on a new connection.
        replay = await run.net.connect(COORD)
        await replay.send_all(bytes(recording.sent))
        await drain_and_close(replay, limit=5)
        (reason,) = run.refusals()
        assert reason.startswith("bad mac: ") and "tag does not verify" in reason
        assert run.coord.dead_ranks == {0, 1}
        assert len(run.timeline.events_of(RankRejoined)) == 2  # the genuine rejoin only


class NoReady(Recording):
    """A relay's stream whose records after the coordinator's HelloAck never leave: its Ready
    is lost on the way."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.reads = 0

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = await self.inner.receive_some(max_bytes)
        self.reads += 1
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self.reads < 2:  # the magic and the Hello go; from the Ready on, nothing does
            await super().send_all(data)


async def test_a_rejoin_whose_ready_was_lost_is_superseded_by_the_same_relay_redialing(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with running(memory_network, handshake_timeout=30, allow_rank_takeover=True) as run:
        await run.hang_up(run.relays["host-a"], {0, 1})
        outcome: list[bool] = []

        async def first_attempt() -> None:
            stream = NoReady(await run.net.connect(COORD))
            raw = await raw_relay_handshake(stream, run.salt, "host-a", [0, 1], world_size=4,
                                            model_sigs=SIGS)
            outcome.append(raw.acked)
            await stream.aclose()

        run.nursery.start_soon(first_attempt)
        await trio.sleep(1)
        assert outcome == [] and run.coord.dead_ranks == {0, 1}  # waiting for its Ready
        # Meanwhile a spare may not claim them (takeover is allowed, but they are claimed),
        # and the same relay re-dialing may.
        assert not (await run.dial("host-x", [0, 1])).acked
        assert "rank 0 is being rejoined by relay 'host-a'" in run.refusals()[0]
        started = trio.current_time()
        assert (await run.dial("host-a", [0, 1])).acked
        await wait_until(lambda: outcome == [False], limit=1)  # closed at once, not at 30 s
        assert trio.current_time() - started < 1
        assert run.coord.live_ranks == {0, 1, 2, 3}
        assert len(run.timeline.events_of(RankRejoined)) == 2
