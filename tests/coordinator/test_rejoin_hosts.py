"""A host that comes back, end to end with real relays and rank endpoints on the in-memory
transport (issue 26): its relay re-runs the full handshake, its new rank endpoints join, the
survivors are told (``DeclareAlive``, as they were told ``DeclareDead``), the newcomers learn who
is still dead, and at the end of the run the restarted relay ends clean."""

from __future__ import annotations

import trio

import flodl_trio as ft
from flodl_trio.events import RankRejoined
from flodl_trio.testing import EventLog, MemoryNetwork

from helpers import COORD, start_host, wait_until


async def test_restarted_host_rejoins_survivors_are_told_and_its_relay_ends_clean(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    timeline = EventLog()
    cfg = ft.CoordinatorConfig(world_size=6, formation_timeout=60, heartbeat_timeout=30)
    layout = {"host-a": [0, 1], "host-b": [2, 3], "host-c": [4, 5]}
    async with trio.open_nursery() as nursery:
        hosts = {h: await start_host(nursery, memory_network, h, r, salt=salt, world=6)
                 for h, r in layout.items()}
        async with ft.open_coordinator(memory_network.listener(COORD), salt=salt, config=cfg,
                                       timeline=timeline) as coord:
            # host-c dies for good, host-a dies and comes back.
            for host in ("host-c", "host-a"):
                hosts[host].kill()
            await wait_until(lambda: coord.dead_ranks == {0, 1, 4, 5}, limit=5)
            await wait_until(lambda: hosts["host-a"].all_done, limit=5)
            restarted_at = trio.current_time()
            back = await start_host(nursery, memory_network, "host-a", [0, 1], salt=salt,
                                    world=6)
            await wait_until(lambda: coord.live_ranks == {0, 1, 2, 3}, limit=5)
            rejoined = timeline.of(RankRejoined)
            assert [ev for _, ev in rejoined] == [RankRejoined(rank=0, host="host-a"),
                                                  RankRejoined(rank=1, host="host-a")]
            assert all(t - restarted_at < 1 for t, _ in rejoined)
            survivors = [hosts["host-b"].ranks[r] for r in (2, 3)]
            await wait_until(lambda: all(
                rec.labels().count("DeclareAlive") == 2 for rec in survivors), limit=2)
            for rec in survivors:
                assert rec.ep is not None and rec.ep.dead_peers == {4, 5}
                told = [(type(m).__name__, int(m.rank)) for m in rec.received
                        if isinstance(m, ft.wire.DeclareDead | ft.wire.DeclareAlive)]
                # Each death, then each return, in order (host-c's and host-a's deaths may
                # interleave).
                assert sorted(told[:4]) == [("DeclareDead", r) for r in (0, 1, 4, 5)]
                assert told[4:] == [("DeclareAlive", 0), ("DeclareAlive", 1)]
            newcomers = [back.ranks[r] for r in (0, 1)]
            await wait_until(lambda: all(rec.ep is not None and rec.ep.dead_peers == {4, 5}
                                         for rec in newcomers), limit=2)
            # The rejoined ranks are addressed like any other.
            result = await coord.broadcast_control(ft.wire.SyncNow())
            assert result.delivered == {0, 1, 2, 3}
            await wait_until(lambda: all("SyncNow" in rec.labels() for rec in newcomers),
                             limit=2)
        await wait_until(lambda: back.all_done and hosts["host-b"].all_done, limit=10)
        assert isinstance(back.exit, ft.RelayExit) and back.exit.clean, back.exit
        assert all(rec.labels()[-1] == "Shutdown" for rec in newcomers)
        # The old endpoints of host-a stayed ended: nothing was delivered to them since.
        assert all(run.outcome == "killed" or isinstance(run.outcome, ft.CoordinatorLost)
                   for run in hosts["host-a"].ranks.values())
        nursery.cancel_scope.cancel()
