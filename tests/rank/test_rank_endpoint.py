"""The rank endpoint (SPEC §6): arguments, dial retry, heartbeats, what reaches the user, the
coordinator-liveness watchdog and the goodbye."""

from __future__ import annotations

import itertools
import socket
from collections import Counter
from typing import Any

import pytest
import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.events import RankDeclaredDead, RankExited
from flodl_trio.testing import MemoryNetwork, open_local_cluster
from flodl_trio.wire import CoordHeartbeat, DeclareDead, Heartbeat, SetGlobalStep, Shutdown

from helpers import COORD, Recorder, events_of, start_host, wait_until
from helpers.raw import raw_coordinator_accept


async def test_rank_not_below_world_size_is_a_config_error_before_dialing() -> None:
    dialed: list[str] = []

    async def dial() -> trio.abc.Stream:
        dialed.append("dialed")
        raise AssertionError("open_rank must not dial")

    salt = ft.SessionSalt.generate()
    for rank, world in ((4, 4), (5, 4)):
        with pytest.raises(ft.ConfigError, match="expected rank < world_size") as excinfo:
            async with ft.open_rank(dial, salt=salt, rank=rank, world_size=world):
                pytest.fail("unreachable")
        assert f"rank {rank}" in str(excinfo.value)
    with pytest.raises(ft.ConfigError, match="rank"):
        async with ft.open_rank(dial, salt=salt, rank=-1, world_size=4):
            pytest.fail("unreachable")
    assert dialed == []


