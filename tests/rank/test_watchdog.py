"""The rank endpoint's coordinator-liveness watchdog (SPEC §6), and what a relay does when its
coordinator goes silent or away.

The "relays" and "coordinators" here are written with the sans-IO wire API, so the test decides
exactly what is (not) sent. Everything runs on ``MockClock`` over ``MemoryNetwork``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.testing import MemoryNetwork

from helpers import COORD, start_host
from helpers.raw import raw_coordinator_accept, raw_rank_accept, read_one_record

FAKE_RELAY = "fake-relay"
WORLD = 4
RANK = 1

Script = Callable[[trio.abc.Stream, ft.SessionSalt], Awaitable[None]]


async def serve_fake_relay(listener: trio.abc.Listener[Any], salt: ft.SessionSalt,
                           script: Script) -> None:
    """Accept one rank, check its hello, ack it, then run ``script`` on the link."""
    stream = await listener.accept()
    try:
        assert await raw_rank_accept(stream, salt, world_size=WORLD, ranks=[RANK]) == RANK
        await script(stream, salt)
    finally:
        await trio.aclose_forcefully(stream)


async def drain(stream: trio.abc.ReceiveStream) -> None:
    """Read (and drop) the rank's heartbeats until it closes: the link stays open, silent."""
    try:
        while await stream.receive_some(65536):
            pass
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


async def send_frames(stream: trio.abc.Stream, salt: ft.SessionSalt, *msgs: Any) -> None:
    await stream.send_all(b"".join(wire.len_frame(wire.encode_frame(salt, m)) for m in msgs))


async def run_rank_against(net: MemoryNetwork, script: Script, *, liveness: float = 3
                           ) -> tuple[list[Any], ft.RankEndpoint, float, BaseException | None]:
    """A rank iterating against a fake relay; returns (received, endpoint, elapsed, error)."""
    salt = ft.SessionSalt.generate()
    received: list[Any] = []
    error: BaseException | None = None
    cfg = ft.RankConfig(coord_liveness_timeout=liveness)
    async with trio.open_nursery() as nursery, net.listener(FAKE_RELAY) as listener:
        nursery.start_soon(serve_fake_relay, listener, salt, script)
        async with ft.open_rank(lambda: net.connect(FAKE_RELAY), salt=salt, rank=RANK,
                                world_size=WORLD, config=cfg) as ep:
            connected_at = trio.current_time()
            try:
                async for msg in ep:
                    received.append(msg)
            except ft.CoordinatorLost as exc:
                error = exc
            elapsed = trio.current_time() - connected_at
    return received, ep, elapsed, error


