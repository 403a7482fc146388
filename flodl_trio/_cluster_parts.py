"""The private parts of :func:`flodl_trio.local_cluster.open_local_cluster`: where its parts
meet (:class:`ClusterNetwork`), which of them still run, and how their ends become the one
exception its block raises."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import trio

from ._errors import ConfigError
from ._lifecycle import choose_one_exception
from .chaos import FaultyDialer
from .coordinator import bind_coordinator
from .net._memory_network import MemoryNetwork
from .net._transport import Dialer
from .relay import Relay

__all__ = ["ClusterNetwork", "Running", "Started", "one_error", "tcp_dialer"]


@attrs.frozen
class ClusterNetwork:
    """Where the parts meet: the coordinator's listener, how a relay reaches it, and (in
    memory) the network the relays' rank ports are on."""

    listen: Any
    coordinator: Any  # a dialer (in memory) or the listener's address (TCP)
    memory: MemoryNetwork | None  # None over TCP
    shown: MemoryNetwork | None  # LocalCluster.network: what the caller gave over TCP

    @classmethod
    async def open(cls, transport: str, network: MemoryNetwork | None,
                   coordinator: str) -> ClusterNetwork:
        """The coordinator's listener on ``transport`` (named ``coordinator`` in memory).

        Raises:
            ConfigError: ``transport`` is neither ``"memory"`` nor ``"tcp"``.
        """
        if transport == "memory":
            net = network if network is not None else MemoryNetwork()

            async def dial_coordinator() -> trio.abc.Stream:
                return await net.connect(coordinator)
            return cls(net.listener(coordinator), dial_coordinator, net, net)
        if transport == "tcp":
            listen = await bind_coordinator(("127.0.0.1", 0))
            return cls(listen, listen.address, None, network)
        raise ConfigError(f"open_local_cluster: transport must be 'memory' or 'tcp', got "
                          f"{transport!r}")

    def rank_port(self, host: str) -> Any:
        """The listener of ``host``'s relay for its ranks (None over TCP: it binds its own)."""
        return self.memory.listener(f"relay:{host}") if self.memory is not None else None

    def upstream(self, host: str, plans: Mapping[str | int, Any]) -> Any:
        """How ``host``'s relay dials the coordinator (through its fault plans, if any)."""
        if host not in plans:
            return self.coordinator
        target = self.coordinator
        return FaultyDialer(tcp_dialer(target) if isinstance(target, tuple) else target,
                            plans[host])

    def rank_dialer(self, host: str, relay: Relay) -> Dialer:
        """A dialer of ``host``'s relay's rank port."""
        memory = self.memory
        if memory is None:
            return tcp_dialer(relay.rank_address)

        async def dial_memory() -> trio.abc.Stream:
            return await memory.connect(f"relay:{host}")
        return dial_memory


class Started:
    """The ``task_status`` of a raw rank: ``started()`` counts it as connected."""

    def __init__(self, on_started: Callable[[], None]) -> None:
        self._on_started = on_started
        self.called = False

    def started(self, value: object = None) -> None:
        if self.called:
            raise RuntimeError("open_local_cluster: a raw rank called task_status.started() "
                               "twice")
        self.called = True
        self._on_started()


class Running:
    """The relay and rank tasks still running, by name; ``all_done`` once there are none."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = set(names)
        self.all_done = trio.Event()
        if not self.names:
            self.all_done.set()

    def finished(self, name: str) -> None:
        self.names.discard(name)
        if not self.names:
            self.all_done.set()


def one_error(body_exc: BaseException | None, first: BaseException | None,
               failures: list[BaseException],
               too_slow: trio.TooSlowError | None) -> BaseException | None:
    """The one exception the cluster's block raises (None: it ends cleanly), from what the body
    raised, what came out of the coordinator's block, what the parts raised, and a teardown
    that took too long."""
    own = body_exc if body_exc is not None and not isinstance(body_exc, trio.Cancelled) else first
    candidates = [own, first, *failures]
    failures = [exc for i, exc in enumerate(candidates)
                if exc is not None and all(exc is not seen for seen in candidates[:i])]
    cancelled_from_outside = trio.current_effective_deadline() == -math.inf
    if (own is None or isinstance(own, trio.Cancelled)) and not cancelled_from_outside:
        # One part failed (a rank_main's AssertionError, ...): that is the error, not an
        # internal one; the parts are the caller's code.
        own = _only_failure(failures)
    if not failures:
        return too_slow
    return choose_one_exception(
        BaseExceptionGroup("local cluster", failures), body_exc=own, failure=too_slow,
        what="local cluster", cancelled_from_outside=cancelled_from_outside)


def _only_failure(excs: Sequence[BaseException]) -> BaseException | None:
    """The one exception in ``excs`` (groups flattened) that is not a cancellation, if one."""
    found: list[BaseException] = []
    todo = list(excs)
    while todo:
        exc = todo.pop()
        if isinstance(exc, BaseExceptionGroup):
            todo.extend(exc.exceptions)
        elif not isinstance(exc, trio.Cancelled):
            found.append(exc)
    return found[0] if len(found) == 1 else None


def tcp_dialer(address: tuple[str, int]) -> Dialer:
    async def dial_tcp() -> trio.abc.Stream:
        return await trio.open_tcp_stream(*address)
    return dial_tcp
