"""A relay rides out a lost durable coordinator (issue 22): its ranks stay connected and are told
``CoordinatorReconnecting``, their frames are queued, the relay re-dials with ``Resume`` and,
once resumed, writes the queued frames first and tells the ranks ``CoordinatorResumed``. After
``coordinator_grace`` they get ``CoordinatorLost``. A coordinator that is not durable (no
``Generation``) is lost exactly as before.

The durable coordinator is scripted (``durable_peer``) from the library's own sans-IO handshake
machine, over the in-memory network under MockClock.
"""

from __future__ import annotations

from typing import Any

import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.net._handshake_io import run_handshake
from flodl_trio.testing import MemoryNetwork

from helpers import wait_until
from helpers.durable_peer import GONE, accept_leg, durably_joined, send_snapshots
from helpers.raw import read_one_record

# ---------------------------------------------------------------- riding it out


async def test_ranks_hear_reconnecting_then_resumed_and_never_coordinator_lost_in_the_grace(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with durably_joined(memory_network) as joined:
        relay = joined.relay
        assert relay.generation == 1 and relay.reconnects == 0
        await joined.first.stream.aclose()  # killed: no Goodbye
        lost_at = trio.current_time()
        await wait_until(lambda: all(r.ep is not None and r.ep.reconnecting is not None
                                     for r in joined.host.ranks.values()))
        await trio.sleep(10)  # 10 s away: the ranks' own watchdog (3 s) is fed by the relay
        leg = await joined.next_leg(generation=2)
        assert leg.received.resumed and leg.received.generation == 1
        assert leg.received.hello.host == "host-a" and leg.received.hello.ranks == (0, 1)
        joined.nursery.start_soon(leg.beat, [0, 1])
        await wait_until(lambda: relay.reconnects == 1)
        await wait_until(lambda: all(r.ep is not None and r.ep.reconnecting is None
                                     for r in joined.host.ranks.values()))
        assert relay.generation == 2
        await joined.finish(leg)
    for run in joined.host.ranks.values():
        told = [m for m in run.received if not isinstance(m, wire.Shutdown)]
        assert isinstance(told[0], wire.CoordinatorReconnecting) and told[0].host == "host-a"
        assert "coordinator_grace=30s" in told[0].detail
        assert told[1:] == [wire.CoordinatorResumed(generation=2)]
        assert run.outcome == "ended" and run.ended_at is not None
        assert run.ended_at > lost_at + 10
    assert isinstance(joined.host.exit, ft.RelayExit) and joined.host.exit.clean


async def test_frames_sent_in_the_gap_reach_the_new_coordinator_first_and_in_order(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with durably_joined(memory_network) as joined:
        await send_snapshots(joined.host, 0, [1])
        assert await joined.first.frames(1) == [wire.SnapshotReady(1)]
        await joined.first.stream.aclose()
        await wait_until(lambda: joined.relay.reconnecting is not None)
        # Both ranks, the first and the last, send while the coordinator is away.
        await send_snapshots(joined.host, 0, [2, 3, 4])
        await send_snapshots(joined.host, 1, [100, 101])
        await trio.sleep(5)
        leg = await joined.next_leg(generation=2)
        joined.nursery.start_soon(leg.beat, [0, 1])
        await wait_until(lambda: joined.relay.reconnects == 1)
        await send_snapshots(joined.host, 0, [5])
        got = [int(m.rank) for m in await leg.frames(6)]
        await joined.finish(leg)
    # Each rank's frames in its order; the gap's before the one sent after the resume.
    assert [n for n in got if n < 100] == [2, 3, 4, 5]
    assert [n for n in got if n >= 100] == [100, 101]
    assert got.index(5) == 5
    assert joined.relay.dropped_while_reconnecting == 0


async def test_frames_the_lost_connection_never_took_are_written_to_the_resumed_one(
    autojump_clock: trio.abc.Clock,
) -> None:
    # A coordinator that hangs and reads nothing, behind a buffer of 64 bytes: the relay's write
    # of the ranks' frames never completes before the connection dies. It is written again,
    # whole, to the resumed connection (what a dead peer's buffer held is lost, as with TCP).
    net = MemoryNetwork(buffer_size=64)
    async with durably_joined(net) as joined:
        await send_snapshots(joined.host, 0, [1, 2])
        await trio.sleep(1)
        await joined.first.stream.aclose()
        leg = await joined.next_leg(generation=2)
        heard: set[int] = set()  # ranks whose coalesced heartbeat (Liveness) came first
        got: list[Any] = []
        with trio.fail_after(60):
            while len(got) < 2:
                rec = await read_one_record(leg.stream, leg.opener)
                assert rec is not None, f"EOF after {got}"
                if rec.kind == wire.RecordKind.CONTROL:
                    msg = wire.decode_relay(rec.payload)
                    if isinstance(msg, wire.Liveness):
                        heard.update(int(r) for r in msg.ranks)
                elif rec.kind == wire.RecordKind.DATA:
                    got.append(wire.frame_message(wire.decode_frame(joined.salt, rec.payload)))
        await joined.finish(leg)
    net.assert_all_closed()
    # The ranks' frames were being written when it died: they reach the resumed connection.
    # Their coalesced heartbeats (Liveness) may have fitted in the dead peer's buffer (lost, as
    # with TCP) or come again; never a rank that is not local.
    assert heard <= {0, 1}
    assert got == [wire.SnapshotReady(1), wire.SnapshotReady(2)]


async def test_frames_over_the_reconnect_queue_are_dropped_and_counted(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with durably_joined(memory_network, reconnect_queue=3) as joined:
        await send_snapshots(joined.host, 0, [99])
        # All written before the loss:
        assert await joined.first.frames(1) == [wire.SnapshotReady(99)]
        await joined.first.stream.aclose()
        await wait_until(lambda: joined.relay.reconnecting is not None)
        await send_snapshots(joined.host, 0, range(10))
        await wait_until(lambda: joined.relay.dropped_while_reconnecting == 7)
        leg = await joined.next_leg(generation=2)
        await wait_until(lambda: joined.relay.reconnects == 1)
        await send_snapshots(joined.host, 0, [50])
        got = [int(m.rank) for m in await leg.frames(4)]
        await joined.finish(leg)
    assert got == [0, 1, 2, 50]
    assert joined.relay.dropped_while_reconnecting == 7


async def test_a_deposed_coordinators_records_never_reach_a_rank(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with durably_joined(memory_network, generation=5) as joined:
        await joined.first.stream.aclose()
        # A coordinator of generation 4 (deposed, still running) answers the re-dial and
        # broadcasts at once; the relay fails that attempt before the welcome.
        stream = await joined.listener.accept()
        machine = wire.CoordinatorHandshake(joined.salt, peer="deposed", generation=4)
        received = await run_handshake(stream, machine)
        assert isinstance(received, wire.HelloReceived) and received.generation == 5
        machine.accept()
        assert isinstance(await run_handshake(stream, machine), wire.Established)
        for msg in (wire.SetGlobalStep(global_step=99), wire.Shutdown()):
            blob = wire.encode_fanout((0, 1), wire.encode_frame(joined.salt, msg))
            try:
                await stream.send_all(machine.sealer.seal(wire.RecordKind.FANOUT, 0, blob))
            except GONE:
                break
        with trio.fail_after(30):  # the relay closes it
            while await stream.receive_some(65536):
                pass
        await stream.aclose()
        assert joined.relay.reconnects == 0
        leg = await joined.next_leg(generation=6)
        assert leg.received.generation == 5
        await wait_until(lambda: joined.relay.reconnects == 1)
        assert joined.relay.generation == 6
        await joined.finish(leg)
    for run in joined.host.ranks.values():
        assert wire.SetGlobalStep(global_step=99) not in run.received
        assert [m for m in run.received if not isinstance(
            m, wire.CoordinatorReconnecting)] == [wire.CoordinatorResumed(6), wire.Shutdown()]


async def test_a_refused_resume_ends_the_relay_at_once_and_the_ranks_hear_why(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with durably_joined(memory_network) as joined:
        await joined.first.stream.aclose()
        await trio.sleep(2)
        assert await accept_leg(joined.listener, joined.salt, generation=2,
                                refuse="host-a is not in the adopted roster") is None
        refused_at = trio.current_time()
        await wait_until(lambda: joined.host.all_done, limit=30)
        assert trio.current_time() - refused_at < 2  # at once, not after the grace
        await joined.listener.aclose()
    assert isinstance(joined.host.exit, ft.JoinRefused)
    assert joined.host.exit.reason == "host-a is not in the adopted roster"
    for run in joined.host.ranks.values():
        assert isinstance(run.outcome, ft.CoordinatorLost)
        assert "host-a is not in the adopted roster" in str(run.outcome)


async def test_the_grace_running_out_gives_the_ranks_coordinator_lost_saying_so(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with durably_joined(memory_network, coordinator_grace=12) as joined:
        await joined.listener.aclose()  # nobody answers the re-dials
        await joined.first.stream.aclose()
        lost_at = trio.current_time()
        await wait_until(lambda: joined.host.all_done, limit=60)
    for run in joined.host.ranks.values():
        assert isinstance(run.received[0], wire.CoordinatorReconnecting)
        assert isinstance(run.outcome, ft.CoordinatorLost)
        assert "not back within coordinator_grace=12s" in str(run.outcome)
        assert run.ended_at is not None and 12 <= run.ended_at - lost_at < 14
    assert isinstance(joined.host.exit, ft.RelayExit) and not joined.host.exit.clean
    assert "not back within coordinator_grace=12s" in joined.host.exit.reason
    assert joined.relay.reconnects == 0


async def test_silence_past_coord_liveness_timeout_is_a_lost_coordinator_and_it_resumes(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with durably_joined(memory_network, coord_liveness_timeout=2) as joined:
        joined_at = trio.current_time()
        # The coordinator is frozen: its connection stays open and says nothing.
        leg = await joined.next_leg(generation=1)
        assert leg.received.resumed
        assert 2 <= trio.current_time() - joined_at < 3
        with trio.fail_after(5):  # the relay closed the silent connection
            while await joined.first.stream.receive_some(65536):
                pass
        await joined.first.stream.aclose()
        joined.nursery.start_soon(leg.beat, [0, 1])
        await wait_until(lambda: joined.relay.reconnects == 1)
        await trio.sleep(20)  # a coordinator that beats is not silent
        assert joined.relay.reconnects == 1
        await joined.finish(leg)
    assert all(run.outcome == "ended" for run in joined.host.ranks.values())
