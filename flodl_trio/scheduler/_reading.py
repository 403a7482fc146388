"""The Sync scheduler's reading (the *Reading* rule of :mod:`flodl_trio.scheduler`): it takes the
coordinator's timing and metrics frames, timing first, and hands each to the part of the
scheduler it concerns. No decision is made here; the scheduler acts on what changed."""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from .._callbacks import Callbacks
from .._errors import FlodlError
from ..wire import Batch, CheckpointResult, EvalResult, NewNcclIdGenerated, SyncAck, TimingMsg
from ._epoch_ledger import EpochLedger
from ._lockstep import Lockstep
from ._parts import Inbox, InboxClosed, Members
from ._reformation import ProcessGroupKeeper

if TYPE_CHECKING:
    from ..coordinator import Coordinator

# Deaths also surface on the timeline (which wakes the loop at once); the poll only backs that up.
_POLL_INTERVAL = 0.25


class Reader:
    """Routes every frame the coordinator delivered to the scheduler's parts.

    Args:
        coord: the coordinator (its ``timing`` and ``metrics`` channels).
        ledger / lockstep / members / group / callbacks: the parts a frame may concern.
    """

    def __init__(self, coord: Coordinator, *, ledger: EpochLedger, lockstep: Lockstep,
                 members: Members, group: ProcessGroupKeeper | None,
                 callbacks: Callbacks) -> None:
        self._inbox = Inbox(coord.timing, coord.metrics, _POLL_INTERVAL)
        self._ledger = ledger
        self._lockstep = lockstep
        self._members = members
        self._group = group
        self._callbacks = callbacks

    def closed(self) -> FlodlError:
        """The error of a run whose coordinator closed its channels."""
        return FlodlError(f"SyncScheduler: the coordinator closed its timing/metrics channels "
                          f"(it is shutting down) during epoch {self._ledger.epoch}")

    def drain(self) -> None:
        """Handle every frame delivered so far.

        Raises:
            FlodlError: the coordinator closed its channels.
        """
        try:
            self._inbox.drain(self._on_timing, self._ledger.on_metrics)
        except InboxClosed:
            raise self.closed() from None

    async def wait(self, events: trio.MemoryReceiveChannel[object]) -> None:
        """Wait (at most a short poll) for a frame or a timeline event.

        Raises:
            FlodlError: the coordinator closed its channels.
        """
        try:
            await self._inbox.wait_any(events)
        except InboxClosed:
            raise self.closed() from None

    def _on_timing(self, msg: TimingMsg) -> None:
        rank = int(msg.rank)
        if self._members.ignores(rank):  # no share in this epoch
            return
        if isinstance(msg, Batch):
            if self._ledger.on_batch(rank, int(msg.step_count)):
                self._lockstep.on_batch(rank)
            # else: before its anchoring SyncAck after a resume, which counts it
        elif isinstance(msg, SyncAck):
            if not self._ledger.on_sync_ack(rank, int(msg.step_count)):
                self._members.restarted(rank)
            self._lockstep.on_ack(rank)
        elif isinstance(msg, NewNcclIdGenerated) and self._group is not None:
            self._group.on_uid(rank, msg.uid)
        elif isinstance(msg, CheckpointResult | EvalResult):
            self._callbacks.on_result(rank, msg)
