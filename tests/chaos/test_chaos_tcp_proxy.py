"""The same faults over real loopback TCP, through the chaos proxy (``chaos_proxy_factory``):
what the coordinator sees is what the kernel does with a FIN or an RST."""

from __future__ import annotations

from functools import partial

import trio
from _chaos.util import EventLog, category, first, run_host, wait_until

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.chaos import FaultPlan
from flodl_trio.events import FormationComplete, HandshakeRejected, RankDeclaredDead, RelayLost
from flodl_trio.pytest_plugin import ChaosProxyFactory

PATIENCE = 10  # real seconds; every step below takes milliseconds


async def test_relay_cut_mid_hello_over_tcp_is_rejected_and_re_dials_through_the_proxy(
    chaos_proxy_factory: ChaosProxyFactory,
) -> None:
    salt = ft.SessionSalt.generate()
    log = EventLog()
    config = ft.CoordinatorConfig(world_size=3, formation_timeout=PATIENCE, handshake_timeout=2)
    with trio.fail_after(PATIENCE):
        async with trio.open_nursery() as nursery:
            bound = await ft.bind_coordinator(("127.0.0.1", 0))
            async with chaos_proxy_factory(bound.address) as proxy:
                proxy.plan(FaultPlan().cut(10, "up"), connection=0)  # mid-Hello
                hosts = [await nursery.start(partial(
                    run_host, None, name, ranks, salt=salt, world=3, upstream=upstream))
                    for name, ranks, upstream in (("host-a", [0, 1], proxy.address),
                                                  ("host-b", [2], bound.address))]
                async with ft.open_coordinator(bound, salt=salt, config=config,
                                               timeline=log) as coord:
                    assert coord.covered_ranks == {0, 1, 2} and not coord.dead_ranks
                    first_conn, second = proxy.connections[:2]
                    assert (first_conn.ended_by, first_conn.bytes_up) == ("cut", 10)
                    assert second.ended_by is None
                await wait_until(lambda: all(h.finished for h in hosts), limit=PATIENCE)
            nursery.cancel_scope.cancel()
    rejected = first(log, HandshakeRejected)
    assert rejected is not None and category(rejected[1].reason) == "eof before hello"
    assert len(log.of(FormationComplete)) == 1
    assert all(h.rank_outcome == dict.fromkeys(h.ranks, "ended") for h in hosts)


async def test_relay_connection_reset_mid_run_over_tcp_kills_its_ranks_only(
    chaos_proxy_factory: ChaosProxyFactory,
) -> None:
    salt = ft.SessionSalt.generate()
    log = EventLog()
    config = ft.CoordinatorConfig(world_size=3, formation_timeout=PATIENCE)
    with trio.fail_after(PATIENCE):
        async with trio.open_nursery() as nursery:
            bound = await ft.bind_coordinator(("127.0.0.1", 0))
            async with chaos_proxy_factory(bound.address) as proxy:
                a, b = [await nursery.start(partial(
                    run_host, None, name, ranks, salt=salt, world=3, upstream=upstream))
                    for name, ranks, upstream in (("host-a", [0, 1], proxy.address),
                                                  ("host-b", [2], bound.address))]
                async with ft.open_coordinator(bound, salt=salt, config=config,
                                               timeline=log) as coord:
                    await coord.broadcast_control(wire.SetGlobalStep(global_step=1))
                    await wait_until(lambda: all(h.steps(r) == [1] for h in (a, b)
                                               for r in h.ranks), limit=PATIENCE)
                    reset_at = trio.current_time()
                    await proxy.reset_all()  # RST towards the relay, close towards us
                    await wait_until(lambda: coord.dead_ranks == {0, 1}, limit=PATIENCE)
                    detected_after = trio.current_time() - reset_at
                    await coord.broadcast_control(wire.SetGlobalStep(global_step=2))
                    await wait_until(lambda: b.steps(2) == [1, 2], limit=PATIENCE)
                    assert coord.live_ranks == {2}
                await wait_until(lambda: a.finished and b.finished, limit=PATIENCE)
            nursery.cancel_scope.cancel()
    assert detected_after < 1.0
    assert proxy.connections[0].ended_by == "reset"
    assert [ev.host for _, ev in log.of(RelayLost)] == ["host-a"]
    assert {ev.rank for _, ev in log.of(RankDeclaredDead)} == {0, 1}
    assert isinstance(a.relay_exit, ft.RelayExit) and not a.relay_exit.clean
    assert "upstream connection lost" in a.relay_exit.reason  # it saw the RST
    assert b.rank_outcome == {2: "ended"}
