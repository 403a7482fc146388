"""The scheduler's epoch callbacks: ``Checkpoint`` and ``ExecuteEvalCallback`` sent to the role
rank after every n-th epoch, followed until answered, moved when their rank dies, and a failed
checkpoint retried on the next live rank (flodl's checkpoint failover)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Sequence

import attrs

from .wire import Checkpoint, CheckpointResult, ControlMsg, EvalResult, ExecuteEvalCallback

log = logging.getLogger("flodl_trio.scheduler")

Send = Callable[[int, ControlMsg], Awaitable[None]]


@attrs.define
class Callback:
    """A Checkpoint or eval sent to the role rank and not yet answered."""

    kind: str  # "checkpoint" | "eval"
    number: int  # checkpoint version / eval schedule id (= epochs completed)
    target: int
    tried: set[int] = attrs.Factory(set)

    def move_to(self, rank: int) -> None:
        """Send it to ``rank`` from now on; the rank it was on counts as having tried it."""
        self.tried.add(self.target)
        self.target = rank

    def message(self) -> ControlMsg:
        if self.kind == "checkpoint":
            return Checkpoint(version=self.number, target_rank=self.target)
        return ExecuteEvalCallback(schedule_id=self.number, epoch=self.number,
                                   target_rank=self.target)


class Callbacks:
    """The open callbacks of one run.

    Args:
        checkpoint_every / eval_every: cadences in epochs (``None``: never).
        send: sends one control message to one rank.
        move_role: moves the epoch-callback role to a rank (and tells everyone).
    """

    def __init__(self, *, checkpoint_every: int | None, eval_every: int | None, send: Send,
                 move_role: Callable[[int], Awaitable[None]]) -> None:
        self._every = (("checkpoint", checkpoint_every), ("eval", eval_every))
        self._send = send
        self._move_role = move_role
        self._open: dict[tuple[str, int], Callback] = {}
        self._failed: list[tuple[int, int, str]] = []  # (version, rank, error)

    @property
    def pending(self) -> bool:
        """Some callback is not answered yet."""
        return bool(self._open)

    @property
    def failed(self) -> bool:
        """Some checkpoint failed and waits for its failover."""
        return bool(self._failed)

    def on_result(self, rank: int, msg: CheckpointResult | EvalResult) -> None:
        """A result arrived from ``rank`` (ignored unless it answers an open callback there)."""
        if isinstance(msg, CheckpointResult):
            cb = self._open.get(("checkpoint", int(msg.version)))
            if cb is not None and cb.target == rank:
                if msg.error is None:
                    del self._open[("checkpoint", cb.number)]
                else:
                    self._failed.append((cb.number, rank, msg.error))
            return
        cb = self._open.get(("eval", int(msg.schedule_id)))
        if cb is not None and cb.target == rank:
            if msg.error is not None:
                log.warning("eval %d on rank %d failed: %s", cb.number, rank, msg.error)
            del self._open[("eval", cb.number)]

    def due(self, completed: int, role: int | None) -> bool:
        """Whether :meth:`after_epoch` sends anything after ``completed`` epochs."""
        return role is not None and any(every is not None and completed % every == 0
                                        for _, every in self._every)

    async def after_epoch(self, completed: int, role: int | None) -> None:
        """Send the callbacks due after ``completed`` epochs to the role rank."""
        for kind, every in self._every:
            if every is not None and completed % every == 0 and role is not None:
                cb = Callback(kind, completed, role)
                self._open[(kind, completed)] = cb
                await self._send(cb.target, cb.message())

    async def retarget(self, gone: Collection[int], role: int | None) -> None:
        """Resend to the role rank every callback whose rank left."""
        for cb in self._open.values():
            if cb.target in gone and role is not None:
                cb.move_to(role)
                await self._send(cb.target, cb.message())

    async def fail_over(self, survivors: Sequence[int], role: int | None) -> None:
        """Retry each failed checkpoint on the next live rank that has not tried it."""
        failed, self._failed = self._failed, []
        for version, rank, error in failed:
            cb = self._open.get(("checkpoint", version))
            if cb is None or cb.target != rank:
                continue
            cb.tried.add(rank)
            order = [r for r in survivors if r > rank] + [r for r in survivors if r < rank]
            candidate = next((r for r in order if r not in cb.tried), None)
            if candidate is None:
                log.error("checkpoint %d failed on every live rank (last: rank %d: %s)",
                          version, rank, error)
                del self._open[("checkpoint", version)]
                continue
            log.warning("checkpoint %d failed on rank %d (%s); retrying on rank %d", version,
                        rank, error, candidate)
            if candidate != role:
                await self._move_role(candidate)
                role = candidate
            cb.move_to(candidate)
            await self._send(candidate, cb.message())
