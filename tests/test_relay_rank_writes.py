"""The relay writes a frame for a rank at once when the rank's writer is idle (issue 23); what
does not fit in the socket is queued and written by the rank's writer, whole and in order."""

from __future__ import annotations

import os
import socket

import trio
import trio.testing

import flodl_trio as ft
from flodl_trio import wire


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
