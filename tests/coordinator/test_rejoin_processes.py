"""A host that comes back, with real processes on loopback (issue 26): a relay process SIGKILLed
mid-run, or right after its join, and started again rejoins the running cohort (its ranks alive
within 3 s of the restart), every epoch is covered exactly once and every process exits 0; a
relay process that claims a live rank is refused at once, with the reason recorded. A host
restarted before its death was noticed (issue 26b): a relay process frozen with SIGSTOP (its TCP
connection stays open, so the coordinator sees nothing until heartbeat_timeout) and a new relay
process for the same host: its ranks rejoin within 3 s, and the frozen one, resumed with SIGCONT,
finds its connection closed and exits without disturbing the run.

Each host is ``scripts/_relay_proc.py`` (a relay and its simulated ranks in one process); the
coordinator and the SyncScheduler run in the test.
"""

from __future__ import annotations

import signal
from typing import Any

import trio

import flodl_trio as ft
from flodl_trio.events import (
    ClusterFailed,
    HandshakeRejected,
    Note,
    RankDeclaredDead,
    RankRejoined,
    RelayJoined,
    RelayLost,
)
from flodl_trio.scheduler import SyncScheduler

from helpers import wait_until
from helpers.scripts import relay_processes

SIM = ("--sim-batch-ms", "40", "--batch-size", "4")
EPOCHS = 6


def _connected(line: str) -> bool:
    return line.startswith("relay ") and " connected " in line


async def _run_with_a_restart(*, kill_after_join: bool) -> None:
    """host-b and host-a run simulated ranks; host-a is SIGKILLed (once its join completed, or
    once epoch 1 started) and started again at once."""
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=20, heartbeat_timeout=30)
    async with relay_processes(limit=40) as relays:
        b = await relays.start("host-b", [2, 3], extra=SIM)
        first = await relays.start("host-a", [0, 1], extra=SIM)
        async with relays.coordinator(cfg) as coord:
            sched = SyncScheduler(coord, total_samples=192, batch_size=4, num_epochs=EPOCHS)
            restarted: list[tuple[float, Any]] = []

            async def kill_and_restart() -> None:
                if kill_after_join:
                    await first.wait_lines(_connected)
                else:
                    await wait_until(lambda: any(
                        ev.what == "epoch_started" and ev.fields["epoch"] == 1
                        for ev in relays.log.events_of(Note)), limit=30)
                first.proc.kill()
                await first.proc.wait()
                child = await relays.start("host-a", [0, 1], extra=SIM)
                restarted.append((trio.current_time(), child))

            relays.nursery.start_soon(kill_and_restart)
            summary = await sched.run()
            assert restarted, "the run ended before host-a was restarted"
        restart_at, again = restarted[0]
        await relays.wait_exits(b, again)

    assert first.proc.returncode == -9
    assert b.proc.returncode == 0, b.lines
    assert again.proc.returncode == 0, again.lines
    assert summary.epochs_completed == EPOCHS
    assert all(c.exact for c in sched.coverage), sched.coverage
    assert summary.deaths == {}
    rejoined = relays.log.of(RankRejoined)
    assert [ev for _, ev in rejoined] == [RankRejoined(rank=0, host="host-a"),
                                          RankRejoined(rank=1, host="host-a")]
    assert all(t - restart_at < 3 for t, _ in rejoined), (restart_at, rejoined)
    # The restarted ranks trained again: each got StartEpoch for the epochs after its return.
    got = again.matching(lambda s: s.startswith("rank 0 got StartEpoch"))
    assert got, again.lines
    assert any(" got DeclareAlive 0 " in s for s in b.lines), b.lines


async def test_relay_sigkilled_mid_run_and_restarted_rejoins_and_the_run_completes() -> None:
    await _run_with_a_restart(kill_after_join=False)


async def test_relay_sigkilled_right_after_its_join_and_restarted_rejoins() -> None:
    await _run_with_a_restart(kill_after_join=True)


