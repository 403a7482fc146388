"""A coordinator frozen as by ``SIGSTOP``, over the in-memory network (issue 34).

A stopped process does nothing: what peers send it waits in its socket buffers (the kernel
still accepts connections and data for it), nothing it would send leaves, it closes nothing, and
its store lease is not renewed. :class:`Freeze` reproduces that for one coordinator in a Trio
run by gating everything it touches -- its listener (:class:`FrozenListener`), every stream it
accepted (:class:`FrozenStream`) and its store handle (:class:`FrozenStore`) -- at one switch.
Its own tasks still wake on their timers meanwhile, but every effect waits at a gate: their sends
leave, and their closes happen, only once it is thawed (``SIGCONT``), as when a stopped process
resumes with its clock jumped ahead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import trio

from flodl_trio import LeadershipLost
from flodl_trio.store import MemoryStore, SessionState, SessionStore


class Freeze:
    """The switch: ``freeze()`` stops the process, ``thaw()`` lets it go on."""

    def __init__(self) -> None:
        self.frozen = False
        self._thawed = trio.Event()
        self._thawed.set()
        self._closes: list[trio.abc.AsyncResource] = []

    def freeze(self) -> None:
        self.frozen = True
        self._thawed = trio.Event()

    def thaw(self) -> None:
        self.frozen = False
        self._thawed.set()

    async def gate(self) -> None:
        """Return once the process runs (at once when it does), always a checkpoint."""
        await trio.lowlevel.checkpoint()
        while self.frozen:
            await self._thawed.wait()

    async def close(self, resource: trio.abc.AsyncResource) -> None:
        """Close ``resource`` now, or, while frozen, once thawed (a stopped process closes
        nothing); never waits."""
        if not self.frozen:
            await trio.aclose_forcefully(resource)
            return
        self._closes.append(resource)
        await trio.lowlevel.checkpoint()

    async def run_closes(self) -> None:
        """The closes deferred while frozen (call after ``thaw()``)."""
        closes, self._closes = self._closes, []
        for resource in closes:
            await trio.aclose_forcefully(resource)


class FrozenStream(trio.abc.HalfCloseableStream):
    """A stream of the frozen process: bytes it read while frozen are kept for it, not lost."""

    def __init__(self, inner: Any, freeze: Freeze) -> None:
        self._inner = inner
        self._freeze = freeze
        self._held = b""

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._freeze.gate()
        await self._inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._freeze.gate()
        await self._inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self._freeze.gate()
        await self._inner.send_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if not self._held:
            self._held = bytes(await self._inner.receive_some(max_bytes))
            if not self._held:
                await self._freeze.gate()
                return b""
        await self._freeze.gate()  # cancelled while frozen: the bytes stay held
        data, self._held = self._held, b""
        return data

    async def aclose(self) -> None:
        await self._freeze.close(self._inner)


class FrozenListener(trio.abc.Listener[FrozenStream]):
    """The frozen process's listener: dials still connect (the kernel's backlog), but nothing
    is accepted until it is thawed."""

    def __init__(self, inner: Any, freeze: Freeze) -> None:
        self._inner = inner
        self._freeze = freeze

    async def accept(self) -> FrozenStream:
        await self._freeze.gate()
        stream = await self._inner.accept()
        await self._freeze.gate()
        return FrozenStream(stream, self._freeze)

    async def aclose(self) -> None:
        await self._freeze.close(self._inner)


class FrozenStore(SessionStore):
    """The frozen process's store handle: no call gets through while frozen, so its lease is
    not renewed (the test expires it, as etcd would after its TTL); a leadership lost
    meanwhile is noticed only once thawed."""

    def __init__(self, inner: MemoryStore, freeze: Freeze) -> None:
        self._inner = inner
        self._freeze = freeze
        self.description = inner.description

    async def acquire(self, *, owner: str) -> int:
        await self._freeze.gate()
        return await self._inner.acquire(owner=owner)

    async def current_leader(self) -> str | None:
        await self._freeze.gate()
        return await self._inner.current_leader()

    async def keep_leadership(self, *, task_status: trio.TaskStatus[None]
                              = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await self._inner.keep_leadership(task_status=task_status)
        except LeadershipLost:
            await self._freeze.gate()
            raise

    async def load(self) -> SessionState | None:
        await self._freeze.gate()
        return await self._inner.load()

    async def save(self, state: SessionState) -> None:
        await self._freeze.gate()
        await self._inner.save(state)

    async def publish_address(self, addresses: Sequence[tuple[str, int]]) -> None:
        await self._freeze.gate()
        await self._inner.publish_address(addresses)

    async def resolve_address(self) -> tuple[tuple[str, int], ...]:
        await self._freeze.gate()
        return await self._inner.resolve_address()

    async def release(self) -> None:
        await self._freeze.gate()
        await self._inner.release()


async def publish_once_leading(store: SessionStore, address: tuple[str, int], *,
                               limit: float = 120) -> float:
    """Publish ``address`` through ``store`` as soon as that handle leads (a coordinator on
    the in-memory network does not publish one itself); returns when (Trio clock)."""
    with trio.fail_after(limit):
        while True:
            try:
                await store.publish_address([address])
                return trio.current_time()
            except LeadershipLost:
                await trio.sleep(0.05)
