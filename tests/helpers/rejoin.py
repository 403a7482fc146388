"""A coordinator whose relays are raw peers the test dials and hangs up (world 4, ranks 0-3, one
model signature, deadlines far away): the set-up of the rejoin tests (issue 26), while the run
forms or once it runs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import attrs
import trio

import flodl_trio as ft
from flodl_trio.events import ClusterFailed, HandshakeRejected
from flodl_trio.testing import EventLog, MemoryNetwork

from helpers import COORD, wait_until
from helpers.raw import RawRelay, drain_and_close, raw_relay_handshake
from helpers.streams import Relayed

SIGS = {"model": bytes(range(32))}
C = TypeVar("C", bound="RawCohort")


def quiet_config(**config: Any) -> ft.CoordinatorConfig:
    """World 4, formation within 60 s, heartbeats too rare to matter; ``config`` on top."""
    return ft.CoordinatorConfig(world_size=4, formation_timeout=60, heartbeat_interval=3600,
                                heartbeat_timeout=3600, **config)


@attrs.define(eq=False)
class RawCohort:
    """A coordinator (``coord`` once it is open) whose relays are raw peers the test dials."""

    net: MemoryNetwork
    salt: ft.SessionSalt
    nursery: trio.Nursery
    timeline: EventLog
    coord: Any = None

    async def dial(self, host: str, ranks: list[int], *, world_size: int = 4,
                   model_sigs: dict[str, bytes] | None = None) -> RawRelay:
        """One relay's full handshake; an admitted one keeps reading until it is closed."""
        raw = await raw_relay_handshake(await self.net.connect(COORD), self.salt, host, ranks,
                                        world_size=world_size,
                                        model_sigs=SIGS if model_sigs is None else model_sigs)
        self.nursery.start_soon(drain_and_close, raw.stream)
        return raw

    def refusals(self) -> list[str]:
        return [ev.reason for ev in self.timeline.events_of(HandshakeRejected)]

    def dial_losing_its_ready(self, host: str, ranks: list[int]) -> list[bool]:
        """Start a relay's dial whose Ready never leaves (:class:`NoReady`); the list returned
        gets whether it was acked, when its handshake ends (its stream is then closed)."""
        outcome: list[bool] = []

        async def attempt() -> None:
            stream = NoReady(await self.net.connect(COORD))
            raw = await raw_relay_handshake(stream, self.salt, host, ranks, world_size=4,
                                            model_sigs=SIGS)
            outcome.append(raw.acked)
            await stream.aclose()

        self.nursery.start_soon(attempt)
        return outcome


@attrs.define(eq=False)
class Run(RawCohort):
    """A running coordinator: ``relays`` are the two that formed it."""

    relays: dict[str, RawRelay] = attrs.Factory(dict)

    async def hang_up(self, raw: RawRelay, dead: set[int]) -> None:
        """Close a relay's connection (a crash, as the coordinator sees it); wait for the
        deaths it causes."""
        await raw.stream.aclose()
        await wait_until(lambda: dead <= self.coord.dead_ranks, limit=5)


class Recording(Relayed):
    """A stream that keeps a copy of every byte sent through it."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.sent = bytearray()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.sent += data
        await self.inner.send_all(data)


@asynccontextmanager
async def running(net: MemoryNetwork, **config: Any) -> AsyncIterator[Run]:
    """host-a carries ranks 0 and 1, host-b ranks 2 and 3; formed; yields the run."""
    cfg = quiet_config(**config)
    async with raw_cohort(net, Run) as run:

        async def form() -> None:
            for host, ranks in (("host-a", [0, 1]), ("host-b", [2, 3])):
                run.relays[host] = await run.dial(host, ranks)

        run.nursery.start_soon(form)
        async with ft.open_coordinator(net.listener(COORD), salt=run.salt, config=cfg,
                                       timeline=run.timeline) as coord:
            run.coord = coord
            await wait_until(lambda: len(run.relays) == 2, limit=1)
            yield run
            assert coord.failure is None
            assert run.timeline.events_of(ClusterFailed) == []


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


@asynccontextmanager
async def raw_cohort(net: MemoryNetwork, kind: type[C]) -> AsyncIterator[C]:
    """A ``kind`` of :class:`RawCohort` with a new salt and timeline, its nursery cancelled when
    the block ends."""
    async with trio.open_nursery() as nursery:
        yield kind(net, ft.SessionSalt.generate(), nursery, EventLog())
        nursery.cancel_scope.cancel()
