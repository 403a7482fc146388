"""The timeline: a bounded, subscribable record of control-plane events (SPEC §8)."""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import IO, Any

import attrs
import trio

from .events import Event, Note


@attrs.frozen
class Stamped:
    """An event with its time: milliseconds since the timeline started (monotonic)."""

    t_ms: float
    event: Event

    def to_dict(self) -> dict[str, Any]:
        return {"t_ms": round(self.t_ms, 3), "kind": self.event.kind, **self.event.to_dict()}


class _Subscriber:
    def __init__(self, send: trio.MemorySendChannel[Stamped]) -> None:
        self.send = send
        self.dropped = 0

    def offer(self, stamped: Stamped) -> None:
        """Queue ``stamped`` without waiting: a subscriber that is behind drops it (counted),
        one that is gone gets nothing."""
        try:
            self.send.send_nowait(stamped)
        except trio.WouldBlock:
            self.dropped += 1
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


# The latest notes of each name kept apart from the window of events (the status page reads
# the epochs' coverage from them): as many as the page lists epochs.
NOTES_KEPT = 32


class Timeline:
    """Stamps and keeps events; never blocks the control plane.

    Args:
        capacity: events kept in memory; past it the oldest are dropped (and counted).
        jsonl_path: if given, every event is appended to this file as one JSON object per line.
    """

    def __init__(self, capacity: int = 100_000, jsonl_path: str | os.PathLike[str] | None = None):
        self._events: deque[Stamped] = deque(maxlen=capacity)
        self.dropped = 0
        self._t0 = time.monotonic()
        self._subscribers: list[_Subscriber] = []
        self._notes: dict[str, deque[dict[str, Any]]] = {}
        self._file: IO[str] | None = None
        if jsonl_path is not None:
            self._file = open(jsonl_path, "a", encoding="utf-8")

    def event(self, ev: Event) -> Stamped:
        """Record ``ev`` now; returns the stamped entry."""
        stamped = Stamped((time.monotonic() - self._t0) * 1000.0, ev)
        if len(self._events) == self._events.maxlen:
            self.dropped += 1
        self._events.append(stamped)
        if isinstance(ev, Note):
            kept = self._notes.get(ev.what)
            if kept is None:
                kept = self._notes[ev.what] = deque(maxlen=NOTES_KEPT)
            kept.append(ev.fields)
        if self._file is not None:
            self._file.write(json.dumps(stamped.to_dict(), default=str) + "\n")
            self._file.flush()
        for sub in self._subscribers:
            sub.offer(stamped)
        return stamped

    def events(self, kind: type[Event] | None = None) -> list[Event]:
        """Events kept so far (optionally only those of one class), oldest first."""
        return [s.event for s in self._events if kind is None or isinstance(s.event, kind)]

    def last_note(self, what: str) -> dict[str, Any] | None:
        """The fields of the latest :class:`~flodl_trio.events.Note` named ``what`` (None if
        there was none), kept even after the event itself left the window of ``capacity``."""
        kept = self._notes.get(what)
        return kept[-1] if kept else None

    def recent_notes(self, what: str) -> list[dict[str, Any]]:
        """The fields of the latest :data:`NOTES_KEPT` notes named ``what``, oldest first, kept
        like :meth:`last_note`'s."""
        return list(self._notes.get(what, ()))

    def stamped(self) -> list[Stamped]:
        return list(self._events)

    @asynccontextmanager
    async def subscribe(self, buffer: int = 256) -> AsyncIterator[Subscription]:
        """A receive channel of new events; a slow subscriber drops (``.dropped`` counts)."""
        send, recv = trio.open_memory_channel[Stamped](buffer)
        sub = _Subscriber(send)
        self._subscribers.append(sub)
        try:
            async with recv:
                yield Subscription(recv, sub)
        finally:
            self._subscribers.remove(sub)
            send.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class Subscription:
    """What :meth:`Timeline.subscribe` yields: iterate it; ``dropped`` says how many were lost."""

    def __init__(self, recv: trio.MemoryReceiveChannel[Stamped], sub: _Subscriber) -> None:
        self.channel = recv
        self._sub = sub

    @property
    def dropped(self) -> int:
        return self._sub.dropped

    async def receive(self) -> Stamped:
        return await self.channel.receive()

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Stamped:
        try:
            return await self.channel.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
