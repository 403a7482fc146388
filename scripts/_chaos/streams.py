"""Streams and dialers that misbehave on purpose, for the in-memory fault scenarios."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from flodl_trio.chaos import FaultPlan, FaultyStream
from flodl_trio.testing import MemoryNetwork, MemoryStream


class FaultyFirstDial:
    """A dialer whose first connection goes through ``FaultyStream(plan)``; re-dials are clean.

    Attributes:
        attempts: the client ends of every connection made, in order.
        dialed_at: the Trio time of each dial.
        faulty: the FaultyStream of the first connection (its ``plan`` may be changed live).
    """

    def __init__(self, net: MemoryNetwork, name: str, plan: FaultPlan) -> None:
        self.net = net
        self.name = name
        self.plan = plan
        self.attempts: list[MemoryStream] = []
        self.dialed_at: list[float] = []
        self.faulty: FaultyStream | None = None

    async def __call__(self) -> trio.abc.Stream:
        stream = await self.net.connect(self.name)
        self.attempts.append(stream)
        self.dialed_at.append(trio.current_time())
        if len(self.attempts) == 1:
            self.faulty = FaultyStream(stream, self.plan, direction_of_send="up")
            return self.faulty
        return stream

    def peer(self, attempt: int) -> str:
        """The peer name the listener side reports for that attempt (``mem:<name>:<n>``)."""
        return f"mem:{self.name}:{self.attempts[attempt].connection.index}"


class _Forwarding(trio.abc.HalfCloseableStream):
    """Forwards every call to ``inner``; subclasses override what they change."""

    def __init__(self, inner: trio.abc.HalfCloseableStream) -> None:
        self.inner = inner

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        data: bytes = await self.inner.receive_some(max_bytes)
        return data

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()


class RecordingStream(_Forwarding):
    """Keeps a copy of every byte sent and received."""

    def __init__(self, inner: trio.abc.HalfCloseableStream) -> None:
        super().__init__(inner)
        self.sent = bytearray()
        self.received = bytearray()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.sent += data
        await self.inner.send_all(data)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        data = await super().receive_some(max_bytes)
        self.received += data
        return data


class DuplicateOneSend(_Forwarding):
    """The first ``send_all`` once ``after`` bytes were sent goes out twice.

    The relay writes whole sealed records in each ``send_all``, so after the handshake this
    replays one batch of records inside the live connection.
    """

    def __init__(self, inner: trio.abc.HalfCloseableStream, *, after: int) -> None:
        super().__init__(inner)
        self.after = after
        self.sent = 0
        self.duplicated: bytes | None = None
        self.duplicated_at: float | None = None

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        payload = bytes(data)
        await self.inner.send_all(payload)
        if self.sent >= self.after and self.duplicated is None:
            self.duplicated = payload
            self.duplicated_at = trio.current_time()
            await self.inner.send_all(payload)
        self.sent += len(payload)


def plain_dialer(net: MemoryNetwork, name: str) -> Callable[[], Any]:
    async def dial() -> trio.abc.Stream:
        return await net.connect(name)

    return dial
