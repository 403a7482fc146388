"""Junk is counted, never amplified (issue 12): the rate-limited counter every hostile-input path
uses, and the relay's rank port under a flood of bad hellos."""

from __future__ import annotations

import logging

import pytest
import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.events import InvalidFrame
from flodl_trio.net._ratelimit import JunkCounter
from flodl_trio.status import render_prometheus
from flodl_trio.testing import MemoryNetwork
from flodl_trio.wire import SetGlobalStep, Shutdown

from helpers import COORD, events_of, hosts_by_hand, start_host, start_rank, wait_until
from helpers.raw import RawRelay, raw_relay_handshake


def test_counter_reports_a_burst_then_one_summary_per_interval_with_the_folded_counts() -> None:
    junk = JunkCounter(burst=3, interval=10.0)
    reports = [junk.add("bad mac" if i % 2 else "timeout", f"conn {i}", now=0.0)
               for i in range(1000)]
    shown = [r for r in reports if r is not None]
    assert [r.detail for r in shown] == ["conn 0", "conn 1", "conn 2"]
    assert junk.total == 1000
    assert junk.by_reason() == {"timeout": 500, "bad mac": 500}
    assert junk.folded_total == 997
    assert junk.recent[-1] == "conn 999"
    assert len(junk.recent) == 5
    # Still inside the interval: nothing more is reported, however many arrive.
    assert junk.add("timeout", "conn 1000", now=9.0) is None
    later = junk.add("bad mac", "conn 1001", now=12.0)
    assert later is not None
    assert later.folded == {"timeout": 499, "bad mac": 499}
    assert later.text() == ("conn 1001; 998 more not logged since the last report "
                            "(bad mac x499, timeout x499)")
    assert junk.summary() == "bad mac x501, timeout x501"


def test_flush_summarises_the_tail_and_is_forced_only_when_asked() -> None:
    junk = JunkCounter(burst=1, interval=10.0)
    assert junk.add("eof", "a", now=0.0) is not None
    assert junk.add("eof", "b", now=0.0) is None
    assert junk.flush(now=1.0) is None  # rate-limited like everything else
    forced = junk.flush(now=1.0, force=True)
    assert forced is not None and forced.detail is None
    assert forced.text() == "1 more not logged since the last report (eof x1)"
    assert junk.flush(now=100.0, force=True) is None  # nothing folded any more


def test_counter_rejects_nonsense_limits() -> None:
    with pytest.raises(ValueError, match="burst >= 1"):
        JunkCounter(burst=0)
    with pytest.raises(ValueError, match="interval > 0"):
        JunkCounter(interval=0.0)


async def flood_rank_port(net: MemoryNetwork, relay: str, hello: bytes, count: int) -> None:
    for _ in range(count):
        stream = await net.connect(relay)
        await stream.send_all(hello)
        with trio.fail_after(30):
            assert await stream.receive_some(100) == b""  # closed without an ack
        await stream.aclose()


async def test_wrong_salt_flood_on_the_rank_port_is_counted_with_a_few_log_lines(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork,
    flodl_log: pytest.LogCaptureFixture,
) -> None:
    other_salt = ft.SessionSalt.generate()
    async with hosts_by_hand(memory_network, 2) as hosts:
        host = await hosts.start("host-a", [0, 1], start_ranks=[0])
        assert host.relay is not None
        await flood_rank_port(memory_network, "relay:host-a",
                              wire.encode_rank_hello(other_salt, 1, 2), 300)
        await flood_rank_port(memory_network, "relay:host-a",
                              wire.encode_rank_hello(hosts.salt, 1, 3), 200)
        assert host.relay.rank_port_rejects == {"bad mac": 300, "world_size mismatch": 200}
        start_rank(hosts.nursery, memory_network, host.ranks[1], salt=hosts.salt, world=2)
        async with hosts.coordinator() as coord:
            await coord.broadcast_control(SetGlobalStep(global_step=1))
        await wait_until(lambda: host.all_done)
    warnings = [r for r in flodl_log.records if r.name == "flodl_trio.relay"
                and r.levelno >= logging.WARNING and "rejected" in r.getMessage()]
    assert 1 <= len(warnings) <= 10
    for run in host.ranks.values():
        assert run.received == [SetGlobalStep(global_step=1), Shutdown()]


def batch(rank: int, step: int) -> wire.Batch:
    return wire.Batch(rank=rank, batch_ms=1.0, data_ms=0.5, step_count=step, param_norm=None,
                      batch_loss=0.1, sync_divergence=None)


