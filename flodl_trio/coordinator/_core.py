"""The coordinator object: formation bookkeeping, readers, sending and the status document."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from functools import partial
from typing import Any

import trio

from .._config import CoordinatorConfig
from .._coord_types import BroadcastResult, RelayInfo
from .._errors import BroadcastError, ConfigError, FormationError, LeadershipLost
from ..events import ShutdownComplete, ShutdownStarted
from ..store import SessionStore
from ..timeline import Timeline
from ..wire import (
    ControlMsg,
    FrameCodec,
    Metrics,
    SaveReason,
    SessionSalt,
    Shutdown,
    TimingMsg,
)
from ._board import Board, DashboardPush
from ._boardview import board_document, epoch_in_progress
from ._leader import Leader
from ._persist import checked_checkpoint
from ._relayconn import Delivery, RelayConn
from ._retire import Retirement
from ._roster import Roster
from ._sending import Sender
from .formation import Formation
from .liveness import Liveness
from .readers import Readers

log = logging.getLogger("flodl_trio.coordinator")


class Coordinator:
    """The run's coordinator, as yielded by :func:`flodl_trio.open_coordinator`.

    Attributes:
        world_size: number of global ranks (an elastic world's maximum: the rank id space).
        config: the :class:`CoordinatorConfig` in force.
        address: ``(host, port)`` it listens on (a property; a ``ConfigError`` when it was
            given listeners instead of an address to bind).
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
        tls: bool = False,
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
        self._address = address
        self.timeline = timeline if timeline is not None else Timeline()
        self._started_wall = time.monotonic()
        self._timing_send, self.timing = trio.open_memory_channel[TimingMsg](
            config.timing_buffer
        )
        self._metrics_send, self.metrics = trio.open_memory_channel[Metrics](
            config.metrics_buffer
        )
        codec = FrameCodec(salt)
        self._roster = Roster[RelayConn](config.world_size, min_world=config.min_world)
        self._sender = Sender(self._roster, codec, self.timeline, config.world_size)
        self._liveness = Liveness(self._roster, self._sender, config, self.timeline)
        self._board = Board(config.world_size)
        self._retirement = Retirement(roster=self._roster, liveness=self._liveness,
                                      config=config, timeline=self.timeline)
        self._readers = Readers(roster=self._roster, liveness=self._liveness, codec=codec,
                                timeline=self.timeline, timing=self._timing_send,
                                metrics=self._metrics_send, board=self._board,
                                retirement=self._retirement,
                                deliver_heartbeats=config.deliver_heartbeats,
                                confirm_left=self._confirm_left)
        self._formation = Formation(
            roster=self._roster, sender=self._sender, liveness=self._liveness,
            readers=self._readers, config=config, salt=salt, timeline=self.timeline, tls=tls)
        self._shutdown_done = trio.Event()
        self._shutdown_begun = False
        self._formation_began: float | None = None
        self._formed_at: float | None = None
        self._leader = Leader(salt=salt, config=config, roster=self._roster, sender=self._sender,
                              liveness=self._liveness, formation=self._formation)
        self._roster.report_changes_to(self._leader.changed)

    # ------------------------------------------------------------------ run (open_coordinator)

    @property
    def failure(self) -> BaseException | None:
        """The :class:`LeadershipLost` once the coordinator stepped down, else the
        :class:`ClusterFailure` once the failure policy stopped the run, else None."""
        return self._leader.deposed or self._liveness.failure

    @property
    def deposed(self) -> LeadershipLost | None:
        """Why the coordinator stepped down (it lost its store's leadership), else None."""
        return self._leader.deposed

    def on_deposed(self, stop: Callable[[], None]) -> None:
        """Call ``stop`` (``open_coordinator``: stop every task) when the coordinator steps
        down."""
        self._leader.when_deposed(stop)

    # ------------------------------------------------------------------ session store

    async def lead(self, store: SessionStore, *, fresh: bool = False,
                   standby: bool = False) -> None:
        """Become ``store``'s leader and adopt its session, or start a new one (SPEC §4.7);
        runs before :meth:`background_tasks`. See :meth:`Leader.lead`."""
        await self._leader.lead(store, fresh=fresh, standby=standby)

    async def publish_address(self, addresses: tuple[tuple[str, int], ...]) -> None:
        """Tell the store where relays can dial this leader (``open_coordinator`` does)."""
        await self._leader.publish_address(addresses)

    @property
    def generation(self) -> int:
        """This coordinator's generation in its session store (the fencing token, greater
        than every generation before it); 0 without a store."""
        return self._leader.generation

    @property
    def resumed(self) -> bool:
        """True when it adopted a running session from its store (SPEC §4.7)."""
        return self._leader.resumed

    @property
    def formation_failure(self) -> FormationError | None:
        return self._formation.failure

    def background_tasks(
        self, control: list[trio.abc.Listener[Any]], abort: trio.Event | None
    ) -> list[Callable[[], Awaitable[None]]]:
        """The tasks a running coordinator needs, for ``open_coordinator`` to start (after
        :meth:`host_writers`); formation's deadline counts from this call."""
        self._formation.start_clock()
        self._formation_began = trio.current_time()
        tasks: list[Callable[[], Awaitable[None]]] = [
            partial(self._formation.accept_loop, listener) for listener in control
        ]
        tasks += [self._liveness.death_worker, self._liveness.coord_heartbeats,
                  self._liveness.staleness_watch]
        tasks += self._leader.tasks()
        if abort is not None:
            tasks.append(partial(self._formation.watch_abort, abort))
        least, most = self.world_range  # an adopted session's range holds (issue 37)
        if least < most:
            tasks.append(self._formation.watch_join_window)
        if self.config.retire_after < math.inf:
            tasks.append(self._retirement.watch)
        return tasks

    async def _confirm_left(self, conn: RelayConn) -> None:
        """A drained relay ended its side: its end is confirmed once durable."""
        await self._retirement.confirm_left(conn, self._leader)

    async def host_writers(self, task_status: trio.TaskStatus[None]) -> None:
        """Host the relay writer tasks, shielded from outside cancellation (see Sender)."""
        await self._sender.host_writers(task_status=task_status)

    async def formed(self) -> None:
        """Return once every rank is covered.

        Raises:
            FormationTimeout / FormationAborted / FormationError: the c/W text says why.
        """
        with self._leader.formed_scope:
            await self._formation.wait()
            await self._leader.flush()  # the formed session is durable before the block
        if self._leader.deposed is not None:
            raise self._leader.deposed
        if self._formed_at is None:
            self._formed_at = trio.current_time()

    def cancel_on_failure(self, scope: trio.CancelScope) -> None:
        """Cancel ``scope`` (the user's block) when the failure policy stops the run or the
        coordinator steps down."""
        self._leader.cancel_on_step_down(scope)
        self._liveness.cancel_on_failure(scope)

    # ------------------------------------------------------------------ public view

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` the coordinator bound (set for the whole block when it bound TCP).

        Raises:
            ConfigError: it was given listeners (e.g. a ``MemoryNetwork``'s), so it has no
                address of its own.
        """
        if self._address is None:
            raise ConfigError("coord.address: expected a coordinator that bound TCP itself, got "
                              "one serving listeners it was given (it has no address)")
        return self._address

    @property
    def relays(self) -> tuple[RelayInfo, ...]:
        """The relays that joined, in join order."""
        return tuple(RelayInfo(c.host, c.ranks, c.peer) for c in self._roster.relays)

    @property
    def covered_ranks(self) -> frozenset[int]:
        return self._roster.covered

    @property
    def world_range(self) -> tuple[int, int]:
        """``(minimum, maximum)`` of the world (``(world_size, world_size)`` when fixed)."""
        return self._roster.min_world, self._roster.world_size

    @property
    def current_world(self) -> int:
        """Ranks in the cohort now: covered, live or dead-and-awaited or exited (retired
        ranks and ranks that never joined are not); ``max_failure`` is judged against it."""
        return self._roster.current_world

    @property
    def retired_ranks(self) -> frozenset[int]:
        """Ranks retired from the world (issue 37) and not joined again since."""
        return frozenset(self._roster.retired)

    @property
    def draining_ranks(self) -> frozenset[int]:
        """Live ranks whose host leaves on purpose (its relay drains, issue 37): each finishes
        its current sync and exits, and is retired then."""
        return self._retirement.draining_ranks() & self._roster.live

    @property
    def live_ranks(self) -> frozenset[int]:
        """Covered ranks that are neither dead nor cleanly exited."""
        return self._roster.live

    @property
    def dead_ranks(self) -> frozenset[int]:
        return frozenset(self._roster.dead)

    @property
    def exited_ranks(self) -> frozenset[int]:
        return self._roster.exited

    @property
    def rejoins(self) -> dict[int, int]:
        """How many times each rank was brought back after being declared dead (ranks that
        never were are absent; a copy). A count that moved means the rank died and came back,
        even if nobody looked at ``dead_ranks`` in between."""
        return self._roster.rejoins

    @property
    def joins(self) -> dict[int, int]:
        """How many times each rank joined the running cohort as a rank it did not cover (an
        elastic world grew, issue 37; a copy). A count that moved means a new process holds the
        rank, even if nobody saw it retired in between."""
        return self._roster.joins

    @property
    def phase(self) -> str:
        """``forming``, ``running``, ``shutting_down`` or ``closed``."""
        return self._roster.phase

    @property
    def heartbeat_period(self) -> float:
        """Seconds between two ``CoordHeartbeat`` to each relay and, once it was told
        (``Cadence``), between two ``Liveness`` records of each relay: ``max(heartbeat_interval,
        min(relays / relay_heartbeat_rate, heartbeat_timeout / 4))`` for the relays connected
        when it was last re-paced (once per period; a change within 10 % is not made), see
        :class:`~flodl_trio.CoordinatorConfig`. ``heartbeat_interval`` until then."""
        return self._liveness.heartbeat_period

    @property
    def lost_broadcasts(self) -> int:
        """Broadcasts that did not reach every live rank."""
        return self._sender.lost_broadcasts

    def is_dead(self, rank: int) -> bool:
        return self._roster.is_dead(rank)

    def dead_reason(self, rank: int) -> str | None:
        return self._roster.dead_reason(rank)

    def host_of(self, rank: int) -> str | None:
        conn = self._roster.relay_of(rank)
        return None if conn is None else conn.host

    def state(self) -> dict[str, Any]:
        """The status document served at ``/state.json`` (SPEC §7); each relay entry also
        says whether the coordinator has closed its connection (``closed``; ``connected``
        turns false first, when the relay is lost or being disconnected). An elastic world's
        ``world``, ``retired``, ``retirements``, ``joins``, ``draining`` and ``drains`` are in
        docs/elastic.rst. ``store`` is its
        session store's size and writes (None without a store, and until it leads one;
        docs/failover.rst)."""
        fields = self._roster.state_fields()
        for entry, conn in zip(fields["relays"], self._roster.relays, strict=True):
            entry["closed"] = conn.closed
        fields.update(self._leader.standby_fields())
        drains_total, drains = self._retirement.drains()
        return {
            **fields,
            "lost_broadcasts": self.lost_broadcasts,
            "fenced_ranks": self._liveness.fenced,
            "relay_write_stalls": self._liveness.write_stalls,
            "relays_disconnected": self._liveness.retired,
            "rejected_handshakes": self._roster.rejects,
            "invalid_frames": self._roster.invalid_frames,
            "pending_handshakes": self._formation.pending_handshakes,
            "uptime_s": round(time.monotonic() - self._started_wall, 3),
            "epoch": epoch_in_progress(self.timeline),
            "draining": sorted(self.draining_ranks),
            "drains_total": drains_total, "drains": drains,
            "store": self._leader.store_status(),
        }

    @property
    def dashboard(self) -> tuple[DashboardPush, ...]:
        """What ranks pushed through the dashboard messages (``DashboardRegister``,
        ``DashboardSetSvg``, ``DashboardSetMetadata``, ``DashboardSetHardware``): the latest of
        each per rank, for at most 256 ranks (those that pushed most recently), SVGs
        sanitised, text clipped."""
        return tuple(self._board.pushes())

    def board(self) -> dict[str, Any]:
        """The status page's document (``/board.json``, every ``/events`` message): phase,
        formation time, the world (its range and size now), ranks by relay with their state,
        step count and last heartbeat age (counts per relay above 1,024 ranks), deaths,
        retirements, epochs, throughput, dashboard pushes."""
        now = trio.current_time()
        began, formed = self._formation_began, self._formed_at
        formation_s = None if began is None else round((formed or now) - began, 3)
        failed = self.failure is not None or self.formation_failure is not None
        doc = board_document(self._roster, self._board, now=now, failed=failed, extras={
            "formation_s": formation_s, "formed": formed is not None,
            "lost_broadcasts": self.lost_broadcasts,
            "uptime_s": round(time.monotonic() - self._started_wall, 3),
        }, coverage=self.timeline.recent_notes("epoch_covered"), draining=self.draining_ranks)
        doc.update(self._leader.standby_fields())
        return doc

    # ------------------------------------------------------------------ scheduler checkpoint

    @property
    def checkpoint(self) -> Mapping[str, Any] | None:
        """The scheduler's last checkpoint (:meth:`save_checkpoint`): on a coordinator that
        adopted a running session from its store, the one the previous coordinator saved;
        None on a fresh run until the first save."""
        return self._leader.checkpoint

    async def save_checkpoint(self, checkpoint: Mapping[str, Any], *,
                              durable: bool = True) -> None:
        """Record the scheduler's checkpoint (a map CBOR can encode: str keys; ints, floats,
        str, bytes, lists, maps). With a session store it is written with the session: at once,
        returning once durable; with ``durable=False``, returning at once, with the next paced
        write (within ``1 / config.store_write_rate`` s; a newer checkpoint replaces it): for
        what an adopting coordinator can do without (docs/failover.rst). Without a store it is
        kept in memory.

        Raises:
            ConfigError: ``checkpoint`` is not a map CBOR can encode (nothing was recorded).
            LeadershipLost: the coordinator was deposed before the write was durable.
            StoreUnavailable: the coordinator has shut down (nothing more is saved).
        """
        self._leader.keep_checkpoint(checked_checkpoint(checkpoint))
        await self._leader.flush(durable=durable)

    # ------------------------------------------------------------------ control

    async def send_control(self, rank: int, msg: ControlMsg) -> None:
        """Send one control message to one rank (queued whole before the first checkpoint).

        Raises:
            SendError: ``msg`` is not a ControlMsg; rank out of range, never announced, dead or
                exited; the connection is closed or stalled (a stalled connection is then
                treated as lost).
        """
        await self._sender.send_control(rank, msg)

    async def broadcast_control(self, msg: ControlMsg) -> BroadcastResult:
        """Send ``msg`` to every live, non-exited rank; best effort, never fail-fast.

        The frame is encoded once and every relay gets one FANOUT record for all its target
        ranks; relays are written concurrently (each by its own writer task), so one stalled
        host delays nobody else's delivery. Cancelling the call does not unsend: the records
        are queued before the first checkpoint and every relay gets each record whole, so a
        cancelled broadcast never tears a relay link.

        What it waits for: every live relay's writer has handed the record to the connection,
        or that relay was given up on (its connection ended, or its writer made no progress
        for ``write_stall_timeout``, after which the relay is lost). So one relay that stops
        reading can hold *this call* for up to ``write_stall_timeout``, while the others
        already have the record; the coordinator's own heartbeats and death notices never
        wait like this (they are only queued).

        Returns:
            BroadcastResult with the delivered ranks (and no failures).

        Raises:
            BroadcastError: some live rank was not reached; ``.result`` names who and why.
            SendError: ``msg`` is not a ControlMsg (nothing was sent).
        """
        return await self._sender.broadcast_control(msg)

    async def declare_dead(self, rank: int, reason: str) -> None:
        """Report a death the orchestrator observed itself.

        Raises:
            ConfigError: ``rank`` is not a rank of this world.
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ConfigError(
                f"declare_dead: expected a rank in [0, {self.world_size}), got {rank!r}"
            )
        if self._liveness.mark_dead(rank, f"declared by the orchestrator: {reason}"):
            # Return once the survivors were told, so what the caller sends next follows the
            # DeclareDead on every link.
            await self._liveness.wait_told()
        else:
            await trio.lowlevel.checkpoint()

    async def retire(self, ranks: Iterable[int] | int, *,
                     reason: str = "retired by the orchestrator") -> None:
        """Take dead (or cleanly exited) ranks out of an elastic world for good (issue 37,
        docs/elastic.rst): they stop counting in the world and against ``max_failure``, and
        nobody waits for them; their ids may join again later. All of them or none.

        Raises:
            ConfigError: not rank ids of this world.
            MembershipError: one is alive (drain its host instead), not in the world or
                retired already, or the world would drop below its minimum.
        """
        self._retirement.retire(self._retirement.checked(ranks), reason)
        await trio.lowlevel.checkpoint()

    def retired_reason(self, rank: int) -> str | None:
        """Why ``rank`` was retired from the world, or None when it is not retired."""
        return self._roster.retired_reason(rank)

    async def shutdown_with_save(self, reason: SaveReason) -> None:
        """Tell every live rank to save and stop (``ShutdownWithSave``); sent once per run."""
        await self._liveness.stop_with_save(SaveReason(reason))

    # ------------------------------------------------------------------ shutdown

    async def shutdown(self, reason: str) -> None:
        """Graceful, bounded, idempotent shutdown (SPEC §4.6); ``open_coordinator`` runs it
        shielded when its block ends."""
        if self._shutdown_begun:
            await self._shutdown_done.wait()
            return
        self._shutdown_begun = True
        self._sender.forget_resumes()
        try:
            await self._shutdown_steps(reason)
        finally:
            # Whatever happened above, the shielded writers must not outlive the coordinator.
            self._sender.stop_writers()

    async def _shutdown_steps(self, reason: str) -> None:
        self._roster.begin_shutdown()
        self.timeline.event(ShutdownStarted(reason=reason))
        relays = self._roster.relays
        for conn in relays:
            conn.stop_delivery()
        log.info("shutting down: %s", reason)
        tail = self._roster.invalid_frames_tail(trio.current_time())
        if tail is not None:
            log.warning("frames dropped: %s", tail.text())
        if self._leader.deposed is None:  # stepped down: not one more record to any relay (§4.7)
            await self._say_goodbye(relays, reason)
        for conn in relays:
            await conn.close()
        if self._leader.deposed is None:  # the cohort was told: the session is over
            await self._leader.finish(reason)
        self._timing_send.close()
        self._metrics_send.close()
        self._liveness.close()
        self._roster.close()
        self.timeline.event(ShutdownComplete())
        self._leader.close()  # its leadership may end now: nothing is left to step down
        self._shutdown_done.set()

    async def _say_goodbye(self, relays: tuple[RelayConn, ...], reason: str) -> None:
        """``Shutdown`` to the live ranks, then ``Goodbye`` and a half-close to every relay,
        bounded by ``shutdown_grace``."""
        with trio.move_on_after(self.config.shutdown_grace):
            if not self._liveness.save_latched and self.live_ranks:
                try:
                    await self.broadcast_control(Shutdown())
                except BroadcastError:
                    pass
            # Half-close first: the relays read everything we wrote, then see EOF and close;
            # our readers drain until then, so nothing in flight turns into a reset.
            alive = [conn for conn in relays if conn.alive]
            eofs = Delivery(len(alive))
            for conn in alive:
                conn.submit_eof(eofs, goodbye=reason)  # after everything already queued for it
            await eofs.done.wait()
            await self._readers.wait_idle()

