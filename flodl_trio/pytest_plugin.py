"""pytest plugin of flodl-trio (registered through the ``pytest11`` entry point).

The fixtures:

``memory_network``
    a fresh :class:`flodl_trio.testing.MemoryNetwork`; at teardown it asserts that every stream
    and listener was closed.
``event_log``
    a fresh :class:`flodl_trio.testing.EventLog` (a ``Timeline`` that notes the Trio time of
    each event): pass it as ``timeline=`` and assert on ``event_log.events_of(...)``.
``local_cluster_factory``
    :func:`flodl_trio.local_cluster.open_local_cluster` on that network (type:
    :class:`LocalClusterFactory`).
``chaos_proxy_factory``
    :func:`flodl_trio.chaos.open_chaos_proxy` as a factory; at teardown it asserts that every
    proxied connection was closed (type: :class:`ChaosProxyFactory`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Literal, Protocol

import pytest

from ._config import CoordinatorConfig, RankConfig, RelayConfig
from .chaos import ChaosProxy, FaultPlan, open_chaos_proxy
from .local_cluster import LocalCluster, RawRankMain, open_local_cluster
from .rank import RankEndpoint
from .store import SessionStore
from .testing import EventLog, MemoryNetwork
from .timeline import Timeline
from .wire import SessionSalt

__all__ = ["ChaosProxyFactory", "LocalClusterFactory"]


class LocalClusterFactory(Protocol):
    """The type of the ``local_cluster_factory`` fixture (annotate test arguments with it)."""

    def __call__(
        self,
        hosts: Mapping[str, Sequence[int]],
        *,
        transport: Literal["memory", "tcp"] = ...,
        salt: SessionSalt | None = ...,
        coord_config: CoordinatorConfig | None = ...,
        relay_config: RelayConfig | None = ...,
        rank_config: RankConfig | None = ...,
        timeline: Timeline | None = ...,
        rank_configs: Mapping[int, RankConfig] | None = ...,
        rank_main: Callable[[RankEndpoint], Awaitable[object]] | None = ...,
        rank_errors: tuple[type[Exception], ...] = ...,
        raw_ranks: Mapping[int, RawRankMain] | None = ...,
        teardown_timeout: float = ...,
        faults: Mapping[str | int, FaultPlan | Sequence[FaultPlan]] | None = ...,
        store: SessionStore | None = ...,
    ) -> AbstractAsyncContextManager[LocalCluster]: ...


class ChaosProxyFactory(Protocol):
    """The type of the ``chaos_proxy_factory`` fixture (annotate test arguments with it)."""

    def __call__(
        self,
        target: tuple[str, int],
        *,
        listen: tuple[str, int] = ...,
        close_grace: float = ...,
    ) -> AbstractAsyncContextManager[ChaosProxy]: ...


@pytest.fixture
def memory_network() -> Iterator[MemoryNetwork]:
    """An in-memory network that works under ``MockClock``; leaks fail the test at teardown."""
    net = MemoryNetwork()
    yield net
    net.assert_all_closed()


@pytest.fixture
def event_log() -> EventLog:
    """A fresh :class:`~flodl_trio.testing.EventLog`; pass it as ``timeline=``."""
    return EventLog()


@pytest.fixture
def local_cluster_factory(memory_network: MemoryNetwork) -> LocalClusterFactory:
    """``open_local_cluster`` bound to this test's ``memory_network``.

    ``async with local_cluster_factory({"h": [0, 1]}) as cluster:`` (any keyword of
    :func:`flodl_trio.local_cluster.open_local_cluster` but ``network`` may be passed;
    ``transport="tcp"`` uses real loopback sockets instead; ``faults=`` puts a relay's or a
    rank's first connections through fault plans, in memory under ``MockClock`` too).
    """

    def factory(
        hosts: Mapping[str, Sequence[int]], **options: Any,
    ) -> AbstractAsyncContextManager[LocalCluster]:
        if "network" in options:
            raise TypeError("local_cluster_factory: network= is this test's memory_network; "
                            "pass transport='tcp' for loopback sockets instead")
        memory = options.get("transport", "memory") == "memory"
        return open_local_cluster(hosts, network=memory_network if memory else None, **options)

    return factory


@pytest.fixture
def chaos_proxy_factory() -> Iterator[ChaosProxyFactory]:
    """``async with chaos_proxy_factory(target, **kw) as proxy:`` runs a fault-injecting TCP
    proxy in front of ``target`` (any keyword of :func:`flodl_trio.chaos.open_chaos_proxy`).

    At teardown every connection of every proxy the test opened must have ended: a proxy is
    closed with its ``async with`` block, so a leftover means a proxy that was never left.
    """
    opened: list[ChaosProxy] = []

    @asynccontextmanager
    async def factory(target: tuple[str, int], **options: Any) -> AsyncIterator[ChaosProxy]:
        async with open_chaos_proxy(target, **options) as proxy:
            opened.append(proxy)
            yield proxy

    yield factory
    live = [conn for proxy in opened for conn in proxy.connections if not conn.closed]
    assert not live, f"{len(live)} proxied connection(s) still open: {live}"