async def test_relay_process_claiming_a_live_rank_is_refused_at_once_with_the_reason() -> None:
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=20, heartbeat_timeout=30)
    async with relay_processes(limit=20) as relays:
        await relays.start_two_hosts()
        async with relays.coordinator(cfg) as coord:
            intruder = await relays.start("host-x", [1])
            started = trio.current_time()
            await wait_until(lambda: relays.log.events_of(HandshakeRejected), limit=10)
            (at, rejected), = relays.log.of(HandshakeRejected)
            assert at - started < 3  # a process start, then one round trip
            assert rejected.reason.startswith("rejoin refused: ")
            assert "relay 'host-x'" in rejected.reason
            assert "rank 1 is alive on relay 'host-a'" in rejected.reason
            assert coord.live_ranks == {0, 1, 2, 3}
            assert coord.state()["rejected_handshakes"]["rejoin refused"] >= 1
            assert not intruder.matching(_connected)


async def test_relay_sigkilled_after_its_ready_during_formation_and_restarted_joins_the_cohort(
) -> None:
    # host-a joins (its Ready verified: it prints "connected") and is SIGKILLed while formation
    # still waits for host-b; then host-a is started again with the same host and ranks, and
    # host-b starts (at the same time: formation waits for host-a's ranks either way). The
    # cohort forms with every rank alive: no failure, no death, no refusal.
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=20, heartbeat_timeout=30)
    async with relay_processes(limit=30) as relays:

        async def hosts() -> None:
            first = await relays.start("host-a", [0, 1])
            await first.wait_lines(_connected)
            first.proc.kill()
            await first.proc.wait()
            await wait_until(lambda: relays.log.events_of(RelayLost), limit=5)
            async with trio.open_nursery() as both:
                both.start_soon(relays.start, "host-a", [0, 1])
                both.start_soon(relays.start, "host-b", [2, 3])

        relays.nursery.start_soon(hosts)
        async with relays.coordinator(cfg) as coord:
            assert coord.live_ranks == {0, 1, 2, 3}
            assert coord.dead_ranks == frozenset()
            joined = [ev.host for ev in relays.log.events_of(RelayJoined)]
            assert joined[0] == "host-a" and sorted(joined[1:]) == ["host-a", "host-b"]
            assert relays.log.events_of(HandshakeRejected) == []
            assert relays.log.events_of(RankDeclaredDead) == []
        first, *rest = relays.children
        (again,) = [child for child in rest if child.host == "host-a"]
        (b,) = [child for child in rest if child.host == "host-b"]
        await relays.wait_exits(again, b)
    assert first.proc.returncode == -9
    assert again.proc.returncode == 0, again.lines
    assert b.proc.returncode == 0, b.lines


# -------------------------------------------------- a host restarted before its death was noticed


async def test_frozen_relay_process_is_superseded_by_its_restart_and_exits_once_resumed() -> None:
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=20, heartbeat_timeout=60)
    async with relay_processes(limit=30) as relays:
        a, frozen = await relays.start_two_hosts()
        async with relays.coordinator(cfg) as coord:
            frozen.proc.send_signal(signal.SIGSTOP)
            restarted_at = trio.current_time()
            again = await relays.start("host-b", [2, 3])
            await wait_until(lambda: len(relays.log.events_of(RankRejoined)) == 2, limit=10)
            rejoined = relays.log.of(RankRejoined)
            assert [ev for _, ev in rejoined] == [RankRejoined(rank=2, host="host-b"),
                                                  RankRejoined(rank=3, host="host-b")]
            assert all(t - restarted_at < 3 for t, _ in rejoined), (restarted_at, rejoined)
            lost = relays.log.events_of(RelayLost)
            assert len(lost) == 1 and lost[0].reason.startswith(
                "superseded: host 'host-b' re-joined from 127.0.0.1:"), lost
            frozen.proc.send_signal(signal.SIGCONT)
            await relays.wait_exits(frozen)  # its connection was closed: it ends
            await trio.sleep(0.5)  # room for any disturbance to show
            assert coord.live_ranks == {0, 1, 2, 3}
            assert len(relays.log.events_of(RelayLost)) == 1, relays.log.events_of(RelayLost)
            assert relays.log.events_of(ClusterFailed) == []
            assert again.proc.returncode is None  # the restarted host carries on
        await relays.wait_exits(a, again)
    assert a.proc.returncode == 0, a.lines
    assert again.proc.returncode == 0, again.lines
    assert frozen.proc.returncode != 0, frozen.lines  # it lost its coordinator
