"""A relay whose upstream breaks still delivers what was verified before the break."""

from __future__ import annotations

import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.testing import MemoryNetwork

from helpers import COORD, start_host, wait_until
from helpers.raw import raw_coordinator_accept


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


class _UpstreamClosedAfterShutdown(trio.abc.Stream):
    """The coordinator's end, as the relay meets it: one read brings ``records`` (a Shutdown),
    then the coordinator is gone: the next write fails, and nothing more arrives."""

    def __init__(self, records: bytes) -> None:
        self.records = records
        self.read = trio.Event()
        self.write_failed = trio.Event()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if not self.read.is_set():
            self.read.set()
            return self.records
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.read.wait()  # the relay's first write upstream comes after it read Shutdown
        self.write_failed.set()
        raise trio.BrokenResourceError("the coordinator closed (EPIPE)")

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


class _RankReadingLate(trio.abc.SendStream):
    """The rank's end of its loopback link, busy: a write waits until the rank reads."""

    def __init__(self) -> None:
        self.reading = trio.Event()
        self.received = bytearray()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.reading.wait()
        self.received += data

    async def wait_send_all_might_not_block(self) -> None:
        await self.reading.wait()

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


async def test_a_shutdown_already_read_reaches_the_rank_when_the_next_upstream_write_fails(
    autojump_clock: trio.abc.Clock,
) -> None:
    from flodl_trio.relay._link import RankLink
    from flodl_trio.relay.pump import Pump
    from flodl_trio.relay.ranks import LocalRanks

    salt = ft.SessionSalt.generate()
    codec = wire.FrameCodec(salt)
    config = ft.RelayConfig()
    key = b"k" * 32
    shutdown = wire.RecordSealer(key, wire.COORD_TO_RELAY).seal(
        wire.RecordKind.DATA, 0, codec.encode(wire.Shutdown()))
    upstream = _UpstreamClosedAfterShutdown(shutdown)
    to_rank = _RankReadingLate()
    from_rank_send, from_rank_recv = trio.testing.memory_stream_one_way_pair()
    local = LocalRanks(host="h", ranks=(0,), world_size=1, salt=salt, config=config)
    link = RankLink(0, trio.StapledStream(to_rank, from_rank_recv), config)
    local.add(link)
    pump = Pump(local, upstream, wire.RecordSealer(key, wire.RELAY_TO_COORD),
                wire.RecordOpener(key, wire.COORD_TO_RELAY))
    async with trio.open_nursery() as nursery:
        async def run_pump() -> None:
            outcome = await pump.run()
            assert not outcome.clean and "lost while writing" in outcome.reason
            await trio.aclose_forcefully(link.stream)  # the relay's teardown closes the link

        nursery.start_soon(run_pump)
        # A heartbeat from the rank is the relay's next write upstream; it fails.
        await from_rank_send.send_all(wire.len_frame(codec.encode(
            wire.Heartbeat(rank=0, step_count=1))))
        await upstream.write_failed.wait()
        to_rank.reading.set()  # the rank gets to its reads only now
    decoder = wire.LenFrameDecoder(max_len=wire.MAX_LEN_FRAME)
    frames = [wire.frame_message(codec.open(blob)) for blob in decoder.feed(to_rank.received)]
    assert frames == [wire.Shutdown()]
