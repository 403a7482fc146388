"""A coordinator with a session store, scripted from the library's own sans-IO handshake
machine (issue 22), for the relay's resume tests until the real adopting coordinator is used:
it sends ``Generation{g}`` before its welcome, tells a ``Resume`` from a ``Hello``, and then does
only what the test says."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.net._handshake_io import run_handshake
from flodl_trio.testing import MemoryNetwork

from helpers import COORD, HostRun, start_host, wait_until
from helpers.raw import read_one_record

GONE = (trio.BrokenResourceError, trio.ClosedResourceError)
# Ranks whose own watchdog would fire in 3 s: only the relay's feeding keeps them up in a gap.
RANK_CFG = ft.RankConfig(coord_liveness_timeout=3, heartbeat_interval=1000)


@attrs.define(eq=False)
class Leg:
    """One upstream connection, the coordinator's end driven by the test."""

    stream: Any
    sealer: Any
    opener: Any
    received: wire.HelloReceived
    salt: ft.SessionSalt
    sending: trio.Lock = attrs.Factory(trio.Lock)  # the heartbeat task and the test both send

    async def send(self, kind: wire.RecordKind, payload: bytes) -> None:
        async with self.sending:
            await self.stream.send_all(self.sealer.seal(kind, 0, payload))

    async def fanout(self, ranks: Sequence[int], msg: Any) -> None:
        blob = wire.encode_fanout(tuple(ranks), wire.encode_frame(self.salt, msg))
        await self.send(wire.RecordKind.FANOUT, blob)

    async def beat(self, ranks: Sequence[int]) -> None:
        """A coordinator's CoordHeartbeat every second, until the stream is gone."""
        try:
            while True:
                await self.fanout(ranks, wire.CoordHeartbeat())
                await trio.sleep(1)
        except GONE:
            pass

    async def end_run(self, ranks: Sequence[int]) -> None:
        """Shut the run down (``Shutdown`` to ``ranks``, ``Goodbye``, EOF), read the relay's
        last records until its EOF, close."""
        await self.fanout(ranks, wire.Shutdown())
        await self.send(wire.RecordKind.CONTROL, wire.encode(wire.Goodbye("done")))
        async with self.sending:
            await self.stream.send_eof()
        with trio.fail_after(30):
            while await read_one_record(self.stream, self.opener) is not None:
                pass
        await self.stream.aclose()

    async def frames(self, n: int, kind: type[Any] = wire.SnapshotReady) -> list[Any]:
        """The next ``n`` rank frames of ``kind`` the relay forwards (others are skipped)."""
        got: list[Any] = []
        with trio.fail_after(60):
            while len(got) < n:
                rec = await read_one_record(self.stream, self.opener)
                assert rec is not None, f"EOF after {got}"
                if rec.kind == wire.RecordKind.DATA:
                    msg = wire.frame_message(wire.decode_frame(self.salt, rec.payload))
                    if isinstance(msg, kind):
                        got.append(msg)
        return got


async def accept_leg(listener: Any, salt: ft.SessionSalt, *, generation: int | None,
                     refuse: str | None = None) -> Leg | None:
    """Accept one relay as a coordinator of ``generation`` (None: without a store); None when
    it refused it (``refuse``) or the relay failed the attempt. Dials the relay already gave up
    on (it waits ``handshake_timeout`` for a Challenge, then re-dials) are skipped."""
    for _ in range(20):
        with trio.fail_after(120):  # a relay that gave up never dials: fail, do not hang
            stream = await listener.accept()
        machine = wire.CoordinatorHandshake(salt, peer="test", generation=generation)
        try:
            received = await run_handshake(stream, machine)
        except (ft.WireError, *GONE):
            await stream.aclose()
            continue
        break
    else:
        raise AssertionError("no relay attempt reached its Hello")
    assert isinstance(received, wire.HelloReceived)
    if refuse is not None:
        machine.refuse(refuse)
        await stream.send_all(machine.data_to_send())
        await stream.aclose()
        return None
    machine.accept()
    try:
        done = await run_handshake(stream, machine)
    except (ft.WireError, *GONE):
        await stream.aclose()
        return None
    assert isinstance(done, wire.Established)
    return Leg(stream, done.sealer, done.opener, received, salt)


def relay_of(host: HostRun) -> ft.Relay:
    assert host.relay is not None
    return host.relay


async def send_snapshots(host: HostRun, rank: int, numbers: Sequence[int]) -> None:
    ep = host.ranks[rank].ep
    assert ep is not None
    for n in numbers:
        await ep.send(wire.SnapshotReady(rank=n))


async def joined_durably(nursery: trio.Nursery, net: MemoryNetwork, salt: ft.SessionSalt, *,
                         generation: int | None = 1, **relay: Any) -> tuple[Any, HostRun, Leg]:
    """A relay of ranks 0 and 1 joined to a scripted coordinator of ``generation``."""
    listener = net.listener(COORD)
    cfg = ft.RelayConfig(**{"coord_liveness_timeout": math.inf, **relay})
    host = await start_host(nursery, net, "host-a", [0, 1], salt=salt, world=2,
                            relay_config=cfg, rank_config=RANK_CFG)
    leg = await accept_leg(listener, salt, generation=generation)
    assert leg is not None and not leg.received.resumed
    await relay_of(host).wait_connected()
    await wait_until(lambda: all(r.ep is not None for r in host.ranks.values()))
    return listener, host, leg


@attrs.define(eq=False)
class DurableRun:
    """A relay (``host-a``, ranks 0 and 1) joined to a scripted durable coordinator, whose leg
    is ``first``; the test ends that leg, accepts the relay's next one, finishes the run."""

    nursery: trio.Nursery
    salt: ft.SessionSalt
    listener: Any
    host: HostRun
    first: Leg

    @property
    def relay(self) -> ft.Relay:
        return relay_of(self.host)

    async def next_leg(self, *, generation: int | None = 2) -> Leg:
        """The relay's next connection, accepted by a coordinator of ``generation``."""
        leg = await accept_leg(self.listener, self.salt, generation=generation)
        assert leg is not None
        return leg

    async def finish(self, leg: Leg) -> None:
        """The coordinator of ``leg`` shuts the run down; everything ends and closes."""
        await leg.end_run([0, 1])
        await self.listener.aclose()


@asynccontextmanager
async def durably_joined(net: MemoryNetwork, *, generation: int | None = 1,
                         **relay: Any) -> AsyncIterator[DurableRun]:
    """:func:`joined_durably` in a nursery of its own, with a new salt."""
    salt = ft.SessionSalt.generate()
    async with trio.open_nursery() as nursery:
        listener, host, first = await joined_durably(nursery, net, salt, generation=generation,
                                                     **relay)
        yield DurableRun(nursery, salt, listener, host, first)
