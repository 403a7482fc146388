"""The :class:`SyncScheduler` (the reference Sync-policy scheduler, SPEC §11). How it decides
is told in one place, the docstring of :mod:`flodl_trio.scheduler`; the order of its phases is
the table of :mod:`flodl_trio.scheduler._phase`; its checkpoints and its resumption are in
:mod:`flodl_trio.scheduler._resume`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import trio

from .. import _timeouts as T
from .._callbacks import Callbacks
from .._errors import ConfigError
from ..events import Note
from ..wire import (
    EpochAggregated,
    ExtendPartition,
    SetEpochCallbackRole,
    SetGlobalStep,
    Shutdown,
    StartEpoch,
    SyncNow,
)
from ._checkpoint import Resumption, checkpoint_map, read_checkpoint
from ._epoch_ledger import EpochLedger
from ._epoch_math import EpochCoverage, Range, check_cadence, check_count, check_ratios
from ._lockstep import Lockstep
from ._outbox import Outbox
from ._parts import Members, RunSummary, no_rank_left, why_gone
from ._phase import Phase, PhaseEvent, PhaseMachine
from ._reading import Reader
from ._reformation import ProcessGroupKeeper
from ._resume import anchor_credit, announce, repeat_share, resume_start

if TYPE_CHECKING:
    from ..coordinator import Coordinator

log = logging.getLogger("flodl_trio.scheduler")

# ---------------------------------------------------------------------------- the scheduler


def _comings(coord: Coordinator) -> dict[int, int]:
    """How many times each rank came (back) into the cohort: rejoins after a death and joins
    of an elastic world; a count that moved means a new process holds the rank."""
    rejoins, joins = coord.rejoins, coord.joins
    return {r: rejoins.get(r, 0) + joins.get(r, 0) for r in rejoins.keys() | joins.keys()}


class SyncScheduler:
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
        self._outbox = Outbox(coord)
        self._group = (ProcessGroupKeeper(coord.timeline, self._outbox.send, float(timeout))
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
        self._members = Members()
        self._callbacks = Callbacks(
            checkpoint_every=check_cadence("checkpoint_every", checkpoint_every),
            eval_every=check_cadence("eval_every", eval_every), send=self._outbox.send,
            move_role=self._outbox.move_role)
        # Built after every check, so that an invalid argument is a ConfigError first.
        self._ledger = EpochLedger(coord.timeline, total_samples=total, batch_size=batch,
                                   world_size=coord.world_size, ratios=ratios)
        res = self._resume
        self._lockstep = (Lockstep() if res is None
                          else Lockstep(global_step=res.global_step, syncs=res.syncs))
        self._reader = Reader(coord, ledger=self._ledger, lockstep=self._lockstep,
                              members=self._members, group=self._group,
                              callbacks=self._callbacks)
        self._phase = PhaseMachine()
        # The closed epoch's notes, held until its close is durable (see ``_save``).
        self._unannounced: list[Note] = []

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
        if self._phase.now is not Phase.BUILT:
            raise ConfigError("SyncScheduler.run: a scheduler runs once; create another one")
        self._phase.fire(PhaseEvent.RUN)
        coord = self._coord
        started = trio.current_time()
        # The cohort as it starts; a rank that joins later is new (issue 37).
        self._members.know(coord.covered_ranks | coord.dead_ranks | coord.exited_ranks)
        async with coord.timeline.subscribe() as events:
            if self._resume is None:
                await self._open_epoch(0, "the first session")
            else:
                await self._begin_resume(self._resume)
            while not self._phase.done:
                self._reader.drain()
                await self._reconcile()
                await self._act()
                if not self._phase.done:
                    await self._reader.wait(events.channel)
        return RunSummary(
            epochs_completed=self._ledger.epochs_completed, syncs=self._lockstep.syncs,
            global_step=self._lockstep.global_step, epoch_metrics=self._ledger.aggregated,
            deaths={r: coord.dead_reason(r) or "" for r in sorted(coord.dead_ranks)},
            elapsed_s=trio.current_time() - started,
            first_epoch=0 if self._resume is None else self._resume.epoch,
            resumed=self._resume is not None, epoch_losses=self._epoch_losses(),
        )

    @property
    def coverage(self) -> tuple[EpochCoverage, ...]:
        """The scheduler's accounting of each epoch it aggregated (:class:`EpochCoverage`):
        which samples it counts as synced and by whom (a rank that left: the batches it
        reported before its last ``SyncAck``).
        """
        return self._ledger.coverage

    # ------------------------------------------------------------------ checkpoints

    async def _save(self, *, between: int | None = None, durable: bool = True) -> None:
        """Checkpoint through the coordinator: the current epoch's shares, or (``between``) the
        epoch about to be dispatched (``num_epochs`` once the last one closed); ``durable``:
        written before this returns, else with the coordinator's next paced write."""
        ledger = self._ledger
        if between is None and self._phase.after_last_epoch:
            # A sync after the last epoch (the final one, or one every rank left): the run is
            # between its last epoch and the end, which a resume reads as finished; the
            # current epoch's numbers would name a closed epoch and be refused as corrupt.
            between = self._num_epochs
        await self._coord.save_checkpoint(checkpoint_map(
            **self._settings, epoch=ledger.epoch if between is None else between,
            epochs_completed=ledger.epochs_completed, global_step=self._lockstep.global_step,
            syncs=self._lockstep.syncs, shares={} if between is not None else ledger.shares,
            last_steps=ledger.last_steps, losses=self._epoch_losses()), durable=durable)
        if durable:
            self._announce_closed()

    def _announce_closed(self) -> None:
        """Record the closed epoch's notes (``epoch_aggregated``, ``epoch_covered``) once its
        close is in the store: a line saying an epoch is done (the CLI's progress, the nemesis's
        coverage) then means a coordinator taking over resumes after it, never inside it."""
        for note in self._unannounced:
            self._coord.timeline.event(note)
        self._unannounced.clear()

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

    # ------------------------------------------------------------------ who takes part

    def _survivors(self) -> list[int]:
        return self._members.survivors(self._coord.live_ranks)

    @property
    def _regroup(self) -> bool:
        """Ranks came back: the group is re-formed with them before the next epoch."""
        return self._group is not None and bool(self._members.joining & self._coord.live_ranks)

    async def _fold_joiners(self) -> list[int]:
        """At an epoch boundary: ranks that came back take part from now on; each learns the
        role and the global step first (a restarted rank knows neither)."""
        joiners = self._members.take_joiners(self._coord.live_ranks)
        role = self._outbox.role
        if role is None:  # the first dispatch tells everyone
            return joiners
        for rank in joiners:
            self._lockstep.join(rank)
            await self._outbox.send_each(rank, [
                SetEpochCallbackRole(rank=role),
                SetGlobalStep(global_step=self._lockstep.global_step)])
        return joiners

    async def _reconcile(self) -> None:
        """Fold newly dead or exited ranks: redistribute their remainders, move the role."""
        coord = self._coord
        # A rank that died and came back between two looks is a death all the same: what it
        # owed of this epoch died with its old process (so did a resumed share's restarted one).
        # A retired rank left like a dead one; one that joined again since is a new process.
        new = self._members.newly_gone(coord.dead_ranks | coord.retired_ranks,
                                       coord.exited_ranks, _comings(coord))
        if new:
            await self._fold_gone(new)
        live = coord.live_ranks
        for what, ranks in (("ranks_rejoined", self._members.returned(live)),
                            ("ranks_joined", self._members.arrived(live))):
            if ranks:
                log.info("rank(s) %s %s; they get work from the next epoch", ranks,
                         what.removeprefix("ranks_"))
                coord.timeline.event(Note(what=what, fields={
                    "ranks": ranks, "from_epoch": self._ledger.epoch + 1}))

    async def _fold_gone(self, new: Sequence[int]) -> None:
        """Settle ranks that left; hand their remainders over, re-form the group, move the
        role and the callbacks they held."""
        self._reader.drain()  # count every batch the coordinator read from them before the death
        members = [r for r in new if r not in self._members.joining]  # of the current group
        shares = self._ledger.shares
        settled = any(r in shares and shares[r].done is None for r in new)
        remainders = [(rank, rest) for rank in new if (rest := self._ledger.settle(rank))]
        for rank in new:
            self._members.leave(rank)
            self._lockstep.forget(rank)
        survivors = self._survivors()
        if not survivors and not self._phase.after_last_epoch:
            survivors = await self._enlist_joiners()
        if not survivors:
            if not (self._phase.after_last_epoch and not remainders):
                raise no_rank_left(self._coord, self._ledger.epoch, self._num_epochs)
            # Every epoch is aggregated and nobody is left to shut down. A final sync still
            # open ends with nobody left to ack it, and is saved like a completed one.
            sync_open = self._phase.sync_open
            self._phase.fire(PhaseEvent.ALL_GONE)
            if sync_open:
                await self._save()
            return
        shares = self._ledger.shares
        fresh = [r for r in survivors  # not members of the epoch (yet): back from a death
                 if r not in shares or shares[r].done is not None]
        # A draining host's ranks are leaving: they take nothing over, unless nobody else is left.
        draining = self._coord.draining_ranks
        takers = [r for r in survivors if r not in draining] or survivors
        handed = [self._ledger.redistribute(dead, rest, takers) for dead, rest in remainders]
        if settled and not self._phase.resuming:
            # Durable: what a dead rank is credited with cannot be re-derived from it, and a
            # resumed scheduler repeats the extensions that follow, never new ones.
            await self._save()
            await self._send_handed(handed, fresh)
        if self._group is not None and not self._phase.after_last_epoch and members:
            await self._group.after_gone([(r, why_gone(self._coord, r)) for r in members],
                                         survivors)
        if self._outbox.role in self._members.gone:
            await self._outbox.move_role(survivors[0])
        await self._callbacks.retarget(self._members.gone, self._outbox.role)

    async def _enlist_joiners(self) -> list[int]:
        """Every member of the epoch left while ranks that came back wait for the next epoch
        (those that died and came back since the last look too): they take this one over
        instead (the run would otherwise fail with live ranks). Returns them; they learn the
        role and the global step first. Resuming (before the anchor), what they take over is
        sent with the shares repeated after the anchoring sync, which counts them in with no
        credit (a fresh share is anchored: nothing of it was done before)."""
        self._members.returned(self._coord.live_ranks)
        joiners = await self._fold_joiners()
        if joiners:
            log.info("every rank of epoch %d left; rank(s) %s, back from a death, take its "
                     "remainder over", self._ledger.epoch, joiners)
            self._coord.timeline.event(Note(what="ranks_enlisted", fields={
                "ranks": joiners, "epoch": self._ledger.epoch}))
        return self._survivors()

    async def _send_handed(self, handed: Sequence[dict[int, list[Range]]],
                           fresh: Sequence[int]) -> None:
        """Send each remainder handed over: an extension to a rank already in the epoch, the
        whole share (a plan, then extensions) to one that begins the epoch with it."""
        for given in handed:
            for rank, part in given.items():
                if rank not in fresh:
                    await self._outbox.send_each(rank, [
                        ExtendPartition(partition_offset=o, partition_size=n) for o, n in part])
        for rank in fresh:
            share = self._ledger.shares.get(rank)
            if share is not None and share.done is None:  # not an earlier process's, settled
                await self._outbox.send_each(rank, repeat_share(self._ledger.epoch, share))

    # ------------------------------------------------------------------ the phases' steps

    async def _open_epoch(self, epoch: int, why: str) -> None:
        """``STARTING``: dispatch ``epoch``, or first form the process group (``FORMING``)."""
        if self._group is None:
            await self._dispatch(epoch)
        else:
            self._phase.form_group_before(epoch)
            await self._group.begin(self._survivors(), why)

    async def _act(self) -> None:
        """One step of the phase the scheduler is in, from what it read so far."""
        if self._group is not None and self._group.waiting:
            if await self._group.advance(self._survivors()):
                return  # no collective (SyncNow) and no new epoch before the group exists
        phase = self._phase.now
        if phase is Phase.FORMING:
            await self._dispatch(self._phase.deferred_epoch)
            return
        if phase is Phase.ANCHOR_DUE:
            await self._send_anchor()
            return
        if phase is Phase.ANCHORING:
            if self._lockstep.all_acked:
                await self._finish_anchor()
            return
        if self._phase.sync_open and self._lockstep.all_acked:
            self._phase.fire(PhaseEvent.ACKED)
            # A sync completed. Paced, not durable: a resumed scheduler re-derives what the
            # live ranks synced since from their anchoring SyncAck (docs/failover.rst).
            await self._save(durable=False)
        if self._callbacks.failed:
            await self._callbacks.fail_over(self._survivors(), self._outbox.role)
        if self._phase.in_epoch:
            await self._epoch_step()
        elif not self._phase.done:
            await self._after_last_epoch_step()

    async def _epoch_step(self) -> None:
        """``EPOCH`` / ``SYNCING``: sync once every live rank stepped; close the epoch once every
        ``Metrics`` is in, after one more sync if some batch of it is unsynced."""
        lockstep = self._lockstep
        if self._phase.now is Phase.EPOCH and lockstep.all_acked and self._leaving_unsynced():
            # A draining host's ranks wait for a sync to leave (issue 37): one now, over every
            # rank that stepped, or they (and whoever waits on their share) would wait forever.
            await self._sync(lockstep.stepped(self._survivors()))
            return
        if lockstep.all_stepped and lockstep.all_acked:
            live = self._survivors()
            if live:
                await self._sync(live)
        # In SYNCING here only if the SyncNow just sent found nobody left to ack it; the next
        # look settles those ranks.
        if self._phase.now is Phase.EPOCH and self._ledger.complete and lockstep.all_acked:
            if self._ledger.unsynced:
                # The epoch ends with a sync: no batch of it may die unsynced after it closed.
                survivors = self._survivors()
                await self._sync(lockstep.stepped(survivors) or survivors)
            else:
                await self._aggregate()

    def _leaving_unsynced(self) -> bool:
        """A rank of a draining host has batches no sync covered yet."""
        draining = self._coord.draining_ranks
        return bool(draining and self._lockstep.stepped(
            r for r in self._survivors() if r in draining))

    async def _after_last_epoch_step(self) -> None:
        """``FINISHING`` / ``FINAL_SYNC`` / ``CLOSING``: the final sync if two or more ranks
        stepped since the last one, then ``Shutdown`` once every callback is answered."""
        if not self._lockstep.all_acked:
            return
        if self._phase.now is Phase.FINISHING:
            survivors = self._survivors()
            stepped = self._lockstep.stepped(survivors)
            if len(survivors) >= 2 and stepped:
                await self._sync(stepped)
                return
            self._phase.fire(PhaseEvent.NO_FINAL_SYNC)
        if not self._callbacks.pending:
            await self._outbox.broadcast(Shutdown())
            self._phase.fire(PhaseEvent.SHUTDOWN)

    async def _dispatch(self, epoch: int) -> None:
        """Plan ``epoch`` over the live ranks and send the plans (``EPOCH``)."""
        self._phase.fire(PhaseEvent.DISPATCH)
        await self._fold_joiners()
        live = self._survivors()
        if not live:
            self._announce_closed()  # the run ends here: what closed is still told
            raise no_rank_left(self._coord, self._ledger.epoch, self._num_epochs)
        plans = self._ledger.plan(epoch, live)
        if self._outbox.role is None:  # first dispatch: every rank learns the role first
            self._lockstep.start(live)
            await self._outbox.name_role(live[0])
        self._ledger.begin(epoch, plans)
        await self._save()  # ahead of the StartEpochs: a resumed scheduler repeats them
        self._coord.timeline.event(Note(what="epoch_started",
                                        fields={"epoch": epoch, "ranks": sorted(plans)}))
        for rank in sorted(plans):
            await self._outbox.send(rank, StartEpoch(plan=plans[rank]))

    async def _sync(self, participants: Sequence[int]) -> None:
        """``SyncNow`` then ``SetGlobalStep`` (``SYNCING``, or ``FINAL_SYNC``)."""
        self._phase.fire(PhaseEvent.SYNC_SENT)
        step = self._lockstep.open_sync(participants)
        self._coord.timeline.event(Note(what="sync", fields={"global_step": step}))
        await self._outbox.broadcast(SyncNow())
        await self._outbox.broadcast(SetGlobalStep(global_step=step))
        self._lockstep.expect_acks(self._survivors())

    async def _aggregate(self) -> None:
        """Close the epoch; dispatch the next one (``EPOCH``), or form the group first with the
        ranks that came back (``FORMING``), or after the last one move to ``FINISHING``."""
        metrics = self._ledger.close()
        epoch = self._ledger.epoch
        log.info("epoch %d aggregated: avg_loss %.4f", epoch, metrics.avg_loss)
        # Its accounting, beside it: it outlives this scheduler in the timeline (a failover's
        # epochs are summed from it) and the status page shows it. Both are recorded once
        # the close is durable (the next durable ``_save``).
        cov = self._ledger.coverage[-1]
        self._unannounced += [
            Note(what="epoch_aggregated", fields={"epoch": epoch, "avg_loss": metrics.avg_loss}),
            Note(what="epoch_covered", fields={
                "epoch": epoch, "exactly_once": cov.exactly_once, "samples": cov.samples,
                "total": cov.total, "gaps": cov.gaps, "overlaps": cov.overlaps})]
        await self._outbox.broadcast(EpochAggregated(metrics=metrics))
        completed = epoch + 1
        # The close is durable by itself only when something goes out before the next
        # epoch's checkpoint (callbacks), or no such checkpoint follows at once; otherwise
        # that one, durable ahead of the StartEpochs, holds it: one write per boundary.
        at_once = (completed < self._num_epochs and not self._regroup
                   and not self._callbacks.due(completed, self._outbox.role))
        await self._save(between=completed, durable=not at_once)
        await self._callbacks.after_epoch(completed, self._outbox.role)
        if completed >= self._num_epochs:
            self._phase.fire(PhaseEvent.LAST_CLOSED)
            self._ledger.finish()
        elif self._group is not None and self._regroup:
            if at_once:  # a rank came back meanwhile: the next epoch waits for the group
                await self._save(between=completed)
            # The group is re-formed with the ranks that came back before they get work.
            joiners = await self._fold_joiners()
            self._phase.form_group_before(completed)
            await self._group.begin(self._survivors(), f"rank(s) {joiners} rejoined")
        else:
            await self._dispatch(completed)

    # ------------------------------------------------------------------ resuming (_resume)

    async def _begin_resume(self, res: Resumption) -> None:
        """``STARTING`` from a checkpoint: settle the ranks that left since, then ``CLOSING``
        (a finished run), the next epoch (between two), or ``ANCHOR_DUE`` (inside one)."""
        coord = self._coord
        self._members.baseline(_comings(coord))
        self._ledger.restore(res.epoch, res.shares, res.epochs_completed, res.last_steps)
        announce(coord.timeline, res, self._num_epochs)
        start = resume_start(res, num_epochs=self._num_epochs, live=coord.live_ranks,
                             gone=coord.dead_ranks | coord.exited_ranks)
        for rank in start.left_before:
            self._members.leave(rank)  # gone before the checkpoint: nothing to settle
        if start.where == "finished":  # the run had ended: only Shutdown is left
            self._phase.fire(PhaseEvent.RESUME_FINISHED)
            self._ledger.finish()
        elif start.where == "between":  # the next epoch was not dispatched
            await self._open_epoch(res.epoch, "resuming the run")
        else:
            await self._resume_in_epoch(start.joining, start.gone_since)

    async def _resume_in_epoch(self, joining: frozenset[int], gone: Sequence[int]) -> None:
        self._members.join_next_epoch(joining)
        self._phase.fire(PhaseEvent.RESUME_IN_EPOCH)  # no extension before the anchor
        if gone:
            await self._fold_gone(gone)
        survivors = self._survivors()
        if not survivors:
            raise no_rank_left(self._coord, self._ledger.epoch, self._num_epochs)
        await self._outbox.name_role(survivors[0])
        if self._group is not None and not self._group.waiting:
            await self._group.begin(survivors, "resuming the run")

    async def _send_anchor(self) -> None:
        """``ANCHOR_DUE``: the anchoring sync; each rank's ``SyncAck`` says how far it got."""
        self._phase.fire(PhaseEvent.ANCHOR_SENT)
        self._lockstep.open_anchor(anchor_credit(self._ledger.shares, self._survivors()))
        self._coord.timeline.event(Note(what="sync", fields={
            "global_step": self._lockstep.global_step}))
        await self._outbox.broadcast(SyncNow())

    async def _finish_anchor(self) -> None:
        """``ANCHORING``, every share anchored: move the global step on, checkpoint, and send
        each rank its share again (a rank ignores what it already has)."""
        self._phase.fire(PhaseEvent.ANCHORED)
        survivors = self._survivors()
        shares = self._ledger.shares
        step = self._lockstep.close_anchor(shares, survivors)
        await self._outbox.broadcast(SetGlobalStep(global_step=step))
        self._lockstep.restart(survivors)
        await self._save()
        for rank in survivors:
            # A rank back from a death that took nothing over holds its earlier process's
            # settled share: nothing of it is sent again.
            if rank in shares and shares[rank].done is None:
                await self._outbox.send_each(rank, repeat_share(self._ledger.epoch, shares[rank]))
