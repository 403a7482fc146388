"""The scheduler's small record types: its run summary, a rank's share of an epoch, its reading
of the coordinator's channels, who takes part, and what it says of ranks that left."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, TypeVar

import attrs
import trio

from .._errors import ClusterFailure
from ..wire import EpochMetrics, Metrics, SaveReason, TimingMsg
from ._epoch_math import Range, processed_ranges, unprocessed_ranges

if TYPE_CHECKING:
    from ..coordinator import Coordinator

_T = TypeVar("_T")


@attrs.frozen
class RunSummary:
    """What :meth:`SyncScheduler.run` returns.

    Attributes:
        epochs_completed: epochs aggregated.
        syncs: ``SyncNow`` broadcasts (the final sync included).
        global_step: the last ``SetGlobalStep`` value.
        epoch_metrics: the ``EpochMetrics`` broadcast for each epoch, in order.
        deaths: rank → reason for every rank the coordinator declared dead.
        elapsed_s: run time on the Trio clock.
        first_epoch: the epoch this scheduler started in (0, or the epoch of the checkpoint it
            resumed from).
        resumed: it resumed from the coordinator's checkpoint (``coord.checkpoint``).
        epoch_losses: the ``avg_loss`` of every epoch of the run, from epoch 0 (index: the
            epoch), across a resume: the epochs closed before it come from the checkpoint. None
            for an epoch no rank's ``Metrics`` arrived for (every rank had finished its share
            before a takeover, its ``Metrics`` sent to the coordinator that died), and for an
            epoch closed before a checkpoint of an earlier version.

    Counts are of the whole run, across a resume: ``epochs_completed``, ``syncs`` and
    ``global_step`` go on from the checkpoint, and ``epoch_losses`` covers every epoch;
    ``epoch_metrics`` holds the epochs this scheduler aggregated (``epochs_completed -
    first_epoch`` of them), those before were broadcast by the scheduler it took over from.
    """

    epochs_completed: int
    syncs: int
    global_step: int
    epoch_metrics: tuple[EpochMetrics, ...]
    deaths: Mapping[int, str]
    elapsed_s: float
    first_epoch: int = 0
    resumed: bool = False
    epoch_losses: tuple[float | None, ...] = ()


@attrs.define
class Share:
    """One rank's work in the current epoch: its plan, then its extensions, in order.

    ``batches`` counts the batches it reported, ``synced`` those reported before its last
    ``SyncAck`` (only those are credited if it leaves). ``start_step`` is its step count before
    its first batch of the epoch. A share restored from a checkpoint is not ``anchored`` until
    the rank's first ``SyncAck`` says, by its step count, how far it got. ``earlier`` is what
    an earlier process of the same rank is credited with in this epoch: it died, came back and
    took the epoch over when every other member of it had left.
    """

    ranges: list[Range]
    batches: int = 0
    synced: int = 0
    start_step: int = 0
    anchored: bool = True
    extended: bool = False
    done: list[Range] | None = None  # set when the rank left: what it is credited for
    earlier: list[Range] = attrs.Factory(list)

    @property
    def credited(self) -> list[Range]:
        """What the epoch's accounting counts for this rank: its earlier process's credit, then
        its share (all of it while it is a member; what it synced once it left)."""
        return [*self.earlier, *(self.ranges if self.done is None else self.done)]

    @property
    def assigned(self) -> int:
        return sum(s for _, s in self.ranges)

    def count_batch(self) -> None:
        """The rank reported one more ``Batch`` of this share."""
        self.batches += 1

    def anchor(self, done: int) -> None:
        """After a resume: the rank's first ``SyncAck`` says it did ``done`` batches."""
        self.batches = done
        self.anchored = True

    def mark_synced(self) -> None:
        """A ``SyncAck`` of the rank: every batch it reported so far is synced."""
        self.synced = self.batches

    def extend(self, part: list[Range]) -> None:
        """A remainder handed over: ``part`` follows the plan and earlier extensions."""
        self.ranges.extend(part)
        self.extended = True

    def leave(self, batch_size: int) -> list[Range]:
        """The rank left: it is credited with what its synced batches covered (``done``); what
        is left of the share, in order."""
        self.done = processed_ranges(self.ranges, self.synced, batch_size)
        return unprocessed_ranges(self.ranges, self.synced, batch_size)


class InboxClosed(Exception):
    """The coordinator closed its timing/metrics channels (it is shutting down)."""


class Inbox:
    """The scheduler's reading of the coordinator's two channels, timing before metrics.

    The coordinator delivers each relay's frames in order but into two channels, so every
    timing frame delivered so far is handled before any ``Metrics``: a rank's last ``Batch`` is
    counted before its ``Metrics``.
    """

    def __init__(self, timing: trio.MemoryReceiveChannel[TimingMsg],
                 metrics: trio.MemoryReceiveChannel[Metrics], poll_interval: float) -> None:
        self._timing = timing
        self._metrics = metrics
        self._poll_interval = poll_interval
        self._held_timing: deque[TimingMsg] = deque()
        self._held_metrics: deque[Metrics] = deque()

    def drain(self, on_timing: Callable[[TimingMsg], None],
              on_metrics: Callable[[Metrics], None]) -> None:
        """Handle everything delivered so far, every timing frame before any Metrics.

        Raises:
            InboxClosed: a channel ended.
        """
        try:
            while True:
                while self._held_timing:
                    on_timing(self._held_timing.popleft())
                while True:
                    try:
                        on_timing(self._timing.receive_nowait())
                    except trio.WouldBlock:
                        break
                if self._held_metrics:
                    on_metrics(self._held_metrics.popleft())
                    continue
                try:
                    on_metrics(self._metrics.receive_nowait())
                except trio.WouldBlock:
                    return
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise InboxClosed from None

    async def wait_any(self, events: trio.MemoryReceiveChannel[object]) -> None:
        """Wait (bounded by the poll interval) for a timing frame, a Metrics or an event.

        Raises:
            InboxClosed: a channel ended.
        """
        closed: list[bool] = []
        discarded: deque[object] = deque()
        with trio.move_on_after(self._poll_interval):
            async with trio.open_nursery() as nursery:
                done = nursery.cancel_scope
                nursery.start_soon(_take_one, self._timing, self._held_timing, done, closed)
                nursery.start_soon(_take_one, self._metrics, self._held_metrics, done, closed)
                nursery.start_soon(_take_one, events, discarded, done, closed)
        if closed:
            raise InboxClosed


