"""Tools for testing code that uses flodl-trio: an in-memory network and whole local clusters.

:func:`open_local_cluster` (with :class:`LocalCluster`, the handles it yields, and
:class:`RawRankSlot` / :class:`RawRankMain` for ranks that speak the wire by hand; all defined in
:mod:`flodl_trio.local_cluster`, which can still be imported from) starts a coordinator, one
relay per host and every rank in one Trio run, over a :class:`MemoryNetwork` by default; the
library's own tests build their clusters with it too. :func:`wait_until` polls a condition in
Trio time, and :class:`EventLog` is a timeline that notes when (in Trio time) each event happened.

:class:`MemoryNetwork` hands out named listeners and dials them. Unlike
:func:`trio.testing.memory_stream_pair`, every direction of a connection has a *bounded* buffer, so
a writer whose peer stops reading blocks in ``send_all`` exactly as it would on a full TCP window;
that is what lets deadline tests provoke write stalls under
``trio.testing.MockClock(autojump_threshold=0)`` in no real time. Nothing here reads the clock.

Example::

    net = MemoryNetwork()
    async with net.listener("coord") as listener:
        client = await net.connect("coord")
        server = await listener.accept()
        await client.send_all(b"ping")
        assert await server.receive_some() == b"ping"
        await client.aclose()
        assert await server.receive_some() == b""
        await server.aclose()
    net.assert_all_closed()
"""

from __future__ import annotations

from typing import TypeVar

import trio

from ._waiting import wait_until
from .events import Event
from .local_cluster import LocalCluster, RawRankMain, RawRankSlot, open_local_cluster
from .net._memory_network import MemoryListener, MemoryNetwork
from .net._memory_stream import MemoryConnection, MemoryStream
from .timeline import Stamped, Timeline

__all__ = [
    "EventLog", "LocalCluster", "MemoryConnection", "MemoryListener", "MemoryNetwork",
    "MemoryStream", "RawRankMain", "RawRankSlot", "open_local_cluster", "wait_until",
]

# Shown (repr, errors, docs) as the testing module's own, where users import them from.
for _cls in (MemoryConnection, MemoryListener, MemoryNetwork, MemoryStream):
    _cls.__module__ = __name__
del _cls

E = TypeVar("E", bound=Event)


class EventLog(Timeline):
    """A :class:`~flodl_trio.timeline.Timeline` that also notes the *Trio* time of each event.

    ``Timeline`` stamps real monotonic time, which says nothing under ``MockClock``; tests that
    assert *when* something was decided (``RankDeclaredDead`` exactly at ``heartbeat_timeout``)
    read ``entries`` or :meth:`of` instead.
    """

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[tuple[float, Event]] = []

    def event(self, ev: Event) -> Stamped:
        self.entries.append((trio.current_time(), ev))
        return super().event(ev)

    def of(self, kind: type[E]) -> list[tuple[float, E]]:
        """``(trio time, event)`` for every event of class ``kind``, oldest first."""
        return [(t, ev) for t, ev in self.entries if isinstance(ev, kind)]

    def events_of(self, kind: type[E]) -> list[E]:
        """Every recorded event of class ``kind``, oldest first."""
        return [ev for _, ev in self.entries if isinstance(ev, kind)]
