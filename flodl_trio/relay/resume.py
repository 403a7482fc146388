"""How a relay rides out a lost durable coordinator (issue 22).

A coordinator that runs with a session store says so with ``Generation{g}`` before its welcome.
A relay that loses such a coordinator without a ``Goodbye`` (EOF, a protocol error, a write
stall, ``coord_liveness_timeout`` of silence) keeps its rank links up for ``coordinator_grace``:
each rank is told ``CoordinatorReconnecting`` and its liveness clock is fed with relay-sealed
``CoordHeartbeat`` frames; the ranks' frames are queued (``reconnect_queue`` of them, later ones
dropped and counted) while the relay re-dials with ``Resume``. Once resumed, the queued frames
are written first and the ranks are told ``CoordinatorResumed{g}``; the old connection was
closed and nothing from it is delivered again. After the grace the ranks hear why the relay gave
up and lose their links (``CoordinatorLost``), as when a coordinator that is not durable dies.

:class:`Reconnector` holds what outlives one upstream connection (the generation seen, the
counters); the pump (:mod:`.pump`) calls :meth:`Reconnector.ride_out` with what the lost leg did
not send, and gets the resumed connection with its :class:`Backlog` (what the next leg writes
first).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable

import attrs
import trio

from .. import _timeouts as T
from .._errors import FlodlError, JoinRefused, WrongSession
from ..wire import (
    ControlMsg,
    CoordHeartbeat,
    CoordinatorReconnecting,
    CoordinatorResumed,
    Draining,
    Established,
    FrameCodec,
    Liveness,
    RankDropped,
    RankExit,
    RelayWaiting,
)
from ._link import RankLink
from .ranks import LocalRanks

log = logging.getLogger("flodl_trio.relay")

# What the rank readers queue for the upstream writer: a rank's frame (rank, blob), the notice
# that its link ended, the ranks' coalesced heartbeats, or that the host leaves (issue 37).
Upstream = tuple[int, bytes] | RankExit | RankDropped | Liveness | Draining

# A connection and its handshake, done.
Joined = tuple[trio.abc.Stream, Established]
# Re-dial a durable coordinator: (generation seen, deadline) -> the new stream, handshake done.
Redial = Callable[[int, float], Awaitable[Joined]]

# The cadence of the relay's own CoordHeartbeat while the coordinator is away (not scaled).
FEED_INTERVAL = T.HEARTBEAT_INTERVAL


@attrs.frozen
class Durable:
    """A coordinator that said ``Generation{generation}`` at the join: a lost connection to it
    is ridden out, re-dialed with ``redial``."""

    generation: int
    redial: Redial


class Backlog:
    """What the upstream writer sends first on a resumed connection, in order: what the lost
    connection did not send, then what the ranks queued while the coordinator was away (their
    frames up to ``bound``; a rank's end notice and ``Liveness`` are always kept)."""

    def __init__(self, unsent: Iterable[Upstream] = (), *, bound: int) -> None:
        self._items: deque[Upstream] = deque(unsent)
        self._bound = bound

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: Upstream) -> bool:
        """Queue ``item``; False (dropped) for a rank's frame with ``bound`` items queued."""
        if isinstance(item, tuple) and len(self._items) >= self._bound:
            return False
        self._items.append(item)
        return True

    def take(self, limit: int) -> list[Upstream]:
        """The next ``limit`` items at most (then no longer queued)."""
        items = self._items
        return [items.popleft() for _ in range(min(limit, len(items)))]


@attrs.frozen
class Resumed:
    """A ride-out that ended well: the new connection, its handshake, and what it sends first."""

    stream: trio.abc.Stream
    established: Established
    backlog: Backlog


