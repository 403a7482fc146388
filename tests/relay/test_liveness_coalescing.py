"""Coalesced heartbeats (issue 23): a relay verifies its ranks' ``Heartbeat`` frames and sends
one ``Liveness`` record per ``heartbeat_interval`` instead; the coordinator applies it as if
each frame had come through. Sans-IO rules first, then a relay against a coordinator played by
the test, then whole clusters on ``MockClock``."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

import flodl_trio as ft
from flodl_trio import WireError, wire
from flodl_trio.events import InvalidFrame, RankDeclaredDead
from flodl_trio.testing import EventLog, MemoryNetwork, open_local_cluster
from flodl_trio.wire import Invalid, RankFrame, RankHeartbeat, RankLinkSession

from helpers import COORD, Recorder, start_host, wait_until
from helpers.raw import raw_coordinator_accept, raw_relay_handshake, read_one_record

SALT = wire.SessionSalt(bytes(range(16)))
CODEC = wire.FrameCodec(SALT)
KEY = b"k" * 32
CONTROL = int(wire.RecordKind.CONTROL)


def link_events(frames: list[bytes], *, codec: wire.FrameCodec | None = CODEC,
                rank: int = 2) -> list[Any]:
    session = RankLinkSession(rank, host="h1", codec=codec)
    session.receive_data(b"".join(wire.len_frame(f) for f in frames))
    out = []
    for _ in range(100):
        event = session.next_event()
        if event is wire.NEED_DATA:
            return out
        out.append(event)
    raise AssertionError("no NEED_DATA after 100 events")


def test_relay_verifies_its_ranks_heartbeat_and_forwards_every_other_frame_untouched() -> None:
    beat = CODEC.encode(wire.Heartbeat(rank=2, step_count=41))
    forged = wire.FrameCodec(wire.SessionSalt(b"\xee" * 16)).encode(
        wire.Heartbeat(rank=2, step_count=1))
    tampered = bytearray(beat)
    tampered[-1] ^= 1  # the step count's last byte: the MAC no longer verifies
    sibling = CODEC.encode(wire.Heartbeat(rank=3, step_count=5))  # speaks for another rank
    batch = CODEC.encode(wire.Batch(rank=2, batch_ms=1.0, data_ms=0.5, step_count=42,
                                    param_norm=None, batch_loss=0.25))
    events = link_events([beat, forged, bytes(tampered), sibling, batch])
    # Only the verified Heartbeat of the link's own rank is the relay's to report; whatever
    # does not verify or speaks for another rank goes on for the coordinator to judge and count.
    assert events == [RankHeartbeat(2, 41), RankFrame(2, forged), RankFrame(2, bytes(tampered)),
                      RankFrame(2, sibling), RankFrame(2, batch)]
    # Without the codec (nothing to verify with) every frame is forwarded as it is.
    assert link_events([beat]) != link_events([beat], codec=None) == [RankFrame(2, beat)]


def test_a_fenced_ranks_heartbeats_are_neither_forwarded_nor_reported() -> None:
    session = RankLinkSession(2, host="h1", codec=CODEC)
    session.fence("declared dead")
    session.receive_data(wire.len_frame(CODEC.encode(wire.Heartbeat(rank=2, step_count=1))))
    assert session.next_event() is wire.NEED_DATA


def coordinator_side(ranks: tuple[int, ...] = (2, 3)) -> wire.CoordinatorSession:
    return wire.CoordinatorSession(wire.RecordOpener(KEY, wire.RELAY_TO_COORD),
                                   wire.RecordSealer(KEY, wire.COORD_TO_RELAY), CODEC,
                                   host="h1", ranks=ranks)


def applied(*msgs: wire.Liveness) -> list[Any]:
    """The coordinator's events for ``msgs``, sealed one after the other by the relay's side."""
    sealer = wire.RecordSealer(KEY, wire.RELAY_TO_COORD)
    session = coordinator_side()
    session.receive_data(b"".join(sealer.seal(CONTROL, 0, wire.encode(m)) for m in msgs))
    return [session.next_event() for _ in msgs]


@pytest.mark.parametrize(("msg", "category", "detail"), [
    (wire.Liveness(ranks=(2, 7), steps=(1, 1), ages=(0.0, 0.0)), "foreign rank",
     "Liveness for ranks [7], which relay 'h1' does not carry [2, 3]"),
    (wire.Liveness(ranks=(3, 2), steps=(1, 1), ages=(0.0, 0.0)), "malformed",
     "expected ranks ascending without duplicates, got [3, 2]"),
    (wire.Liveness(ranks=(2, 2), steps=(1, 1), ages=(0.0, 0.0)), "malformed",
     "expected ranks ascending without duplicates, got [2, 2]"),
    (wire.Liveness(ranks=(2, 3), steps=(1,), ages=(0.0, 0.0)), "malformed",
     "got 2 ranks, 1 step counts, 2 ages"),
    (wire.Liveness(ranks=(), steps=(5,), ages=()), "malformed",
     "expected a step count and an age for each rank; got 0 ranks, 1 step counts, 0 ages"),
    (wire.Liveness(ranks=(2,), steps=(1,), ages=(-0.5,)), "malformed",
     "expected ages ≥ 0 s, got (-0.5,)"),
    (wire.Liveness(ranks=(2,), steps=(1,), ages=(float("nan"),)), "malformed",
     "expected ages ≥ 0 s"),
])
def test_coordinator_drops_a_liveness_record_that_speaks_for_other_ranks_or_is_malformed(
        msg: wire.Liveness, category: str, detail: str) -> None:
    good = wire.Liveness(ranks=(2, 3), steps=(5, 6), ages=(0.25, 0.0))
    bad, after = applied(msg, good)
    assert isinstance(bad, Invalid) and bad.category == category and detail in bad.detail
    assert after == good  # one bad record is dropped, the connection goes on


def test_an_empty_liveness_is_the_relays_idle_tick_and_is_accepted() -> None:
    # A tick with no heartbeat pending sends a Liveness naming no rank: the relay is alive and
    # holds nothing (the coordinator's evidence, SPEC §4.5); it once was dropped as malformed.
    idle = wire.Liveness(ranks=(), steps=(), ages=())
    good = wire.Liveness(ranks=(2, 3), steps=(5, 6), ages=(0.25, 0.0))
    assert applied(idle, good, idle) == [idle, good, idle]


def test_relay_side_never_seals_a_liveness_record_for_ranks_that_are_not_local() -> None:
    session = wire.UpstreamSession(wire.RecordOpener(KEY, wire.COORD_TO_RELAY),
                                   wire.RecordSealer(KEY, wire.RELAY_TO_COORD), host="h1",
                                   ranks=(2, 3))
    with pytest.raises(WireError, match=r"relay→coordinator Liveness: expected ranks of the "
                       r"coordinator \(relay 'h1'\) \[2, 3\], got \[3, 4\]"):
        session.send(wire.Liveness(ranks=(3, 4), steps=(1, 1), ages=(0.0, 0.0)))
    record = session.send(wire.Liveness(ranks=(2, 3), steps=(1, 1), ages=(0.0, 0.0)))
    opener = wire.RecordOpener(KEY, wire.RELAY_TO_COORD)
    opener.push(record)  # the refused one was never sealed: this one is seq 0
    assert opener.next_record() is not None


# ------------------------------------------------------------------ a relay, coordinator by hand


async def test_relay_sends_one_liveness_record_per_interval_for_all_its_ranks_instead_of_frames(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    salt = ft.SessionSalt.generate()
    records: list[tuple[float, Any]] = []
    async with trio.open_nursery() as nursery:
        listener = memory_network.listener(COORD)

        async def coordinator() -> None:
            side = await raw_coordinator_accept(listener, salt)
            await listener.aclose()
            try:
                while (rec := await read_one_record(side.stream, side.opener)) is not None:
                    records.append((trio.current_time(), rec))
            finally:
                await trio.aclose_forcefully(side.stream)

        nursery.start_soon(coordinator)
        host = await start_host(nursery, memory_network, "host-0", [0, 1, 2, 3], salt=salt,
                                world=4, rank_config=ft.RankConfig(coord_liveness_timeout=100))
        assert host.relay is not None
        await host.relay.wait_connected()
        for run in host.ranks.values():
            await run.entered.wait()
        for rank, run in host.ranks.items():
            assert run.ep is not None
            run.ep.step_count = 100 + rank
        start = trio.current_time()
        await trio.sleep(10)
        nursery.cancel_scope.cancel()

    late = [(t, rec) for t, rec in records if t > start + 1.5]  # every rank reports its step
    assert late and not [rec for _, rec in records if rec.kind != CONTROL]  # no frame forwarded
    msgs = [wire.decode_relay(rec.payload) for _, rec in late]
    assert all(isinstance(m, wire.Liveness) for m in msgs)
    # About one record per interval, each carrying every rank (four frames a second before).
    assert 7 <= len(msgs) <= 10
    for msg in msgs:
        assert msg.ranks == (0, 1, 2, 3) and msg.steps == (100, 101, 102, 103)
        assert all(0.0 <= age <= 1.0 for age in msg.ages)


# ------------------------------------------------------------------------ whole clusters


def board_steps(coord: ft.Coordinator) -> dict[int, int]:
    """Each rank's step count on the status page."""
    return {rank: step for relay in coord.board()["relays"]
            for rank, _, step, _ in relay["ranks"]}


