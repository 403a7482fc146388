"""The Sync scheduler's phases: one value, a table of the moves between them, and one place that
makes a move (:meth:`PhaseMachine.fire`). The scheduler decides *when* something happens (an
epoch's plans went out, every ``SyncAck`` is in); this module says what phase that leads to, and
refuses a move the table does not hold, so the order of a run can be read here in one screen::

    BUILT --run--> STARTING
    STARTING --dispatch--> EPOCH             a fresh run, or a checkpoint between two epochs
    STARTING --form_group--> FORMING         the same with a process group to form first
    STARTING --resume_in_epoch--> ANCHOR_DUE a checkpoint inside an epoch
    STARTING --resume_finished--> CLOSING    a checkpoint of a run whose epochs all closed
    FORMING --dispatch--> EPOCH              the group formed: the deferred epoch goes out
    ANCHOR_DUE --anchor_sent--> ANCHORING    the anchoring SyncNow went out
    ANCHORING --anchored--> EPOCH            every anchoring SyncAck is in; the shares repeated
    EPOCH --sync_sent--> SYNCING             every live rank stepped (or the epoch ends unsynced)
    SYNCING --acked--> EPOCH                 every live rank acknowledged; checkpoint
    EPOCH --dispatch--> EPOCH                an epoch closed; the next one went out
    EPOCH --form_group--> FORMING            an epoch closed; ranks came back: group first
    EPOCH --last_closed--> FINISHING         the last epoch closed
    FINISHING --sync_sent--> FINAL_SYNC      two or more ranks stepped since the last sync
    FINISHING --no_final_sync--> CLOSING     nothing left to sync
    FINAL_SYNC --acked--> CLOSING            the final sync completed; checkpoint
    CLOSING --shutdown--> DONE               every epoch callback answered; Shutdown went out
    FINISHING | FINAL_SYNC | CLOSING --all_gone--> DONE   nobody is left to shut down

A process-group re-formation after a death is not a phase: it holds every phase (no ``SyncNow``
and no new epoch go out) until the sessions are sent, and the phase then goes on where it was.
"""

from __future__ import annotations

import enum
import logging

from .._errors import FlodlError

log = logging.getLogger("flodl_trio.scheduler")


class Phase(enum.Enum):
    """Where a :class:`~flodl_trio.scheduler.SyncScheduler` is in its run."""

    BUILT = "built"  # run() not called yet
    STARTING = "starting"  # run() called: a fresh start, or reading the checkpoint
    FORMING = "forming"  # the process group forms before an epoch is dispatched
    ANCHOR_DUE = "anchor_due"  # resuming in an epoch: the anchoring SyncNow is still to send
    ANCHORING = "anchoring"  # the anchoring SyncNow is out; waiting for every SyncAck
    EPOCH = "epoch"  # an epoch runs; no sync is open
    SYNCING = "syncing"  # an epoch runs; a SyncNow is out and not every SyncAck is in
    FINISHING = "finishing"  # every epoch closed; the final sync is still to decide
    FINAL_SYNC = "final_sync"  # the final SyncNow is out
    CLOSING = "closing"  # waiting for the epoch callbacks' answers before Shutdown
    DONE = "done"  # Shutdown went out, or nobody was left after the last epoch


class PhaseEvent(enum.Enum):
    """What happened, as far as the phase is concerned."""

    RUN = "run"
    DISPATCH = "dispatch"
    FORM_GROUP = "form_group"
    RESUME_IN_EPOCH = "resume_in_epoch"
    RESUME_FINISHED = "resume_finished"
    ANCHOR_SENT = "anchor_sent"
    ANCHORED = "anchored"
    SYNC_SENT = "sync_sent"
    ACKED = "acked"
    LAST_CLOSED = "last_closed"
    NO_FINAL_SYNC = "no_final_sync"
    SHUTDOWN = "shutdown"
    ALL_GONE = "all_gone"


P, E = Phase, PhaseEvent

