"""The relay's small shared types: how it ended, and one local rank's link."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import attrs
import trio

from .._config import RelayConfig
from ..net._socket_io import Reader, write_now
from ..net._transport import StreamWriter
from ..wire import FrameCodec, RankLinkSession

# Bytes a rank may send before the pump starts that the relay reads ahead (SPEC §5 phase 1).
EARLY_LIMIT = 1 << 20


@attrs.frozen
class RelayExit:
    """How a relay ended. ``clean`` is False when the upstream link broke rather than closed."""

    reason: str
    clean: bool = True


class RankLink:
    """One local rank's loopback connection and its outbound queue.

    The queue holds ``queue_size`` frames; the upstream reader never waits on it. A rank that
    lets it overflow for ``write_stall_timeout`` (or whose writer makes no progress for that
    long) is dropped, so its siblings never wait on it.
    """

    def __init__(self, rank: int, stream: trio.abc.Stream, config: RelayConfig, *,
                 host: str = "", codec: FrameCodec | None = None,
                 reader: Reader | None = None) -> None:
        self.rank = rank
        # The rank's frames in (the pump's rank reader feeds it): where they are cut, whether
        # they are still forwarded (not once the coordinator fenced the rank), and, with a
        # codec, which are the rank's verified Heartbeats (coalesced into Liveness records).
        self.session = RankLinkSession(rank, host=host, codec=codec)
        self.stream = stream
        # The stream's reads (the handshake's reader carries on: it knows whether the socket
        # was drained).
        self.reader = reader if reader is not None else Reader(stream)
        self.writer = StreamWriter(stream, write_stall_timeout=config.write_stall_timeout)
        self.queue_size = config.queue_size
        self.write_stall_timeout = config.write_stall_timeout
        self._pending: deque[bytes] = deque()
        self._more = trio.Event()
        # Starts the pump's writer for this link (attach_writer), called once: the first time
        # the kernel does not take a frame at once, or when the queue ends. Until then a rank
        # that keeps up costs no writer task.
        self._start_writer: Callable[[], None] | None = None
        # The pump's writer has a batch in flight (taken from the queue, not yet written).
        self.writing = False
        # The rank's socket, for writing at once while the writer is idle (loopback only).
        self._socket = stream.socket if isinstance(stream, trio.SocketStream) else None
        self._ending = False
        self.full_since: float | None = None
        self.gone = False
        self.writer_done = trio.Event()
        self.reader_done = trio.Event()
        # Why the relay dropped this rank itself (RankDropped upstream instead of RankExit).
        self.dropped: str | None = None
        # What the rank sent while the relay was still accepting ranks, and whether its link
        # already ended then; the pump starts from these.
        self.early = bytearray()
        self.early_eof = False

    def read_early(self, data: bytes | bytearray) -> None:
        """Keep what the rank sent while the relay was still accepting ranks."""
        self.early += data

    def early_ended(self) -> None:
        """The rank's link ended while the relay was still accepting ranks (after every rank
        was in: the pump reports its ``RankExit``)."""
        self.early_eof = True

    def take_early(self) -> bytes:
        """What the rank sent before the pump started (then forgotten)."""
        early, self.early = bytes(self.early), bytearray()
        return early

    def stop(self) -> None:
        """Carry nothing more to or from the rank: its reader ended, or the relay closes."""
        self.gone = True

    def reader_ended(self) -> None:
        """The rank's frames ended (EOF, a reset, a drop): what is queued for it is still
        written, then its link is half-closed."""
        self.gone = True
        self.reader_done.set()
        self.end_queue()

    def drop(self, reason: str) -> bool:
        """The relay cuts the rank off for ``reason`` (its reader then reports
        ``RankDropped``); False when the link was gone or dropped already."""
        if self.gone or self.dropped is not None:
            return False
        self.dropped = reason
        self.gone = True
        self.end_queue()
        return True

    async def write(self, batch: list[bytes]) -> None:
        """Write ``batch`` (taken with :meth:`next_batch`) in one write; meanwhile
        :meth:`offer` queues behind it instead of writing at once."""
        self.writing = True
        await self.writer.send(batch[0] if len(batch) == 1 else b"".join(batch))
        self.writing = False

    @property
    def fenced(self) -> str | None:
        """The coordinator's reason when it fenced this rank: its frames are no longer
        forwarded."""
        return self.session.fenced

    def offer(self, blob: bytes, now: float) -> bool:
        """Queue ``blob`` for the rank without waiting; False when the queue has been over
        ``queue_size`` for ``write_stall_timeout`` (the rank must be dropped)."""
        if self.gone or self._ending:
            return True
        if not self._pending and not self.writing and self._socket is not None:
            blob = blob[write_now(self._socket, blob):]
            if not blob:
                return True
        self._pending.append(blob)
        self._wake_writer()
        if len(self._pending) > self.queue_size:
            if self.full_since is None:
                self.full_since = now
            elif now - self.full_since >= self.write_stall_timeout:
                return False
        return True

    def end_queue(self) -> None:
        """No more frames: the writer delivers what is queued, then half-closes."""
        self._ending = True
        self._wake_writer()

    def attach_writer(self, start: Callable[[], None]) -> None:
        """``start()`` runs the pump's writer for this link; it is called once, the first
        time there is something to write that the kernel did not take at once (or the queue
        ends) -- at once if that happened already."""
        self._start_writer = start
        if self._pending or self._ending:
            self._wake_writer()

    def _wake_writer(self) -> None:
        self._more.set()
        start, self._start_writer = self._start_writer, None
        if start is not None:
            start()

    async def next_batch(self, limit: int = 64) -> list[bytes] | None:
        """Up to ``limit`` queued frames (waiting for one); None once ended and drained."""
        while not self._pending:
            if self._ending:
                return None
            self._more = trio.Event()
            await self._more.wait()
        batch = [self._pending.popleft() for _ in range(min(limit, len(self._pending)))]
        if len(self._pending) <= self.queue_size:
            self.full_since = None
        return batch