class Reconnector:
    """What a relay of a durable coordinator keeps across upstream connections.

    Attributes:
        generation: the highest coordinator generation seen.
        reconnects: resumes so far.
        dropped: frames from the ranks dropped while reconnecting (over ``reconnect_queue``).
        away: why the coordinator is away, while the relay rides it out, else None.
        last_lost: why it was lost the last time (kept once resumed), else None.
        gave_up: once a ride-out failed: why, and the error the relay fails with (a
            ``Refused`` resume, a salt that differs) or None (the grace ran out).
    """

    def __init__(self, local: LocalRanks, durable: Durable, *,
                 drop_rank: Callable[[RankLink, str], None]) -> None:
        self.local = local
        self.config = local.config
        self.host = local.host
        self.generation = durable.generation
        self.reconnects = 0
        self.dropped = 0
        self.away: str | None = None
        self.last_lost: str | None = None
        self.gave_up: tuple[str, FlodlError | None] = ("", None)
        self._redial = durable.redial
        self._drop_rank = drop_rank
        self._codec = FrameCodec(local.salt)

    @property
    def enabled(self) -> bool:
        """False when ``coordinator_grace`` is 0: a lost coordinator ends the relay."""
        return self.config.coordinator_grace > 0

    def tell(self, msg: ControlMsg) -> None:
        """Queue one relay-sealed notice for every connected rank (in order with the rest)."""
        frame = self._codec.encode(msg)
        now = trio.current_time()
        for link in self.local.links():
            if link.gone or link.fenced is not None:
                continue
            if not link.offer(link.session.send(frame), now):
                self._drop_rank(link, f"it did not drain its queue of {link.queue_size} frames "
                                f"within write_stall_timeout={self.config.write_stall_timeout:g}s")

    async def ride_out(self, reason: str, up_recv: trio.MemoryReceiveChannel[Upstream],
                       unsent: list[Upstream]) -> Resumed | None:
        """Keep the ranks up, queue their frames and re-dial until ``coordinator_grace`` ends.

        ``unsent``: what the lost connection did not send (the batch it was writing first);
        it goes first on the next one.

        Returns the resumed connection, else None (see ``gave_up``).
        """
        grace = self.config.coordinator_grace
        self.away = self.last_lost = reason
        backlog = Backlog(unsent, bound=self.config.reconnect_queue)
        log.warning("relay %r: lost the coordinator (%s); re-dialing for up to "
                    "coordinator_grace=%gs", self.host, reason, grace)
        self.tell(CoordinatorReconnecting(
            host=self.host, detail=f"relay {self.host!r} lost the coordinator ({reason}); "
            f"re-dialing for up to coordinator_grace={grace:g}s"))
        joined, error, last = await self._redial_within(grace, up_recv, backlog)
        if joined is None:
            if error is not None:
                why = f"coordinator lost ({reason}); its resume failed: {error}"
            else:
                why = (f"coordinator lost ({reason}) and not back within coordinator_grace="
                       f"{grace:g}s; last attempt: {last}")
            self.tell(RelayWaiting(host=self.host, detail=f"relay {self.host!r} gave up: {why}"))
            self.gave_up = (why, error)
            return None
        stream, established = joined
        if established.generation is not None:
            self.generation = max(self.generation, established.generation)
        self.reconnects += 1
        self.away = None
        log.info("relay %r resumed with the coordinator (generation %d, %d frame(s) queued, "
                 "%d dropped so far)", self.host, self.generation, len(backlog), self.dropped)
        self.tell(CoordinatorResumed(generation=self.generation))
        return Resumed(stream, established, backlog)

    async def _redial_within(self, grace: float, up_recv: trio.MemoryReceiveChannel[Upstream],
                             backlog: Backlog,
                             ) -> tuple[Joined | None, FlodlError | None, str]:
        """Re-dial for ``grace`` seconds while the ranks' frames go to ``backlog`` and their
        liveness clocks are fed: the new connection, or the error that ends the attempts (a
        ``Refused`` resume, a salt that differs), and the last failure."""
        deadline = trio.current_time() + grace
        joined: Joined | None = None
        error: FlodlError | None = None
        last = "none finished"
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._queue_while_away, up_recv, backlog)
                nursery.start_soon(self._feed_liveness)
                with trio.move_on_at(deadline):
                    try:
                        joined = await self._redial(self.generation, deadline)
                    except (JoinRefused, WrongSession) as exc:
                        error = exc
                    except FlodlError as exc:
                        last = str(exc)
                nursery.cancel_scope.cancel()
        except BaseException:
            if joined is not None:  # cancelled as it resumed: no connection is left open
                await trio.aclose_forcefully(joined[0])
            raise
        return joined, error, last

    async def _queue_while_away(self, up_recv: trio.MemoryReceiveChannel[Upstream],
                                backlog: Backlog) -> None:
        """Move the ranks' frames to ``backlog``, up to ``reconnect_queue``; a rank's end
        notice (at most one per rank) is always kept."""
        async for item in up_recv:
            if not backlog.add(item):
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 1000 == 0:
                    log.warning("relay %r: %d frame(s) from the ranks dropped while "
                                "reconnecting (reconnect_queue=%d)", self.host, self.dropped,
                                self.config.reconnect_queue)

    async def _feed_liveness(self) -> None:
        """The coordinator's heartbeat, sealed by the relay, so the ranks' watchdogs wait for
        the relay's own deadline rather than fire at ``coord_liveness_timeout``."""
        while True:
            await trio.sleep(FEED_INTERVAL)
            self.tell(CoordHeartbeat())


__all__ = ["FEED_INTERVAL", "Backlog", "Durable", "Reconnector", "Redial", "Resumed", "Upstream"]
