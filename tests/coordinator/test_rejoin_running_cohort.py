"""Who may rejoin a running cohort (issue 26), on the in-memory transport under MockClock: a relay
whose named ranks are all dead is admitted and they are alive again; one naming a rank alive on
another host, a rank of another host (takeover off), another world size or another model is
refused at once, with the reason recorded, and the run goes on untouched.

A host restarted before the coordinator noticed its old relay died (issue 26b): its authenticated
Hello supersedes the same host's live connection, whose ranks are declared dead the usual way and
rejoin in the same handshake; another host, or the same host naming a rank alive on another host,
is still refused."""

from __future__ import annotations

import pytest
import trio

import flodl_trio as ft
from flodl_trio.events import (
    ClusterFailed,
    RankDeclaredDead,
    RankRejoined,
    RankTakenOver,
    RelayJoined,
    RelayLost,
)
from flodl_trio.testing import EventLog, MemoryNetwork

from helpers import COORD, wait_until
from helpers.raw import drain_and_close, raw_relay_handshake
from helpers.rejoin import SIGS, RawCohort, Recording, quiet_config, raw_cohort, running


async def test_relay_whose_ranks_are_all_dead_is_admitted_and_they_are_alive_again(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with running(memory_network) as run:
        await run.hang_up(run.relays["host-a"], {0, 1})
        assert run.coord.live_ranks == {2, 3}
        again = await run.dial("host-a", [0, 1])
        assert again.acked
        await wait_until(lambda: run.coord.live_ranks == {0, 1, 2, 3}, limit=1)
        assert run.coord.dead_ranks == frozenset()
        assert run.timeline.events_of(RankRejoined) == [
            RankRejoined(rank=0, host="host-a"), RankRejoined(rank=1, host="host-a")]
        assert [ev.host for ev in run.timeline.events_of(RelayJoined)] == [
            "host-a", "host-b", "host-a"]
        assert run.refusals() == []
        assert run.coord.state()["rejoins"] == {"0": 1, "1": 1}
        # The new connection is the one addressed: a send to a rejoined rank goes through.
        await run.coord.send_control(0, ft.wire.SyncNow())


async def test_relay_of_another_host_naming_a_live_rank_is_refused_at_once_with_the_reason(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with running(memory_network) as run:
        # host-a is alive: a stranger may not claim its ranks (its own double supersedes it
        # since issue 26b: below).
        started = trio.current_time()
        stranger = await run.dial("host-c", [1])
        assert not stranger.acked
        assert trio.current_time() - started == pytest.approx(0)
        reasons = run.refusals()
        assert len(reasons) == 1
        assert reasons[0].startswith("rejoin refused: "), reasons
        assert "relay 'host-c'" in reasons[0]
        assert "expected every rank it names to be dead, but rank 1 is alive on relay " \
               "'host-a'" in reasons[0]
        assert run.coord.live_ranks == {0, 1, 2, 3}
        assert run.coord.state()["rejected_handshakes"] == {"rejoin refused": 1}


async def test_same_host_naming_one_dead_and_one_live_rank_supersedes_its_connection(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with running(memory_network) as run:
        await run.coord.declare_dead(0, "gpu fell off the bus")
        # Another host naming them is refused (rank 1 is alive on host-a; no takeover).
        assert not (await run.dial("host-c", [0, 1])).acked
        assert "rank 0 was announced by host 'host-a'" in run.refusals()[0]
        # host-a itself restarted: its old connection (rank 1 alive on it) is superseded.
        assert (await run.dial("host-a", [0, 1])).acked
        await wait_until(lambda: run.coord.live_ranks == {0, 1, 2, 3}, limit=1)
        assert run.timeline.events_of(RankRejoined) == [RankRejoined(rank=0, host="host-a"),
                                                        RankRejoined(rank=1, host="host-a")]
        assert len(run.refusals()) == 1


async def test_takeover_by_another_host_is_refused_by_default(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with running(memory_network) as run:
        await run.hang_up(run.relays["host-a"], {0, 1})
        assert not (await run.dial("spare", [0, 1])).acked
        (reason,) = run.refusals()
        assert "rank 0 was announced by host 'host-a'" in reason
        assert "allow_rank_takeover=True" in reason
        assert run.coord.dead_ranks == {0, 1}


async def test_takeover_by_a_spare_host_is_admitted_when_allowed_and_recorded(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with running(memory_network, allow_rank_takeover=True) as run:
        await run.hang_up(run.relays["host-a"], {0, 1})
        assert (await run.dial("spare", [0, 1])).acked
        await wait_until(lambda: run.coord.live_ranks == {0, 1, 2, 3}, limit=1)
        assert run.timeline.events_of(RankTakenOver) == [
            RankTakenOver(rank=0, host="spare", previous_host="host-a"),
            RankTakenOver(rank=1, host="spare", previous_host="host-a")]
        assert [ev.host for ev in run.timeline.events_of(RankRejoined)] == ["spare", "spare"]
        hosts = [r["host"] for r in run.coord.state()["relays"]]
        assert hosts == ["host-b", "spare"]  # the crashed connection left the roster


@pytest.mark.parametrize(("world_size", "sigs", "expected"), [
    (5, SIGS, "world_size mismatch: the coordinator's world_size is 4, the relay's is 5"),
    (4, {"model": bytes(32)}, "model signature mismatch"),
], ids=["world-size", "model-signature"])
async def test_rejoin_with_another_world_or_model_is_refused(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, world_size: int,
    sigs: dict[str, bytes], expected: str,
) -> None:
    async with running(memory_network) as run:
        await run.hang_up(run.relays["host-a"], {0, 1})
        assert not (await run.dial("host-a", [0, 1], world_size=world_size,
                                   model_sigs=sigs)).acked
        (reason,) = run.refusals()
        assert expected in reason and "relay 'host-a'" in reason
        assert run.coord.dead_ranks == {0, 1}


async def test_rank_that_exited_cleanly_never_rejoins(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with running(memory_network) as run:
        b = run.relays["host-b"]
        frame = ft.wire.FrameCodec(run.salt).encode(ft.wire.Exiting(rank=3))
        await b.stream.send_all(b.sealer.seal(int(ft.wire.RecordKind.DATA), 3, frame))
        await wait_until(lambda: run.coord.exited_ranks == {3}, limit=1)
        await run.hang_up(b, {2})
        assert not (await run.dial("host-b", [2, 3])).acked
        assert "rank 3 exited cleanly and does not rejoin" in run.refusals()[0]
        assert (await run.dial("host-b", [2])).acked
        await wait_until(lambda: run.coord.live_ranks == {0, 1, 2}, limit=1)


async def test_a_recorded_rejoin_replayed_on_a_new_connection_is_refused(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with running(memory_network) as run:
        await run.hang_up(run.relays["host-a"], {0, 1})
        recording = Recording(await run.net.connect(COORD))
        genuine = await raw_relay_handshake(recording, run.salt, "host-a", [0, 1], world_size=4,
                                            model_sigs=SIGS)
        assert genuine.acked
        await wait_until(lambda: run.coord.live_ranks == {0, 1, 2, 3}, limit=1)
        await run.hang_up(genuine, {0, 1})
        # Everything the genuine relay sent (its magic, Hello, Ready), on a new connection.
        replay = await run.net.connect(COORD)
        await replay.send_all(bytes(recording.sent))
        await drain_and_close(replay, limit=5)
        (reason,) = run.refusals()
        assert reason.startswith("bad mac: ") and "tag does not verify" in reason
        assert run.coord.dead_ranks == {0, 1}
        assert len(run.timeline.events_of(RankRejoined)) == 2  # the genuine rejoin only


async def test_a_rejoin_whose_ready_was_lost_is_superseded_by_the_same_relay_redialing(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with running(memory_network, handshake_timeout=30, allow_rank_takeover=True) as run:
        await run.hang_up(run.relays["host-a"], {0, 1})
        outcome = run.dial_losing_its_ready("host-a", [0, 1])
        await trio.sleep(1)
        assert outcome == [] and run.coord.dead_ranks == {0, 1}  # waiting for its Ready
        # Meanwhile a spare may not claim them (takeover is allowed, but they are claimed),
        # and the same relay re-dialing may.
        assert not (await run.dial("host-x", [0, 1])).acked
        assert "rank 0 is being rejoined by relay 'host-a'" in run.refusals()[0]
        started = trio.current_time()
        assert (await run.dial("host-a", [0, 1])).acked
        await wait_until(lambda: outcome == [False], limit=1)  # closed at once, not at 30 s
        assert trio.current_time() - started < 1
        assert run.coord.live_ranks == {0, 1, 2, 3}
        assert len(run.timeline.events_of(RankRejoined)) == 2


# ----------------------------------------------------- a restarted host supersedes its connection


def superseded(log: EventLog) -> list[tuple[str, tuple[int, ...]]]:
    return [(ev.host, ev.ranks) for ev in log.events_of(RelayLost)
            if ev.reason.startswith("superseded: ")]


async def test_same_host_redialing_supersedes_its_live_connection_and_its_ranks_rejoin_at_once(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with running(memory_network) as run:
        old = run.relays["host-a"]
        started = trio.current_time()
        assert (await run.dial("host-a", [0, 1])).acked
        await wait_until(lambda: run.coord.live_ranks == {0, 1, 2, 3}
                         and len(run.timeline.events_of(RankRejoined)) == 2, limit=1)
        assert trio.current_time() - started < 0.5  # heartbeat_timeout is 3600 s here
        assert superseded(run.timeline) == [("host-a", (0, 1))]
        lost = run.timeline.events_of(RelayLost)[0]
        assert "superseded: host 'host-a' re-joined from mem:coordinator:" in lost.reason
        dead = run.timeline.events_of(RankDeclaredDead)
        assert [(ev.rank, ev.host) for ev in dead] == [(0, "host-a"), (1, "host-a")]
        assert all("superseded" in ev.reason for ev in dead), dead
        assert run.refusals() == []
        assert run.coord.state()["rejoins"] == {"0": 1, "1": 1}
        # The old connection is closed: its peer read EOF (drain_and_close then closed its end,
        # long before its 30 s limit), not silence.
        await trio.sleep(0.1)
        with pytest.raises(trio.ClosedResourceError):
            await old.stream.receive_some(1)
        await run.coord.send_control(1, ft.wire.SyncNow())  # addressed to the new connection


async def test_same_host_naming_a_rank_alive_on_another_host_is_refused_and_supersedes_nothing(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with running(memory_network, allow_rank_takeover=True) as run:
        assert not (await run.dial("host-a", [0, 1, 2])).acked
        reasons = run.refusals()
        assert len(reasons) == 1
        assert "rank 2 is alive on relay 'host-b'" in reasons[0], reasons
        assert run.coord.live_ranks == {0, 1, 2, 3}
        assert run.timeline.events_of(RelayLost) == []
        assert run.timeline.events_of(RankDeclaredDead) == []
        await run.coord.send_control(0, ft.wire.SyncNow())  # host-a's old connection still works


async def test_supersede_deaths_count_for_the_failure_policy(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    cfg = quiet_config(max_failure=ft.MaxFailure.absolute(2))
    async with raw_cohort(memory_network, RawCohort) as cohort:
        log = cohort.timeline
        restarted: list[bool] = []

        async def form() -> None:
            for host, ranks in (("host-a", [0, 1]), ("host-b", [2, 3])):
                assert (await cohort.dial(host, ranks)).acked

        async def restart_b() -> None:
            restarted.append((await cohort.dial("host-b", [2, 3])).acked)

        cohort.nursery.start_soon(form)
        with pytest.raises(ft.ClusterFailure, match="max_failure absolute"):
            async with ft.open_coordinator(memory_network.listener(COORD), salt=cohort.salt,
                                           config=cfg, timeline=log) as coord:
                await wait_until(lambda: coord.live_ranks == {0, 1, 2, 3}, limit=1)
                # Two momentary deaths reach max_failure=2: the run stops, the host stays out.
                cohort.nursery.start_soon(restart_b)
                await trio.sleep(10)  # the policy cancels the body long before
        await wait_until(lambda: restarted != [], limit=5)
        assert restarted == [False], restarted
        rejected = cohort.refusals()
        # "but cluster failure: MAX_FAILURE_EXCEEDED ...", or "but the coordinator is shutting
        # down" once the failure has cancelled the body: either way, judged after the deaths.
        assert len(rejected) == 1 and "expected a running cohort to rejoin, but " \
            in rejected[0], rejected
        assert [ev.reason for ev in log.events_of(ClusterFailed)] == ["MAX_FAILURE_EXCEEDED"]
        assert log.events_of(RankRejoined) == []
        assert superseded(log) == [("host-b", (2, 3))]


async def test_two_redials_of_a_restarted_host_end_with_one_connection_carrying_its_ranks(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with running(memory_network, handshake_timeout=30) as run:
        # The first re-dial supersedes the live connection, then goes quiet.
        outcome = run.dial_losing_its_ready("host-a", [0, 1])
        await wait_until(lambda: run.coord.dead_ranks == {0, 1}, limit=1)
        assert outcome == []  # waiting for its Ready; its ranks are claimed
        assert not (await run.dial("host-c", [0])).acked  # no one else's
        started = trio.current_time()
        assert (await run.dial("host-a", [0, 1])).acked  # the second re-dial wins
        await wait_until(lambda: outcome == [False], limit=1)
        assert trio.current_time() - started < 1
        assert run.coord.live_ranks == {0, 1, 2, 3}
        assert superseded(run.timeline) == [("host-a", (0, 1))]
        assert len(run.timeline.events_of(RankDeclaredDead)) == 2
        assert len(run.timeline.events_of(RankRejoined)) == 2


async def test_old_connection_ending_as_it_is_superseded_is_lost_once(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with running(memory_network) as run:
        old = run.relays["host-a"]
        async with trio.open_nursery() as both:  # the crash resets as the restart dials
            both.start_soon(old.stream.aclose)
            both.start_soon(run.dial, "host-a", [0, 1])
        await wait_until(lambda: run.coord.live_ranks == {0, 1, 2, 3}, limit=1)
        assert [ev.host for ev in run.timeline.events_of(RelayLost)] == ["host-a"]
        assert [ev.rank for ev in run.timeline.events_of(RankDeclaredDead)] == [0, 1]
        assert len(run.timeline.events_of(RankRejoined)) == 2
        assert run.refusals() == []


async def test_supersede_declares_the_ranks_dead_even_without_declare_dead_on_relay_loss(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with running(memory_network, declare_dead_on_relay_loss=False) as run:
        assert (await run.dial("host-b", [2, 3])).acked
        await wait_until(lambda: len(run.timeline.events_of(RankRejoined)) == 2, limit=1)
        assert [ev.rank for ev in run.timeline.events_of(RankDeclaredDead)] == [2, 3]
        assert run.coord.live_ranks == {0, 1, 2, 3}
