"""The :class:`SyncScheduler` (the reference Sync-policy scheduler, SPEC §11). How it decides
is told in one place, the docstring of :mod:`flodl_trio.scheduler`; its checkpoints and its
resumption are in :mod:`flodl_trio.scheduler._resume`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import trio

from .. import _timeouts as T
from .._callbacks import Callbacks
from .._errors import BroadcastError, ClusterFailure, ConfigError, FlodlError, SendError
from ..events import Note
from ..wire import (
    Batch,
    CheckpointResult,
    ControlMsg,
    EpochAggregated,
    EvalResult,
    ExtendPartition,
    NewNcclIdGenerated,
    SaveReason,
    SetEpochCallbackRole,
    SetGlobalStep,
    Shutdown,
    StartEpoch,
    SyncAck,
    SyncNow,
    TimingMsg,
)
from ._checkpoint import Resumption, read_checkpoint
from ._epoch_ledger import EpochLedger
from ._epoch_math import (
    EpochCoverage,
    Range,
    check_cadence,
    check_count,
    check_ratios,
)
from ._parts import Inbox, InboxClosed, Members, RunSummary
from ._reformation import ProcessGroupKeeper
from ._resume import Resuming

if TYPE_CHECKING:
    from ..coordinator import Coordinator

log = logging.getLogger("flodl_trio.scheduler")

# Deaths also surface on the timeline (which wakes the loop at once); the poll only backs that up.
_POLL_INTERVAL = 0.25

# ---------------------------------------------------------------------------- the scheduler


class SyncScheduler(Resuming):
    """Drive ``num_epochs`` epochs of ``total_samples`` samples with the Sync policy.

    Args:
        coord: a formed coordinator (the body of ``open_coordinator``).
        total_samples: dataset size (> 0).
        batch_size: samples per batch on every rank (> 0).
        num_epochs: epochs to run (> 0).
        partition_ratios: one non-negative weight per world rank (sum > 0); ``None`` is equal.
        checkpoint_every: send ``Checkpoint{version=n}`` to the role rank after every n-th epoch;
            an error result moves the role to the next live rank and retries there.
        eval_every: send ``ExecuteEvalCallback{schedule_id=n, epoch=n}`` likewise (errors logged).
        process_group: (re-)form the ranks' collective process group before the first epoch and
            after every death (off: the ranks have no collective, as in the simulated demo).
        reform_timeout: seconds one re-formation may take, from ``RequestNewNcclId`` to the
            sessions (default 60, scaled by ``FLODL_NET_TIMEOUT_SCALE``); past it, or when no
            live rank is left to ask, :meth:`run` raises :class:`ReformationError`.

    Built on a coordinator whose ``checkpoint`` is set (one that adopted a running session, or
    whose previous scheduler was cancelled), it resumes that run from the checkpoint.

    Raises:
        ConfigError: an invalid argument, or a checkpoint of a run with other settings.
        StoreCorrupt: the coordinator's checkpoint is not a Sync scheduler checkpoint.
    """

    def __init__(self, coord: Coordinator, *, total_samples: int, batch_size: int,
                 num_epochs: int, partition_ratios: Sequence[float] | None = None,
                 checkpoint_every: int | None = None, eval_every: int | None = None,
                 process_group: bool = False, reform_timeout: float | None = None) -> None:
        self._coord = coord
        timeout = T.scaled(T.FORMATION_TIMEOUT) if reform_timeout is None else reform_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ConfigError(f"SyncScheduler: expected reform_timeout > 0 seconds, got "
                              f"{reform_timeout!r}")
        self._group = (ProcessGroupKeeper(coord.timeline, self._send, float(timeout))
                       if process_group else None)
        total = check_count("total_samples", total_samples)
        batch = check_count("batch_size", batch_size)
        self._num_epochs = check_count("num_epochs", num_epochs)
        ratios = check_ratios(partition_ratios, coord.world_size)
        self._settings = {"total_samples": total, "batch_size": batch,
                          "num_epochs": self._num_epochs}
        saved = coord.checkpoint
        self._resume: Resumption | None = (
            None if saved is None else read_checkpoint(saved, **self._settings))
        self._awaiting_batch: set[int] = set()
        self._awaiting_ack: set[int] = set()
        self._steps: dict[int, int] = {}  # batches since the last sync, per rank
        self._members = Members()
        self._deferred_epoch: int | None = None  # dispatched once the process group formed
        self._role: int | None = None
        self._callbacks = Callbacks(
            checkpoint_every=check_cadence("checkpoint_every", checkpoint_every),
            eval_every=check_cadence("eval_every", eval_every), send=self._send,
            move_role=self._move_role)
        # Built after every check, so that an invalid argument is a ConfigError first.
        self._ledger = EpochLedger(coord.timeline, total_samples=total, batch_size=batch,
                                   world_size=coord.world_size, ratios=ratios)
        self._inbox = Inbox(coord.timing, coord.metrics, _POLL_INTERVAL)
        self._global_step = 0
        self._syncs = 0
        self._sync_open = False  # a SyncNow went out and not every ack is in
        self._finishing = False
        self._final_sync_done = False
        self._done = False
        self._ran = False
        self._first_epoch = 0 if self._resume is None else self._resume.epoch
        self._anchor_due = False
        self._anchoring = None
        self._restarted: set[int] = set()  # anchored by a SyncAck that cannot be theirs

    async def run(self) -> RunSummary:
        """Run every epoch, then broadcast ``Shutdown``.

        Returns:
            the :class:`RunSummary`.

        Raises:
            ClusterFailure: no live rank is left before the run finished.
            ReformationError: the process group could not be re-formed (``process_group``).
            FlodlError: the coordinator closed its channels (it is shutting down).
            ConfigError: ``run`` was called twice.
        """
        if self._ran:
            raise ConfigError("SyncScheduler.run: a scheduler runs once; create another one")
        self._ran = True
        coord = self._coord
        started = trio.current_time()
        async with coord.timeline.subscribe() as events:
            if self._resume is not None:
                await self._begin_resume(self._resume)
            elif self._group is not None:
                self._deferred_epoch = 0
                await self._group.begin(self._survivors(), "the first session")
            else:
                await self._dispatch(0)
            while not self._done:
                self._drain()
                await self._reconcile()
                await self._act()
                if not self._done:
                    try:
                        await self._inbox.wait_any(events.channel)
                    except InboxClosed:
                        raise self._closed() from None
        return RunSummary(
            epochs_completed=self._ledger.epochs_completed, syncs=self._syncs,
            global_step=self._global_step, epoch_metrics=self._ledger.aggregated,
            deaths={r: coord.dead_reason(r) or "" for r in sorted(coord.dead_ranks)},
            elapsed_s=trio.current_time() - started, first_epoch=self._first_epoch,
            resumed=self._resume is not None, epoch_losses=self._epoch_losses(),
        )

    @property
    def coverage(self) -> tuple[EpochCoverage, ...]:
        """The scheduler's accounting of each epoch it aggregated (:class:`EpochCoverage`):
        which samples it counts as synced and by whom (a rank that left: the batches it
        reported before its last ``SyncAck``).
        """
        return self._ledger.coverage

    # ------------------------------------------------------------------ reading

    def _closed(self) -> FlodlError:
        return FlodlError(f"SyncScheduler: the coordinator closed its timing/metrics channels "
                          f"(it is shutting down) during epoch {self._ledger.epoch}")

    def _drain(self) -> None:
        try:
            self._inbox.drain(self._on_timing, self._ledger.on_metrics)
        except InboxClosed:
            raise self._closed() from None

    def _on_timing(self, msg: TimingMsg) -> None:
        rank = int(msg.rank)
        if self._members.ignores(rank):  # no share in this epoch
            return
        if isinstance(msg, Batch):
            if not self._ledger.on_batch(rank, int(msg.step_count)):
                return  # before its anchoring SyncAck after a resume, which counts it
            self._steps[rank] = self._steps.get(rank, 0) + 1
            self._awaiting_batch.discard(rank)
        elif isinstance(msg, SyncAck):
            if not self._ledger.on_sync_ack(rank, int(msg.step_count)):
                self._restarted.add(rank)
            self._awaiting_ack.discard(rank)
        elif isinstance(msg, NewNcclIdGenerated) and self._group is not None:
            self._group.on_uid(rank, msg.uid)
        elif isinstance(msg, CheckpointResult | EvalResult):
            self._callbacks.on_result(rank, msg)

    # ------------------------------------------------------------------ sending

    async def _send(self, rank: int, msg: ControlMsg) -> None:
        try:
            await self._coord.send_control(rank, msg)
        except SendError as exc:
            # The failed write declared the rank dead (or it already was); _reconcile handles it.
            log.warning("%s", exc)

    async def _broadcast(self, msg: ControlMsg) -> None:
        try:
            await self._coord.broadcast_control(msg)
        except BroadcastError as exc:
            log.warning("%s", exc)

    # ------------------------------------------------------------------ deciding

    def _survivors(self) -> list[int]:
        return self._members.survivors(self._coord.live_ranks)

    async def _fold_joiners(self) -> list[int]:
        """At an epoch boundary: ranks that came back take part from now on; each learns the
        role and the global step first (a restarted rank knows neither)."""
        joiners = self._members.take_joiners(self._coord.live_ranks)
        if self._role is None:  # the first dispatch tells everyone
            return joiners
        for rank in joiners:
            self._awaiting_batch.add(rank)
            self._steps[rank] = 0
            await self._send(rank, SetEpochCallbackRole(rank=self._role))
            await self._send(rank, SetGlobalStep(global_step=self._global_step))
        return joiners

    def _no_rank_left(self) -> ClusterFailure:
        coord = self._coord
        why = {rank: reason for rank in coord.dead_ranks
               if (reason := coord.dead_reason(rank)) is not None}
        return ClusterFailure(SaveReason.ALL_RANKS_LOST, coord.dead_ranks,
                              f"scheduler: no live rank left in epoch {self._ledger.epoch} of "
                              f"{self._num_epochs}", why=why)

    async def _dispatch(self, epoch: int) -> None:
        await self._fold_joiners()
        live = self._survivors()
        if not live:
            raise self._no_rank_left()
        plans = self._ledger.plan(epoch, live)
        if self._role is None:  # first dispatch: every rank learns the role before StartEpoch
            self._role = live[0]
            self._awaiting_batch = set(live)
            self._steps = dict.fromkeys(live, 0)
            await self._broadcast(SetEpochCallbackRole(rank=self._role))
        self._ledger.begin(epoch, plans)
        await self._save()  # ahead of the StartEpochs: a resumed scheduler repeats them
        self._coord.timeline.event(Note(what="epoch_started",
                                        fields={"epoch": epoch, "ranks": sorted(plans)}))
        for rank in sorted(plans):
            await self._send(rank, StartEpoch(plan=plans[rank]))

    async def _reconcile(self) -> None:
        """Fold newly dead or exited ranks: redistribute their remainders, move the role."""
        coord = self._coord
        # A rank that died and came back between two looks is a death all the same: what it
        # owed of this epoch died with its old process.
        new = self._members.newly_gone(coord.dead_ranks, coord.exited_ranks, coord.rejoins)
        if self._restarted:  # a resumed share's rank is a new process: the old one is gone
            new = sorted(set(new) | (self._restarted - self._members.gone))
            self._restarted.clear()
        if new:
            await self._fold_gone(new)
        back = self._members.returned(coord.live_ranks)
        if back:
            log.info("rank(s) %s rejoined; they get work from the next epoch", back)
            coord.timeline.event(Note(what="ranks_rejoined", fields={
                "ranks": back, "from_epoch": self._ledger.epoch + 1}))

    async def _fold_gone(self, new: Sequence[int]) -> None:
        coord = self._coord
        self._drain()  # count every batch the coordinator read from them before the death
        remainders: list[tuple[int, list[Range]]] = []
        members = [r for r in new if r not in self._members.joining]  # of the current group
        shares = self._ledger.shares
        settled = any(r in shares and shares[r].done is None for r in new)
        for rank in new:
            rest = self._ledger.settle(rank)
            if rest:
                remainders.append((rank, rest))
            self._members.leave(rank)
            for waiting in (self._awaiting_batch, self._awaiting_ack):
                waiting.discard(rank)
            if self._anchoring is not None:
                self._anchoring.pop(rank, None)
        survivors = self._survivors()
        if not survivors:
            if self._finishing and not remainders:
                self._done = True  # every epoch is aggregated; nobody is left to shut down
                return
            raise self._no_rank_left()
        handed: list[dict[int, list[Range]]] = []
        for dead, rest in remainders:
            log.info("rank %d left %d unsynced samples of epoch %d; extending ranks %s", dead,
                     sum(s for _, s in rest), self._ledger.epoch, survivors)
            given = self._ledger.hand_over(rest, survivors)
            handed.append(given)
            self._coord.timeline.event(Note(what="redistributed", fields={
                "epoch": self._ledger.epoch, "from_rank": dead,
                "to": {str(r): [list(rng) for rng in p] for r, p in given.items()}}))
        if settled and not self._resuming:
            # Durable: what a dead rank is credited with cannot be re-derived from it, and a
            # resumed scheduler repeats the extensions that follow, never new ones.
            await self._save()
            for given in handed:
                for rank, part in given.items():
                    for offset, size in part:
                        await self._send(rank, ExtendPartition(partition_offset=offset,
                                                               partition_size=size))
        if self._group is not None and not self._finishing and members:
            await self._group.after_gone(
                [(r, coord.dead_reason(r) or ("exited cleanly" if r in coord.exited_ranks
                                              else "died and came back"))
                 for r in members], survivors)
        if self._role in self._members.gone:
            await self._move_role(survivors[0])
        await self._callbacks.retarget(self._members.gone, self._role)

    @property
    def _regroup(self) -> bool:
        """Ranks came back: the group is re-formed with them before the next epoch."""
        return self._group is not None and bool(self._members.joining & self._coord.live_ranks)

    @property
    def _group_waiting(self) -> bool:
        return self._group is not None and self._group.waiting

    async def _move_role(self, rank: int) -> None:
        log.info("epoch callback role moves from rank %s to rank %d", self._role, rank)
        self._role = rank
        await self._broadcast(SetEpochCallbackRole(rank=rank))

    async def _sync(self, participants: Sequence[int]) -> None:
        self._syncs += 1
        self._sync_open = True
        self._global_step += min(self._steps.get(r, 0) for r in participants)
        self._coord.timeline.event(Note(what="sync", fields={"global_step": self._global_step}))
        await self._broadcast(SyncNow())
        await self._broadcast(SetGlobalStep(global_step=self._global_step))
        live = self._survivors()
        self._steps = dict.fromkeys(live, 0)
        self._awaiting_batch = set(live)
        self._awaiting_ack = set(live)

    async def _act(self) -> None:
        if self._group is not None and self._group.waiting:
            if await self._group.advance(self._survivors()):
                return  # no collective (SyncNow) and no new epoch before the group exists
        if self._anchor_due and not self._group_waiting:
            await self._send_anchor()
            return
        if self._anchoring is not None:
            if not self._awaiting_ack:
                await self._finish_anchor()
            return
        if self._sync_open and not self._awaiting_ack:
            self._sync_open = False
            # A sync completed. Paced, not durable: a resumed scheduler re-derives what the
            # live ranks synced since from their anchoring SyncAck (docs/failover.rst).
            await self._save(durable=False)
        if self._deferred_epoch is not None and not self._group_waiting:
            epoch, self._deferred_epoch = self._deferred_epoch, None
            await self._dispatch(epoch)
            return
        if self._callbacks.failed:
            await self._callbacks.fail_over(self._survivors(), self._role)
        if not self._finishing:
            if not self._awaiting_batch and not self._awaiting_ack:
                live = self._survivors()
                if live:
                    await self._sync(live)
            if self._ledger.complete and not self._awaiting_ack:
                if self._ledger.unsynced:
                    # The epoch ends with a sync: no batch of it may die unsynced after it closed.
                    stepped = [r for r in self._survivors() if self._steps.get(r, 0) > 0]
                    await self._sync(stepped or self._survivors())
                else:
                    await self._aggregate()
            return
        if self._awaiting_ack or self._done:
            return
        if not self._final_sync_done:
            self._final_sync_done = True
            stepped = [r for r in self._survivors() if self._steps.get(r, 0) > 0]
            if len(self._survivors()) >= 2 and stepped:
                await self._sync(stepped)
                return
        if not self._callbacks.pending:
            await self._broadcast(Shutdown())
            self._done = True

    async def _aggregate(self) -> None:
        metrics = self._ledger.close()
        epoch = self._ledger.epoch
        log.info("epoch %d aggregated: avg_loss %.4f", epoch, metrics.avg_loss)
        self._coord.timeline.event(Note(what="epoch_aggregated", fields={
            "epoch": epoch, "avg_loss": metrics.avg_loss}))
        # Its accounting, beside it: it outlives this scheduler in the timeline (a failover's
        # epochs are summed from it) and the status page shows it.
        cov = self._ledger.coverage[-1]
        self._coord.timeline.event(Note(what="epoch_covered", fields={
            "epoch": epoch, "exactly_once": cov.exactly_once, "samples": cov.samples,
            "total": cov.total, "gaps": cov.gaps, "overlaps": cov.overlaps}))
        await self._broadcast(EpochAggregated(metrics=metrics))
        completed = epoch + 1
        # The close is durable by itself only when something goes out before the next
        # epoch's checkpoint (callbacks), or no such checkpoint follows at once; otherwise
        # that one, durable ahead of the StartEpochs, holds it: one write per boundary.
        at_once = (completed < self._num_epochs and not self._regroup
                   and not self._callbacks.due(completed, self._role))
        await self._save(between=completed, durable=not at_once)
        await self._callbacks.after_epoch(completed, self._role)
        if completed < self._num_epochs:
            if self._group is not None and self._regroup:
                if at_once:  # a rank came back meanwhile: the next epoch waits for the group
                    await self._save(between=completed)
                # The group is re-formed with the ranks that came back before they get work.
                joiners = await self._fold_joiners()
                self._deferred_epoch = completed
                await self._group.begin(self._survivors(), f"rank(s) {joiners} rejoined")
                return
            await self._dispatch(completed)
        else:
            self._finishing = True
            self._ledger.finish()
