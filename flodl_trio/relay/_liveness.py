"""The relay's coalesced liveness (issue 23): one ``Liveness`` record per heartbeat interval.

The rank links' sessions verify each local rank's ``Heartbeat`` (salt MAC, its own rank) and
the pump records it here instead of forwarding the frame; once per ``heartbeat_interval`` the
ticker queues one ``Liveness`` record naming every rank heard from since the last one, with
the step count of its latest ``Heartbeat`` and how long ago it was verified. A rank's pending
entry is queued before anything else from that rank (the rank reader calls
:meth:`Heartbeats.take` first): the coordinator never sees a rank's heartbeat after that rank's
later frames or its ``RankExit``, and a rank that beats faster than the relay's
``heartbeat_interval`` is reported at its own pace (its next heartbeat sends the pending one).
A tick with no heartbeat pending still sends a ``Liveness``, naming no rank: the coordinator
judges staleness on evidence (SPEC §4.5), and this record says that the relay is alive and
holds no heartbeat of any of its ranks, so a rank whose last heartbeat is ``heartbeat_timeout``
old is silent, not held back; and the relay is never silent longer than one tick.

A coordinator of many relays paces the records (``Cadence{interval}``, issue 23): the ticker
then runs every ``max(heartbeat_interval, interval)`` seconds, from its next tick, and a rank's
later ``Heartbeat`` replaces its pending one instead of sending it (only a frame of another
kind, or the rank's end, sends it early). The ages in each record keep the coordinator's clocks
exact at any pace.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ..net._transport import STREAM_GONE
from ..wire import Liveness

# What a tick sends when no heartbeat is pending (immutable: one for every relay).
IDLE = Liveness(ranks=(), steps=(), ages=())


class Heartbeats:
    """The local ranks' verified heartbeats not yet reported upstream: rank → (step count,
    when it was verified)."""

    def __init__(self, interval: float = 0.0) -> None:
        self._pending: dict[int, tuple[int, float]] = {}
        self.records = 0  # Liveness records taken so far (with heartbeats)
        self.beats = 0  # heartbeats they carried
        self.idle = 0  # ticks that had none (an empty Liveness went instead)
        self.cadence = 0.0  # the coordinator's Cadence on this connection (0: none)
        self._interval = interval  # the relay's own heartbeat_interval

    def follow(self, interval: float) -> None:
        """The coordinator asked for one ``Liveness`` per ``interval`` seconds (``Cadence``;
        0 on a new connection: the relay's own ``heartbeat_interval`` again)."""
        self.cadence = interval

    def forget(self) -> None:
        """A new connection after a wake-up (issue 37): what was pending is void, and the
        pace is the relay's own again."""
        self._pending = {}
        self.cadence = 0.0

    def record(self, rank: int, step_count: int, now: float) -> None:
        """``rank``'s Heartbeat verified at ``now``; a later one replaces it."""
        self._pending[rank] = (step_count, now)

    def pending(self, rank: int) -> bool:
        """``rank`` has a heartbeat that no ``Liveness`` carried yet."""
        return rank in self._pending

    def due_before(self, rank: int, *, heartbeat: bool) -> bool:
        """``rank``'s pending heartbeat must be sent before its next frame: always before one
        of another kind (order), and before its next ``Heartbeat`` unless the coordinator
        paced the records slower than the relay's own interval (then the later one replaces
        it)."""
        if rank not in self._pending:
            return False
        return not heartbeat or self.cadence <= self._interval

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

    def tick(self, now: float) -> Liveness:
        """What a tick at ``now`` sends: :meth:`take`, or the empty ``Liveness`` when no
        heartbeat is pending."""
        msg = self.take(now)
        if msg is None:
            self.idle += 1
            return IDLE
        return msg

    async def ticker(self, interval: float, up_send: trio.MemorySendChannel[Any],
                     readers_gone: trio.Event,
                     send: Callable[[trio.MemorySendChannel[Any], Any], Awaitable[None]]
                     | None = None) -> None:
        """Queue a ``Liveness`` every ``interval`` (or the coordinator's slower ``Cadence``):
        the pending heartbeats, or an empty one (:meth:`tick`), until the last rank reader
        ended (each reader takes its own rank's before its last record; what is pending then
        goes, nothing more), then close ``up_send``. ``send(up_send, msg)`` sends one (the
        pump's ``send_up``; default: ``up_send.send``)."""
        self._interval = interval
        with up_send:
            while not readers_gone.is_set():
                with trio.move_on_after(max(interval, self.cadence)):
                    await readers_gone.wait()
                now = trio.current_time()
                msg = self.take(now) if readers_gone.is_set() else self.tick(now)
                if msg is not None:
                    try:
                        if send is None:
                            await up_send.send(msg)
                        else:
                            await send(up_send, msg)
                    except STREAM_GONE:
                        return
