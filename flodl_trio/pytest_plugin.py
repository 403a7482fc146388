"""pytest plugin of flodl-trio (registered through the ``pytest11`` entry point).

Fixtures:
    memory_network: a fresh :class:`flodl_trio.testing.MemoryNetwork`; at teardown it asserts
        that every stream and listener was closed.
    local_cluster_factory: :func:`flodl_trio.local_cluster.open_local_cluster` on that network.
    chaos_proxy_factory: :func:`flodl_trio.chaos.open_chaos_proxy` as a factory; at teardown it
        asserts that every proxied connection was closed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest

from .testing import MemoryNetwork


@pytest.fixture
def memory_network() -> Iterator[MemoryNetwork]:
    """An in-memory network that works under ``MockClock``; leaks fail the test at teardown."""
    net = MemoryNetwork()
    yield net
    net.assert_all_closed()


@pytest.fixture
def local_cluster_factory(memory_network: MemoryNetwork) -> Any:
    """``open_local_cluster`` bound to this test's ``memory_network``.

    ``async with local_cluster_factory({"h": [0, 1]}) as cluster:`` (any keyword of
    :func:`flodl_trio.local_cluster.open_local_cluster` may be passed; ``transport="tcp"`` uses
    real loopback sockets instead).
    """
    from .local_cluster import open_local_cluster

    def factory(hosts: Mapping[str, Sequence[int]], **kwargs: Any) -> Any:
        if kwargs.get("transport", "memory") == "memory":
            kwargs.setdefault("network", memory_network)
        return open_local_cluster(hosts, **kwargs)

    return factory


@pytest.fixture
def chaos_proxy_factory() -> Iterator[Any]:
    """``async with chaos_proxy_factory(target, **kw) as proxy:`` runs a fault-injecting TCP
    proxy in front of ``target`` (any keyword of :func:`flodl_trio.chaos.open_chaos_proxy`).

    At teardown every connection of every proxy the test opened must have ended: a proxy is
    closed with its ``async with`` block, so a leftover means a proxy that was never left.
    """
    from contextlib import asynccontextmanager

    from .chaos import ChaosProxy, open_chaos_proxy

    opened: list[ChaosProxy] = []

    @asynccontextmanager
    async def factory(target: tuple[str, int], **kwargs: Any) -> Any:
        async with open_chaos_proxy(target, **kwargs) as proxy:
            opened.append(proxy)
            yield proxy

    yield factory
    live = [conn for proxy in opened for conn in proxy.connections if not conn.closed]
    assert not live, f"{len(live)} proxied connection(s) still open: {live}"
