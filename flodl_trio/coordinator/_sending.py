"""Coordinator → relays: one writer task per relay, ``send_control`` and ``broadcast_control``."""

from __future__ import annotations

from collections.abc import Callable

import trio

from .._coord_types import BroadcastResult
from .._errors import BroadcastError, SendError
from ..events import LostBroadcast
from ..timeline import Timeline
from ..wire import (
    ControlMsg,
    Fenced,
    FenceRank,
    FrameCodec,
    Shutdown,
    control_label,
)
from ._relayconn import Delivery, RelayConn
from ._roster import Roster, ranks_text


class Sender:
    """Encodes control messages once and hands each relay's session and writer the frame.

    The writer tasks live in a shielded nursery (:meth:`host_writers`) so that the graceful
    shutdown can still write ``Shutdown`` and the half-closes after an outside cancellation.
    """

    def __init__(self, roster: Roster[RelayConn], codec: FrameCodec, timeline: Timeline,
                 world_size: int) -> None:
        self._roster = roster
        self._codec = codec
        self._timeline = timeline
        self._world_size = world_size
        self.lost_broadcasts = 0
        self._writers: trio.Nursery | None = None
        self._writers_scope: trio.CancelScope | None = None
        # Unset while relays of an adopted session await their resume (._adopt): a broadcast,
        # or a send to one of their ranks, waits for them rather than failing.
        self.resumes = trio.Event()
        self.resumes.set()
        self._resume_progress = trio.Event()  # one of them resumed or was given up on
        self._leads: Callable[[], bool] = lambda: True

    def guard_with(self, leads: Callable[[], bool]) -> None:
        """Ask ``leads`` before anything is sent: a coordinator whose store's leadership ran out
        while it did not run (a SIGSTOP past its lease) must not hand its ranks one more
        command, nor a heartbeat, before it finds out; ``leads`` steps it down instead."""
        self._leads = leads

    async def _stepped_down(self, what: str) -> SendError:
        """The error of a send refused because the coordinator stepped down (a checkpoint
        first: the user's block is cancelled by the step-down, so it usually sees that)."""
        await trio.lowlevel.checkpoint()
        return SendError(f"{what}: expected to send as the store's leader, but the coordinator "
                         "stepped down (its leadership was lost); nothing was sent")

    async def host_writers(self, task_status: trio.TaskStatus[None]) -> None:
        """Host the relay writer tasks where an outside cancellation cannot reach them;
        :meth:`stop_writers` ends them once shutdown is done."""
        with trio.CancelScope(shield=True) as scope:
            self._writers_scope = scope
            async with trio.open_nursery() as writers:
                self._writers = writers
                task_status.started()
                await trio.sleep_forever()

    def await_resumes(self) -> None:
        """Relays of an adopted session await their resume (._adopt): from now on a broadcast,
        or a send to one of their ranks, waits for them (:meth:`resumes_moved`)."""
        self.resumes = trio.Event()

    def forget_resumes(self) -> None:
        """Nobody waits for a resume any more (shutdown, or the coordinator stepped down)."""
        self.resumes.set()

    def resumes_moved(self, *, all_done: bool) -> None:
        """Relays awaiting their resume resumed or were given up on (``all_done``: none is
        left): wake the sends waiting for them."""
        self._resume_progress.set()
        self._resume_progress = trio.Event()
        if all_done:
            self.resumes.set()

    def start_writer(self, conn: RelayConn) -> None:
        """Open ``conn``'s session, then give it the writers' nursery (``host_writers`` must
        be running): its writer task starts there the first time it is needed."""
        assert self._writers is not None, "host_writers is not running"
        conn.open_session(self._codec)
        conn.start_writer(self._writers)

    def stop_writers(self) -> None:
        if self._writers_scope is not None:
            self._writers_scope.cancel()

    async def send_control(self, rank: int, msg: ControlMsg) -> None:
        """See :meth:`Coordinator.send_control`."""
        label = control_label(msg)
        what = f"send_control({label}) to rank {rank}"
        if not isinstance(msg, ControlMsg):
            raise SendError(f"{what}: expected a ControlMsg (coordinator → rank), got {label}")
        if (isinstance(rank, bool) or not isinstance(rank, int)
                or not 0 <= rank < self._world_size):
            raise SendError(f"{what}: expected a rank in [0, {self._world_size}), got {rank!r}")
        if not self._leads():
            raise await self._stepped_down(what)
        conn = self._roster.relay_of(rank)
        while (conn is not None and conn.awaiting_resume and not self.resumes.is_set()
               and not self._roster.shutting_down):
            await self._resume_progress.wait()  # its relay resumes, or it is given up on
            conn = self._roster.relay_of(rank)
        if conn is None:
            raise SendError(f"{what}: no relay announced rank {rank}")
        dead_reason = self._roster.dead_reason(rank)
        if dead_reason is not None:
            raise SendError(f"{what}: rank {rank} was declared dead ({dead_reason})")
        if self._roster.has_exited(rank):
            raise SendError(f"{what}: rank {rank} exited cleanly and is never addressed again")
        if not conn.alive:
            raise SendError(f"{what}: {conn.describe()} is gone ({conn.lost_reason})")
        delivery = Delivery(1)
        conn.submit_frame(rank, self._codec.encode(msg), delivery)
        await delivery.done.wait()
        failure = delivery.failures.get(conn)
        if failure is not None:
            # Cancelled meanwhile (the coordinator stepped down over that very loss): the
            # caller is told so, not of a failed send it would report.
            await trio.lowlevel.checkpoint_if_cancelled()
            raise SendError(f"{what}: {conn.describe()}: {failure}")

    def _groups(self) -> tuple[dict[RelayConn, list[int]], dict[int, str]]:
        """Live ranks by relay connection, and the live ranks whose relay is already gone."""
        groups: dict[RelayConn, list[int]] = {}
        failed: dict[int, str] = {}
        for conn in self._roster.relays:
            ranks = self._roster.live_of(conn)
            if not ranks or conn.awaiting_resume:  # told what it missed when it resumes
                continue
            if conn.alive:
                groups[conn] = ranks
            else:
                for rank in ranks:
                    failed[rank] = (f"relay {conn.host!r} is gone "
                                    f"({conn.lost_reason or conn.retired})")
        return groups, failed

    def _outcome(self, msg: ControlMsg, groups: dict[RelayConn, list[int]],
                 failed: dict[int, str], delivery: Delivery) -> BroadcastResult:
        """Who got ``msg``; a lost broadcast is counted and recorded (not ``Shutdown``, and
        not once shutdown has begun)."""
        delivered: set[int] = set()
        for conn, ranks in groups.items():
            failure = delivery.failures.get(conn)
            if failure is None:
                delivered.update(ranks)
            else:
                for r in ranks:
                    failed[r] = f"relay {conn.host!r}: {failure}"
        if failed and not isinstance(msg, Shutdown) and not self._roster.shutting_down:
            self.lost_broadcasts += 1
            self._timeline.event(LostBroadcast(control=control_label(msg),
                                               failures=dict(failed)))
        return BroadcastResult(frozenset(delivered), failed)

    def post(self, msg: ControlMsg, *, only_idle: bool = False) -> None:
        """Queue ``msg`` for every live rank and return at once: periodic and best-effort
        sends never wait on a relay. With ``only_idle``, a relay whose writer still has
        something queued or in flight is skipped (a heartbeat behind a backlog adds nothing).
        Failures are counted as lost broadcasts when the writers report them."""
        if not self._leads():
            return
        groups, failed = self._groups()
        if only_idle:
            groups = {conn: ranks for conn, ranks in groups.items() if conn.idle}
        frame = self._codec.encode(msg)

        def settled(done: Delivery) -> None:
            self._outcome(msg, groups, failed, done)

        delivery = Delivery(len(groups), on_done=settled)
        for conn, ranks in groups.items():
            conn.submit_fanout(ranks, frame, delivery)

    def post_to(self, conn: RelayConn, msg: ControlMsg) -> None:
        """Queue ``msg`` for ``conn``'s live ranks only and return at once (best effort)."""
        ranks = self._roster.live_of(conn)
        if ranks and conn.alive and self._leads():
            conn.submit_fanout(ranks, self._codec.encode(msg), None)

    def fence(self, rank: int, reason: str) -> RelayConn | None:
        """Tell a rank declared dead, through its relay, that it is cut off and why (SPEC §4.5):
        a ``Fenced`` frame to the rank, then ``FenceRank`` to the relay. Returns the relay
        connection, or None when it is gone already (there is no one to tell)."""
        conn = self._roster.relay_of(rank)
        if conn is None or not conn.alive or conn.awaiting_resume or not self._leads():
            return None
        conn.submit_frame(rank, self._codec.encode(Fenced(rank=rank, reason=reason)), None)
        conn.submit_control(FenceRank(rank=rank, reason=reason), None)
        return conn

    async def broadcast_control(self, msg: ControlMsg) -> BroadcastResult:
        """See :meth:`Coordinator.broadcast_control`."""
        label = control_label(msg)
        if not isinstance(msg, ControlMsg):
            raise SendError(f"broadcast of {label}: expected a ControlMsg (coordinator → rank), "
                            f"got {label}")
        if not self.resumes.is_set() and not self._roster.shutting_down:
            # Relays of an adopted session: resumed or given up on. (Only then: a wait is a
            # checkpoint, and a broadcast is queued whole before its first checkpoint.)
            await self.resumes.wait()
        if not self._leads():
            raise await self._stepped_down(f"broadcast of {label}")
        groups, failed = self._groups()
        frame = self._codec.encode(msg)
        # Every relay's writer task gets its record now; they write concurrently.
        delivery = Delivery(len(groups))
        for conn, ranks in groups.items():
            conn.submit_fanout(ranks, frame, delivery)
        await delivery.done.wait()
        result = self._outcome(msg, groups, failed, delivery)
        if result.failed:
            await trio.lowlevel.checkpoint_if_cancelled()  # as in send_control
            raise BroadcastError(
                f"broadcast of {label}: expected delivery to every live rank, "
                f"{len(result.failed)} failed: ranks {ranks_text(sorted(result.failed))} "
                f"({'; '.join(sorted(set(result.failed.values())))})",
                result,
            )
        return result
