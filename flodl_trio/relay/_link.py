"""The relay's small shared types: how it ended, and one local rank's link."""

from __future__ import annotations

import attrs
import trio

from .._config import RelayConfig
from .._transport import StreamWriter

# Bytes a rank may send before the pump starts that the relay reads ahead (SPEC §5 phase 1).
EARLY_LIMIT = 1 << 20


@attrs.frozen
class RelayExit:
    """How a relay ended. ``clean`` is False when the upstream link broke rather than closed."""

    reason: str
    clean: bool = True


class RankLink:
    """One local rank's loopback connection and its outbound queue."""

    def __init__(self, rank: int, stream: trio.abc.Stream, config: RelayConfig) -> None:
        self.rank = rank
        self.stream = stream
        self.writer = StreamWriter(stream, write_stall_timeout=config.write_stall_timeout)
        self.out_send, self.out_recv = trio.open_memory_channel[bytes](config.queue_size)
        self.gone = False
        self.writer_done = trio.Event()
        # What the rank sent while the relay was still accepting ranks, and whether its link
        # already ended then; the pump starts from these.
        self.early = bytearray()
        self.early_eof = False
