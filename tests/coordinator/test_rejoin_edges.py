"""A host that comes back (issue 26), at the edges a user meets: a restart that reaches the
coordinator after the run's final ``Shutdown`` went out (the embedder still inside its
``open_coordinator`` block, saving a checkpoint, say). In-memory transport, MockClock."""

from __future__ import annotations

import trio

import flodl_trio as ft
from flodl_trio.events import (
    HandshakeRejected,
    RankDeclaredDead,
    RankRejoined,
    RelayLost,
)
from flodl_trio.testing import EventLog, MemoryNetwork

from helpers import COORD, start_host, wait_until
from helpers.raw import drain_and_close, raw_relay_handshake


async def test_host_restarted_after_the_final_shutdown_is_not_left_waiting_for_a_run_that_ended(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    log = EventLog()
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=60, heartbeat_timeout=30)
    async with trio.open_nursery() as nursery:
        a = await start_host(nursery, memory_network, "host-a", [0, 1], salt=salt, world=4)
        b = await start_host(nursery, memory_network, "host-b", [2, 3], salt=salt, world=4)
        async with ft.open_coordinator(memory_network.listener(COORD), salt=salt, config=cfg,
                                       timeline=log) as coord:
            b.kill()
            await wait_until(lambda: coord.dead_ranks == {2, 3}, limit=5)
            await wait_until(lambda: b.all_done, limit=5)
            # The run is over: the scheduler's last word went out to every live rank.
            await coord.broadcast_control(ft.wire.Shutdown())
            await wait_until(lambda: all(r.done.is_set() for r in a.ranks.values()), limit=5)
            back = await start_host(nursery, memory_network, "host-b", [2, 3], salt=salt,
                                    world=4)
            # The embedder saves a checkpoint before leaving the block.
            await wait_until(lambda: log.events_of(RankRejoined)
                             or log.events_of(HandshakeRejected), limit=5)
            await trio.sleep(5)
        with trio.fail_after(30):
            await back.done.wait()
            for run in back.ranks.values():
                await run.done.wait()
        # Either refused (the run is over) or admitted and then told Shutdown like everyone:
        # never left with ranks that fail for want of a Shutdown.
        for rank, run in back.ranks.items():
            assert run.outcome == "ended", (rank, run.outcome, run.labels())
        nursery.cancel_scope.cancel()


async def test_relay_claiming_a_live_rank_ends_at_once_naming_the_rank_and_its_owner(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    log = EventLog()
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=60, heartbeat_timeout=30)
    async with trio.open_nursery() as nursery:
        for host, ranks in (("host-a", [0, 1]), ("host-b", [2, 3])):
            await start_host(nursery, memory_network, host, ranks, salt=salt, world=4)
        async with ft.open_coordinator(memory_network.listener(COORD), salt=salt, config=cfg,
                                       timeline=log) as coord:
            started = trio.current_time()
            intruder = await start_host(nursery, memory_network, "host-x", [1], salt=salt,
                                        world=4)
            with trio.move_on_after(40):
                await intruder.done.wait()
            took = trio.current_time() - started
            assert coord.live_ranks == {0, 1, 2, 3}
            assert len(log.events_of(HandshakeRejected)) == 1, log.events_of(HandshakeRejected)
            assert intruder.done.is_set() and took < 3, took
            assert isinstance(intruder.exit, ft.JoinRefused), intruder.exit
            assert "rank 1 is alive on relay 'host-a'" in intruder.exit.reason, intruder.exit
        nursery.cancel_scope.cancel()


async def test_host_restarted_before_its_death_was_noticed_rejoins_once_it_is(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    log = EventLog()
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=60, heartbeat_timeout=45)
    async with trio.open_nursery() as nursery:
        await start_host(nursery, memory_network, "host-a", [0, 1], salt=salt, world=4)

        frozen_closed = trio.Event()

        async def frozen_host_b() -> None:  # joins, then never says a word again
            raw = await raw_relay_handshake(await memory_network.connect(COORD), salt,
                                            "host-b", [2, 3], world_size=4)
            assert raw.acked
            await drain_and_close(raw.stream, limit=3600)
            frozen_closed.set()  # the coordinator closed it (the drain ended before its limit)

        nursery.start_soon(frozen_host_b)
        async with ft.open_coordinator(memory_network.listener(COORD), salt=salt, config=cfg,
                                       timeline=log) as coord:
            await trio.sleep(1)
            restarted_at = trio.current_time()
            back = await start_host(nursery, memory_network, "host-b", [2, 3], salt=salt,
                                    world=4)
            with trio.move_on_after(cfg.heartbeat_timeout + 10):
                await wait_until(lambda: len(log.events_of(RankRejoined)) == 2,
                                 limit=cfg.heartbeat_timeout + 10)
            took = trio.current_time() - restarted_at
            assert log.events_of(RankRejoined) == [RankRejoined(rank=2, host="host-b"),
                                                   RankRejoined(rank=3, host="host-b")], (
                took, back.exit)
            assert took < 3, took  # well before heartbeat_timeout (45 s)
            assert coord.live_ranks == {0, 1, 2, 3}
            # The frozen connection was lost as superseded and its ranks declared dead first.
            lost = log.events_of(RelayLost)
            assert [(e.host, e.ranks) for e in lost] == [("host-b", (2, 3))], lost
            assert lost[0].reason.startswith("superseded: host 'host-b' re-joined from "), lost
            assert [e.rank for e in log.events_of(RankDeclaredDead)] == [2, 3]
            await wait_until(lambda: frozen_closed.is_set(), limit=5)
        nursery.cancel_scope.cancel()