async def test_rank_started_before_its_relay_listens_connects_once_the_listener_appears(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    attempts: list[float] = []
    entered_at: list[float] = []

    async def dial() -> trio.abc.Stream:
        attempts.append(trio.current_time())
        return await memory_network.connect("relay:host-a")

    async with trio.open_nursery() as nursery:

        async def rank() -> None:
            async with ft.open_rank(dial, salt=salt, rank=0, world_size=1) as ep:
                entered_at.append(trio.current_time())
                async for _ in ep:
                    pass

        nursery.start_soon(rank)
        await trio.sleep(3.2)
        assert not entered_at
        async with ft.open_relay(lambda: memory_network.connect(COORD), salt=salt,
                                 host="host-a", ranks=[0], world_size=1,
                                 rank_listen=memory_network.listener("relay:host-a")):
            async with ft.open_coordinator(memory_network.listener(COORD), salt=salt,
                                           config=ft.CoordinatorConfig(world_size=1)):
                pass
    # Retries every 0.5 s, well within connect_timeout (30 s).
    assert 3.2 <= entered_at[0] <= 3.2 + 0.5 + 1e-6
    gaps = [b - a for a, b in itertools.pairwise(attempts)]
    assert len(attempts) >= 7 and all(gap == pytest.approx(0.5) for gap in gaps)


async def test_rank_whose_relay_never_listens_fails_after_connect_timeout(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    started = trio.current_time()
    with pytest.raises(ft.HandshakeError) as excinfo:
        async with ft.open_rank(lambda: memory_network.connect("relay:nowhere"),
                                salt=ft.SessionSalt.generate(), rank=0, world_size=1,
                                config=ft.RankConfig(connect_timeout=4)):
            pytest.fail("unreachable")
    assert trio.current_time() - started == pytest.approx(4, abs=0.5)
    assert "rank 0" in str(excinfo.value)
    assert "4s" in str(excinfo.value)


async def test_rank_dial_retries_over_real_tcp_until_the_relay_binds_its_port() -> None:
    """ECONNREFUSED from the OS is retried; the rank connects once the port is bound."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    salt = ft.SessionSalt.generate()
    net = MemoryNetwork()
    got: list[Any] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:

            async def rank() -> None:
                async with ft.open_rank(("127.0.0.1", port), salt=salt, rank=0,
                                        world_size=1) as ep:
                    async for msg in ep:
                        got.append(msg)

            nursery.start_soon(rank)
            await trio.sleep(1.2)  # a few refused attempts
            assert got == []
            async with ft.open_relay(lambda: net.connect(COORD), salt=salt, host="host-tcp",
                                     ranks=[0], world_size=1, rank_listen=port) as relay:
                assert relay.rank_address == ("127.0.0.1", port)
                async with ft.open_coordinator(net.listener(COORD), salt=salt,
                                               config=ft.CoordinatorConfig(world_size=1)) as c:
                    await c.send_control(0, SetGlobalStep(global_step=1))
    assert got == [SetGlobalStep(global_step=1), Shutdown()]
    net.assert_all_closed()


async def test_heartbeats_are_sent_every_interval_whatever_the_user_code_does(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        host = await start_host(nursery, memory_network, "host-a", [0, 1], salt=salt, world=2,
                                start_ranks=[])

        async def busy_rank(rank: int) -> None:
            # Never iterates and never sends: only the endpoint's own task speaks.
            async with ft.open_rank(lambda: memory_network.connect("relay:host-a"), salt=salt,
                                    rank=rank, world_size=2) as ep:
                ep.step_count = 40 + rank
                await release.wait()

        for rank in host.ranks:
            nursery.start_soon(busy_rank, rank)
        async with ft.open_coordinator(memory_network.listener(COORD), salt=salt,
                                       config=ft.CoordinatorConfig(world_size=2)) as coord:
            counts: Counter[int] = Counter()
            steps: set[tuple[int, int]] = set()
            with trio.move_on_after(5):
                async for msg in coord.timing:
                    assert isinstance(msg, Heartbeat)
                    counts[msg.rank] += 1
                    steps.add((msg.rank, msg.step_count))
            release.set()
        await wait_until(lambda: host.done.is_set())
        await listener_closed(memory_network)
    assert set(counts) == {0, 1}
    assert all(4 <= n <= 7 for n in counts.values()), counts
    # FT/2: the first Heartbeat goes out with the handshake, before the user code set a step.
    assert steps - {(0, 0), (1, 0)} == {(0, 40), (1, 41)}


async def listener_closed(net: MemoryNetwork) -> None:
    await trio.lowlevel.checkpoint()
    assert net.open_listeners() == []


async def test_coord_heartbeats_keep_the_rank_alive_but_never_reach_the_user(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    rank_cfg = ft.RankConfig(coord_liveness_timeout=5)
    rec = Recorder()
    async with open_local_cluster({"host-a": [0, 1]}, network=memory_network,
                                  rank_config=rank_cfg, rank_main=rec) as c:
        await trio.sleep(20)  # four liveness timeouts, filled with CoordHeartbeat only
        for rank, run in rec.ranks.items():
            assert c.ranks[rank].coordinator_lost is None
            assert run.received == []
        await c.coord.broadcast_control(SetGlobalStep(global_step=2))
    for run in rec.ranks.values():
        assert run.received == [SetGlobalStep(global_step=2), Shutdown()]
        assert not any(isinstance(m, CoordHeartbeat) for m in run.received)


async def test_silent_coordinator_is_lost_after_coord_liveness_timeout(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    listener = memory_network.listener(COORD)
    rank_cfg = ft.RankConfig(coord_liveness_timeout=6)
    async with trio.open_nursery() as nursery:
        host = await start_host(nursery, memory_network, "host-a", [0, 1], salt=salt, world=3,
                                rank_config=rank_cfg)
        # A coordinator that completes the handshake and then never says anything.
        side = await raw_coordinator_accept(listener, salt)
        started = trio.current_time()
        await wait_until(lambda: all(r.done.is_set() for r in host.ranks.values()), step=0.001)
        lost_after = trio.current_time() - started
        await wait_until(lambda: host.done.is_set())
        await side.stream.aclose()
        await listener.aclose()
    assert lost_after == pytest.approx(6, abs=0.01)
    for rank, run in host.ranks.items():
        assert isinstance(run.outcome, ft.CoordinatorLost)
        assert "coord_liveness_timeout=6s" in str(run.outcome)
        assert run.endpoint is not None
        assert run.endpoint.dead_peers == frozenset({0, 1, 2}) - {rank}


async def test_declare_dead_is_delivered_and_updates_dead_peers(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    rec = Recorder()
    async with open_local_cluster({"host-a": [0, 1], "host-b": [2]}, network=memory_network,
                                  rank_main=rec) as c:
        await c.coord.declare_dead(2, "observed by the orchestrator")
        await wait_until(lambda: DeclareDead(rank=2) in rec[0].received)
        assert c.ranks[0].dead_peers == frozenset({2})
    assert rec[1].received == [DeclareDead(rank=2), Shutdown()]


async def test_exiting_is_sent_on_clean_exit_but_not_when_the_body_raised(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    hosts = {"host-a": [0, 1], "host-b": [2]}
    rec = Recorder()
    async with open_local_cluster(hosts, network=memory_network, rank_main=rec,
                                  rank_errors=(RuntimeError, ft.FlodlError)) as c:
        exiting_from: list[int] = []

        async def watch_timing() -> None:
            async for msg in c.coord.timing:
                if isinstance(msg, wire.Exiting):
                    exiting_from.append(msg.rank)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_timing)
            rec[0].leave()
            boom = RuntimeError("training step blew up")
            rec[1].crash(boom)
            await wait_until(lambda: 0 in c.coord.exited_ranks and 1 in c.coord.dead_ranks)
            await trio.sleep(1)
            nursery.cancel_scope.cancel()
        assert exiting_from == [0]
        assert c.coord.exited_ranks == frozenset({0})
        assert [ev.rank for ev in events_of(c.coord.timeline, RankExited)] == [0]
        (dead,) = events_of(c.coord.timeline, RankDeclaredDead)
        assert dead.rank == 1 and "without Exiting" in dead.reason
    assert c.outcomes[0] == "left"
    assert c.outcomes[1] is boom
    assert isinstance(c.relay_exits["host-b"], ft.RelayExit)
