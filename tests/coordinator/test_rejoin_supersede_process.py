"""A host restarted before its death was noticed, with real processes on loopback (issue 26b):
a relay process frozen with SIGSTOP (its TCP connection stays open, so the coordinator sees
nothing until heartbeat_timeout) and a new relay process for the same host: its ranks rejoin
within 3 s, and the frozen one, resumed with SIGCONT, finds its connection closed and exits
without disturbing the run. ``scripts/_relay_proc.py`` is one host (relay and ranks)."""

from __future__ import annotations

import signal
from typing import Any

import trio

import flodl_trio as ft
from flodl_trio.events import ClusterFailed, RankRejoined, RelayLost
from flodl_trio.testing import EventLog

from helpers import wait_until
from helpers.scripts import load_script, start_relay_processes

RelayProcess = load_script("_relay_proc").RelayProcess


async def test_frozen_relay_process_is_superseded_by_its_restart_and_exits_once_resumed() -> None:
    salt = ft.SessionSalt.generate()
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=20, heartbeat_timeout=60)
    log = EventLog()
    children: list[Any] = []
    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                bound = await ft.bind_coordinator(("127.0.0.1", 0))
                _, frozen = await start_relay_processes(nursery, bound.address, salt, children)
                async with ft.open_coordinator(bound, salt=salt, config=cfg,
                                               timeline=log) as coord:
                    frozen.proc.send_signal(signal.SIGSTOP)
                    restarted_at = trio.current_time()
                    again = await RelayProcess.start(
                        nursery, coordinator=bound.address, salt=salt, host="host-b",
                        ranks=[2, 3], world_size=4)
                    children.append(again)
                    await wait_until(lambda: len(log.events_of(RankRejoined)) == 2, limit=10)
                    rejoined = log.of(RankRejoined)
                    assert [ev for _, ev in rejoined] == [RankRejoined(rank=2, host="host-b"),
                                                          RankRejoined(rank=3, host="host-b")]
                    assert all(t - restarted_at < 3 for t, _ in rejoined), (restarted_at,
                                                                            rejoined)
                    lost = log.events_of(RelayLost)
                    assert len(lost) == 1 and lost[0].reason.startswith(
                        "superseded: host 'host-b' re-joined from 127.0.0.1:"), lost
                    frozen.proc.send_signal(signal.SIGCONT)
                    with trio.fail_after(10):
                        await frozen.proc.wait()  # its connection was closed: it ends
                    await trio.sleep(0.5)  # room for any disturbance to show
                    assert coord.live_ranks == {0, 1, 2, 3}
                    assert len(log.events_of(RelayLost)) == 1, log.events_of(RelayLost)
                    assert log.events_of(ClusterFailed) == []
                    assert again.proc.returncode is None  # the restarted host carries on
                with trio.fail_after(10):
                    for child in (children[0], again):
                        await child.proc.wait()
                nursery.cancel_scope.cancel()
    finally:
        for child in children:
            await child.stop()
    assert children[0].proc.returncode == 0, children[0].lines
    assert again.proc.returncode == 0, again.lines
    assert frozen.proc.returncode != 0, frozen.lines  # it lost its coordinator