async def test_coalesced_heartbeats_reach_coord_timing_and_the_board_as_heartbeats(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    async def rank_main(ep: ft.RankEndpoint) -> None:
        ep.step_count = 10 + ep.rank
        async for _ in ep:
            pass

    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=10)
    async with open_local_cluster({"host-0": [0, 1], "host-1": [2, 3]}, network=memory_network,
                                  coord_config=cfg, rank_main=rank_main) as c:
        beats: dict[int, int] = {}
        with trio.fail_after(5):
            while len(beats) < 4 or set(beats.values()) != {10, 11, 12, 13}:
                msg = await c.coord.timing.receive()
                assert isinstance(msg, wire.Heartbeat)
                beats[msg.rank] = msg.step_count
        assert beats == {0: 10, 1: 11, 2: 12, 3: 13}
        assert board_steps(c.coord) == beats


async def test_without_deliver_heartbeats_ranks_stay_live_and_timing_gets_no_heartbeats(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    async def rank_main(ep: ft.RankEndpoint) -> None:
        ep.step_count = 7
        async for _ in ep:
            pass

    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=10, heartbeat_timeout=3,
                               deliver_heartbeats=False)
    async with open_local_cluster({"host-0": [0, 1], "host-1": [2, 3]}, network=memory_network,
                                  coord_config=cfg, rank_main=rank_main) as c:
        await trio.sleep(30)  # ten heartbeat timeouts
        assert c.coord.dead_ranks == frozenset() and c.coord.live_ranks == {0, 1, 2, 3}
        with pytest.raises(trio.WouldBlock):
            c.coord.timing.receive_nowait()
        assert board_steps(c.coord) == {0: 7, 1: 7, 2: 7, 3: 7}
        # The page shows each rank heard from within two intervals: its own heartbeat's, and the
        # relay's cadence of reporting it.
        ages = [age for relay in c.coord.board()["relays"] for *_, age in relay["ranks"]]
        assert all(age is not None and age <= 2.0 for age in ages), ages


