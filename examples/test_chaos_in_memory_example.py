"""Chaos tests in memory, in virtual time (docs/chaos.rst): handshakes cut at named steps, and
the one error of the library taken out of your own nursery's exception group.

Run with ``pytest examples/test_chaos_in_memory_example.py`` (the ``testing`` extra and
``trio_mode = true``, as for ``examples/test_chaos_example.py``).
"""

from __future__ import annotations

# --8<-- [start:imports]
import trio

import flodl_trio as ft
from flodl_trio.chaos import FaultPlan, rank_handshake_bytes, upstream_handshake_bytes
from flodl_trio.events import HandshakeRejected, RelayJoined
from flodl_trio.local_cluster import layout
from flodl_trio.pytest_plugin import LocalClusterFactory
from flodl_trio.testing import MemoryNetwork

# --8<-- [end:imports]


# --8<-- [start:memory-cuts]
async def test_handshakes_cut_at_named_steps_in_memory_re_dial_and_form(
    autojump_clock: trio.abc.Clock, local_cluster_factory: LocalClusterFactory,
) -> None:
    hosts = layout(2, 2)  # host-0 carries ranks 0 and 1, host-1 ranks 2 and 3
    relay_steps = upstream_handshake_bytes(host="host-0", ranks=hosts["host-0"], world_size=4)
    rank_steps = rank_handshake_bytes(rank=2)
    faults: dict[str | int, FaultPlan] = {
        # host-0's first connection: the coordinator gets its whole Hello, then nothing.
        "host-0": FaultPlan().cut(*relay_steps.after("Hello")),
        # rank 2's first connection: its relay never sees the ack arrive.
        2: FaultPlan().cut(*rank_steps.before("ack")),
    }
    timeline = ft.Timeline()
    async with local_cluster_factory(hosts, faults=faults, timeline=timeline) as cluster:
        assert cluster.coord.live_ranks == {0, 1, 2, 3}  # both re-dialed and joined
        assert cluster.relays["host-1"].rank_port_rejects == {"no first frame": 1}
    [rejected] = timeline.events(HandshakeRejected)
    assert isinstance(rejected, HandshakeRejected)
    assert rejected.reason.startswith("no ready: relay 'host-0'")  # HelloAck sent, no Ready
    joined = [ev.host for ev in timeline.events(RelayJoined) if isinstance(ev, RelayJoined)]
    assert sorted(joined) == ["host-0", "host-1"]  # the cut attempt never counted as a join
# --8<-- [end:memory-cuts]


# --8<-- [start:groups]
async def test_the_one_error_comes_out_of_your_own_nursery_with_except_star(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork,
) -> None:
    salt = ft.SessionSalt.generate()
    config = ft.CoordinatorConfig(world_size=2, formation_timeout=5)
    failures: list[ft.FormationTimeout] = []
    try:
        async with trio.open_nursery() as nursery:  # your own: the coordinator beside a task
            nursery.start_soon(trio.sleep_forever)
            async with ft.open_coordinator(memory_network.listener("coordinator"), salt=salt,
                                           config=config):
                pass  # no relay ever dials: formation times out
    except* ft.FormationTimeout as group:  # what leaves a nursery comes in a group
        failures += [exc for exc in group.exceptions if isinstance(exc, ft.FormationTimeout)]
    [failure] = failures  # the library raised one; the group holds just it
    assert "0/2 ranks covered" in str(failure)
# --8<-- [end:groups]
