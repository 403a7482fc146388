"""The coordinator object: formation bookkeeping, readers, sending and the status document."""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from typing import Any

import trio

from .._config import CoordinatorConfig
from .._coord_types import BroadcastResult, RelayInfo
from .._errors import (
    BroadcastError,
    ConfigError,
    FormationError,
    SendError,
)
from .._ratelimit import JunkCounter
from ..events import (
    LostBroadcast,
    ShutdownComplete,
    ShutdownStarted,
)
from ..timeline import Timeline
from ..wire import (
    FrameCodec,
    Metrics,
    RecordKind,
    SaveReason,
    SessionSalt,
    Shutdown,
    TimingMsg,
    WireMessage,
    control_label,
    encode_fanout,
)
from . import liveness
from ._relayconn import Delivery, RelayConn, ranks_text

log = logging.getLogger("flodl_trio.coordinator")

_STOP_READING = (trio.ClosedResourceError, trio.BrokenResourceError)


class Coordinator:
    """The run's coordinator, as yielded by :func:`flodl_trio.open_coordinator`.

    Attributes:
        world_size: number of global ranks.
        config: the :class:`CoordinatorConfig` in force.
        address: ``(host, port)`` when the coordinator bound TCP itself, else ``None``.
        timing: receive channel of every TimingMsg (heartbeats included), bounded.
        metrics: receive channel of every Metrics message, bounded.
        lost_broadcasts: broadcasts that did not reach every live rank.
        timeline: the :class:`Timeline` events are recorded on.
    """

    def __init__(
        self,
        *,
        salt: SessionSalt,
        config: CoordinatorConfig,
        timeline: Timeline | None,
        address: tuple[str, int] | None,
    ) -> None:
        if not isinstance(salt, SessionSalt):
            raise ConfigError(
                f"open_coordinator: expected a SessionSalt, got {type(salt).__name__}"
            )
        if not isinstance(config, CoordinatorConfig):
            raise ConfigError(
                f"open_coordinator: expected a CoordinatorConfig, got {type(config).__name__}"
            )
        self.world_size = config.world_size
        self.config = config
        self.address = address
        self.timeline = timeline if timeline is not None else Timeline()
        self._timeline = self.timeline
        self._salt = salt
        self._codec = FrameCodec(salt)
        self._relays: list[RelayConn] = []
        self._conn_of_rank: dict[int, RelayConn] = {}
        self._dead: dict[int, str] = {}
        self._exited: set[int] = set()
        self._last_seen: dict[int, float] = {}
        self._rejects: Counter[str] = Counter()
        # Frames dropped from authenticated relays (forged, foreign-rank, undecodable).
        self._invalid_frames = JunkCounter()
        self.lost_broadcasts = 0
        self._phase = "forming"
        self._started_wall = time.monotonic()
        self._formation_started = 0.0
        self._timing_send, self.timing = trio.open_memory_channel[TimingMsg](
            config.timing_buffer
        )
        self._metrics_send, self.metrics = trio.open_memory_channel[Metrics](
            config.metrics_buffer
        )
        self._death_send, self._death_recv = trio.open_memory_channel[int](math.inf)
        self._deaths_marked = 0
        self._deaths_handled = 0
        self._deaths_progress = trio.Event()
        self._formation_settled = trio.Event()
        self._formation_failure: FormationError | None = None
        self._failure: BaseException | None = None
        self._save_latched = False
        self._shutting_down = False
        self._shutdown_done = trio.Event()
        self._shutdown_begun = False
        self._body_scope: trio.CancelScope | None = None
        self._liveness_wake = trio.Event()
        self._readers_active = 0
        self._readers_idle = trio.Event()
        self._readers_idle.set()
        self._conn_counter = 0
        # Relays whose HelloAck is still being written: formation is not complete until every
        # one is acknowledged, else a relay lost mid-ack would leave its ranks neither live nor
        # dead after formation.
        self._acks_in_flight: set[RelayConn] = set()
        self._tls = False
        self._writers: trio.Nursery = None  # type: ignore[assignment]  # set by _form
        self._writers_scope: trio.CancelScope | None = None
        self._warned_hosts: set[str] = set()
        self._nursery: trio.Nursery = None  # type: ignore[assignment]  # set by open_coordinator

    # ------------------------------------------------------------------ public view

    @property
    def relays(self) -> tuple[RelayInfo, ...]:
        """The relays that joined, in join order."""
        return tuple(RelayInfo(c.host, c.ranks, c.peer) for c in self._relays)

    @property
    def covered_ranks(self) -> frozenset[int]:
        return frozenset(self._conn_of_rank)

    @property
    def live_ranks(self) -> frozenset[int]:
        """Covered ranks that are neither dead nor cleanly exited."""
        return frozenset(r for r in self._conn_of_rank if r not in self._dead and
                         r not in self._exited)

    @property
    def dead_ranks(self) -> frozenset[int]:
        return frozenset(self._dead)

    @property
    def exited_ranks(self) -> frozenset[int]:
        return frozenset(self._exited)

    @property
    def phase(self) -> str:
        """``forming``, ``running``, ``shutting_down`` or ``closed``."""
        return self._phase

    def is_dead(self, rank: int) -> bool:
        return rank in self._dead

    def dead_reason(self, rank: int) -> str | None:
        return self._dead.get(rank)

    def host_of(self, rank: int) -> str | None:
        conn = self._conn_of_rank.get(rank)
        return None if conn is None else conn.host

    def state(self) -> dict[str, Any]:
        """The status document served at ``/state.json`` (SPEC §7)."""
        return {
            "phase": self._phase,
            "world_size": self.world_size,
            "covered": len(self._conn_of_rank),
            "relays": [
                {"host": c.host, "ranks": list(c.ranks), "peer": c.peer} for c in self._relays
            ],
            "live": sorted(self.live_ranks),
            "dead": [{"rank": r, "reason": why} for r, why in sorted(self._dead.items())],
            "exited": sorted(self._exited),
            "lost_broadcasts": self.lost_broadcasts,
            "rejected_handshakes": dict(self._rejects),
            "invalid_frames": self._invalid_frames.by_reason(),
            "uptime_s": round(time.monotonic() - self._started_wall, 3),
        }

    # ------------------------------------------------------------------ control

    async def send_control(self, rank: int, msg: WireMessage) -> None:
        """Send one control message to one rank (queued whole before the first checkpoint).

        Raises:
            SendError: rank out of range, never announced, dead or exited; the connection is
                closed or stalled (a stalled connection is then treated as lost).
        """
        label = control_label(msg)
        what = f"send_control({label}) to rank {rank}"
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise SendError(f"{what}: expected a rank in [0, {self.world_size}), got {rank!r}")
        conn = self._conn_of_rank.get(rank)
        if conn is None:
            raise SendError(f"{what}: no relay announced rank {rank}")
        if rank in self._dead:
            raise SendError(f"{what}: rank {rank} was declared dead ({self._dead[rank]})")
        if rank in self._exited:
            raise SendError(f"{what}: rank {rank} exited cleanly and is never addressed again")
        if not conn.alive:
            raise SendError(f"{what}: {conn.describe()} is gone ({conn.lost_reason})")
        delivery = Delivery(1)
        conn.submit(RecordKind.DATA, rank, self._codec.encode(msg), delivery)
        await delivery.done.wait()
        failure = delivery.failures.get(conn)
        if failure is not None:
            raise SendError(f"{what}: {conn.describe()}: {failure}")

    async def broadcast_control(self, msg: WireMessage) -> BroadcastResult:
        """Send ``msg`` to every live, non-exited rank; best effort, never fail-fast.

        The frame is encoded once and every relay gets one FANOUT record for all its target
        ranks; relays are written concurrently (each by its own writer task), so one stalled
        host delays nobody else. Cancelling the call does not unsend: the records are queued
        before the first checkpoint and every relay gets each record whole, so a cancelled
        broadcast never tears a relay link.

        Returns:
            BroadcastResult with the delivered ranks (and no failures).

        Raises:
            BroadcastError: some live rank was not reached; ``.result`` names who and why.
        """
        label = control_label(msg)
        frame = self._codec.encode(msg)
        groups: dict[RelayConn, list[int]] = {}
        failed: dict[int, str] = {}
        for rank in sorted(self.live_ranks):
            conn = self._conn_of_rank[rank]
            if conn.alive:
                groups.setdefault(conn, []).append(rank)
            else:
                failed[rank] = f"relay {conn.host!r} is gone ({conn.lost_reason})"
        # Every relay's writer task gets its record now; they write concurrently.
        delivery = Delivery(len(groups))
        for conn, ranks in groups.items():
            conn.submit(RecordKind.FANOUT, 0, encode_fanout(ranks, frame), delivery)
        await delivery.done.wait()
        delivered: set[int] = set()
        for conn, ranks in groups.items():
            failure = delivery.failures.get(conn)
            if failure is None:
                delivered.update(ranks)
            else:
                for r in ranks:
                    failed[r] = f"relay {conn.host!r}: {failure}"
        result = BroadcastResult(frozenset(delivered), failed)
        if failed:
            if not isinstance(msg, Shutdown) and not self._shutting_down:
                self.lost_broadcasts += 1
                self._timeline.event(LostBroadcast(control=label, failures=dict(failed)))
            raise BroadcastError(
                f"broadcast of {label}: expected delivery to every live rank, "
                f"{len(failed)} failed: ranks {ranks_text(sorted(failed))} "
                f"({'; '.join(sorted(set(failed.values())))})",
                result,
            )
        return result

    async def declare_dead(self, rank: int, reason: str) -> None:
        """Report a death the orchestrator observed itself.

        Raises:
            ConfigError: ``rank`` is not a rank of this world.
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ConfigError(
                f"declare_dead: expected a rank in [0, {self.world_size}), got {rank!r}"
            )
        if liveness.mark_dead(self, rank, f"declared by the orchestrator: {reason}"):
            # Return once the survivors were told, so what the caller sends next follows the
            # DeclareDead on every link.
            target = self._deaths_marked
            while self._deaths_handled < target and not self._shutting_down:
                await self._deaths_progress.wait()
        else:
            await trio.lowlevel.checkpoint()

    async def shutdown_with_save(self, reason: SaveReason) -> None:
        """Tell every live rank to save and stop (``ShutdownWithSave``); sent once per run."""
        await liveness.stop_with_save(self, SaveReason(reason))


    def _on_write_failure(self, conn: RelayConn, cause: str) -> None:
        liveness.relay_lost(self, conn, cause)

    # ------------------------------------------------------------------ lifecycle

    async def _host_writers(self, task_status: trio.TaskStatus[trio.Nursery]) -> None:
        """Host the relay writer tasks where an outside cancellation cannot reach them.

        The shielded shutdown still has to write ``Shutdown`` and the half-closes through them;
        ``_shutdown`` cancels this scope once it is done.
        """
        with trio.CancelScope(shield=True) as scope:
            self._writers_scope = scope
            async with trio.open_nursery() as writers:
                task_status.started(writers)
                await trio.sleep_forever()

    async def _shutdown(self, reason: str) -> None:
        """Graceful, bounded, idempotent shutdown (SPEC §4.6); the caller shields it."""
        if self._shutdown_begun:
            await self._shutdown_done.wait()
            return
        self._shutdown_begun = True
        try:
            await self._shutdown_steps(reason)
        finally:
            # Whatever happened above, the shielded writers must not outlive the coordinator.
            if self._writers_scope is not None:
                self._writers_scope.cancel()

    async def _shutdown_steps(self, reason: str) -> None:
        self._shutting_down = True
        self._phase = "shutting_down"
        self._timeline.event(ShutdownStarted(reason=reason))
        for conn in self._relays:
            if conn.delivery_scope is not None:
                conn.delivery_scope.cancel()
        log.info("shutting down: %s", reason)
        tail = self._invalid_frames.flush(trio.current_time(), force=True)
        if tail is not None:
            log.warning("frames dropped: %s", tail.text())
        with trio.move_on_after(self.config.shutdown_grace):
            if not self._save_latched and self.live_ranks:
                try:
                    await self.broadcast_control(Shutdown())
                except BroadcastError:
                    pass
            # Half-close first: the relays read everything we wrote, then see EOF and close;
            # our readers drain until then, so nothing in flight turns into a reset.
            alive = [conn for conn in self._relays if conn.alive]
            eofs = Delivery(len(alive))
            for conn in alive:
                conn.submit_eof(eofs)  # after everything already queued for it
            await eofs.done.wait()
            await self._readers_idle.wait()
        for conn in list(self._relays):
            await conn.close()
        self._timing_send.close()
        self._metrics_send.close()
        self._death_send.close()
        self._phase = "closed"
        self._timeline.event(ShutdownComplete())
        self._shutdown_done.set()