TRANSITIONS: dict[tuple[Phase, PhaseEvent], Phase] = {
    (P.BUILT, E.RUN): P.STARTING,
    (P.STARTING, E.DISPATCH): P.EPOCH,
    (P.STARTING, E.FORM_GROUP): P.FORMING,
    (P.STARTING, E.RESUME_IN_EPOCH): P.ANCHOR_DUE,
    (P.STARTING, E.RESUME_FINISHED): P.CLOSING,
    (P.FORMING, E.DISPATCH): P.EPOCH,
    (P.ANCHOR_DUE, E.ANCHOR_SENT): P.ANCHORING,
    (P.ANCHORING, E.ANCHORED): P.EPOCH,
    (P.EPOCH, E.SYNC_SENT): P.SYNCING,
    (P.SYNCING, E.ACKED): P.EPOCH,
    (P.EPOCH, E.DISPATCH): P.EPOCH,
    (P.EPOCH, E.FORM_GROUP): P.FORMING,
    (P.EPOCH, E.LAST_CLOSED): P.FINISHING,
    (P.FINISHING, E.SYNC_SENT): P.FINAL_SYNC,
    (P.FINISHING, E.NO_FINAL_SYNC): P.CLOSING,
    (P.FINAL_SYNC, E.ACKED): P.CLOSING,
    (P.CLOSING, E.SHUTDOWN): P.DONE,
    (P.FINISHING, E.ALL_GONE): P.DONE,
    (P.FINAL_SYNC, E.ALL_GONE): P.DONE,
    (P.CLOSING, E.ALL_GONE): P.DONE,
}
"""(phase, event) -> the next phase; a pair that is not here is a move the scheduler never makes."""

_IN_EPOCH = frozenset({P.EPOCH, P.SYNCING})
_AFTER_LAST_EPOCH = frozenset({P.FINISHING, P.FINAL_SYNC, P.CLOSING, P.DONE})
_RESUMING = frozenset({P.ANCHOR_DUE, P.ANCHORING})
_SYNC_OPEN = frozenset({P.SYNCING, P.FINAL_SYNC})


class PhaseMachine:
    """The scheduler's current phase; :meth:`fire` is the only way it changes.

    Also holds the one datum that belongs to a phase: the epoch that ``FORMING`` dispatches once
    the process group exists.
    """

    def __init__(self) -> None:
        self._now = Phase.BUILT
        self._deferred_epoch: int | None = None

    @property
    def now(self) -> Phase:
        return self._now

    def fire(self, event: PhaseEvent) -> Phase:
        """Make the move ``event`` leads to from the current phase; the new phase.

        Raises:
            FlodlError: the table has no such move (a bug in the scheduler, not in the run).
        """
        new = TRANSITIONS.get((self._now, event))
        if new is None:
            allowed = sorted(e.value for p, e in TRANSITIONS if p is self._now)
            raise FlodlError(f"SyncScheduler: expected one of {allowed} in phase "
                             f"{self._now.value!r}, got {event.value!r}")
        log.debug("scheduler phase %s --%s--> %s", self._now.value, event.value, new.value)
        if new is not Phase.FORMING:
            self._deferred_epoch = None
        self._now = new
        return new

    def form_group_before(self, epoch: int) -> None:
        """Move to ``FORMING``: ``epoch`` is dispatched once the process group exists."""
        self.fire(PhaseEvent.FORM_GROUP)
        self._deferred_epoch = epoch

    @property
    def deferred_epoch(self) -> int:
        """The epoch ``FORMING`` dispatches (only read in that phase)."""
        if self._deferred_epoch is None:
            raise FlodlError(f"SyncScheduler: expected a deferred epoch in phase "
                             f"{Phase.FORMING.value!r}, got none in {self._now.value!r}")
        return self._deferred_epoch

    @property
    def in_epoch(self) -> bool:
        """An epoch runs (a sync open or not)."""
        return self._now in _IN_EPOCH

    @property
    def after_last_epoch(self) -> bool:
        """Every epoch closed: only the final sync, the callbacks and ``Shutdown`` are left."""
        return self._now in _AFTER_LAST_EPOCH

    @property
    def resuming(self) -> bool:
        """Resuming and not yet anchored: no extension goes out before the anchoring sync."""
        return self._now in _RESUMING

    @property
    def sync_open(self) -> bool:
        """A (non-anchoring) ``SyncNow`` went out and not every ack was taken in."""
        return self._now in _SYNC_OPEN

    @property
    def done(self) -> bool:
        return self._now is Phase.DONE
