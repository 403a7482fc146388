"""Waking up (issue 37): a relay whose ranks were all fenced joins again with them.

A host frozen past ``heartbeat_timeout`` (``SIGSTOP``, a hung VM) is declared dead: the
coordinator fences each of its ranks (a ``Fenced`` frame to the rank, ``FenceRank`` to the
relay) and, once none is left alive on the connection, says ``Goodbye`` and closes it. When the
host wakes, its relay reads all of that at once. With ``RelayConfig.rejoin_when_fenced`` it does
not pass the end on to its ranks:

* each fenced rank's link is *held*: its frames are no longer forwarded, but it stays open;
* when the connection then ends while every rank still connected is held, the relay dials again
  with a fresh ``Hello`` naming those ranks (:meth:`Wakeup.wake_up`), as a restarted host would.
  The coordinator's admission table judges it (a rejoin of dead ranks, or a refusal with its
  reason). Meanwhile the held ranks hear ``RelayWaiting`` every second (what the relay does,
  and their liveness clock kept running);
* once admitted, each named rank's link forwards again and the rank is told ``Readmitted``
  first; the upstream writer sends what the ranks' ends left queued (their ``RankExit``), and
  the pump runs a new leg on the new connection;
* refused (or not admitted within ``connect_timeout``), the held ranks are told why and the
  relay ends with that error, as a relay that was never fenced would.

A rank fenced while its relay stays connected (its own process hung, the relay is fine) is held
for ``shutdown_grace`` only: if the connection is still up then, its link is ended as without
the setting and the rank ends with ``RankEvicted``. (The coordinator fences all of a frozen
host's ranks within about one heartbeat interval and closes the connection right after the
last, so a frozen host's ranks are never released this way.)
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import attrs
import trio

from .._errors import FlodlError
from ..wire import FrameCodec, RankDropped, RankExit, Readmitted, RelayWaiting
from ._link import RankLink
from .ranks import LocalRanks
from .resume import FEED_INTERVAL, Backlog, Joined, Upstream

log = logging.getLogger("flodl_trio.relay")

# Join again with a fresh Hello naming these ranks.
Rejoin = Callable[[tuple[int, ...]], Awaitable[Joined]]
# Before naming its ranks the relay lets them read their Fenced: one that does not wait for its
# relay (RankConfig.rejoin_when_fenced off) closes its link meanwhile, and is not brought back
# only to die again at once. Not scaled: local ranks on loopback, not a network deadline.
WAKE_SETTLE = 0.25


@attrs.frozen
class Woken:
    """A wake-up that was admitted: the new connection, the ranks it named, what it writes
    first."""

    joined: Joined
    ranks: tuple[int, ...]
    backlog: Backlog


class Wakeup:
    """What a relay with ``rejoin_when_fenced`` keeps of its fenced ranks.

    Attributes:
        held: the fenced ranks whose links it keeps open, rank -> the coordinator's reason.
        wakeups: how many times it joined again after its ranks were fenced.
        waking: while it re-dials, the ranks it brings back and why they were fenced; else
            None. ``last``: the same of the last wake-up (kept).
        gave_up: once a wake-up failed: why, and the error the relay ends with.
    """

    def __init__(self, local: LocalRanks, rejoin: Rejoin) -> None:
        self.local = local
        self.host = local.host
        self.config = local.config
        self.held: dict[int, str] = {}
        self.wakeups = 0
        self.waking: tuple[tuple[int, ...], str] | None = None
        self.last: tuple[tuple[int, ...], str] | None = None
        self.gave_up: tuple[str, FlodlError | None] = ("", None)
        self._rejoin = rejoin
        self._codec = FrameCodec(local.salt)
        self._nursery: trio.Nursery | None = None

    def attach(self, nursery: trio.Nursery) -> None:
        """Run the hold timers in ``nursery`` (the pump's)."""
        self._nursery = nursery

    def hold(self, link: RankLink, reason: str, leg_ended: Callable[[], bool]) -> None:
        """Keep fenced ``link`` open; ``leg_ended()`` says whether the connection that fenced
        it has ended. If it has not after ``shutdown_grace``, the rank was fenced on its own
        (the relay is fine): its link is then ended as without the setting."""
        first = not self.held
        self.held[link.rank] = reason
        log.warning("relay %r: the coordinator fenced rank %d: %s; its link is held "
                    "(rejoin_when_fenced)", self.host, link.rank, reason)
        if first and self._nursery is not None:
            self._nursery.start_soon(self._release_after, leg_ended)

    async def _release_after(self, leg_ended: Callable[[], bool]) -> None:
        await trio.sleep(self.config.shutdown_grace)
        if leg_ended() or self.waking is not None:
            return
        for rank in sorted(self.held):
            link = self.local.link(rank)
            if link is not None:
                log.warning("relay %r: rank %d stays fenced while the relay is connected; "
                            "ending its link", self.host, rank)
                link.end_queue()
        self.held.clear()

    def _held_links(self) -> list[RankLink]:
        links = (self.local.link(rank) for rank in sorted(self.held))
        return [link for link in links if link is not None and not link.gone]

    def armed(self) -> bool:
        """Every rank still connected is held (and one is): the coordinator dropped the whole
        relay, whose end is then a wake-up."""
        if not self._held_links():
            return False
        return all(link.fenced is not None for link in self.local.links() if not link.gone)

    def tell(self, msg: RelayWaiting | Readmitted, links: list[RankLink]) -> None:
        """Queue one relay-sealed notice for ``links`` (never waits; a link whose rank is
        gone takes nothing)."""
        frame = self._codec.encode(msg)
        now = trio.current_time()
        for link in links:
            link.offer(link.session.send(frame), now)

    async def settle(self, up_recv: trio.MemoryReceiveChannel[Upstream]) -> bool:
        """Give the held ranks ``WAKE_SETTLE`` to read their ``Fenced`` (what they send
        meanwhile is dropped); True if one is still connected, to be brought back."""
        with trio.move_on_after(WAKE_SETTLE):
            async for _ in up_recv:
                pass
        return bool(self._held_links())

    async def wake_up(self, up_recv: trio.MemoryReceiveChannel[Upstream]) -> Woken | None:
        """Join again with the held ranks still connected; the new connection, or None (see
        ``gave_up``; the held ranks were told why)."""
        links = self._held_links()
        ranks = tuple(link.rank for link in links)
        reason = self.held[ranks[0]]
        self.waking = self.last = (ranks, reason)
        log.warning("relay %r: every rank it carries was fenced (%s); joining again with ranks "
                    "%s (rejoin_when_fenced)", self.host, reason, list(ranks))
        backlog = Backlog(bound=0)
        joined: Joined | None = None
        error: FlodlError | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._keep_ends, up_recv, backlog, frozenset(ranks))
                nursery.start_soon(self._keep_informed, links, reason)
                try:
                    joined = await self._rejoin(ranks)
                except FlodlError as exc:
                    error = exc
                nursery.cancel_scope.cancel()
        except BaseException:
            if joined is not None:  # cancelled as it joined: no connection is left open
                await trio.aclose_forcefully(joined[0])
            raise
        finally:
            self.waking = None
        if joined is None:
            why = f"its ranks were fenced ({reason}) and its wake-up failed: {error}"
            self.tell(RelayWaiting(host=self.host, detail=f"relay {self.host!r} gave up: {why}"),
                      links)
            self.gave_up = (why, error)
            return None
        self.wakeups += 1
        for rank in ranks:
            self.held.pop(rank, None)
        for link in links:  # the rank hears Readmitted before anything of the new connection
            link.session.readmit()
        self.tell(Readmitted(host=self.host, reason=reason), links)
        log.warning("relay %r: back in the run with ranks %s (wake-up %d)", self.host,
                    list(ranks), self.wakeups)
        return Woken(joined, ranks, backlog)

    async def _keep_ends(self, up_recv: trio.MemoryReceiveChannel[Upstream], backlog: Backlog,
                         ranks: frozenset[int]) -> None:
        """While re-dialing, keep the end notices of the ranks the new ``Hello`` names (sent
        first on the new connection); drop the rest: a fenced rank's frames are not forwarded,
        and the old connection's heartbeats are void."""
        async for item in up_recv:
            if isinstance(item, RankExit | RankDropped) and int(item.rank) in ranks:
                backlog.add(item)

    async def _keep_informed(self, links: list[RankLink], reason: str) -> None:
        """Tell the held ranks what the relay does, every ``FEED_INTERVAL`` (their liveness
        clock runs on it, as while a relay joins)."""
        ranks = [link.rank for link in links]
        while True:
            self.tell(RelayWaiting(host=self.host, detail=(
                f"relay {self.host!r}: ranks {ranks} were fenced ({reason}); joining again "
                "with a fresh Hello")), links)
            await trio.sleep(FEED_INTERVAL)


__all__ = ["Rejoin", "Wakeup", "Woken"]
