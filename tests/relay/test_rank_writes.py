"""The relay writes a frame for a rank at once when the rank's writer is idle (issue 23); what
does not fit in the socket is queued and written by the rank's writer, whole and in order."""

from __future__ import annotations

import os
import socket

import trio
import trio.testing

import flodl_trio as ft
from flodl_trio import wire

from helpers import live_task_names


def _link_and_pump(stream: trio.abc.Stream, config: ft.RelayConfig) -> tuple[object, object]:
    from flodl_trio.relay._link import RankLink
    from flodl_trio.relay.pump import Pump
    from flodl_trio.relay.ranks import LocalRanks

    salt = ft.SessionSalt.generate()
    local = LocalRanks(host="h", ranks=(0,), world_size=1, salt=salt, config=config)
    link = RankLink(0, stream, config)
    local.add(link)
    up_relay, _up_coord = trio.testing.memory_stream_pair()
    key = b"k" * 32
    pump = Pump(local, up_relay, wire.RecordSealer(key, wire.RELAY_TO_COORD),
                wire.RecordOpener(key, wire.COORD_TO_RELAY))
    return link, pump


async def _socket_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    a, b = trio.socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    return trio.SocketStream(a), trio.SocketStream(b)


async def test_a_frame_for_a_rank_that_keeps_up_is_on_its_socket_before_any_writer_runs() -> None:
    relay_side, rank_side = await _socket_pair()
    async with relay_side, rank_side:
        link, _pump = _link_and_pump(relay_side, ft.RelayConfig())
        assert link.offer(b"frame-1", 0.0)  # type: ignore[attr-defined]
        # No task ran in between: the bytes are readable now, without waiting.
        assert os.read(rank_side.socket.fileno(), 100) == b"frame-1"


async def test_frames_for_a_rank_that_stopped_reading_arrive_whole_and_in_order_later() -> None:
    relay_side, rank_side = await _socket_pair()
    async with relay_side, rank_side:
        await _fill_and_drain(relay_side, rank_side)


async def _fill_and_drain(relay_side: trio.SocketStream, rank_side: trio.SocketStream) -> None:
    config = ft.RelayConfig(queue_size=1000, write_stall_timeout=10)
    link, pump = _link_and_pump(relay_side, config)
    frames = [bytes([i % 251]) * 997 for i in range(300)]  # ~300 KB: far over both buffers
    for frame in frames:
        assert link.offer(frame, trio.current_time())  # type: ignore[attr-defined]
    received = bytearray()
    total = sum(len(f) for f in frames)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pump.write_to_rank, link)  # type: ignore[attr-defined]
        with trio.fail_after(10):
            while len(received) < total:
                received += await rank_side.receive_some(65536)
        link.end_queue()  # type: ignore[attr-defined]
    assert bytes(received) == b"".join(frames)
    assert await rank_side.receive_some(10) == b""  # then half-closed, nothing after


def _rank_writer_tasks() -> list[str]:
    """The names of every Pump rank-writer task running in this Trio run."""
    return [n for n in live_task_names() if n.endswith("Pump.rank_writer")]


async def test_a_rank_gets_a_writer_task_only_once_the_kernel_does_not_take_its_frames() -> None:
    # Issue 23: a rank that reads what it is sent costs the relay no writer task; the one whose
    # socket fills gets one, its frames still arrive whole and in order, and the end of the
    # pump half-closes every rank's link, writer or not.
    from flodl_trio.relay._link import RankLink
    from flodl_trio.relay.pump import Pump
    from flodl_trio.relay.ranks import LocalRanks
    from flodl_trio.wire._session import Deliver

    config = ft.RelayConfig(queue_size=1000, write_stall_timeout=30)
    local = LocalRanks(host="h", ranks=(0, 1, 2), world_size=3,
                       salt=ft.SessionSalt.generate(), config=config)
    pairs = [await _socket_pair() for _ in range(3)]
    for rank, (relay_side, _) in enumerate(pairs):
        local.add(RankLink(rank, relay_side, config))
    up_relay, up_coord = trio.testing.memory_stream_pair()
    key = b"k" * 32
    pump = Pump(local, up_relay, wire.RecordSealer(key, wire.RELAY_TO_COORD),
                wire.RecordOpener(key, wire.COORD_TO_RELAY))
    frames = [bytes([i % 251]) * 997 for i in range(200)]  # ~200 KB: far over the buffers
    got: dict[int, bytearray] = {r: bytearray() for r in range(3)}

    async def read_rank(rank: int, total: int) -> None:
        with trio.fail_after(20):
            while len(got[rank]) < total:
                got[rank] += await pairs[rank][1].receive_some(65536)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pump.run)
        await trio.testing.wait_all_tasks_blocked()
        assert _rank_writer_tasks() == []  # nothing to write yet
        for i in range(3):
            pump.deliver(Deliver((0, 1, 2), frames[i]))
            for rank in range(3):
                await read_rank(rank, sum(len(f) for f in frames[:i + 1]))
        assert _rank_writer_tasks() == []  # every rank took its frames at once
        for frame in frames[3:]:  # rank 2 stops reading: only its link needs a writer
            pump.deliver(Deliver((0, 1, 2), frame))
            for rank in (0, 1):
                await read_rank(rank, len(got[rank]) + len(frame))
        await trio.testing.wait_all_tasks_blocked()
        assert len(_rank_writer_tasks()) == 1
        await read_rank(2, sum(len(f) for f in frames))
        pump.finish("test over", now=False)
        for link in local.links():
            link.end_queue()  # as the upstream's end does: each link is half-closed
        with trio.fail_after(10):
            for _, rank_side in pairs:
                assert await rank_side.receive_some(10) == b""
        nursery.cancel_scope.cancel()
    for rank in range(3):
        assert bytes(got[rank]) == b"".join(frames)
    for relay_side, rank_side in pairs:
        await trio.aclose_forcefully(relay_side)
        await trio.aclose_forcefully(rank_side)
    await trio.aclose_forcefully(up_coord)
