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

In the scheduler's phases (:mod:`flodl_trio.scheduler._phase`) a resume is ``STARTING`` then,
inside an epoch, ``ANCHOR_DUE`` (step 1 done, the anchoring ``SyncNow`` waits for the process
group if any) and ``ANCHORING`` (step 2) before the epoch runs (``EPOCH``, step 3 done). This
module decides (no I/O); the scheduler sends.

Only a rank that dies in the same window, after acknowledging a sync that the checkpoint does not
hold (with a paced store, up to ``1 / store_write_rate`` seconds of syncs), is credited less than
it synced (as is one whose ``SyncAck`` died with its relay): that part is processed again (at
least once).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Literal

import attrs

from ..events import Note
from ..timeline import Timeline
from ..wire import ControlMsg, EpochPlan, ExtendPartition, StartEpoch
from ._checkpoint import Resumption
from ._parts import Share

log = logging.getLogger("flodl_trio.scheduler")


@attrs.frozen
class ResumeStart:
    """How a scheduler taking a run over begins, from its checkpoint and the coordinator's view.

    Attributes:
        where: ``"finished"`` (every epoch closed: only ``Shutdown`` is left), ``"between"``
            (the next epoch was not dispatched) or ``"in_epoch"`` (the epoch goes on, anchored).
        left_before: ranks gone that hold no share of the checkpoint: nothing to settle.
        joining: live ranks without a share of the current epoch: work from the next one.
        gone_since: ranks that hold a share and are no longer live: settled like a death.
    """

    where: Literal["finished", "between", "in_epoch"]
    left_before: frozenset[int]
    joining: frozenset[int] = frozenset()
    gone_since: tuple[int, ...] = ()


def resume_start(res: Resumption, *, num_epochs: int, live: frozenset[int],
                 gone: frozenset[int]) -> ResumeStart:
    """Decide how to take the run over (``gone``: the ranks dead or exited)."""
    held = frozenset(r for r, share in res.shares.items() if share.done is None)
    left = gone - held
    if res.epoch >= num_epochs:
        return ResumeStart("finished", left)
    if not res.shares:
        return ResumeStart("between", left)
    return ResumeStart("in_epoch", left, joining=live - held,
                       gone_since=tuple(sorted(held - live)))


def announce(timeline: Timeline, res: Resumption, num_epochs: int) -> None:
    """Log and note (``scheduler_resumed``) where the run is taken over."""
    log.info("resuming from the checkpoint: epoch %d of %d, %d closed, global step %d",
             res.epoch, num_epochs, res.epochs_completed, res.global_step)
    timeline.event(Note(what="scheduler_resumed", fields={
        "epoch": res.epoch, "epochs_completed": res.epochs_completed,
        "global_step": res.global_step}))


def anchor_credit(shares: Mapping[int, Share], survivors: Sequence[int]) -> dict[int, int]:
    """The ranks the anchoring ``SyncNow`` anchors (survivors that hold a share: not one back
    from a death whose earlier process's share was settled), each with the batches the
    checkpoint credits it with."""
    return {r: shares[r].synced for r in survivors if r in shares and shares[r].done is None}


def repeat_share(epoch: int, share: Share) -> list[ControlMsg]:
    """The commands of a share, sent again after the anchor: ``StartEpoch`` with the plan, then
    each extension in order (a rank ignores what it already has)."""
    (offset, size), *extensions = share.ranges
    msgs: list[ControlMsg] = [StartEpoch(plan=EpochPlan(epoch=epoch, partition_offset=offset,
                                                        partition_size=size))]
    msgs.extend(ExtendPartition(partition_offset=o, partition_size=s) for o, s in extensions)
    return msgs