async def test_a_rank_silent_behind_a_live_relay_is_declared_at_the_timeout_of_its_last_heartbeat(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    # The relay reports heartbeats up to an interval after it verified them; their age puts the
    # coordinator's clock back to when they arrived, so the detection is not delayed.
    log = EventLog()
    rec = Recorder(raw={1: 1.0})
    cfg = ft.CoordinatorConfig(world_size=2, formation_timeout=10, heartbeat_timeout=5)
    relay_cfg = ft.RelayConfig(heartbeat_interval=1.0)
    async with open_local_cluster({"host-0": [0, 1]}, network=memory_network, timeline=log,
                                  rank_main=rec, raw_ranks=rec.raw_mains, coord_config=cfg,
                                  relay_config=relay_cfg) as c:
        await trio.sleep(3.3)
        silent_since = rec.raw[1].go_silent()
        await wait_until(lambda: 1 in c.coord.dead_ranks, limit=10)
        ((declared_at, event),) = log.of(RankDeclaredDead)
        assert declared_at == pytest.approx(silent_since + 5, abs=1e-6)
        assert event.reason == "heartbeat stale (>5s)"
        assert c.coord.live_ranks == {0}


async def test_a_relay_cannot_keep_another_relays_rank_alive_with_liveness_records(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    salt = ft.SessionSalt.generate()
    log = EventLog()
    cfg = ft.CoordinatorConfig(world_size=2, formation_timeout=10, heartbeat_timeout=4)
    async with trio.open_nursery() as nursery:
        async def hosts() -> None:
            # Rank 1's relay joins, then never speaks for it; relay host-0 claims rank 1 too.
            one = await raw_relay_handshake(await memory_network.connect(COORD), salt, "host-1",
                                            [1], world_size=2)
            zero = await raw_relay_handshake(await memory_network.connect(COORD), salt,
                                             "host-0", [0], world_size=2)
            try:
                assert one.acked and zero.acked
                for _ in range(10):
                    forged = wire.Liveness(ranks=(0, 1), steps=(1, 1), ages=(0.0, 0.0))
                    honest = wire.Liveness(ranks=(0,), steps=(1,), ages=(0.0,))
                    data = zero.sealer.seal(CONTROL, 0, wire.encode(forged))
                    data += zero.sealer.seal(CONTROL, 0, wire.encode(honest))
                    await zero.stream.send_all(data)
                    await trio.sleep(1)
            finally:
                with trio.CancelScope(shield=True):
                    await trio.aclose_forcefully(one.stream)
                    await trio.aclose_forcefully(zero.stream)

        nursery.start_soon(hosts)
        async with ft.open_coordinator(memory_network.listener(COORD), salt=salt, config=cfg,
                                       timeline=log) as coord:
            await wait_until(lambda: 1 in coord.dead_ranks, limit=10)
            assert coord.live_ranks == {0}  # host-0's own rank is live: its honest records
            assert coord.dead_reason(1) == "heartbeat stale (>4s)"
            invalid = [ev for _, ev in log.of(InvalidFrame)]
            assert invalid[0].host == "host-0"
            assert "Liveness for ranks [1], which relay 'host-0' does not carry [0]" in \
                invalid[0].reason
            nursery.cancel_scope.cancel()


async def test_a_liveness_record_never_revives_or_reports_a_rank_declared_dead_since(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    salt = ft.SessionSalt.generate()
    cfg = ft.CoordinatorConfig(world_size=2, formation_timeout=10, heartbeat_timeout=4)
    relay: list[Any] = []
    async with trio.open_nursery() as nursery:
        async def host() -> None:
            raw = await raw_relay_handshake(await memory_network.connect(COORD), salt, "host-0",
                                            [0, 1], world_size=2)
            relay.append(raw)
            try:
                await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True):
                    await trio.aclose_forcefully(raw.stream)

        nursery.start_soon(host)
        async with ft.open_coordinator(memory_network.listener(COORD), salt=salt,
                                       config=cfg) as coord:
            await coord.declare_dead(1, "its GPU fell off the bus")
            # The relay heard rank 1's heartbeat just before it learned of the death.
            (raw,) = relay
            for step in (5, 6):
                msg = wire.Liveness(ranks=(0, 1), steps=(step, step), ages=(0.0, 0.0))
                await raw.stream.send_all(raw.sealer.seal(CONTROL, 0, wire.encode(msg)))
                await trio.sleep(2)
            beats = []
            while True:
                try:
                    beats.append(coord.timing.receive_nowait())
                except trio.WouldBlock:
                    break
            assert beats == [wire.Heartbeat(rank=0, step_count=5),
                             wire.Heartbeat(rank=0, step_count=6)]
            assert board_steps(coord) == {0: 6, 1: None}
            assert coord.dead_ranks == {1} and coord.live_ranks == {0}
            assert "its GPU fell off the bus" in (coord.dead_reason(1) or "")
            nursery.cancel_scope.cancel()
