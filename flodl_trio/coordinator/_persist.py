"""The coordinator's session store writer (SPEC §4.7): one task, coalescing, paced.

Every change the store keeps (a relay joined, rejoined, resumed or was uncovered, a death, a clean
exit, formation complete, a scheduler checkpoint) calls :meth:`Persistence.request`, which only
marks the state dirty. One writer task takes a snapshot of the roster when it is free and saves
it, so at most one write is in flight and the latest state wins: a burst of a thousand deaths
costs one or two writes, never one each. Every write holds the latest checkpoint the scheduler
gave, durable or not, so a state never pairs a roster with an older checkpoint than it had.

Pacing (issue 34): a change that can wait is written no sooner than ``interval`` (``1 /
store_write_rate``) after the previous write began, nor sooner than that write took after it
ended (saving never takes more than half of the coordinator's time). :meth:`Persistence.flush`
(``save_checkpoint``, formation) does not wait for either: it is written at once, and returns
once a write that began after its own request is durable. So a store sees at most one write per
``interval`` plus one per flush.

A save refused because a newer generation took over (``LeadershipLost``) ends the writer and
deposes the coordinator (``on_lost``); a store that cannot be written (``StoreUnavailable``) is
tried again every ``RETRY_INTERVAL`` until it can, or until its leadership is lost.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import cbor2
import trio

from .._errors import ConfigError, LeadershipLost, StoreUnavailable
from ..store import SessionState, SessionStore
from ._relayconn import RelayConn
from ._roster import Roster

log = logging.getLogger("flodl_trio.coordinator.store")

RETRY_INTERVAL = 1.0  # a cadence: how soon an unwritable store is tried again


class Persistence:
    """Saves the session to ``store`` (see the module doc).

    Attributes:
        generation: this coordinator's generation (the fencing token of every save).
        saves: states written so far.
        last_write: when the last write ended (Trio clock), None before the first.
    """

    def __init__(self, store: SessionStore, *, generation: int, salt_id: bytes,
                 roster: Roster[RelayConn], on_lost: Callable[[LeadershipLost], None],
                 interval: float = 0.0) -> None:
        self._store = store
        self._interval = interval  # seconds between two paced writes (0: no pacing)
        self._next_write = -math.inf  # when a change that can wait may be written
        self.last_write: float | None = None  # when the last durable write ended (Trio clock)
        self.generation = generation
        self._salt_id = salt_id
        self._roster = roster
        self._on_lost = on_lost
        self.checkpoint: dict[str, Any] | None = None
        self.ended: tuple[str, float] | None = None  # the end marker: how, when (Unix time)
        self.saves = 0
        self._requested = 0  # requests so far
        self._written = 0  # requests covered by the last durable write
        self._dirty = trio.Event()
        self._progress = trio.Event()
        self._lost: LeadershipLost | None = None
        self._closed = False
        self._urgent = trio.Event()  # a flush is waiting: save without pausing first

    def keep_checkpoint(self, checkpoint: dict[str, Any] | None) -> None:
        """The scheduler's latest checkpoint: every write from now on holds it."""
        self.checkpoint = checkpoint

    def request(self) -> None:
        """The state changed: the writer saves it (coalesced with other changes)."""
        self._requested += 1
        self._dirty.set()

    async def flush(self) -> None:
        """Request a save and return once a write that includes the state as it is now is
        durable.

        Raises:
            LeadershipLost: the coordinator was deposed before the write was durable.
            StoreUnavailable: the coordinator shut down before it was.
        """
        self.request()
        self._urgent.set()
        target = self._requested
        while self._written < target:
            self.check_writable()
            await self._progress.wait()

    def check_writable(self) -> None:
        """Raise what stops the session from being saved any more, if anything does.

        Raises:
            LeadershipLost: the coordinator was deposed.
            StoreUnavailable: the coordinator shut down.
        """
        if self._lost is not None:
            raise self._lost
        if self._closed:
            raise StoreUnavailable(f"store {self._store.description}: the coordinator has shut "
                                   "down; expected to save the session, nothing more is "
                                   "written")

    def mark_ended(self, outcome: str, at: float) -> None:
        """The session ended (``outcome``, at Unix time ``at``): every save from now on carries
        the end marker."""
        self.ended = (outcome, at)

    def close(self) -> None:
        """The coordinator shut down: nothing more is saved; waiting flushes fail."""
        self._closed = True
        self._wake()

    def snapshot(self) -> SessionState:
        """The session as it is now."""
        roster = self._roster
        return SessionState(
            salt_id=self._salt_id, world_size=roster.world_size,
            model_sigs=roster.cohort_sigs(), roster=roster.carried(), dead=roster.dead,
            exited=roster.exited, failures=len(roster.dead), generation=self.generation,
            formed=roster.formed, checkpoint=self.checkpoint,
            ended=None if self.ended is None else self.ended[0],
            ended_at=None if self.ended is None else self.ended[1],
            min_world_size=roster.min_world if roster.min_world < roster.world_size else None,
            retired={rank: roster.retired_reason(rank) or "" for rank in roster.retired})

    async def run(self) -> None:
        """The one writer (runs in the coordinator's nursery until it is cancelled or the
        coordinator is deposed)."""
        while not self._closed:
            await self._dirty.wait()
            with trio.move_on_at(self._next_write):  # paced, unless a flush waits
                await self._urgent.wait()
            if self._closed:
                return
            self._dirty, self._urgent = trio.Event(), trio.Event()
            covered = self._requested
            began = trio.current_time()
            try:
                await self._store.save(self.snapshot())
            except LeadershipLost as exc:
                self._lost = exc
                self._wake()
                self._on_lost(exc)
                return
            except StoreUnavailable as exc:
                lost = self._store.lost_leadership()
                if lost is not None:  # woken deposed: its lease is gone, nothing to retry
                    self._lost = lost
                    self._wake()
                    self._on_lost(lost)
                    return
                log.warning("session store %s: save failed, trying again in %gs: %s",
                            self._store.description, RETRY_INTERVAL, exc)
                self._dirty.set()
                await trio.sleep(RETRY_INTERVAL)
                continue
            ended = self.last_write = trio.current_time()
            self.saves += 1
            self._written = covered
            self._wake()
            # Busy at most half the time (a save of a large world costs tens of milliseconds
            # of this process's time), and at most one paced write per interval: changes that
            # keep coming (a checkpoint per sync, a death at a time) are coalesced, not
            # turned into back-to-back writes that grow the store's history without bound.
            self._next_write = max(began + self._interval, ended + (ended - began))

    def _wake(self) -> None:
        self._progress.set()
        self._progress = trio.Event()


def checked_checkpoint(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a scheduler checkpoint, checked now (not in the writer, where a bad one would
    end the coordinator).

    Raises:
        ConfigError: not a map with text keys that CBOR can encode.
    """
    if not isinstance(checkpoint, Mapping) or not all(isinstance(k, str) for k in checkpoint):
        raise ConfigError(f"save_checkpoint: expected a map with str keys, got "
                          f"{type(checkpoint).__name__} {checkpoint!r:.80}")
    copy = dict(checkpoint)
    try:
        cbor2.dumps(copy, canonical=True)
    except (cbor2.CBOREncodeError, TypeError, ValueError) as exc:
        raise ConfigError(f"save_checkpoint: expected a map CBOR can encode (str, int, float, "
                          f"bytes, lists, maps), got {copy!r:.80} ({exc})") from None
    return copy
