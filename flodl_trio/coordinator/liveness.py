"""What happens when a rank or a relay dies (SPEC §4.5), in one place.

- ``mark_dead`` records a death synchronously (roster, event) and queues the follow-up.
- ``death_worker`` tells the survivors (``DeclareDead``) and applies the failure policy.
- ``staleness_watch`` declares ranks whose last heartbeat is older than ``heartbeat_timeout``
  once there is evidence that their relay holds no newer one: it reported since that deadline,
  or sent nothing for ``heartbeat_timeout`` (SPEC §4.5, ``Roster.stale``); time in which the
  coordinator could not read a relay (its reader waiting on a full channel) does not count, so
  a slow consumer never kills healthy ranks.
- ``relay_lost`` handles an upstream connection that ended.
- ``coord_heartbeats`` sends ``CoordHeartbeat`` once per ``heartbeat_period``, which it paces
  to the number of relays (issue 23): ``max(heartbeat_interval, min(relays /
  relay_heartbeat_rate, heartbeat_timeout / 4))``. A period that moved by more than 10 % is
  told to every relay (``Cadence``), and to each relay that joins while it is not
  ``heartbeat_interval`` (``joined``); the relays then send their ``Liveness`` at that pace.

No send here waits on a relay: ``DeclareDead``, ``ShutdownWithSave`` from the policy, the
heartbeats and the fencing records are queued on each relay's writer (``Sender.post``), so one
relay that stopped reading delays nobody else; its writer gives up after
``write_stall_timeout`` and the relay is lost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

import trio

from .._config import CoordinatorConfig
from .._errors import BroadcastError, ClusterFailure
from ..events import (
    ClusterFailed,
    RankDeclaredDead,
    RankFenced,
    RelayLost,
    RelayRetired,
    RelayStalled,
)
from ..timeline import Timeline
from ..wire import Cadence, CoordHeartbeat, DeclareDead, SaveReason, ShutdownWithSave
from ._relayconn import RelayConn
from ._roster import Roster
from ._sending import Sender

log = logging.getLogger("flodl_trio.coordinator.liveness")
_RECHECK = -1  # on the death channel: apply the failure policy again, nobody died
# A period within 10 % of the one the relays were told is not told again: one relay joining or
# leaving must not send a record to each of 8k relays.
_RETELL = 0.1


def heartbeat_period(config: CoordinatorConfig, relays: int) -> float:
    """The relay ↔ coordinator heartbeat period for ``relays`` connected relays: their
    exchanges stay under ``relay_heartbeat_rate`` a second, but never slower than four periods
    per ``heartbeat_timeout`` (the relays' and ranks' coordinator-silence deadlines keep that
    margin at the defaults: four chances, as a Kubernetes node lease renewed every 10 s of its
    40 s) and never faster than ``heartbeat_interval``."""
    paced = min(relays / config.relay_heartbeat_rate, config.heartbeat_timeout / 4)
    return max(config.heartbeat_interval, paced)


class Liveness:
    """Deaths, the failure policy, staleness and the coordinator's heartbeats.

    Attributes:
        failure: the :class:`ClusterFailure` once the policy has stopped the run, else None.
        fenced: ranks told they were declared dead (``Fenced``) so far.
        write_stalls: relays lost because their writer made no progress.
        retired: relay connections closed because every rank on them was dead.
    """

    def __init__(self, roster: Roster[RelayConn], sender: Sender, config: CoordinatorConfig,
                 timeline: Timeline) -> None:
        self._roster = roster
        self._sender = sender
        self._config = config
        self._timeline = timeline
        # Deaths not yet told to the survivors. Never full: a rank is in it at most once
        # (``_queued``), so world_size bounds it even when a rank rejoins and dies again before
        # its first death was told; the later death is then told by the same DeclareDead.
        self._death_send, self._death_recv = trio.open_memory_channel[int](
            max(1, config.world_size))
        self._queued: set[int] = set()
        self._deaths_marked = 0
        self._deaths_handled = 0
        self._deaths_progress = trio.Event()
        self._wake_event = trio.Event()
        self._save_latched = False
        self._body_scope: trio.CancelScope | None = None
        self._leads: Callable[[], bool] = _always
        self.failure: ClusterFailure | None = None
        # What the relays were told (Cadence); CoordHeartbeat goes out at this pace too.
        self.heartbeat_period = config.heartbeat_interval
        self.fenced = 0
        self.write_stalls = 0
        self.retired = 0
        # When each rank was last declared dead (retire_after counts from it; a death restored
        # by an adoption counts from the coordinator's start), and a wake-up for whoever waits
        # for the membership to move (a death, a join).
        self._died_at: dict[int, float] = {}
        self._born = trio.current_time()
        self._moved = trio.Event()

    @property
    def save_latched(self) -> bool:
        """``ShutdownWithSave`` was broadcast (the graceful shutdown then sends no Shutdown)."""
        return self._save_latched

    def cancel_on_failure(self, scope: trio.CancelScope) -> None:
        """Cancel ``scope`` (the user's block) when the failure policy stops the run."""
        self._body_scope = scope

    def guard_with(self, leads: Callable[[], bool]) -> None:
        """Ask ``leads`` before declaring any death or judging the failure policy: a
        coordinator that lost its store's leadership (and steps down when ``leads`` finds
        out) declares nothing and says nothing more."""
        self._leads = leads

    def leads(self) -> bool:
        """Whether the coordinator may still act as its store's leader (see
        :meth:`guard_with`; always True without a store)."""
        return self._leads()

    def wake(self) -> None:
        """Last-seen clocks moved: the staleness watch recomputes its next deadline."""
        self._wake_event.set()
        self._membership_moved()

    def _membership_moved(self) -> None:
        self._moved.set()
        self._moved = trio.Event()

    async def next_change(self) -> None:
        """Return at the next death, or the next time ranks join or rejoin."""
        await self._moved.wait()

    def died_at(self, rank: int) -> float:
        """When ``rank`` was last declared dead (trio clock; a death restored by an adoption:
        when this coordinator started)."""
        return self._died_at.get(rank, self._born)

    def close(self) -> None:
        """Shutdown: no more deaths are handled."""
        self._death_send.close()

    def mark_dead(self, rank: int, reason: str) -> bool:
        """Declare ``rank`` dead now; False if it was not live (or shutdown has begun, or the
        coordinator no longer leads its store)."""
        if not self._leads() or not self._roster.mark_dead(rank, reason):
            return False
        self._died_at[rank] = trio.current_time()
        self._membership_moved()
        conn = self._roster.relay_of(rank)
        host = conn.host if conn is not None else "?"
        log.warning("rank %d (host %s) declared dead: %s", rank, host, reason)
        self._timeline.event(RankDeclaredDead(rank=rank, host=host, reason=reason))
        self.fence(rank, reason)
        if rank not in self._queued:
            self._queued.add(rank)
            self._deaths_marked += 1
            self._death_send.send_nowait(rank)
        return True

    def fence(self, rank: int, reason: str) -> None:
        """Tell a dead rank through its relay; disconnect a relay whose ranks are all dead."""
        conn = self._sender.fence(rank, reason)
        if conn is None:
            return
        self.fenced += 1
        self._timeline.event(RankFenced(rank=rank, host=conn.host, reason=reason))
        if not self._roster.live_of(conn):
            conn.retire("every rank on it was declared dead", self._config.shutdown_grace)
            self.retired += 1
            log.warning("%s: every rank on it was declared dead; disconnecting it",
                        conn.describe())
            self._timeline.event(RelayRetired(host=conn.host, ranks=conn.ranks))

    def formed(self) -> None:
        """Formation completed: the failure policy judges the deaths it saw (it never does
        while forming)."""
        if self._roster.dead:
            try:
                self._death_send.send_nowait(_RECHECK)
            except (trio.ClosedResourceError, trio.WouldBlock):
                pass  # shut down already, or deaths queued: the worker judges them anyway

    async def wait_told(self) -> None:
        """Return once every death marked so far was told to the survivors (or shutdown)."""
        target = self._deaths_marked
        while self._deaths_handled < target and not self._roster.shutting_down:
            await self._deaths_progress.wait()

    def relay_lost(self, conn: RelayConn, cause: str, stalled: bool = False) -> None:
        """An upstream connection ended: during formation its ranks are uncovered again (the
        relay may re-dial); afterwards its live ranks are declared dead at once. Only its
        first end counts (a retired connection's end is no loss)."""
        if not conn.abandon(cause, stalled=stalled):
            return
        if self._roster.shutting_down or not self._leads():
            return  # closed on purpose, or deposed: nothing is lost, nothing is said
        if stalled:
            self.write_stalls += 1
            self._timeline.event(RelayStalled(host=conn.host, ranks=conn.ranks,
                                              stalled_s=conn.write_stall_timeout))
        reason = f"relay {conn.host!r} at {conn.peer} lost: {cause}"
        self._timeline.event(RelayLost(host=conn.host, ranks=conn.ranks, reason=cause))
        if self._roster.forming:
            self._roster.unregister(conn)
            log.warning("%s during formation; its ranks are uncovered again", reason)
            return
        log.warning("%s", reason)
        if self._config.declare_dead_on_relay_loss:
            for rank in conn.ranks:
                if self._roster.carries(conn, rank):  # not a rank rejoined elsewhere since
                    self.mark_dead(rank, reason)

    async def death_worker(self) -> None:
        """Tell the survivors about each death, then apply the failure policy."""
        async for rank in self._death_recv:
            batch = [rank]
            while True:  # several deaths at once (a whole relay) → one policy decision
                try:
                    batch.append(self._death_recv.receive_nowait())
                except trio.WouldBlock:
                    break
            self._queued.difference_update(batch)
            deaths = [dead for dead in batch if dead != _RECHECK]
            for dead in deaths:
                if self._roster.shutting_down:
                    break
                self._sender.post(DeclareDead(rank=dead))  # failures: counted as lost
            await self.apply_failure_policy()
            self._deaths_handled += len(deaths)
            self._deaths_progress.set()
            self._deaths_progress = trio.Event()

    async def apply_failure_policy(self) -> None:
        policy = self._config.max_failure
        reason = self._roster.failure_reason(policy)
        # The policy decides once (``failure``); the ShutdownWithSave latch only stops a second
        # broadcast. Testing the latch here let an explicit shutdown_with_save() silence the
        # policy.
        if (reason is None or self.failure is not None or self._roster.shutting_down
                or not self._leads()):
            return
        world = self._roster.current_world
        detail = (
            f"max_failure {policy.describe(world)} reached"
            if reason is SaveReason.MAX_FAILURE_EXCEEDED and policy is not None
            else "no live rank is left"
        )
        await self.stop_with_save(reason, wait=False)
        why = self._roster.dead
        dead = tuple(sorted(why))
        self._timeline.event(ClusterFailed(reason=reason.name, dead=dead))
        self.failure = ClusterFailure(reason, dead, detail, why=why)
        log.error("%s", self.failure)
        if self._body_scope is not None:
            self._body_scope.cancel()

    async def stop_with_save(self, reason: SaveReason, *, wait: bool = True) -> None:
        """Broadcast ``ShutdownWithSave{reason}`` once per run (latched); without ``wait`` it is
        only queued on every relay (the failure policy never waits on a slow relay)."""
        if self._save_latched:
            await trio.lowlevel.checkpoint()
            return
        self._save_latched = True
        if not wait:
            self._sender.post(ShutdownWithSave(reason=reason))
            await trio.lowlevel.checkpoint()
            return
        try:
            await self._sender.broadcast_control(ShutdownWithSave(reason=reason))
        except BroadcastError:
            pass

    async def staleness_watch(self) -> None:
        """Declare the stale ranks (``Roster.stale``) the moment they are: it sleeps until the
        next deadline it was given, or until a reader wakes it (a report it waits for, a
        rejoin, formation's end)."""
        timeout = self._config.heartbeat_timeout
        reason = f"heartbeat stale (>{timeout:g}s)"
        while True:
            # A lost relay is *not* skipped: without declare_dead_on_relay_loss its ranks are
            # declared by staleness, as in flodl (skipping them left them live forever).
            overdue, next_check = self._roster.stale(
                trio.current_time(), timeout, lambda conn: conn.paused)
            for rank in overdue:
                self.mark_dead(rank, reason)
            self._wake_event = trio.Event()
            with trio.move_on_at(next_check):
                await self._wake_event.wait()

    def repace(self) -> None:
        """Pace the heartbeat exchange to the relays connected now (while forming: to the
        relays the world will have, ``Roster.pacing_relays``); tell every relay when the
        period moved by more than 10 % of the one they were told."""
        relays = self._roster.pacing_relays()
        period = heartbeat_period(self._config, relays)
        told = self.heartbeat_period
        if abs(period - told) <= _RETELL * told:
            return
        log.info("heartbeat period %gs -> %gs (%d relays %s)", told, period, relays,
                 "expected" if self._roster.forming else "connected")
        self.heartbeat_period = period
        for conn in self._roster.relays:
            self.tell_cadence(conn)

    def join_cadence(self, conn: RelayConn) -> Cadence | None:
        """The ``Cadence`` for ``conn``'s handshake to seal after its welcome, in the same
        write (``CoordinatorHandshake.accept(cadence=)``), or None while the period is the
        ``heartbeat_interval`` a relay starts with; ``conn`` counts as told it. While
        forming, the period is paced first for the relays the world will have, so the relays
        of a large world learn it as they join, not in a round of ``Cadence`` records later."""
        if self._roster.forming:
            self.repace()
        if self.heartbeat_period == self._config.heartbeat_interval:
            return None
        conn.told_cadence(self.heartbeat_period)
        return Cadence(interval=self.heartbeat_period)

    def joined(self, conn: RelayConn) -> None:
        """``conn`` joined, rejoined or resumed (after its welcome): it learns the period, if
        what it runs at (``heartbeat_interval``, or the Cadence its handshake sent) is not
        the period now."""
        if (conn.cadence or self._config.heartbeat_interval) != self.heartbeat_period:
            self.tell_cadence(conn)

    def tell_cadence(self, conn: RelayConn) -> None:
        """Queue ``Cadence{heartbeat_period}`` for ``conn`` (never waits on it; nothing for a
        connection that ended or has not joined)."""
        if not conn.alive or conn.session is None:
            return
        conn.told_cadence(self.heartbeat_period)
        # RelayConn.submit_control seals through the connection's CoordinatorSession, whose
        # send takes a Cadence; its annotation names only Goodbye and FenceRank.
        conn.submit_control(cast(Any, Cadence(interval=self.heartbeat_period)), None)

    async def coord_heartbeats(self) -> None:
        while True:
            await trio.sleep(self.heartbeat_period)
            if self._roster.shutting_down:
                return
            self.repace()
            if not self._roster.live:
                continue
            # Each relay gets what it can take: one behind a backlog (or stalled) is skipped,
            # and nobody waits for anybody's write.
            self._sender.post(CoordHeartbeat(), only_idle=True)


def _always() -> bool:
    """The leadership check of a coordinator without a store: it always leads."""
    return True
