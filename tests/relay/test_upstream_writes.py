"""The relay writes an upstream record at once while its upstream writer is idle (issue 23): a
rank's frame or a ``Liveness`` record costs one ``write``, not a wake-up of the writer task.
What the kernel does not take is finished by the writer first, so records still reach the
coordinator whole and in sealing order; a record cut by a lost leg is sent again, resealed,
on the resumed connection."""

from __future__ import annotations

import os
import socket
from collections import deque
from typing import Any

import trio
import trio.testing

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.relay.pump import Pump
from flodl_trio.relay.ranks import LocalRanks

from helpers.raw import read_one_record

KEY = b"k" * 32


def _pump(upstream: trio.abc.Stream, *, queue_size: int = 64) -> Pump:
    config = ft.RelayConfig(queue_size=queue_size, write_stall_timeout=30)
    local = LocalRanks(host="h", ranks=(0, 1), world_size=2,
                       salt=ft.SessionSalt.generate(), config=config)
    return Pump(local, upstream, wire.RecordSealer(KEY, wire.RELAY_TO_COORD),
                wire.RecordOpener(KEY, wire.COORD_TO_RELAY))


async def _tcp_pair(buffer: int = 4096) -> tuple[trio.SocketStream, trio.SocketStream]:
    a, b = trio.socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)
    return trio.SocketStream(a), trio.SocketStream(b)


def _coordinator_opener() -> Any:
    return wire.RecordOpener(KEY, wire.RELAY_TO_COORD)


async def test_a_record_sent_while_the_writer_is_idle_is_on_the_socket_before_any_task_runs(
) -> None:
    relay_side, coord_side = await _tcp_pair(1 << 16)
    async with relay_side, coord_side:
        pump = _pump(relay_side)
        up_send, up_recv = trio.open_memory_channel[Any](64)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump.run_upstream, up_recv)
            await trio.testing.wait_all_tasks_blocked()  # the writer is parked
            liveness = wire.Liveness(ranks=(0, 1), steps=(3, 4), ages=(0.0, 0.0))
            await pump.send_up(up_send, liveness)
            await pump.send_up(up_send, (1, b"frame of rank 1"))
            # No task ran in between: both records are readable now, without waiting.
            data = os.read(coord_side.socket.fileno(), 1 << 16)
            opener = _coordinator_opener()
            opener.push(data)
            first, second = opener.next_record(), opener.next_record()
            assert opener.next_record() is None and opener.buffered == 0
            assert first.kind == wire.RecordKind.CONTROL
            assert wire.decode_relay(first.payload) == liveness
            assert second.kind == wire.RecordKind.DATA
            assert (second.rank, bytes(second.payload)) == (1, b"frame of rank 1")
            nursery.cancel_scope.cancel()


async def _send_all_from(pump: Pump, up_send: trio.MemorySendChannel[Any], rank: int,
                         frames: list[bytes], every: int) -> None:
    async with up_send:
        for i, frame in enumerate(frames):
            await pump.send_up(up_send, (rank, frame))
            if i % every == 0:
                await trio.lowlevel.checkpoint()  # let the others interleave, the writer catch up


async def test_records_over_a_full_socket_arrive_whole_in_sealing_order_and_per_rank_order(
) -> None:
    # Two ranks send ~600 KB upstream through a socket with 4 KB buffers, while the coordinator
    # reads slowly: most sends find the writer idle at first, then the kernel takes only part of
    # a record, then the queue fills. The coordinator's opener checks every record's MAC and
    # sequence number, so a record cut, reordered against its sealing or lost fails it.
    relay_side, coord_side = await _tcp_pair()
    async with relay_side, coord_side:
        pump = _pump(relay_side, queue_size=8)
        up_send, up_recv = trio.open_memory_channel[Any](8)
        frames = {rank: [bytes([rank * 100 + i % 97]) * (500 + 37 * (i % 50)) + i.to_bytes(4)
                         for i in range(300)] for rank in (0, 1)}
        got: dict[int, list[bytes]] = {0: [], 1: []}
        opener = _coordinator_opener()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump.run_upstream, up_recv)
            with up_send:
                for rank, every in ((0, 3), (1, 7)):
                    nursery.start_soon(_send_all_from, pump, up_send.clone(), rank,
                                       frames[rank], every)
            with trio.fail_after(30):
                while True:
                    rec = await read_one_record(coord_side, opener)
                    if rec is None:
                        break  # the writer half-closed: every sender closed its clone
                    got[rec.rank].append(bytes(rec.payload))
                    if (len(got[0]) + len(got[1])) % 50 == 0:
                        await trio.sleep(0.001)  # a slow coordinator
            await coord_side.aclose()  # the coordinator closes too: the leg ends
        assert got == frames
        assert opener.buffered == 0


class _Resume:
    """Stands in for the relay's Reconnector: records what the lost leg had in flight."""

    enabled = True

    def __init__(self) -> None:
        self.backlog: deque[Any] = deque()
        self.in_flight: list[Any] | None = None
        self.gave_up = ("test over", None)

    async def ride_out(self, reason: str, up_recv: Any, in_flight: list[Any]) -> None:
        self.in_flight = list(in_flight)
        await trio.lowlevel.checkpoint()


async def test_a_record_the_kernel_took_only_part_of_is_sent_again_when_the_leg_is_lost(
) -> None:
    # The coordinator reads nothing: the direct write of a big record leaves a rest for the
    # writer; the leg is lost before the writer takes it. The record is handed to the resume
    # first (resealed for the next connection), never dropped and never sent half.
    relay_side, coord_side = await _tcp_pair()
    async with relay_side, coord_side:
        pump = _pump(relay_side)
        resume = _Resume()
        pump.resume = resume  # type: ignore[assignment]
        up_send, up_recv = trio.open_memory_channel[Any](64)
        big = (0, b"x" * 200_000)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump.run_upstream, up_recv)
            await trio.testing.wait_all_tasks_blocked()  # the writer is parked
            await pump.send_up(up_send, big)
            pump.lose_leg("test: the connection died")  # before the writer ran
        assert resume.in_flight is not None and resume.in_flight[0] == big
        # Nothing but the start of that one record reached the dead connection.
        data = b""
        while chunk := _read_now(coord_side):
            data += chunk
        assert 0 < len(data) < 200_000


def _read_now(stream: trio.SocketStream) -> bytes:
    try:
        return os.read(stream.socket.fileno(), 1 << 20)
    except BlockingIOError:
        return b""


async def test_a_record_sent_after_the_leg_was_lost_never_reaches_the_lost_connection(
) -> None:
    # The leg is lost (a newer leader took over, say) while its writer is parked, and a rank's
    # record comes before the writer ran again: it is queued for the next connection, not
    # written to the one being dropped, whose coordinator would never act on it.
    relay_side, coord_side = await _tcp_pair(1 << 16)
    async with relay_side, coord_side:
        pump = _pump(relay_side)
        resume = _Resume()
        pump.resume = resume  # type: ignore[assignment]
        up_send, up_recv = trio.open_memory_channel[Any](64)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump.run_upstream, up_recv)
            await trio.testing.wait_all_tasks_blocked()  # the writer is parked
            pump.lose_leg("test: a newer coordinator leads")
            await pump.send_up(up_send, (1, b"frame of rank 1"))
        assert _read_now(coord_side) == b""
        assert up_recv.receive_nowait() == (1, b"frame of rank 1")  # left for the next leg
