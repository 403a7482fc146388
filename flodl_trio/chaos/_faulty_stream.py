"""FaultyStream: the same fault plans over any trio stream (memory streams under MockClock)."""

from __future__ import annotations

from typing import Literal

import trio

from .._errors import ConfigError
from ..net._memory_stream import ConflictGuard
from ._plan import FaultPlan, _drip_piece, _Schedule


class FaultyStream(trio.abc.HalfCloseableStream):
    """Apply a :class:`FaultPlan` to any :class:`trio.abc.Stream` (works under ``MockClock``).

    Bytes passed to :meth:`send_all` travel ``direction_of_send``; received bytes travel the
    other way. A cut closes the wrapped stream (later sends raise
    :class:`trio.BrokenResourceError`, receives return ``b""``); a stall blocks (cancellably)
    forever at its offset; a reset calls the wrapped stream's ``reset()`` / ``abort()`` if it has
    one (e.g. :class:`~flodl_trio.testing.MemoryStream`), else ``aclose()``, and every later call
    raises :class:`trio.BrokenResourceError`.

    Args:
        stream: the stream to wrap; it is owned (closed) by this wrapper.
        plan: the faults to apply.
        direction_of_send: ``"up"`` when this is the dialer's end, ``"down"`` for the server end.

    Attributes:
        bytes_sent: bytes forwarded by :meth:`send_all` (the offset of the send direction).
        bytes_received: bytes returned by :meth:`receive_some` (the offset of the other).
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        plan: FaultPlan,
        *,
        direction_of_send: Literal["up", "down"] = "up",
    ) -> None:
        if direction_of_send not in ("up", "down"):
            raise ConfigError(
                f"direction_of_send must be 'up' or 'down', got {direction_of_send!r}"
            )
        self.stream = stream
        self.plan = plan
        self.bytes_sent = 0
        self.bytes_received = 0
        self._send_direction: Literal["up", "down"] = direction_of_send
        self._receive_direction: Literal["up", "down"] = (
            "down" if direction_of_send == "up" else "up"
        )
        self._ended: str | None = None  # "cut" or "reset" once the plan fired
        self._closed = False  # our own aclose() ran: every call raises ClosedResourceError
        self._eof_sent = False  # send_eof() ran: sending raises ClosedResourceError
        # Bytes already taken from the wrapped stream but not returned yet: a receive cancelled
        # during its delay/drip sleep must not lose them.
        self._held = b""
        self._send_guard = ConflictGuard("send_all on a FaultyStream")
        self._receive_guard = ConflictGuard("receive_some on a FaultyStream")

    async def _fire(self, action: str) -> None:
        if self._ended is not None:
            return
        self._ended = action
        breaker = getattr(self.stream, "reset", None) or getattr(self.stream, "abort", None)
        if action == "reset" and callable(breaker):
            outcome = breaker()
            if outcome is not None:
                await outcome
            await trio.lowlevel.checkpoint()
        else:
            await self.stream.aclose()

    async def _fire_due(self, offset: int, schedule: _Schedule) -> None:
        if self.plan.resets_at_once:
            await self._fire("reset")
        action = schedule.action_at(offset)
        if action in ("cut", "reset"):
            await self._fire(action)

    def _check_open(self, what: str, *, sending: bool = False) -> None:
        # Before the plan's own state: trio's stream contract says a stream we closed (or
        # half-closed, for sends) raises ClosedResourceError, even for an empty send_all.
        if self._closed:
            raise trio.ClosedResourceError(f"{what} on a FaultyStream that was closed")
        if sending and self._eof_sent:
            raise trio.ClosedResourceError(f"{what} on a FaultyStream after send_eof()")

    def _broken(self, what: str) -> trio.BrokenResourceError:
        return trio.BrokenResourceError(
            f"{what} after the fault plan's {self._ended} ({self.plan})"
        )

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Send ``data`` through the plan's faults for the send direction."""
        with self._send_guard.hold():
            self._check_open("send_all", sending=True)
            payload = bytes(data)
            schedule = self.plan.schedule(self._send_direction)
            await self._fire_due(self.bytes_sent, schedule)
            if self._ended is not None:
                raise self._broken("send_all")
            if schedule.delay:
                await trio.sleep(schedule.delay)
            sent = 0
            while sent < len(payload):
                if schedule.action_at(self.bytes_sent) == "stall":
                    await trio.sleep_forever()
                room = schedule.room(self.bytes_sent)
                step = len(payload) - sent if room is None else min(room, len(payload) - sent)
                if schedule.rate is not None:
                    step = min(step, _drip_piece(schedule.rate))
                    await trio.sleep(step / schedule.rate)
                piece = schedule.corrupted(payload[sent : sent + step], self.bytes_sent)
                await self.stream.send_all(piece)
                sent += step
                self.bytes_sent += step
                await self._fire_due(self.bytes_sent, schedule)
                if self._ended is not None and sent < len(payload):
                    raise self._broken(f"send_all with {len(payload) - sent} bytes unsent")
            await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """Receive through the plan's faults for the receive direction."""
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        with self._receive_guard.hold():
            self._check_open("receive_some")
            schedule = self.plan.schedule(self._receive_direction)
            await self._fire_due(self.bytes_received, schedule)
            if self._ended == "reset":
                raise self._broken("receive_some")
            if self._ended == "cut":
                await trio.lowlevel.checkpoint()
                return b""
            if not self._held:
                if schedule.action_at(self.bytes_received) == "stall":
                    await trio.sleep_forever()
                limits = [
                    n for n in (max_bytes, schedule.room(self.bytes_received)) if n is not None
                ]
                if schedule.rate is not None:
                    limits.append(_drip_piece(schedule.rate))
                data = await self.stream.receive_some(min(limits) if limits else None)
                if not data:
                    return b""
                self._held = schedule.corrupted(data, self.bytes_received)
                if schedule.delay:
                    await trio.sleep(schedule.delay)
                if schedule.rate is not None:
                    await trio.sleep(len(self._held) / schedule.rate)
            else:
                await trio.lowlevel.checkpoint()
            count = len(self._held) if max_bytes is None else max_bytes
            data, self._held = self._held[:count], self._held[count:]
            self.bytes_received += len(data)
            # Fire a cut or reset as soon as its offset is reached, so the peer sees it promptly.
            await self._fire_due(self.bytes_received, schedule)
            return data

    async def wait_send_all_might_not_block(self) -> None:
        """Delegate to the wrapped stream."""
        with self._send_guard.hold():
            self._check_open("wait_send_all_might_not_block", sending=True)
            await self.stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        """Half-close the wrapped stream (it must be a :class:`trio.abc.HalfCloseableStream`)."""
        if not isinstance(self.stream, trio.abc.HalfCloseableStream):
            raise TypeError(f"{type(self.stream).__name__} cannot half-close (no send_eof)")
        with self._send_guard.hold():
            self._check_open("send_eof")
            if self._ended is not None:
                raise self._broken("send_eof")
            self._eof_sent = True
            await self.stream.send_eof()

    async def aclose(self) -> None:
        """Close the wrapped stream (idempotent); later calls raise ``ClosedResourceError``."""
        self._closed = True
        await self.stream.aclose()
