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
    AuthError,
    BroadcastError,
    ConfigError,
    FormationAborted,
    FormationError,
    FormationTimeout,
    SendError,
    WireError,
)
from .._transport import close_all, is_local_or_private, peer_of
from ..events import (
    FormationComplete,
    FormationFailed,
    HandshakeRejected,
    InvalidFrame,
    LostBroadcast,
    RankExited,
    RelayJoined,
    ShutdownComplete,
    ShutdownStarted,
)
from ..timeline import Timeline
from ..wire import (
    Exiting,
    FrameCodec,
    HelloAck,
    Metrics,
    MsgKind,
    RankExit,
    Record,
    RecordKind,
    SaveReason,
    SessionSalt,
    Shutdown,
    TimingMsg,
    WireMessage,
    control_label,
    decode_metrics,
    decode_relay,
    decode_timing,
    encode,
    encode_fanout,
    frames_before,
)
from . import liveness
from ._handshake import Rejected, coordinator_handshake, switch_to_connection_keys
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


    # ------------------------------------------------------------------ formation

    async def _accept_loop(self, listener: trio.abc.Listener[Any]) -> None:
        while True:
            try:
                stream = await listener.accept()
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                return
            except OSError as exc:
                # Out of file descriptors and the like: back off instead of spinning.
                log.warning("accept failed: %r; retrying in 0.1 s", exc)
                await trio.sleep(0.1)
                continue
            self._nursery.start_soon(self._serve_connection, stream)

    def _reject(self, peer: str, category: str, detail: str) -> None:
        self._rejects[category] += 1
        log.info("handshake rejected (%s): %s", category, detail)
        self._timeline.event(HandshakeRejected(peer=peer, reason=f"{category}: {detail}"))
        if self._phase != "forming":
            return
        total = sum(self._rejects.values())
        if self.config.strict_formation:
            self._fail_formation(FormationError(self._formation_text(
                f"strict formation: handshake from {peer} rejected ({category}: {detail})")))
        elif total > self.config.max_rejected_handshakes:
            self._fail_formation(FormationError(self._formation_text(
                f"more than max_rejected_handshakes={self.config.max_rejected_handshakes} "
                "rejected handshakes")))

    def _fail_formation(self, exc: FormationError) -> None:
        if self._formation_failure is None and self._phase == "forming":
            self._formation_failure = exc
            self._formation_settled.set()

    def _formation_text(self, headline: str) -> str:
        covered = len(self._conn_of_rank)
        joined = ", ".join(f"{c.host} {ranks_text(c.ranks)}" for c in self._relays) or "none"
        rejects = ", ".join(f"{k} x{n}" for k, n in sorted(self._rejects.items())) or "none"
        return (
            f"{headline}: {covered}/{self.world_size} ranks covered; hosts joined: {joined}; "
            f"rejected connections: {rejects}"
        )

    def _hello_problem(self, host: str, ranks: tuple[int, ...], peer: str) -> str | None:
        who = f"authenticated Hello from relay {host!r} at {peer}"
        if not ranks:
            return f"{who}: expected at least one rank, got an empty rank list"
        if list(ranks) != sorted(ranks):
            return f"{who}: expected ranks in ascending order, got {list(ranks)[:16]}"
        seen: set[int] = set()
        for r in ranks:
            if r in seen:
                return f"{who}: rank {r} is announced twice in one Hello"
            seen.add(r)
            if r >= self.world_size:
                return f"{who}: rank {r} is out of range for world_size {self.world_size}"
            owner = self._conn_of_rank.get(r)
            if owner is not None:
                return (f"{who}: rank {r} was already announced by relay {owner.host!r} at "
                        f"{owner.peer}")
        return None

    def _unregister(self, conn: RelayConn) -> None:
        if conn in self._relays:
            self._relays.remove(conn)
        for r in conn.ranks:
            if self._conn_of_rank.get(r) is conn:
                del self._conn_of_rank[r]
                self._last_seen.pop(r, None)

    async def _serve_connection(self, stream: trio.abc.Stream) -> None:
        peer = peer_of(stream)
        if self._phase != "forming":
            await trio.aclose_forcefully(stream)
            self._reject(peer, "cohort formed", f"{peer}: connection after formation completed")
            return
        try:
            with trio.fail_after(self.config.handshake_timeout):
                auth = await coordinator_handshake(stream, self._salt, peer)
        except trio.TooSlowError:
            await trio.aclose_forcefully(stream)
            self._reject(peer, "timeout", f"{peer}: no authenticated Hello within "
                         f"handshake_timeout={self.config.handshake_timeout:g}s")
            return
        except Rejected as rej:
            await trio.aclose_forcefully(stream)
            self._reject(peer, rej.category, rej.detail)
            return
        except BaseException:
            await close_all([stream])  # cancelled mid-handshake: the stream must not leak
            raise
        hello = auth.hello
        if self._phase != "forming":
            await trio.aclose_forcefully(stream)
            self._reject(peer, "cohort formed", f"relay {hello.host!r} at {peer}: Hello after "
                         "formation completed")
            return
        # A relay that lost its connection mid-handshake re-dials with the same host and ranks;
        # that is a reconnect, not a contradiction.
        ranks = tuple(hello.ranks)
        for old in list(self._relays):
            if old.host == hello.host and old.ranks == ranks:
                log.info("relay %r re-joined from %s; dropping its old connection", hello.host,
                         peer)
                old.lost_reason = "superseded by a new connection"
                self._unregister(old)
                self._nursery.start_soon(old.close)
        problem = self._hello_problem(hello.host, ranks, peer)
        if problem is not None:
            await trio.aclose_forcefully(stream)
            self._fail_formation(FormationError(self._formation_text(problem)))
            return
        self._conn_counter += 1
        conn = RelayConn(
            host=hello.host, ranks=ranks, peer=peer, stream=stream, sealer=auth.sealer,
            opener=auth.opener, write_stall_timeout=self.config.write_stall_timeout,
            index=self._conn_counter,
        )
        self._relays.append(conn)
        self._acks_in_flight.add(conn)
        now = trio.current_time()
        for r in ranks:
            self._conn_of_rank[r] = conn
            self._last_seen[r] = now
        ack = auth.sealer.seal(RecordKind.CONTROL, 0, encode(HelloAck(hello.nonce)))
        try:
            with trio.fail_after(self.config.handshake_timeout):
                await stream.send_all(ack)
        except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._acks_in_flight.discard(conn)
            self._unregister(conn)
            conn.lost_reason = "HelloAck not delivered"
            await conn.close()
            self._reject(peer, "connection error", f"relay {hello.host!r} at {peer}: HelloAck "
                         f"not delivered ({type(exc).__name__})")
            return
        self._acks_in_flight.discard(conn)
        switch_to_connection_keys(auth, self._salt)
        conn.on_lost = self._on_write_failure
        self._writers.start_soon(conn.run_writer)
        self._warn_cleartext(peer)
        log.info("relay %r joined from %s with ranks %s", hello.host, peer, ranks_text(ranks))
        self._timeline.event(RelayJoined(host=hello.host, ranks=ranks, peer=peer))
        if (len(self._conn_of_rank) == self.world_size and not self._acks_in_flight
                and self._phase == "forming"):
            self._complete_formation()
        await self._read_relay(conn)

    def _on_write_failure(self, conn: RelayConn, cause: str) -> None:
        liveness.relay_lost(self, conn, cause)

    def _warn_cleartext(self, peer: str) -> None:
        host = peer.rsplit(":", 1)[0].strip("[]")
        if self._tls or host in self._warned_hosts or is_local_or_private(host):
            return
        if host.startswith("<") or host.startswith("mem:"):
            return
        self._warned_hosts.add(host)
        log.warning("relay at %s joined over cleartext from outside loopback/private ranges: "
                    "frames are authenticated but readable on the network; use TLS "
                    "(ssl_context=)", peer)

    def _complete_formation(self) -> None:
        self._phase = "running"
        now = trio.current_time()
        for r in self._conn_of_rank:
            self._last_seen[r] = now
        elapsed = (now - self._formation_started) * 1000.0
        self._timeline.event(FormationComplete(
            relays=len(self._relays), world_size=self.world_size, elapsed_ms=round(elapsed, 3)))
        log.info("formation complete: %d ranks over %d relays in %.1f ms", self.world_size,
                 len(self._relays), elapsed)
        self._formation_settled.set()
        self._liveness_wake.set()

    # ------------------------------------------------------------------ readers

    async def _read_relay(self, conn: RelayConn) -> None:
        self._readers_active += 1
        self._readers_idle = trio.Event() if self._readers_active == 1 else self._readers_idle
        cause: str | None = None
        try:
            while cause is None:
                data = await conn.stream.receive_some(65536)
                if not data:
                    err = conn.opener.eof_error(f"relay {conn.host!r}")
                    cause = str(err) if err is not None else "connection closed by the relay (EOF)"
                    break
                try:
                    records = conn.opener.feed(data)
                except WireError as exc:
                    # Records authenticated before the bad one are acted on; then it ends.
                    for rec in frames_before(exc):
                        await self._on_record(conn, rec)
                    raise
                for rec in records:
                    await self._on_record(conn, rec)
        except AuthError as exc:
            cause = f"authentication failure: {exc}"
        except WireError as exc:
            cause = f"protocol error: {exc}"
        except trio.BrokenResourceError as exc:
            cause = f"connection reset ({exc.__cause__!r})" if exc.__cause__ else "connection reset"
        except trio.ClosedResourceError:
            cause = "connection closed"
        finally:
            self._readers_active -= 1
            if self._readers_active == 0:
                self._readers_idle.set()
        if cause is not None and conn.lost_reason is None:
            liveness.relay_lost(self, conn, cause)

    async def _on_record(self, conn: RelayConn, rec: Record) -> None:
        if rec.kind == RecordKind.DATA:
            await self._on_frame(conn, rec)
        elif rec.kind == RecordKind.CONTROL:
            self._on_relay_control(conn, rec.payload)
        else:
            log.warning("%s sent a record of kind %d, which only flows coordinator→relay; "
                        "dropped", conn.describe(), rec.kind)

    def _invalid(self, conn: RelayConn, rank: int, reason: str) -> None:
        log.warning("%s, rank %d: %s; frame dropped", conn.describe(), rank, reason)
        self._timeline.event(InvalidFrame(rank=rank, host=conn.host, reason=reason))

    async def _on_frame(self, conn: RelayConn, rec: Record) -> None:
        try:
            frame = self._codec.open(rec.payload)
        except WireError as exc:
            self._invalid(conn, rec.rank, str(exc))
            return
        msg: TimingMsg | Metrics
        try:
            if frame.kind == MsgKind.TIMING:
                msg = decode_timing(frame.payload)
            elif frame.kind == MsgKind.METRICS:
                msg = decode_metrics(frame.payload)
            else:
                if frame.kind not in (MsgKind.RESERVED_4, MsgKind.RESERVED_5):
                    log.info("%s: frame of kind %d is not for this direction; dropped",
                             conn.describe(), frame.kind)
                return
        except WireError as exc:
            self._invalid(conn, rec.rank, str(exc))
            return
        rank = int(msg.rank)
        if rank not in conn.rank_set:
            self._invalid(conn, rank, f"{type(msg).__name__} speaks for rank {rank}, which relay "
                          f"{conn.host!r} does not carry {ranks_text(conn.ranks)}")
            return
        if rank in self._dead:
            log.debug("rank %d was declared dead; its late %s is dropped", rank,
                      type(msg).__name__)
            return
        if isinstance(msg, TimingMsg):
            self._last_seen[rank] = trio.current_time()
            if isinstance(msg, Exiting) and rank not in self._exited:
                self._exited.add(rank)
                self._timeline.event(RankExited(rank=rank))
            await self._deliver(conn, self._timing_send, msg)
        else:
            await self._deliver(conn, self._metrics_send, msg)

    async def _deliver(self, conn: RelayConn, send: trio.MemorySendChannel[Any], msg: Any) -> None:
        if self._shutting_down:
            try:
                send.send_nowait(msg)
            except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
                pass  # nobody is reading any more; never block shutdown on it
            return
        try:
            send.send_nowait(msg)
            return
        except trio.WouldBlock:
            pass
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return
        paused_at = trio.current_time()
        conn.paused_since = paused_at
        try:
            with trio.CancelScope() as conn.delivery_scope:
                await send.send(msg)  # shutdown cancels this wait: nobody will read any more
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return
        finally:
            conn.delivery_scope = None
            paused = trio.current_time() - paused_at
            conn.paused_since = None
            # The coordinator was not reading this relay; that time is not the ranks' silence.
            for r in conn.ranks:
                if r in self._last_seen:
                    self._last_seen[r] += paused
            self._liveness_wake.set()

    def _on_relay_control(self, conn: RelayConn, payload: bytes) -> None:
        try:
            msg = decode_relay(payload)
        except WireError as exc:
            self._invalid(conn, 0, f"relay control record: {exc}")
            return
        if not isinstance(msg, RankExit):
            log.warning("%s sent %s after the handshake; dropped", conn.describe(),
                        type(msg).__name__)
            return
        rank = int(msg.rank)
        if rank not in conn.rank_set:
            self._invalid(conn, rank, f"RankExit for rank {rank}, which relay {conn.host!r} does "
                          "not carry")
            return
        if rank in self._exited:
            log.info("rank %d disconnected after Exiting", rank)
            return
        liveness.mark_dead(self, rank, f"relay {conn.host!r} reported that rank {rank}'s "
                           "connection ended without Exiting")

    # ------------------------------------------------------------------ lifecycle

    async def _form(self, control: list[trio.abc.Listener[Any]], abort: trio.Event | None) -> None:
        nursery = self._nursery
        self._writers = await nursery.start(self._host_writers)
        self._formation_started = trio.current_time()
        for listener in control:
            nursery.start_soon(self._accept_loop, listener)
        nursery.start_soon(liveness.death_worker, self)
        nursery.start_soon(liveness.coord_heartbeats, self)
        nursery.start_soon(liveness.staleness_watch, self)
        if abort is not None:
            nursery.start_soon(self._watch_abort, abort)
        timeout = self.config.formation_timeout
        with trio.move_on_after(timeout):
            await self._formation_settled.wait()
        failure = self._formation_failure
        if failure is None and self._phase == "forming":
            failure = FormationTimeout(self._formation_text(
                f"formation timed out after {timeout:g}s"))
        if failure is not None:
            self._formation_failure = failure
            self._timeline.event(FormationFailed(reason=str(failure),
                                                 covered=len(self._conn_of_rank)))
            log.error("%s", failure)
            raise failure

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

    async def _watch_abort(self, abort: trio.Event) -> None:
        await abort.wait()
        if self._phase == "forming":
            self._fail_formation(FormationAborted(self._formation_text("formation aborted")))

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


