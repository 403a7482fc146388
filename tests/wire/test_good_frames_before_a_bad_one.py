"""A chunk that holds whole frames followed by a bad one: the peers act on the whole frames, then
end the connection (``wire.frames_before``). Before, a decoder error dropped every frame of the
chunk it arrived in, and the peer never saw messages that had arrived intact.

The far ends are written with the sans-IO wire API (``helpers``), on ``MemoryNetwork`` and
``MockClock``.
"""

from __future__ import annotations

import struct
from typing import Any

import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.events import RelayLost
from flodl_trio.testing import MemoryNetwork

from helpers import COORD, events_of, start_host, wait_until
from helpers.raw import (
    RawRank,
    raw_coordinator_accept,
    raw_rank_accept,
    raw_relay_handshake,
    read_one_record,
)

OVERSIZED = struct.pack("<I", wire.MAX_LEN_FRAME + 1)  # a length prefix over the ceiling


async def test_rank_receives_the_frames_before_a_bad_length_then_loses_the_coordinator(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    received: list[Any] = []

    async def fake_relay(listener: trio.abc.Listener[Any]) -> None:
        stream = await listener.accept()
        await raw_rank_accept(stream, salt, world_size=1, ranks=[0])
        frames = [wire.len_frame(wire.encode_frame(salt, wire.SetGlobalStep(step)))
                  for step in (5, 6)]  # fmt: skip
        await stream.send_all(b"".join(frames) + OVERSIZED)  # one chunk
        with trio.move_on_after(10):
            while await stream.receive_some(65536):
                pass
        await trio.aclose_forcefully(stream)

    async with trio.open_nursery() as nursery, memory_network.listener("relay") as listener:
        nursery.start_soon(fake_relay, listener)
        async with ft.open_rank(lambda: memory_network.connect("relay"), salt=salt, rank=0,
                                world_size=1) as ep:
            try:
                async for msg in ep:
                    received.append(msg)
            except ft.CoordinatorLost as exc:
                lost: ft.CoordinatorLost | None = exc
            else:
                lost = None
    assert received == [wire.SetGlobalStep(5), wire.SetGlobalStep(6)]
    assert lost is not None and "protocol error" in str(lost) and "ceiling" in str(lost)


async def test_relay_forwards_a_ranks_frames_before_its_bad_length_then_drops_that_rank(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    records: list[wire.Record] = []
    upstream_ready = trio.Event()

    async def coordinator() -> None:
        side = await raw_coordinator_accept(listener, salt)
        await listener.aclose()
        upstream_ready.set()
        try:
            while (rec := await read_one_record(side.stream, side.opener)) is not None:
                records.append(rec)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(side.stream)

    async with trio.open_nursery() as nursery:
        listener = memory_network.listener(COORD)
        nursery.start_soon(coordinator)
        host = await start_host(nursery, memory_network, "host-0", [0, 1], salt=salt, world=2,
                                start_ranks=[])
        raw: dict[int, RawRank] = {}

        async def raw_rank(rank: int) -> None:
            raw[rank] = await RawRank.connect(lambda: memory_network.connect("relay:host-0"),
                                              salt=salt, rank=rank, world_size=2, interval=None)
            await raw[rank].run()

        for rank in (0, 1):
            nursery.start_soon(raw_rank, rank)
        await upstream_ready.wait()
        frames = [wire.encode_frame(salt, wire.LrUpdate(rank=0, lr=lr)) for lr in (0.1, 0.2)]
        await raw[0].stream.send_all(b"".join(wire.len_frame(f) for f in frames) + OVERSIZED)
        await raw[0].eof.wait()  # the relay closed rank 0's link
        await wait_until(lambda: any(r.kind == wire.RecordKind.CONTROL
                                     and wire.decode_relay(r.payload) == wire.RankExit(0)
                                     for r in records))
        nursery.cancel_scope.cancel()
    assert not isinstance(host.exit, Exception)  # the relay failed in no way until cancelled

    def of_rank_0(rec: wire.Record) -> object:
        if rec.kind == wire.RecordKind.DATA:
            return rec.payload if rec.rank == 0 else None
        msg = wire.decode_relay(rec.payload)
        if isinstance(msg, wire.Liveness):  # the relay's coalesced heartbeats
            return ("heartbeat", dict(zip(msg.ranks, msg.steps, strict=True))[0]) \
                if 0 in msg.ranks else None
        return msg

    # FT/2: rank 0's handshake Heartbeat came first (verified by the relay, in a Liveness
    # record), then the two frames before the bad length, then its RankExit.
    assert [m for m in map(of_rank_0, records) if m is not None] == [
        ("heartbeat", 0), *frames, wire.RankExit(0)]


async def test_coordinator_acts_on_records_before_a_bad_one_then_loses_the_relay(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    listener = memory_network.listener(COORD)
    cfg = ft.CoordinatorConfig(world_size=1, declare_dead_on_relay_loss=False)
    timeline = ft.Timeline()
    relay: list[Any] = []
    handshaken = trio.Event()

    async def raw_relay() -> None:
        raw = await raw_relay_handshake(await memory_network.connect(COORD), salt, "host-0", [0],
                                        world_size=1)
        relay.append(raw)
        handshaken.set()  # the coordinator may enter its block before the relay read HelloAck
        with trio.move_on_after(30):
            try:
                while await raw.stream.receive_some(65536):
                    pass
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        await trio.aclose_forcefully(raw.stream)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(raw_relay)
        async with ft.open_coordinator(listener, salt=salt, config=cfg,
                                       timeline=timeline) as coord:
            await handshaken.wait()
            (raw,) = relay
            good = [raw.sealer.seal(wire.RecordKind.DATA, 0,
                                    wire.encode_frame(salt, wire.LrUpdate(rank=0, lr=lr)))
                    for lr in (0.1, 0.2)]  # fmt: skip
            tampered = bytearray(raw.sealer.seal(
                wire.RecordKind.DATA, 0, wire.encode_frame(salt, wire.LrUpdate(rank=0, lr=0.3))))
            tampered[-1] ^= 1
            await raw.stream.send_all(b"".join(good) + bytes(tampered))  # one chunk
            with trio.fail_after(5):
                got = [await coord.timing.receive(), await coord.timing.receive()]
            await wait_until(lambda: events_of(timeline, RelayLost))
        nursery.cancel_scope.cancel()

    assert got == [wire.LrUpdate(rank=0, lr=0.1), wire.LrUpdate(rank=0, lr=0.2)]
    (lost,) = events_of(timeline, RelayLost)
    assert lost.host == "host-0" and "authentication failure" in lost.reason