async def test_forged_and_foreign_rank_frames_are_dropped_counted_and_barely_logged(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork,
    flodl_log: pytest.LogCaptureFixture,
) -> None:
    salt, other_salt = ft.SessionSalt.generate(), ft.SessionSalt.generate()
    listener = memory_network.listener(COORD)
    codec, forger = wire.FrameCodec(salt), wire.FrameCodec(other_salt)
    relays: list[RawRelay] = []

    async def raw_relay() -> None:
        relays.append(await raw_relay_handshake(await memory_network.connect(COORD), salt,
                                                "host-a", [0], world_size=1))

    foreign, forged = 1500, 500
    async with trio.open_nursery() as nursery:
        nursery.start_soon(raw_relay)
        async with ft.open_coordinator(listener, salt=salt,
                                       config=ft.CoordinatorConfig(world_size=1)) as coord:
            await wait_until(lambda: relays)
            (relay,) = relays
            junk = [relay.sealer.seal(wire.RecordKind.DATA, 0, codec.encode(batch(7, i)))
                    for i in range(foreign)]
            junk += [relay.sealer.seal(wire.RecordKind.DATA, 0, forger.encode(batch(0, i)))
                     for i in range(forged)]
            genuine = batch(0, 12345)
            junk.append(relay.sealer.seal(wire.RecordKind.DATA, 0, codec.encode(genuine)))
            await relay.stream.send_all(b"".join(junk))
            with trio.fail_after(30):
                async for msg in coord.timing:
                    if msg == genuine:
                        break
                    assert isinstance(msg, wire.Heartbeat) or msg.rank == 0
            state = coord.state()
            assert state["invalid_frames"] == {"foreign rank": foreign, "bad mac": forged}
            metrics = render_prometheus(state)
            assert f'flodl_trio_invalid_frames_total{{reason="foreign rank"}} {foreign}' in metrics
            assert coord.live_ranks == frozenset({0})
            events = events_of(coord.timeline, InvalidFrame)
        await relay.stream.aclose()
    assert 1 <= len(events) <= 10
    assert "does not carry" in events[0].reason
    lines = [r for r in flodl_log.records if r.name.startswith("flodl_trio")
             and "frame dropped" in r.getMessage()]
    assert 1 <= len(lines) <= 10


# ------------------------------------------------------------------ a rank with the wrong salt


@pytest.mark.parametrize("fault", ["wrong salt", "wrong world size"])
async def test_a_rejected_sibling_is_named_by_the_relay_and_its_healthy_ranks_at_its_deadline(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork,
    flodl_log: pytest.LogCaptureFixture, fault: str,
) -> None:
    salt, other_salt = ft.SessionSalt.generate(), ft.SessionSalt.generate()
    started = trio.current_time()
    ended: dict[int, float] = {}
    async with trio.open_nursery() as nursery:
        # Default deadlines: rank coord_liveness 30 s and connect 30 s, relay rank accept 60 s.
        host = await start_host(nursery, memory_network, "host-a", [0, 1], salt=salt, world=2,
                                start_ranks=[0])
        bad_salt, bad_world = (other_salt, 2) if fault == "wrong salt" else (salt, 3)
        bad = host.ranks[1]
        start_rank(nursery, memory_network, bad, salt=bad_salt, world=bad_world)

        async def note_end(rank: int) -> None:
            await host.ranks[rank].done.wait()
            ended[rank] = trio.current_time() - started

        nursery.start_soon(note_end, 0)
        nursery.start_soon(note_end, 1)
        with trio.fail_after(120):
            await host.done.wait()
        await wait_until(lambda: host.all_done)
    reason = "bad mac" if fault == "wrong salt" else "world_size mismatch"
    cause = "wrong session salt?" if fault == "wrong salt" else "world_size 3 != expected 2"
    # The relay's own error names the cause.
    assert type(host.exit) is ft.FormationTimeout
    assert f"{reason} x" in str(host.exit) and cause in str(host.exit)
    # The healthy sibling lived until the relay's own deadline, and its error says why.
    assert ended[0] == pytest.approx(60, abs=1.5)
    healthy = host.ranks[0].outcome
    assert isinstance(healthy, ft.CoordinatorLost)
    assert "relay 'host-a' gave up" in str(healthy)
    assert cause in str(healthy)
    assert "missing [1]" in str(healthy)
    # The rejected rank gave up after its connect_timeout; the relay did not log every retry.
    assert isinstance(bad.outcome, ft.HandshakeError)
    assert ended[1] == pytest.approx(30, abs=1.5)
    warnings = [r for r in flodl_log.records if r.name == "flodl_trio.relay"
                and r.levelno >= logging.WARNING]
    assert len(warnings) <= 12


async def test_a_rank_outlives_its_relay_dialing_an_absent_coordinator_and_is_told_why(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork,
) -> None:
    salt = ft.SessionSalt.generate()
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        # Nobody listens on the coordinator's name: the relay re-dials for connect_timeout.
        host = await start_host(nursery, memory_network, "host-a", [0], salt=salt, world=1,
                                relay_config=ft.RelayConfig(connect_timeout=40),
                                rank_config=ft.RankConfig(coord_liveness_timeout=10))
        with trio.fail_after(120):
            await host.done.wait()
        await wait_until(lambda: host.all_done)
        ended = trio.current_time() - started
    assert type(host.exit) is ft.HandshakeError
    assert "within 40s" in str(host.exit)
    assert ended == pytest.approx(40, abs=1.5)  # the relay's deadline, not the rank's 10 s
    lost = host.ranks[0].outcome
    assert isinstance(lost, ft.CoordinatorLost)
    assert "relay 'host-a' gave up" in str(lost) and "no listener on mem:coordinator" in str(lost)
