"""Shutdown and cancellation (SPEC §4.6, §5, §6): leaving a block is graceful and bounded, an
outside cancel propagates, and every ``open_*`` raises one exception, never an ExceptionGroup."""

from __future__ import annotations

import pytest
import trio

import flodl_trio as ft
from flodl_trio.events import (
    ClusterFailed,
    FormationFailed,
    RelayJoined,
    ShutdownComplete,
    ShutdownStarted,
)
from flodl_trio.testing import MemoryNetwork
from flodl_trio.wire import SetGlobalStep, Shutdown, ShutdownWithSave

from helpers import COORD, events_of, hosts_by_hand, recorded, wait_until
from helpers.lifecycle import cancel_after
from helpers.raw import RawRelay, raw_relay_handshake

HOSTS = {"host-a": [0, 1], "host-b": [2, 3]}


# ------------------------------------------------------------------ graceful shutdown


async def test_leaving_the_block_sends_shutdown_to_every_rank_and_closes_everything(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with recorded(memory_network) as (c, rec):
        coord = c.coord
        await coord.broadcast_control(SetGlobalStep(global_step=1))
        assert coord.state()["phase"] == "running"
        assert not events_of(coord.timeline, ShutdownStarted)
    kinds = [ev.kind for ev in coord.timeline.events()]
    assert kinds.count("ShutdownStarted") == 1 and kinds.count("ShutdownComplete") == 1
    assert kinds.index("ShutdownStarted") < kinds.index("ShutdownComplete")
    (started,) = events_of(coord.timeline, ShutdownStarted)
    assert started.reason == "the block exited"
    assert coord.state()["phase"] == "closed"
    assert coord.phase == "closed"
    for rank, run in rec.ranks.items():
        # Iteration ended cleanly right after yielding Shutdown.
        assert run.received == [SetGlobalStep(global_step=1), Shutdown()]
        assert c.outcomes[rank] == "ended"
    assert set(c.relay_exits) == set(HOSTS)
    for relay_exit in c.relay_exits.values():
        assert isinstance(relay_exit, ft.RelayExit) and relay_exit.clean
    memory_network.assert_all_closed()


async def test_timing_and_metrics_consumers_see_end_of_channel_after_the_block(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with recorded(memory_network) as (c, _):
        await trio.sleep(3)  # some heartbeats are queued, unread
    drained = 0
    with trio.fail_after(1):
        async for _ in c.coord.timing:  # ends: the channel was closed by the shutdown
            drained += 1
    assert drained >= 4
    with pytest.raises(trio.EndOfChannel):
        await c.coord.timing.receive()
    with pytest.raises(trio.EndOfChannel):
        await c.coord.metrics.receive()


async def test_shutdown_is_bounded_by_shutdown_grace_when_a_relay_never_closes(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    cfg = ft.CoordinatorConfig(world_size=3, shutdown_grace=4)
    async with hosts_by_hand(memory_network, 3, {"host-a": [0, 1]}) as hosts:
        host_a = hosts.runs["host-a"]
        stuck: list[RawRelay] = []

        async def relay_that_stops_reading() -> None:
            raw = await raw_relay_handshake(await memory_network.connect(COORD), hosts.salt,
                                            "host-stuck", [2], world_size=3)
            stuck.append(raw)  # it neither reads nor closes from here on

        hosts.nursery.start_soon(relay_that_stops_reading)
        async with hosts.coordinator(cfg) as coord:
            await wait_until(lambda: bool(stuck))
            left_at = trio.current_time()
        shutdown_took = trio.current_time() - left_at
        assert shutdown_took == pytest.approx(4, abs=0.01)
        assert coord.phase == "closed"
        assert len(events_of(hosts.timeline, ShutdownComplete)) == 1
        # The coordinator closed the connection of the relay that never did.
        raw = stuck[0]
        with trio.fail_after(1):
            while await raw.stream.receive_some(65536):
                pass
        await raw.stream.aclose()
        await wait_until(lambda: host_a.all_done)
    assert all(run.received == [Shutdown()] for run in host_a.ranks.values())


# ------------------------------------------------------------------ cancellation from outside


async def test_outside_cancel_during_formation_propagates_and_closes_every_stream(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=60)
    async with hosts_by_hand(memory_network, 4, {"host-a": [0, 1]}) as hosts:
        host_a = hosts.runs["host-a"]
        # A connection stuck mid-handshake while the cancel arrives.
        half_open = await memory_network.connect(COORD)
        await half_open.send_all(b"\xe2\x17")
        with trio.move_on_after(5) as scope:
            async with hosts.coordinator(cfg):
                pytest.fail("formation cannot complete: host-b never comes")
        assert scope.cancelled_caught
        assert trio.current_time() == pytest.approx(5)
        assert len(events_of(hosts.timeline, RelayJoined)) == 1
        assert not events_of(hosts.timeline, FormationFailed)  # a cancel is not a formation failure
        assert len(events_of(hosts.timeline, ShutdownComplete)) == 1
        assert await half_open.receive_some(100) == b""
        await half_open.aclose()
        await wait_until(lambda: host_a.all_done)
    memory_network.assert_all_closed()


async def test_outside_cancel_while_running_propagates_after_a_graceful_shutdown(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    entered = False
    async with hosts_by_hand(memory_network, 4, HOSTS) as hosts:
        with trio.CancelScope() as scope:
            async with hosts.coordinator() as coord:
                entered = True
                hosts.nursery.start_soon(cancel_after, scope, 3.0)
                await trio.sleep_forever()
        assert entered and scope.cancelled_caught
        (started,) = events_of(coord.timeline, ShutdownStarted)
        assert started.reason == "cancelled"
        assert coord.phase == "closed"
        await wait_until(lambda: hosts.all_done)
    for hr in hosts.runs.values():
        for run in hr.ranks.values():
            assert run.received == [Shutdown()] and run.outcome == "ended"
    memory_network.assert_all_closed()


async def test_outside_cancel_of_relay_and_rank_propagates_and_closes_their_streams(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with hosts_by_hand(memory_network, 4, HOSTS) as hosts:
        host_a, host_b = hosts.runs.values()
        async with hosts.coordinator() as coord:
            host_a.ranks[1].kill()
            await wait_until(lambda: host_a.ranks[1].done.is_set())
            assert host_a.ranks[1].outcome == "killed"  # Cancelled, not an exception group
            await wait_until(lambda: 1 in coord.dead_ranks)
            host_b.kill()
            await wait_until(lambda: host_b.all_done)
            assert host_b.exit == "killed"
            await wait_until(lambda: coord.dead_ranks == frozenset({1, 2, 3}))
            assert coord.live_ranks == frozenset({0})
        await wait_until(lambda: host_a.all_done)
    for rank in (2, 3):  # their relay vanished without a Shutdown
        assert isinstance(host_b.ranks[rank].outcome, ft.CoordinatorLost)
    assert host_a.ranks[0].outcome == "ended"
    memory_network.assert_all_closed()


# ------------------------------------------------------------------ one exception out


async def test_coordinator_body_value_error_comes_out_as_exactly_that_value_error(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    boom = ValueError("the orchestrator's own bug")
    async with hosts_by_hand(memory_network, 4, HOSTS) as hosts:
        with pytest.raises(ValueError) as excinfo:  # raised by open_coordinator itself
            async with hosts.coordinator() as coord:
                raise boom
        await wait_until(lambda: hosts.all_done)
    assert excinfo.value is boom
    assert type(excinfo.value) is ValueError
    (started,) = events_of(coord.timeline, ShutdownStarted)
    assert started.reason == "the block raised ValueError"
    assert all(run.received == [Shutdown()] for hr in hosts.runs.values()
               for run in hr.ranks.values())


async def test_relay_body_value_error_comes_out_as_exactly_that_value_error(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    boom = ValueError("relay body")
    with pytest.raises(ValueError) as excinfo:
        async with ft.open_relay(lambda: memory_network.connect(COORD),
                                 salt=ft.SessionSalt.generate(), host="host-a", ranks=[0],
                                 world_size=1, rank_listen=memory_network.listener("relay:a")):
            await trio.sleep(1)
            raise boom
    assert excinfo.value is boom and type(excinfo.value) is ValueError
    memory_network.assert_all_closed()


async def test_rank_body_value_error_comes_out_as_exactly_that_value_error(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    boom = ValueError("rank body")
    async with hosts_by_hand(memory_network, 2, {"host-a": [0, 1]}) as hosts:
        host = hosts.runs["host-a"]
        async with hosts.coordinator():
            host.ranks[0].crash(boom)
            await wait_until(lambda: host.ranks[0].done.is_set())
        await wait_until(lambda: host.all_done)
    assert host.ranks[0].outcome is boom
    assert type(host.ranks[0].outcome) is ValueError


async def test_formation_failure_comes_out_as_a_formation_error_not_a_group(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    cfg = ft.CoordinatorConfig(world_size=2, formation_timeout=3)
    try:
        async with ft.open_coordinator(memory_network.listener(COORD),
                                       salt=ft.SessionSalt.generate(), config=cfg):
            pytest.fail("unreachable")
    except BaseExceptionGroup:  # pragma: no cover - the point of the test
        pytest.fail("open_coordinator let an ExceptionGroup escape")
    except ft.FormationTimeout as exc:
        assert isinstance(exc, ft.FormationError)
        assert exc.__cause__ is None or not isinstance(exc.__cause__, BaseExceptionGroup)


async def test_cluster_failure_cancels_the_body_and_comes_out_alone(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    cfg = ft.CoordinatorConfig(world_size=4, max_failure=ft.MaxFailure.absolute(2))
    body_cancelled = False
    async with hosts_by_hand(memory_network, 4, HOSTS) as hosts:
        host_a, host_b = hosts.runs.values()
        with pytest.raises(ft.ClusterFailure) as excinfo:  # raised by open_coordinator itself
            async with hosts.coordinator(cfg) as coord:
                host_b.kill()
                try:
                    await trio.sleep_forever()
                except trio.Cancelled:
                    body_cancelled = True
                    raise
        await wait_until(lambda: host_a.all_done and host_b.all_done)
    assert type(excinfo.value) is ft.ClusterFailure
    assert body_cancelled
    assert excinfo.value.reason == ft.SaveReason.MAX_FAILURE_EXCEEDED
    assert excinfo.value.dead == frozenset({2, 3})
    (failed,) = events_of(coord.timeline, ClusterFailed)
    assert failed.dead == (2, 3)
    for run in host_a.ranks.values():
        assert run.received[-1] == ShutdownWithSave(reason=ft.SaveReason.MAX_FAILURE_EXCEEDED)
        assert Shutdown() not in run.received  # the save latch replaces the plain Shutdown
        assert run.outcome == "ended"
