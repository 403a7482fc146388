"""Records to a relay over plain TCP go straight to the socket when its writer is idle; a socket
that takes only part of a record leaves the rest to the writer (real loopback sockets: the point
is what the kernel accepts)."""

from __future__ import annotations

from typing import Any

import trio

import flodl_trio as ft
from flodl_trio import wire

from helpers import live_task_names, wait_until
from helpers.raw import raw_relay_handshake

UID = 48 * 1024  # a few of these fill a loopback socket's buffers


async def test_records_to_a_relay_that_stops_reading_arrive_whole_and_in_order() -> None:
    salt = ft.SessionSalt.generate()
    cfg = ft.CoordinatorConfig(world_size=2, formation_timeout=10, heartbeat_interval=3600,
                               heartbeat_timeout=600, write_stall_timeout=30)
    count = 120
    async with await ft.bind_coordinator(("127.0.0.1", 0)) as bound:
        stream = await trio.open_tcp_stream(*bound.address)
        async with stream, trio.open_nursery() as nursery:
            relays: list[object] = []
            joined = trio.Event()

            async def join() -> None:
                relays.append(await raw_relay_handshake(stream, salt, "host-a", [0, 1],
                                                              world_size=2))
                joined.set()

            nursery.start_soon(join)
            async with ft.open_coordinator(bound, salt=salt, config=cfg) as coord:
                sent = trio.Event()

                async def send_all_of_them() -> None:
                    # The relay reads nothing meanwhile: the first records go straight to the
                    # socket, one goes in part, the rest wait in the writer.
                    for i in range(count):
                        uid = i.to_bytes(4, "little") * (UID // 4)
                        msg = wire.NewNcclSession(uid=uid, new_rank=i, new_world_size=2)
                        if i % 2:
                            await coord.broadcast_control(msg)
                        else:
                            await coord.send_control(i % 4 // 2, msg)
                    sent.set()

                nursery.start_soon(send_all_of_them)
                with trio.fail_after(10):
                    await joined.wait()
                (relay,) = relays
                await trio.sleep(0.5)
                assert not sent.is_set()  # the socket is full: later records are queued
                got: list[int] = []
                with trio.fail_after(20):
                    while len(got) < count:
                        data = await stream.receive_some(1 << 20)
                        assert data, f"EOF after {len(got)} records"
                        # Opening verifies every record's tag: a record torn, reordered or
                        # written twice would fail here with AuthError or WireError.
                        for rec in relay.opener.feed(data):  # type: ignore[attr-defined]
                            if rec.kind == wire.RecordKind.FANOUT:
                                _, frame = wire.decode_fanout(rec.payload)
                            else:
                                frame = rec.payload
                            msg = wire.frame_message(wire.decode_frame(salt, frame))
                            assert isinstance(msg, wire.NewNcclSession)
                            assert msg.uid == msg.new_rank.to_bytes(4, "little") * (UID // 4)
                            got.append(msg.new_rank)
                assert got == list(range(count))
                with trio.fail_after(10):
                    await sent.wait()
            nursery.cancel_scope.cancel()


def writer_tasks() -> list[str]:
    """The names of every RelayConn writer task running in this Trio run."""
    return [n for n in live_task_names() if n.endswith("RelayConn.run_writer")]


async def test_a_relay_gets_a_writer_task_only_once_the_kernel_does_not_take_its_records(
) -> None:
    # Issue 23: joined relays that take what they are sent cost no writer task; the one whose
    # socket fills gets one, and every record still arrives whole and in order.
    salt = ft.SessionSalt.generate()
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=10, heartbeat_interval=3600,
                               heartbeat_timeout=600, write_stall_timeout=30)
    count = 40
    async with await ft.bind_coordinator(("127.0.0.1", 0)) as bound:
        streams = [await trio.open_tcp_stream(*bound.address) for _ in range(4)]
        async with trio.open_nursery() as nursery:
            raws: dict[int, object] = {}

            async def join(r: int) -> None:
                raws[r] = await raw_relay_handshake(streams[r], salt, f"host-{r}", [r],
                                                    world_size=4)

            for r in range(4):
                nursery.start_soon(join, r)
            async with ft.open_coordinator(bound, salt=salt, config=cfg) as coord:
                await coord.broadcast_control(wire.Throttle())  # all idle: no task
                assert writer_tasks() == []
                sent = trio.Event()

                async def send_to_rank_0() -> None:
                    for i in range(count):
                        uid = i.to_bytes(4, "little") * (UID // 4)
                        await coord.send_control(0, wire.NewNcclSession(
                            uid=uid, new_rank=i, new_world_size=4))
                    sent.set()

                nursery.start_soon(send_to_rank_0)
                await wait_until(lambda: len(writer_tasks()) == 1, limit=10, step=0.05)
                assert not sent.is_set()  # relay 0 reads nothing yet: its socket is full
                raw0: Any = raws[0]
                got = 0
                with trio.fail_after(20):
                    while got < count:
                        data = await streams[0].receive_some(1 << 20)
                        assert data, f"EOF after {got} records"
                        for rec in raw0.opener.feed(data):
                            if rec.kind == wire.RecordKind.DATA:
                                got += 1
                    await sent.wait()
                assert len(writer_tasks()) == 1  # the three others never needed one
                nursery.cancel_scope.cancel()
        for stream in streams:
            await trio.aclose_forcefully(stream)
