"""The Sync scheduler's checkpoints and its resumption from one (issue 22).

**Checkpoints.** The scheduler saves its position through ``Coordinator.save_checkpoint``: when
a sync completed (every live rank acknowledged it), paced (``durable=False``: written with the
coordinator's next paced write, issue 34), since what a live rank synced since is asked again by
the anchoring sync below; and durably (before the call returns, with a session store) when it
settles a rank that left (ahead of the ``ExtendPartition`` messages that hand its unsynced
remainder over), ahead of an epoch's ``StartEpoch`` messages (which also holds the epoch that just
closed), and after the anchoring sync. Writing ahead of the sends means a resumed scheduler may
repeat a command the ranks already have, never miss one; ranks ignore a repeated ``StartEpoch``
(the plan they are working on) or ``ExtendPartition`` (one they already received in the epoch).

**Resuming.** A :class:`SyncScheduler` built on a coordinator whose ``checkpoint`` is set (one
that adopted a running session, or one whose previous scheduler was cancelled) takes the run
over from it. Epochs closed before it are not run again. The current epoch goes on:

1. A rank of the checkpoint that is no longer live is credited only with what the checkpoint
   says it synced; the rest of its share goes to the survivors, like any death.
2. One ``SyncNow`` goes to every live rank (the *anchoring* sync). Each rank's ``SyncAck`` step
   count, minus its step count when the epoch began, is how many batches of its share it has
   done: all of them are synced by that very sync, so what the ranks did after the checkpoint
   (while no scheduler was reading) is kept, not lost. ``Batch`` frames read before that
   ``SyncAck`` are in its count and are not counted again. A count below what the checkpoint
   credits, or beyond the share, is not the process that held the share (it restarted): the
   rank is settled as gone and gets work from the next epoch.
3. The global step moves on by the fewest batches a rank did since the checkpoint
   (``SetGlobalStep``), then each rank is sent its share again, plan then extensions in order,
   so that one whose commands died with the previous scheduler gets them. The epoch then runs as
   usual.

Only a rank that dies in the same window, after acknowledging a sync that the checkpoint does not
hold (with a paced store, up to ``1 / store_write_rate`` seconds of syncs), is credited less than
it synced (as is one whose ``SyncAck`` died with its relay): that part is processed again (at
least once).
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._errors import ClusterFailure
from ..events import Note
from ..wire import (
    ControlMsg,
    EpochPlan,
    ExtendPartition,
    SetEpochCallbackRole,
    SetGlobalStep,
    StartEpoch,
    SyncNow,
)
from ._checkpoint import Resumption, checkpoint_map
from ._epoch_ledger import EpochLedger
from ._parts import Members
from ._reformation import ProcessGroupKeeper

if TYPE_CHECKING:
    from ..coordinator import Coordinator

log = logging.getLogger("flodl_trio.scheduler")


class Resuming(abc.ABC):
    """The checkpoint and resume part of :class:`SyncScheduler` (which provides the rest)."""

    _coord: Coordinator
    _ledger: EpochLedger
    _members: Members
    _group: ProcessGroupKeeper | None
    _settings: dict[str, Any]
    _num_epochs: int
    _global_step: int
    _syncs: int
    _steps: dict[int, int]
    _awaiting_batch: set[int]
    _awaiting_ack: set[int]
    _role: int | None
    _deferred_epoch: int | None
    _finishing: bool
    _final_sync_done: bool
    _anchor_due: bool  # resuming: the anchoring SyncNow goes out once it may
    _anchoring: dict[int, int] | None  # rank -> batches credited at the resume, until anchored
    _resume: Resumption | None

    @abc.abstractmethod
    def _survivors(self) -> list[int]:
        """The ranks that take part in the current epoch, ascending."""

    @abc.abstractmethod
    def _no_rank_left(self) -> ClusterFailure:
        """The failure to raise when no live rank is left."""

    @abc.abstractmethod
    async def _send(self, rank: int, msg: ControlMsg) -> None:
        """Send one control message (a failure is logged: the rank is dead)."""

    @abc.abstractmethod
    async def _broadcast(self, msg: ControlMsg) -> None:
        """Broadcast one control message (failures are logged)."""

    @abc.abstractmethod
    async def _dispatch(self, epoch: int) -> None:
        """Plan ``epoch`` over the live ranks and send the plans."""

    @abc.abstractmethod
    async def _fold_gone(self, new: Sequence[int]) -> None:
        """Settle ranks that left and hand their remainders over."""

    async def _save(self, *, between: int | None = None, durable: bool = True) -> None:
        """Checkpoint through the coordinator: the current epoch's shares, or (``between``) the
        epoch about to be dispatched (``num_epochs`` once the last one closed); ``durable``:
        written before this returns, else with the coordinator's next paced write."""
        ledger = self._ledger
        await self._coord.save_checkpoint(checkpoint_map(
            **self._settings, epoch=ledger.epoch if between is None else between,
            epochs_completed=ledger.epochs_completed, global_step=self._global_step,
            syncs=self._syncs, shares={} if between is not None else ledger.shares,
            last_steps=ledger.last_steps, losses=self._epoch_losses()), durable=durable)

    def _epoch_losses(self) -> tuple[float | None, ...]:
        """Every closed epoch's ``avg_loss`` (see ``RunSummary.epoch_losses``): the
        checkpoint's for the epochs before this scheduler, then its own."""
        before: tuple[float | None, ...] = ()
        if self._resume is not None:
            closed = self._resume.epochs_completed
            known = self._resume.losses[:closed]
            before = known + (None,) * (closed - len(known))
        # A rank that reported has an entry; an epoch with none has no loss (not 0.0).
        return before + tuple(m.avg_loss if any(m.per_rank) else None
                              for m in self._ledger.aggregated)

    @property
    def _resuming(self) -> bool:
        """Resuming and not yet anchored: no extension goes out before the anchoring sync."""
        return self._anchor_due or self._anchoring is not None

    async def _begin_resume(self, res: Resumption) -> None:
        """Take the run over from the checkpoint: settle the ranks that left since; the
        anchoring sync goes out from ``_act``."""
        coord = self._coord
        self._global_step, self._syncs = res.global_step, res.syncs
        self._members.baseline(coord.rejoins)
        self._ledger.restore(res.epoch, res.shares, res.epochs_completed, res.last_steps)
        log.info("resuming from the checkpoint: epoch %d of %d, %d closed, global step %d",
                 res.epoch, self._num_epochs, res.epochs_completed, res.global_step)
        coord.timeline.event(Note(what="scheduler_resumed", fields={
            "epoch": res.epoch, "epochs_completed": res.epochs_completed,
            "global_step": res.global_step}))
        held = {r for r, share in res.shares.items() if share.done is None}
        for rank in (coord.dead_ranks | coord.exited_ranks) - held:
            self._members.leave(rank)  # gone before the checkpoint: nothing to settle
        if res.epoch >= self._num_epochs:  # the run had ended: only Shutdown is left
            self._finishing = self._final_sync_done = True
            self._ledger.finish()
            return
        if not res.shares:  # between two epochs: the next one was not dispatched
            if self._group is not None:
                self._deferred_epoch = res.epoch
                await self._group.begin(self._survivors(), "resuming the run")
            else:
                await self._dispatch(res.epoch)
            return
        self._members.joining.update(coord.live_ranks - held)
        self._anchor_due = True
        gone = sorted(held - coord.live_ranks)
        if gone:
            await self._fold_gone(gone)
        survivors = self._survivors()
        if not survivors:
            raise self._no_rank_left()
        self._role = survivors[0]
        await self._broadcast(SetEpochCallbackRole(rank=self._role))
        if self._group is not None and not self._group.waiting:
            await self._group.begin(survivors, "resuming the run")

    async def _send_anchor(self) -> None:
        """The anchoring sync: each rank's ``SyncAck`` says how far it got in its share."""
        self._anchor_due = False
        shares = self._ledger.shares
        live = [r for r in self._survivors() if r in shares]
        self._anchoring = {r: shares[r].synced for r in live}
        self._syncs += 1
        self._coord.timeline.event(Note(what="sync", fields={"global_step": self._global_step}))
        await self._broadcast(SyncNow())
        self._awaiting_ack = set(live)

    async def _finish_anchor(self) -> None:
        """Every share is anchored: move the global step on, checkpoint, and send each rank its
        share again (a rank ignores what it already has)."""
        credited, self._anchoring = self._anchoring or {}, None
        survivors = self._survivors()
        shares = self._ledger.shares
        self._global_step += min((shares[r].batches - credited[r] for r in survivors
                                  if r in credited), default=0)
        await self._broadcast(SetGlobalStep(global_step=self._global_step))
        self._steps = dict.fromkeys(survivors, 0)
        self._awaiting_batch = set(survivors)
        await self._save()
        for rank in survivors:
            if rank not in shares:
                continue
            (offset, size), *extensions = shares[rank].ranges
            await self._send(rank, StartEpoch(plan=EpochPlan(
                epoch=self._ledger.epoch, partition_offset=offset, partition_size=size)))
            for offset, size in extensions:
                await self._send(rank, ExtendPartition(partition_offset=offset,
                                                       partition_size=size))