async def _take_one(channel: trio.MemoryReceiveChannel[_T], held: deque[_T],
                    done: trio.CancelScope, closed: list[bool]) -> None:
    try:
        held.append(await channel.receive())
    except (trio.EndOfChannel, trio.ClosedResourceError):
        closed.append(True)
    done.cancel()


class Members:
    """Who takes part in the scheduler's current epoch, as the coordinator's view changes.

    ``known``: ranks the scheduler has seen in the cohort; a live rank it has not (an elastic
    world grew, issue 37) is new. ``gone``: ranks that died, exited or were retired, whose share
    is settled. ``joining``: ranks back from the dead (issue 26) or new, that wait for the next
    epoch to get work. A rank whose rejoin (or join) count moved between two looks died and
    came back unseen: it is gone all the same, and so is one whose anchoring ``SyncAck`` after
    a resume cannot be the share holder's (:meth:`restarted`).
    """

    def __init__(self) -> None:
        self.gone: set[int] = set()
        self.joining: set[int] = set()
        self.known: set[int] = set()
        self._rejoins_seen: dict[int, int] = {}
        self._restarted: set[int] = set()

    def know(self, ranks: Iterable[int]) -> None:
        """``ranks`` are in the cohort as the scheduler starts (members, or gone)."""
        self.known.update(ranks)

    def baseline(self, rejoins: Mapping[int, int]) -> None:
        """Take the coordinator's rejoin counts as seen (a scheduler that resumes a run: the
        rejoins before it were its predecessor's to handle)."""
        self._rejoins_seen = dict(rejoins)

    def survivors(self, live: frozenset[int]) -> list[int]:
        """The ranks that take part in the current epoch, ascending."""
        return sorted((live & self.known) - self.gone - self.joining)

    def ignores(self, rank: int) -> bool:
        """``rank`` has no share in the current epoch: its reports are not counted."""
        return rank in self.gone or rank in self.joining or rank not in self.known

    def newly_gone(self, dead: frozenset[int], exited: frozenset[int],
                   rejoins: Mapping[int, int]) -> list[int]:
        """Known ranks that left since the last look (dead, exited or retired; a death and
        return between two looks included), ascending; the caller settles each and calls
        :meth:`leave`."""
        missed = {r for r, n in rejoins.items()
                  if n != self._rejoins_seen.get(r, 0) and r not in self.gone}
        self._rejoins_seen = dict(rejoins)
        restarted, self._restarted = self._restarted - self.gone, set()
        left = ((dead | exited) - self.gone) | missed | restarted
        return sorted(left & self.known)

    def restarted(self, rank: int) -> None:
        """``rank``'s anchoring ``SyncAck`` cannot be the share holder's: a new process holds
        the rank, the old one is gone (it is at the next :meth:`newly_gone`)."""
        self._restarted.add(rank)

    def leave(self, rank: int) -> None:
        self.joining.discard(rank)
        self.gone.add(rank)

    def join_next_epoch(self, ranks: Iterable[int]) -> None:
        """``ranks`` have no share in the current epoch (a resume found them live without
        one): they get work from the next epoch."""
        self.joining.update(ranks)
        self.known.update(ranks)

    def returned(self, live: frozenset[int]) -> list[int]:
        """Gone ranks that are live again; they join at the next epoch."""
        back = sorted(self.gone & live)
        self.gone.difference_update(back)
        self.joining.update(back)
        return back

    def arrived(self, live: frozenset[int]) -> list[int]:
        """Live ranks the scheduler never saw (an elastic world grew); they join at the next
        epoch."""
        new = sorted(live - self.known)
        self.known.update(new)
        self.joining.update(new)
        return new

    def take_joiners(self, live: frozenset[int]) -> list[int]:
        """At an epoch boundary: the joining ranks still live take part from now on."""
        joiners = sorted(self.joining & live)
        self.joining.clear()
        return joiners


def why_gone(coord: Coordinator, rank: int) -> str:
    """Why ``rank`` left, as the coordinator says (for a re-formation's error message)."""
    retired = coord.retired_reason(rank)
    return coord.dead_reason(rank) or (f"retired: {retired}" if retired is not None else (
        "exited cleanly" if rank in coord.exited_ranks else "died and came back"))


def no_rank_left(coord: Coordinator, epoch: int, num_epochs: int) -> ClusterFailure:
    """The failure of a run with no live rank left in ``epoch``, naming why each one died."""
    why = {rank: reason for rank in coord.dead_ranks
           if (reason := coord.dead_reason(rank)) is not None}
    return ClusterFailure(SaveReason.ALL_RANKS_LOST, coord.dead_ranks,
                          f"scheduler: no live rank left in epoch {epoch} of {num_epochs}",
                          why=why)
