"""The relay's coalesced liveness (issue 23): one ``Liveness`` record per heartbeat interval.

The rank links' sessions verify each local rank's ``Heartbeat`` (salt MAC, its own rank) and
the pump records it here instead of forwarding the frame; once per ``heartbeat_interval`` the
ticker queues one ``Liveness`` record naming every rank heard from since the last one, with
the step count of its latest ``Heartbeat`` and how long ago it was verified. A rank's pending
entry is queued before anything else from that rank (the rank reader calls
:meth:`Heartbeats.take` first): the coordinator never sees a rank's heartbeat after that rank's
later frames or its ``RankExit``, and a rank that beats faster than the relay's
``heartbeat_interval`` is reported at its own pace (its next heartbeat sends the pending one).
"""

from __future__ import annotations

from typing import Any

import trio

from ..net._transport import STREAM_GONE
from ..wire import Liveness


class Heartbeats:
    """The local ranks' verified heartbeats not yet reported upstream: rank → (step count,
    when it was verified)."""

    def __init__(self) -> None:
        self._pending: dict[int, tuple[int, float]] = {}
        self.records = 0  # Liveness records taken so far
        self.beats = 0  # heartbeats they carried

    def record(self, rank: int, step_count: int, now: float) -> None:
        """``rank``'s Heartbeat verified at ``now``; a later one replaces it."""
        self._pending[rank] = (step_count, now)

    def pending(self, rank: int) -> bool:
        """``rank`` has a heartbeat that no ``Liveness`` carried yet."""
        return rank in self._pending

    def take(self, now: float) -> Liveness | None:
        """The ``Liveness`` at ``now`` of every pending heartbeat (ranks ascending), which are
        then no longer pending; None when there is none."""
        pending = self._pending
        if not pending:
            return None
        ranks = tuple(sorted(pending))
        beats = [pending[r] for r in ranks]
        msg = Liveness(ranks=ranks, steps=tuple(step for step, _ in beats),
                       ages=tuple(max(0.0, now - at) for _, at in beats))
        self._pending = {}
        self.records += 1
        self.beats += len(ranks)
        return msg

    async def ticker(self, interval: float, up_send: trio.MemorySendChannel[Any],
                     readers_gone: trio.Event) -> None:
        """Queue the pending heartbeats every ``interval`` until the last rank reader ended
        (each reader takes its own rank's before its last record), then close ``up_send``."""
        with up_send:
            while not readers_gone.is_set():
                with trio.move_on_after(interval):
                    await readers_gone.wait()
                msg = self.take(trio.current_time())
                if msg is not None:
                    try:
                        await up_send.send(msg)
                    except STREAM_GONE:
                        return
