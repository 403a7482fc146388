"""One authenticated relay connection, as the coordinator sees it."""

from __future__ import annotations

import trio

from .._transport import StreamWriter
from ..wire import RecordKind, RecordOpener, RecordSealer


class RelayConn:
    """An upstream connection after ``HelloAck``: its ranks, its sealed directions, its writer.

    Records are sealed under the writer's lock, so the sequence numbers on the wire are in the
    order the records are written.
    """

    def __init__(
        self,
        *,
        host: str,
        ranks: tuple[int, ...],
        peer: str,
        stream: trio.abc.Stream,
        sealer: RecordSealer,
        opener: RecordOpener,
        write_stall_timeout: float,
        index: int,
    ) -> None:
        self.host = host
        self.ranks = ranks
        self.rank_set = frozenset(ranks)
        self.peer = peer
        self.stream = stream
        self.sealer = sealer
        self.opener = opener
        self.writer = StreamWriter(stream, write_stall_timeout=write_stall_timeout)
        self.index = index
        self.lost_reason: str | None = None
        # Backpressure bookkeeping: while the reader waits on a full channel the coordinator is
        # not reading this connection, so that time must not count towards heartbeat staleness.
        self.paused_since: float | None = None
        self.delivery_scope: trio.CancelScope | None = None
        self.closed = False

    @property
    def alive(self) -> bool:
        return self.lost_reason is None and not self.closed

    async def send_record(self, kind: RecordKind, rank: int, payload: bytes) -> None:
        sealer = self.sealer
        await self.writer.send(lambda: sealer.seal(kind, rank, payload))

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            await trio.aclose_forcefully(self.stream)

    def describe(self) -> str:
        return f"relay {self.host!r} at {self.peer} (ranks {_ranks_text(self.ranks)})"


def _ranks_text(ranks: tuple[int, ...]) -> str:
    if len(ranks) <= 8:
        return str(list(ranks))
    return f"[{ranks[0]}..{ranks[-1]}, {len(ranks)} ranks]"


def ranks_text(ranks: tuple[int, ...] | list[int]) -> str:
    return _ranks_text(tuple(ranks))
