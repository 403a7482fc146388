"""A relay *process* SIGKILLed after formation (real processes, real loopback TCP): the kernel's
close of its socket is what the coordinator sees, and its ranks are declared dead at once
(SPEC §4.5, §13), not after the heartbeat timeout; the survivors are told.
"""

from __future__ import annotations

import time

import trio

import flodl_trio as ft
from flodl_trio.events import RankDeclaredDead, RelayLost

from helpers.scripts import load_script, relay_processes

arrival_time = load_script("_relay_proc").arrival_time


async def test_sigkilled_relay_process_ranks_are_declared_dead_at_once_and_survivors_told() -> None:
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=8, heartbeat_timeout=30)
    async with relay_processes(limit=9) as relays:
        victim, survivor = await relays.start_two_hosts()
        async with relays.coordinator(cfg) as coord:
            for child in relays.children:
                await child.wait_lines(lambda s: s.startswith("relay ") and " connected " in s)
            killed_at, killed_wall = trio.current_time(), time.time()
            victim.proc.kill()

            with trio.fail_after(1):
                while coord.dead_ranks != {0, 1}:  # noqa: ASYNC110 - measuring latency
                    await trio.sleep(0.001)
            deaths = relays.log.of(RankDeclaredDead)
            assert sorted(ev.rank for _, ev in deaths) == [0, 1]
            assert all(t - killed_at < 1.0 for t, _ in deaths)
            assert all("'host-a'" in ev.reason for _, ev in deaths)
            assert [ev.host for ev in relays.log.events(RelayLost)] == ["host-a"]
            assert coord.live_ranks == {2, 3}

            with trio.fail_after(2):
                told = await survivor.wait_lines(lambda s: " got DeclareDead " in s, 4)
            assert sorted(" ".join(s.split()[:5]) for s in told) == [
                "rank 2 got DeclareDead 0", "rank 2 got DeclareDead 1",
                "rank 3 got DeclareDead 0", "rank 3 got DeclareDead 1"]
            assert all(arrival_time(s) - killed_wall < 1.0 for s in told)
        # Leaving the block shuts the survivors down cleanly.
        with trio.fail_after(5):
            await survivor.proc.wait()
            await survivor.wait_lines(lambda s: s.startswith("relay host-b exit "))
        assert survivor.proc.returncode == 0, survivor.lines
        assert len(survivor.matching(lambda s: " got Shutdown " in s)) == 2
        assert victim.proc.returncode == -9
