"""Re-forming the ranks' collective process group (NCCL, gloo) through the control vocabulary.

The scheduler owns the decisions; this module is the bookkeeping of one re-formation at a time,
with no I/O and no clock of its own (the caller passes ``now``), so every branch is testable.

One re-formation:

1. The lowest live rank not yet tried is asked for a new session id (``RequestNewNcclId``).
2. It answers ``NewNcclIdGenerated{uid}``; the uid is opaque here and says where to rendezvous
   (for torch.distributed: the address of a store the asked rank now serves).
3. Each live rank gets ``NewNcclSession{uid, new_rank, new_world_size}``: the asked rank is new
   rank 0 (it serves the rendezvous), the others follow in ascending global rank.

If the asked rank dies first, the next lowest live rank is asked. If no live rank is left to ask,
or no answer arrives within ``timeout`` of the start, the re-formation fails with a
:class:`ReformationError` that names every rank asked and what became of it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence

import attrs
import trio

from .._errors import FlodlError
from ..events import Note
from ..timeline import Timeline
from ..wire import ControlMsg, NewNcclSession, RequestNewNcclId

log = logging.getLogger("flodl_trio.scheduler")


class ReformationError(FlodlError):
    """The ranks' process group could not be re-formed (no live rank produced a session id in
    time); the message names each rank asked and why it did not answer."""


@attrs.define
class Reformation:
    """The state of the current re-formation, if any.

    Attributes:
        timeout: seconds from the start of one re-formation to the sessions being sent.
        generation: how many re-formations were started.
        active: one is waiting for its session id.
        candidate: the rank asked last.
        why: what started it (for logs and errors).
    """

    timeout: float
    generation: int = 0
    active: bool = False
    candidate: int | None = None
    why: str = ""
    _deadline: float = 0.0
    _uid: bytes | None = None
    _tried: list[int] = attrs.Factory(list)
    _history: list[str] = attrs.Factory(list)

    def begin(self, survivors: Sequence[int], now: float, why: str) -> int:
        """Start a re-formation among ``survivors`` (ascending); the rank to ask.

        Raises:
            ReformationError: no survivor.
        """
        self.generation += 1
        self.active = True
        self.why = why
        self._deadline = now + self.timeout
        self._uid = None
        self._tried = []
        self._history = []
        return self._next(survivors)

    def _next(self, survivors: Sequence[int]) -> int:
        candidate = next((r for r in survivors if r not in self._tried), None)
        if candidate is None:
            self.active = False
            raise self._error("no live rank is left to ask")
        self._tried.append(candidate)
        self.candidate = candidate
        log.info("process group re-formation %d (%s): asking rank %d for a new session id",
                 self.generation, self.why, candidate)
        return candidate

    def _error(self, last: str) -> ReformationError:
        asked = "; ".join(self._history) or "no rank was asked"
        return ReformationError(
            f"scheduler: re-forming the process group ({self.why}) failed: expected a "
            f"NewNcclIdGenerated within reform_timeout={self.timeout:g}s; {asked}; {last}")

    def on_gone(self, gone: Iterable[tuple[int, str]], survivors: Sequence[int]) -> int | None:
        """Ranks left the run (``(rank, reason)``); the rank to ask now, if the asked one left.

        Raises:
            ReformationError: the asked rank left and no live rank is left to ask.
        """
        if not self.active:
            return None
        for rank, reason in gone:
            if rank == self.candidate:
                # Also after it answered: its uid points at a rendezvous that died with it.
                self._history.append(f"rank {rank} was asked and was declared dead ({reason})")
                self._uid = None
                return self._next(survivors)
        return None

    def on_uid(self, rank: int, uid: bytes) -> None:
        """A ``NewNcclIdGenerated`` arrived (ignored unless from the asked rank, once)."""
        if not self.active or rank != self.candidate or self._uid is not None:
            log.info("NewNcclIdGenerated from rank %d ignored (asked: %s)", rank, self.candidate)
            return
        self._uid = uid

    @property
    def answered(self) -> bool:
        """The asked rank answered: the sessions can go out."""
        return self.active and self._uid is not None

    def sessions(self, survivors: Sequence[int]) -> dict[int, NewNcclSession]:
        """Each survivor's ``NewNcclSession``; ends this re-formation.

        The asked rank is new rank 0 (it serves the rendezvous), the rest follow ascending.
        """
        assert self._uid is not None and self.candidate is not None
        order = [self.candidate] + [r for r in survivors if r != self.candidate]
        self.active = False
        return {r: NewNcclSession(uid=self._uid, new_rank=i, new_world_size=len(order))
                for i, r in enumerate(order)}

    def check_deadline(self, now: float) -> None:
        """Raise if the re-formation is still waiting at its deadline.

        Raises:
            ReformationError: naming the ranks asked.
        """
        if self.active and self._uid is None and now >= self._deadline:
            self.active = False
            raise self._error(f"rank {self.candidate} was asked and did not answer within "
                              f"reform_timeout={self.timeout:g}s")


class ProcessGroupKeeper:
    """The scheduler's side of re-formation: sends the messages, notes them on the timeline.

    Args:
        timeline: where ``process_group_requested`` / ``process_group_formed`` notes go.
        send: sends one control message to one rank (failures are the caller's to log).
        timeout: ``reform_timeout``, seconds.
    """

    def __init__(self, timeline: Timeline, send: Callable[[int, ControlMsg], Awaitable[None]],
                 timeout: float) -> None:
        self.state = Reformation(timeout)
        self._timeline = timeline
        self._send = send

    @property
    def waiting(self) -> bool:
        """A re-formation is waiting for its session id."""
        return self.state.active

    async def begin(self, survivors: Sequence[int], why: str) -> None:
        """Start a re-formation among ``survivors``."""
        await self._ask(self.state.begin(survivors, trio.current_time(), why))

    async def after_gone(self, gone: Sequence[tuple[int, str]], survivors: Sequence[int]) -> None:
        """Ranks left: ask the next rank if the asked one left, or start a new re-formation
        (the current group includes the dead)."""
        if self.state.active:
            ask = self.state.on_gone(gone, survivors)
            if ask is not None:
                await self._ask(ask)
        else:
            await self.begin(survivors, f"after rank(s) {sorted(r for r, _ in gone)} left")

    def on_uid(self, rank: int, uid: bytes) -> None:
        """A ``NewNcclIdGenerated`` arrived."""
        self.state.on_uid(rank, uid)

    async def advance(self, survivors: Sequence[int]) -> bool:
        """Send the sessions once the id arrived; True while the re-formation still waits.

        Raises:
            ReformationError: the deadline passed.
        """
        if not self.state.answered:
            self.state.check_deadline(trio.current_time())
            return True
        sessions = self.state.sessions(survivors)
        self._timeline.event(Note(what="process_group_formed", fields={
            "generation": self.state.generation, "ranks": sorted(sessions)}))
        for rank in sorted(sessions):
            await self._send(rank, sessions[rank])
        return False

    async def _ask(self, rank: int) -> None:
        self._timeline.event(Note(what="process_group_requested", fields={
            "rank": rank, "why": self.state.why}))
        await self._send(rank, RequestNewNcclId())
