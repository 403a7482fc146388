"""FaultyDialer: a dialer whose first connections go through fault plans (in memory or TCP)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import trio

from .._errors import ConfigError
from ._faulty_stream import FaultyStream
from ._plan import FaultPlan


class FaultyDialer:
    """Wrap a dialer so that its first connections go through :class:`FaultyStream`: the n-th
    plan applies to the n-th connection (from the dialer's side: its sends travel ``"up"``),
    and every connection after the last plan is clean, as a re-dial after a fault is.

    Give it to anything that takes an async callable target (``open_relay``, ``open_rank``),
    or let :func:`~flodl_trio.local_cluster.open_local_cluster` do so (``faults=``).

    Args:
        dial: the dialer to wrap (an async callable returning a stream).
        plans: the plan of the first connection, or of the first few, in order.

    Attributes:
        streams: the :class:`FaultyStream` of each faulted connection, in dial order (their
            ``bytes_sent`` and ``bytes_received`` say how far each got).
        dials: connections made so far.
    """

    def __init__(self, dial: Callable[[], Awaitable[trio.abc.Stream]],
                 plans: FaultPlan | Sequence[FaultPlan]) -> None:
        self._plans = (plans,) if isinstance(plans, FaultPlan) else tuple(plans)
        if not self._plans or not all(isinstance(p, FaultPlan) for p in self._plans):
            raise ConfigError(f"FaultyDialer: expected a FaultPlan or a non-empty sequence of "
                              f"them, got {plans!r}")
        self._dial = dial
        self.streams: list[FaultyStream] = []
        self.dials = 0

    async def __call__(self) -> trio.abc.Stream:
        stream = await self._dial()
        self.dials += 1
        if self.dials > len(self._plans):
            return stream
        faulty = FaultyStream(stream, self._plans[self.dials - 1], direction_of_send="up")
        self.streams.append(faulty)
        return faulty
