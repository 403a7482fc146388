"""What happens when a rank or a relay dies (SPEC §4.5), in one place.

- ``mark_dead`` records a death synchronously (state, event) and queues the follow-up.
- ``death_worker`` tells the survivors (``DeclareDead``) and applies the failure policy.
- ``staleness_watch`` declares ranks whose last TIMING frame is older than ``heartbeat_timeout``;
  time in which the coordinator could not read a relay (its reader waiting on a full channel) does
  not count, so a slow consumer never kills healthy ranks.
- ``relay_lost`` handles an upstream connection that ended.
- ``coord_heartbeats`` sends ``CoordHeartbeat`` on its cadence.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import trio

from .._errors import BroadcastError, ClusterFailure
from ..events import ClusterFailed, RankDeclaredDead, RelayLost
from ..wire import CoordHeartbeat, DeclareDead, SaveReason, ShutdownWithSave
from . import formation

if TYPE_CHECKING:
    from ._core import Coordinator
    from ._relayconn import RelayConn

log = logging.getLogger("flodl_trio.coordinator.liveness")


def mark_dead(coord: Coordinator, rank: int, reason: str) -> bool:
    """Declare ``rank`` dead now; False if it was not live (or shutdown has begun)."""
    if coord._shutting_down or rank in coord._dead or rank in coord._exited:
        return False
    conn = coord._conn_of_rank.get(rank)
    if conn is None:
        return False
    coord._dead[rank] = reason
    coord._deaths_marked += 1
    log.warning("rank %d (host %s) declared dead: %s", rank, conn.host, reason)
    coord._timeline.event(RankDeclaredDead(rank=rank, host=conn.host, reason=reason))
    coord._death_send.send_nowait(rank)
    return True


def relay_lost(coord: Coordinator, conn: RelayConn, cause: str) -> None:
    """An upstream connection ended: during formation its ranks are uncovered again (the relay
    may re-dial); afterwards its live ranks are declared dead at once."""
    if conn.lost_reason is not None:
        return
    conn.lost_reason = cause
    conn.stop_writer()
    coord._nursery.start_soon(conn.close)
    if coord._shutting_down:
        return
    reason = f"relay {conn.host!r} at {conn.peer} lost: {cause}"
    coord._timeline.event(RelayLost(host=conn.host, ranks=conn.ranks, reason=cause))
    if coord._phase == "forming":
        formation.unregister(coord, conn)
        log.warning("%s during formation; its ranks are uncovered again", reason)
        return
    log.warning("%s", reason)
    if coord.config.declare_dead_on_relay_loss:
        for rank in conn.ranks:
            mark_dead(coord, rank, reason)


async def death_worker(coord: Coordinator) -> None:
    """Tell the survivors about each death, then apply the failure policy."""
    async for rank in coord._death_recv:
        batch = [rank]
        while True:  # several deaths at once (a whole relay) → one policy decision
            try:
                batch.append(coord._death_recv.receive_nowait())
            except trio.WouldBlock:
                break
        for dead in batch:
            if coord._shutting_down:
                break
            try:
                await coord.broadcast_control(DeclareDead(rank=dead))
            except BroadcastError:
                pass  # counted and recorded by broadcast_control
        await apply_failure_policy(coord)
        coord._deaths_handled += len(batch)
        coord._deaths_progress.set()
        coord._deaths_progress = trio.Event()


def failure_reason(coord: Coordinator) -> SaveReason | None:
    dead = len(coord._dead)
    if dead == 0:
        return None
    policy = coord.config.max_failure
    if policy is not None and dead >= policy.limit(coord.world_size):
        return SaveReason.MAX_FAILURE_EXCEEDED
    if not coord.live_ranks:
        return SaveReason.ALL_RANKS_LOST
    return None


async def apply_failure_policy(coord: Coordinator) -> None:
    reason = failure_reason(coord)
    # The policy decides once (``_failure``); the ShutdownWithSave latch only stops a second
    # broadcast. Testing the latch here let an explicit shutdown_with_save() silence the policy.
    if reason is None or coord._failure is not None or coord._shutting_down:
        return
    policy = coord.config.max_failure
    detail = (
        f"max_failure {policy.describe(coord.world_size)} reached"
        if reason is SaveReason.MAX_FAILURE_EXCEEDED and policy is not None
        else "no live rank is left"
    )
    await stop_with_save(coord, reason)
    dead = tuple(sorted(coord._dead))
    coord._timeline.event(ClusterFailed(reason=reason.name, dead=dead))
    coord._failure = ClusterFailure(reason, dead, detail)
    log.error("%s", coord._failure)
    if coord._body_scope is not None:
        coord._body_scope.cancel()


async def stop_with_save(coord: Coordinator, reason: SaveReason) -> None:
    """Broadcast ``ShutdownWithSave{reason}`` once per run (latched)."""
    if coord._save_latched:
        return
    coord._save_latched = True
    try:
        await coord.broadcast_control(ShutdownWithSave(reason=reason))
    except BroadcastError:
        pass


async def staleness_watch(coord: Coordinator) -> None:
    timeout = coord.config.heartbeat_timeout
    reason = f"heartbeat stale (>{timeout:g}s)"
    while True:
        now = trio.current_time()
        next_check = math.inf
        # Staleness counts only once the cohort is formed (formation has its own deadline).
        watched = sorted(coord.live_ranks) if coord._phase == "running" else []
        for rank in watched:
            # A lost relay is *not* skipped: without declare_dead_on_relay_loss its ranks are
            # declared by staleness, as in flodl (skipping them left them live forever).
            if coord._conn_of_rank[rank].paused_since is not None:
                continue
            due = coord._last_seen[rank] + timeout
            if due <= now:
                mark_dead(coord, rank, reason)
            else:
                next_check = min(next_check, due)
        coord._liveness_wake = trio.Event()
        with trio.move_on_at(next_check):
            await coord._liveness_wake.wait()


async def coord_heartbeats(coord: Coordinator) -> None:
    interval = coord.config.heartbeat_interval
    while True:
        await trio.sleep(interval)
        if coord._shutting_down:
            return
        if not coord.live_ranks:
            continue
        try:
            await coord.broadcast_control(CoordHeartbeat())
        except BroadcastError:
            pass
