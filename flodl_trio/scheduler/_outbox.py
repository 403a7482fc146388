"""The Sync scheduler's sending: every control message it sends goes through the coordinator here,
and here is the one rank that holds the epoch-callback role."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from .._errors import BroadcastError, SendError
from ..wire import ControlMsg, SetEpochCallbackRole

if TYPE_CHECKING:
    from ..coordinator import Coordinator

log = logging.getLogger("flodl_trio.scheduler")


class Outbox:
    """Sends to one rank or to all through ``coord``; a failed send is logged, not raised (the
    failed write declared the rank dead, or it already was: the scheduler's next look at the
    coordinator settles it).

    Args:
        coord: the coordinator the scheduler drives.
    """

    def __init__(self, coord: Coordinator) -> None:
        self._coord = coord
        self._role: int | None = None

    @property
    def role(self) -> int | None:
        """The rank that holds the epoch-callback role (``None`` before the first one is named)."""
        return self._role

    async def send(self, rank: int, msg: ControlMsg) -> None:
        try:
            await self._coord.send_control(rank, msg)
        except SendError as exc:
            log.warning("%s", exc)

    async def send_each(self, rank: int, msgs: Iterable[ControlMsg]) -> None:
        """Send ``msgs`` to ``rank``, in order."""
        for msg in msgs:
            await self.send(rank, msg)

    async def broadcast(self, msg: ControlMsg) -> None:
        try:
            await self._coord.broadcast_control(msg)
        except BroadcastError as exc:
            log.warning("%s", exc)

    async def name_role(self, rank: int) -> None:
        """Give ``rank`` the role and tell every rank (the first dispatch, or a resume)."""
        self._role = rank
        await self.broadcast(SetEpochCallbackRole(rank=rank))

    async def move_role(self, rank: int) -> None:
        """Move the role to ``rank`` (its holder left, or failed a checkpoint) and tell everyone."""
        log.info("epoch callback role moves from rank %s to rank %d", self._role, rank)
        await self.name_role(rank)