async def test_silent_coordinator_makes_iteration_raise_coordinator_lost_at_liveness_timeout(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    watched: dict[str, Any] = {}

    async def silent(stream: trio.abc.Stream, salt: ft.SessionSalt) -> None:
        watched["before"] = trio.current_time()
        await drain(stream)

    received, ep, elapsed, error = await run_rank_against(memory_network, silent, liveness=3)
    assert isinstance(error, ft.CoordinatorLost)
    assert "no frame from the coordinator within coord_liveness_timeout=3s" in str(error)
    assert f"rank {RANK}" in str(error)
    assert elapsed == pytest.approx(3, abs=1e-9)
    assert received == []
    assert ep.dead_peers == {0, 2, 3}
    with pytest.raises(ft.SendError, match="coordinator lost"):
        await ep.send(wire.Heartbeat(rank=RANK, step_count=0))


async def test_rank_is_not_lost_one_tick_before_liveness_timeout(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    seen: dict[str, Any] = {}

    async def silent(stream: trio.abc.Stream, salt: ft.SessionSalt) -> None:
        await drain(stream)

    async def look(ep_box: list[ft.RankEndpoint]) -> None:
        await trio.sleep(3 - 0.01)
        seen["lost"] = ep_box[0].coordinator_lost
        seen["dead_peers"] = ep_box[0].dead_peers

    salt = ft.SessionSalt.generate()
    async with trio.open_nursery() as nursery, memory_network.listener(FAKE_RELAY) as listener:
        nursery.start_soon(serve_fake_relay, listener, salt, silent)
        async with ft.open_rank(lambda: memory_network.connect(FAKE_RELAY), salt=salt, rank=RANK,
                                world_size=WORLD,
                                config=ft.RankConfig(coord_liveness_timeout=3)) as ep:
            nursery.start_soon(look, [ep])
            with pytest.raises(ft.CoordinatorLost):
                async for _ in ep:
                    pass
    assert seen == {"lost": None, "dead_peers": frozenset()}


async def test_coord_heartbeats_keep_the_watchdog_fed_and_are_not_delivered(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    beats = {"last": 0.0}

    async def heartbeating_then_silent(stream: trio.abc.Stream, salt: ft.SessionSalt) -> None:
        for _ in range(30):
            await trio.sleep(1)
            await send_frames(stream, salt, wire.CoordHeartbeat())
        beats["last"] = trio.current_time()
        await drain(stream)

    received, _, elapsed, error = await run_rank_against(memory_network,
                                                         heartbeating_then_silent, liveness=3)
    assert received == []  # absorbed
    assert isinstance(error, ft.CoordinatorLost)
    # Alive for 30 s with a 3 s timeout, then lost exactly 3 s after the last CoordHeartbeat.
    assert elapsed == pytest.approx(30 + 3, abs=1e-9)


@pytest.mark.parametrize("last", [wire.Shutdown(),
                                  wire.ShutdownWithSave(reason=ft.SaveReason.MAX_FAILURE_EXCEEDED)])
async def test_shutdown_then_close_ends_iteration_cleanly_and_keeps_dead_peers(
        last: Any, autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    async def declare_then_shutdown(stream: trio.abc.Stream, salt: ft.SessionSalt) -> None:
        await trio.sleep(1)
        await send_frames(stream, salt, wire.DeclareDead(rank=2), wire.SyncNow(), last)
        await stream.aclose()

    received, ep, elapsed, error = await run_rank_against(memory_network, declare_then_shutdown)
    assert error is None
    assert received == [wire.DeclareDead(rank=2), wire.SyncNow(), last]
    assert ep.dead_peers == {2}
    assert ep.coordinator_lost is None
    assert elapsed == pytest.approx(1, abs=1e-9)


async def test_link_eof_without_shutdown_raises_coordinator_lost_at_once(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    async def close_after_a_message(stream: trio.abc.Stream, salt: ft.SessionSalt) -> None:
        await trio.sleep(1)
        await send_frames(stream, salt, wire.SyncNow())
        await stream.aclose()

    received, ep, elapsed, error = await run_rank_against(memory_network, close_after_a_message,
                                                          liveness=30)
    assert received == [wire.SyncNow()]
    assert isinstance(error, ft.CoordinatorLost)
    assert "ended without Shutdown" in str(error)
    assert elapsed == pytest.approx(1, abs=1e-9)  # at once, not at the 30 s liveness timeout
    assert ep.dead_peers == {0, 2, 3}


async def real_time_limit(seconds: float, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` after ``seconds`` of *real* time: a task that spins without blocking
    stops MockClock's autojump, so a mock-time deadline would never fire."""
    await trio.to_thread.run_sync(time.sleep, seconds, abandon_on_cancel=True)
    scope.cancel()


async def test_rank_that_is_not_iterating_is_not_lost_for_frames_it_has_not_read(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    flood = 1100  # more than the endpoint's inbox holds, so its reader waits on the user

    async def flood_then_heartbeat(stream: trio.abc.Stream, salt: ft.SessionSalt) -> None:
        await send_frames(stream, salt, *[wire.SetGlobalStep(global_step=i) for i in range(flood)])
        for _ in range(20):
            await trio.sleep(1)
            await send_frames(stream, salt, wire.CoordHeartbeat())
        await send_frames(stream, salt, wire.Shutdown())
        await drain(stream)

    salt = ft.SessionSalt.generate()
    steps: list[int] = []
    with trio.CancelScope() as guard:
        async with trio.open_nursery() as nursery, memory_network.listener(FAKE_RELAY) as listener:
            nursery.start_soon(real_time_limit, 5, guard)
            nursery.start_soon(serve_fake_relay, listener, salt, flood_then_heartbeat)
            async with ft.open_rank(lambda: memory_network.connect(FAKE_RELAY), salt=salt,
                                    rank=RANK, world_size=WORLD,
                                    config=ft.RankConfig(coord_liveness_timeout=3)) as ep:
                await trio.sleep(10)  # the user is busy for 3x the liveness timeout
                assert ep.coordinator_lost is None
                async for msg in ep:
                    if isinstance(msg, wire.SetGlobalStep):
                        steps.append(int(msg.global_step))
            nursery.cancel_scope.cancel()
    assert not guard.cancelled_caught, "the endpoint spun without blocking (real-time guard)"
    assert steps == list(range(flood))
    assert ep.coordinator_lost is None


# --------------------------------------------------------------------------- relay side


async def test_silent_coordinator_is_caught_by_the_ranks_watchdog_behind_a_real_relay(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    salt = ft.SessionSalt.generate()
    records: list[Any] = []
    async with trio.open_nursery() as nursery:
        listener = memory_network.listener(COORD)

        async def silent_coordinator() -> None:
            side = await raw_coordinator_accept(listener, salt)
            await listener.aclose()
            # Link open, nothing sent: only read what the relay forwards.
            while (rec := await read_one_record(side.stream, side.opener)) is not None:
                records.append(rec)
            await side.stream.aclose()

        nursery.start_soon(silent_coordinator)
        host = await start_host(nursery, memory_network, "host-0", [0, 1], salt=salt, world=2,
                                rank_config=ft.RankConfig(coord_liveness_timeout=3))
        assert host.relay is not None
        await host.relay.wait_connected()
        for run in host.ranks.values():
            await run.done.wait()
        exit_ = await host.relay.wait_closed()

    assert host.exit == exit_  # open_relay raised nothing after it
    for run in host.ranks.values():
        assert isinstance(run.outcome, ft.CoordinatorLost)
        assert "coord_liveness_timeout=3s" in str(run.outcome)
        assert run.ended_at == pytest.approx(3, abs=1e-9)
        assert run.endpoint is not None and run.endpoint.dead_peers == {1 - run.rank}
    # Until then the relay carried the ranks' heartbeats up, coalesced: Liveness records (their
    # frames are not forwarded); then it ended with its ranks.
    assert not [rec for rec in records if rec.kind == wire.RecordKind.DATA]
    liveness = [msg for rec in records if rec.kind == wire.RecordKind.CONTROL
                and isinstance(msg := wire.decode_relay(rec.payload), wire.Liveness)]
    beats = [(r, s) for msg in liveness for r, s in zip(msg.ranks, msg.steps, strict=True)]
    assert {r for r, _ in beats} == {0, 1} and len(beats) >= 4
    assert all(step == 0 for _, step in beats)
    assert exit_ == ft.RelayExit("all ranks exited")


@pytest.mark.parametrize("goes_away", ["half-close", "close"])
async def test_relay_ends_on_upstream_eof_and_its_ranks_lose_the_coordinator(
        goes_away: str, autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    salt = ft.SessionSalt.generate()
    async with trio.open_nursery() as nursery:
        listener = memory_network.listener(COORD)

        async def coordinator_that_goes_away() -> None:
            side = await raw_coordinator_accept(listener, salt)
            await listener.aclose()
            await trio.sleep(2)
            if goes_away == "half-close":  # EOF, still reading (what a dying process's FIN is)
                await side.stream.send_eof()
                while await read_one_record(side.stream, side.opener) is not None:
                    pass
            await side.stream.aclose()

        nursery.start_soon(coordinator_that_goes_away)
        host = await start_host(nursery, memory_network, "host-0", [0, 1, 2], salt=salt, world=3)
        assert host.relay is not None
        exit_ = await host.relay.wait_closed()
        closed_at = trio.current_time()

    # At once: the relay closed its ranks' links, they saw EOF, then it ended (whichever of
    # "its ranks are gone" and "upstream closed" it noticed last).
    assert closed_at == pytest.approx(2, abs=1e-9)
    # FT/2: no Goodbye came first, so whatever the relay noticed, it did not end clean.
    reasons = {"coordinator closed the connection without a Goodbye (it died, or dropped this "
               "relay)"}
    if goes_away == "close":  # it may notice while writing a heartbeat, before reading the EOF
        reasons.add("upstream connection lost while writing (BrokenResourceError)")
        reasons.add("upstream connection lost (BrokenResourceError)")
    assert exit_.reason in reasons
    assert not exit_.clean
    assert host.exit == exit_  # open_relay raised nothing after it
    for run in host.ranks.values():
        assert isinstance(run.outcome, ft.CoordinatorLost)
        assert "ended without Shutdown" in str(run.outcome)
        assert run.ended_at is not None and run.ended_at <= closed_at
        assert run.ended_at == pytest.approx(2, abs=1e-9)  # at once, not after 30 s
        assert run.endpoint is not None
        assert run.endpoint.dead_peers == frozenset({0, 1, 2}) - {run.rank}


async def test_forged_frames_are_counted_and_barely_logged_and_do_not_feed_the_watchdog(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork,
        flodl_log: pytest.LogCaptureFixture) -> None:
    forger = ft.SessionSalt.generate()

    async def forging(stream: trio.abc.Stream, salt: ft.SessionSalt) -> None:
        await send_frames(stream, forger, *[wire.SetGlobalStep(global_step=i)
                                             for i in range(2000)])
        await send_frames(stream, salt, wire.SetGlobalStep(global_step=7))
        await drain(stream)

    received, ep, elapsed, error = await run_rank_against(memory_network, forging, liveness=3)
    # The genuine frame got through; the forged ones neither arrived nor kept the rank alive.
    assert received == [wire.SetGlobalStep(global_step=7)]
    assert isinstance(error, ft.CoordinatorLost)
    assert elapsed == pytest.approx(3, abs=1e-6)
    assert ep.dropped_frames == {"invalid frame": 2000}
    lines = [r for r in flodl_log.records if "frame dropped" in r.getMessage()]
    assert 1 <= len(lines) <= 6
