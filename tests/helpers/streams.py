"""Bytes from a stream, bounded: until a condition holds, the stream ends, a number of bytes
arrived (never more are read) or a time passed; and a stream that passes everything on, for
the ones that change one thing."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import trio


async def receive_until(stream: trio.abc.ReceiveStream, enough: Callable[[bytearray], bool], *,
                        most: int = 1 << 20, patience: float = math.inf) -> bytes:
    """What ``stream`` received when ``enough(data)`` held, it ended (EOF), ``most`` bytes had
    arrived, or ``patience`` seconds had passed: whichever came first."""
    data = bytearray()
    with trio.move_on_after(patience):
        while not enough(data) and len(data) < most:  # each round reads a byte, or ends
            chunk = await stream.receive_some(most - len(data))
            if not chunk:
                break
            data += chunk
    return bytes(data)


async def read_exactly(stream: trio.abc.ReceiveStream, count: int, *,
                       patience: float = math.inf) -> bytes:
    """``count`` bytes, or fewer if the stream ends (or ``patience`` runs out) first."""
    return await receive_until(stream, lambda data: len(data) >= count, most=count,
                               patience=patience)


class Relayed(trio.abc.HalfCloseableStream):
    """A stream that passes everything to ``inner``: the base of the ones that change one
    thing."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some(max_bytes)

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()
