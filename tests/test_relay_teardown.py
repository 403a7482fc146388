"""A relay whose upstream breaks still delivers what was verified before the break."""

from __future__ import annotations

import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.testing import MemoryNetwork

from helpers import COORD, raw_coordinator_accept, start_host, wait_until


async def test_frames_verified_before_a_tampered_record_reach_every_rank(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    codec = wire.FrameCodec(salt)
    listener = memory_network.listener(COORD)
    async with trio.open_nursery() as nursery:
        host = await start_host(nursery, memory_network, "host-a", [0, 1], salt=salt, world=2)
        side = await raw_coordinator_accept(listener, salt)
        good = [side.sealer.seal(wire.RecordKind.FANOUT, 0, wire.encode_fanout(
            [0, 1], codec.encode(wire.SetGlobalStep(global_step=i)))) for i in range(3)]
        bad = bytearray(side.sealer.seal(wire.RecordKind.FANOUT, 0, wire.encode_fanout(
            [0, 1], codec.encode(wire.SetGlobalStep(global_step=99)))))
        bad[-1] ^= 0xFF  # tampered: its tag no longer verifies
        await side.stream.send_all(b"".join(good) + bytes(bad))  # one chunk
        await wait_until(lambda: host.done.is_set())
        await side.stream.aclose()
        await listener.aclose()
    for rank in (0, 1):
        steps = [m.global_step for m in host.ranks[rank].received
                 if isinstance(m, wire.SetGlobalStep)]
        assert steps == [0, 1, 2]
    assert isinstance(host.exit, ft.AuthError)
