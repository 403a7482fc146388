"""Writing chaos tests with flodl-trio's pytest plugin (docs/chaos.rst).

Run with ``pytest examples/test_chaos_example.py``: the fixtures come from the plugin that
installing flodl-trio registers; pytest-trio runs the ``async`` tests, which needs
``trio_mode = true`` under ``[tool.pytest.ini_options]`` (install the ``testing`` extra).
"""

from __future__ import annotations

# --8<-- [start:imports]
import trio

import flodl_trio as ft
from flodl_trio.chaos import FaultPlan
from flodl_trio.events import HandshakeRejected, RankDeclaredDead
from flodl_trio.local_cluster import layout
from flodl_trio.pytest_plugin import ChaosProxyFactory, LocalClusterFactory

# --8<-- [end:imports]


# --8<-- [start:proxy]
async def test_a_relay_cut_mid_handshake_re_dials_and_the_cohort_forms(
    chaos_proxy_factory: ChaosProxyFactory,
) -> None:
    salt = ft.SessionSalt.generate()
    timeline = ft.Timeline()
    config = ft.CoordinatorConfig(world_size=1, formation_timeout=20, handshake_timeout=2)
    with trio.fail_after(30):  # real sockets, real time: bound the whole test
        bound = await ft.bind_coordinator(("127.0.0.1", 0))
        async with chaos_proxy_factory(bound.address) as proxy:
            proxy.plan(FaultPlan().cut(10, "up"), connection=0)  # only the first connection
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_host, proxy.address, salt)  # the relay dials the proxy
                async with ft.open_coordinator(bound, salt=salt, config=config,
                                               timeline=timeline) as coord:
                    assert coord.live_ranks == {0}
    first_connection = proxy.connections[0]
    assert (first_connection.ended_by, first_connection.bytes_up) == ("cut", 10)
    assert timeline.events(HandshakeRejected)  # rejected, recorded, survived


async def run_host(coordinator: tuple[str, int], salt: ft.SessionSalt) -> None:
    async with ft.open_relay(coordinator, salt=salt, host="host-a", ranks=[0],
                             world_size=1) as relay:
        async with ft.open_rank(relay.rank_address, salt=salt, rank=0, world_size=1) as ep:
            async for _ in ep:  # until the coordinator's Shutdown
                pass
# --8<-- [end:proxy]


# --8<-- [start:memory]
async def test_a_killed_relay_is_declared_dead_and_the_survivors_are_told(
    autojump_clock: trio.abc.Clock, local_cluster_factory: LocalClusterFactory,
) -> None:
    async with local_cluster_factory(layout(2, 2)) as cluster:  # in memory, virtual time
        cluster.kill_relay("host-1")  # carries ranks 2 and 3
        with trio.fail_after(5):
            for survivor in (0, 1):
                told = [await cluster.ranks[survivor].receive() for _ in range(2)]
                assert {msg.rank for msg in told if isinstance(msg, ft.DeclareDead)} == {2, 3}
        assert cluster.coord.dead_ranks == {2, 3}
        deaths = cluster.coord.timeline.events(RankDeclaredDead)
        assert {ev.rank for ev in deaths if isinstance(ev, RankDeclaredDead)} == {2, 3}
        await cluster.coord.broadcast_control(ft.SyncNow())  # the survivors still get everything
        assert isinstance(await cluster.ranks[0].receive(), ft.SyncNow)
# --8<-- [end:memory]

