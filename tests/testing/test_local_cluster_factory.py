"""The ``local_cluster_factory`` fixture takes open_local_cluster's keywords, as its docstring
says: every one but ``network`` (the test's own memory network)."""

from __future__ import annotations

import pytest
import trio

from flodl_trio.local_cluster import layout
from flodl_trio.pytest_plugin import LocalClusterFactory
from flodl_trio.store import MemoryStore


async def test_the_factory_gives_the_coordinator_its_session_store(
    autojump_clock: trio.abc.Clock, local_cluster_factory: LocalClusterFactory
) -> None:
    store = MemoryStore()
    async with local_cluster_factory(layout(1, 2), store=store) as cluster:
        assert cluster.coord.state()["store"]["kind"] == "memory"
        assert await store.current_leader() is not None
    assert await store.load() is not None  # the coordinator kept its session there


def test_the_factory_refuses_a_network_of_its_own_and_says_which_one_it_uses(
    local_cluster_factory: LocalClusterFactory
) -> None:
    with pytest.raises(TypeError, match=r"network= is this test's memory_network"):
        local_cluster_factory(layout(1, 1), network=None)  # type: ignore[call-arg]
