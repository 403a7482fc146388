"""Fault injection: a real loopback TCP proxy and a stream wrapper that cut, stall, corrupt,
delay, drip or reset the bytes passing through them.

A :class:`FaultPlan` says what goes wrong on one connection. :func:`open_chaos_proxy` applies
plans to real TCP connections (the point is what the OS does: FIN, RST, a full window);
:class:`FaultyStream` applies the same plan to any :class:`trio.abc.Stream`, typically a
:class:`~flodl_trio.testing.MemoryStream` under ``MockClock``.

Directions: ``"up"`` is client→server (dialer→target), ``"down"`` is server→client, ``"both"``
applies the fault to each direction independently. Byte offsets count from the first byte of that
direction; an offset fault triggers once exactly that many bytes have been forwarded.
"""

from __future__ import annotations

import ipaddress
import math
import socket
import struct
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager, suppress
from typing import Literal

import attrs
import trio

from ._errors import ConfigError
from .testing import _ConflictGuard

__all__ = ["ChaosProxy", "Direction", "Fault", "FaultPlan", "FaultyStream", "ProxiedConnection"]

Direction = Literal["up", "down", "both"]
_DIRECTIONS = ("up", "down", "both")
_CHUNK = 65536


def _drip_piece(rate: float) -> int:
    # ~20 writes a second keeps a high rate cheap while a low rate still trickles 1 byte at a time.
    return max(1, int(rate // 20))


@attrs.frozen
class Fault:
    """One fault of a :class:`FaultPlan` (see the builder methods for what each kind does).

    Attributes:
        kind: ``"cut"``, ``"stall"``, ``"corrupt"``, ``"delay"``, ``"drip"`` or ``"reset"``.
        direction: ``"up"``, ``"down"`` or ``"both"``.
        offset: the byte offset for cut / stall / corrupt / reset (None: reset at once).
        seconds: the hold time of a delay.
        rate: bytes per second of a drip.
        xor: the mask a corrupt applies.
    """

    kind: str
    direction: Direction
    offset: int | None = None
    seconds: float = 0.0
    rate: float = 0.0
    xor: int = 0


@attrs.frozen
class _Schedule:
    """A plan seen from one direction: what happens at which offset."""

    cut_at: int | None
    stall_at: int | None
    reset_at: int | None
    corrupt: Mapping[int, int]
    delay: float
    rate: float | None

    def action_at(self, offset: int) -> str | None:
        for action, at in (
            ("reset", self.reset_at),
            ("cut", self.cut_at),
            ("stall", self.stall_at),
        ):
            if at is not None and offset >= at:
                return action
        return None

    def room(self, offset: int) -> int | None:
        """Bytes that may pass before the next cut / stall / reset boundary (None: unlimited)."""
        boundaries = (self.cut_at, self.stall_at, self.reset_at)
        ahead = [at - offset for at in boundaries if at is not None and at > offset]
        return min(ahead) if ahead else None

    def corrupted(self, data: bytes | bytearray, offset: int) -> bytes:
        if not self.corrupt:
            return bytes(data)
        out = bytearray(data)
        for at, mask in self.corrupt.items():
            if offset <= at < offset + len(out):
                out[at - offset] ^= mask
        return bytes(out)


class FaultPlan:
    """The faults of one connection, built with chainable methods.

    Example::

        FaultPlan().corrupt(12, "up").stall(4096, "down")
    """

    def __init__(self) -> None:
        self._faults: list[Fault] = []

    @property
    def faults(self) -> tuple[Fault, ...]:
        """The faults added so far, in order."""
        return tuple(self._faults)

    def _add(self, fault: Fault) -> FaultPlan:
        if fault.direction not in _DIRECTIONS:
            raise ConfigError(
                f"{fault.kind}: direction must be one of {_DIRECTIONS}, got {fault.direction!r}"
            )
        self._faults.append(fault)
        return self

    @staticmethod
    def _offset(kind: str, value: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{kind}: expected a byte offset int >= 0, got {value!r}")
        return value

    def cut(self, after_bytes: int, direction: Direction) -> FaultPlan:
        """Once ``after_bytes`` passed in ``direction``, close both sides gracefully (FIN)."""
        return self._add(Fault("cut", direction, self._offset("cut", after_bytes)))

    def stall(self, after_bytes: int, direction: Direction) -> FaultPlan:
        """After ``after_bytes``, forward nothing more in ``direction``; the connection stays open.

        The stalled side is no longer read, so its writer eventually blocks on a full window.
        """
        return self._add(Fault("stall", direction, self._offset("stall", after_bytes)))

    def corrupt(self, at_byte: int, direction: Direction, *, xor: int = 0xFF) -> FaultPlan:
        """XOR the byte at offset ``at_byte`` of ``direction`` with ``xor`` (1..255)."""
        if isinstance(xor, bool) or not isinstance(xor, int) or not 1 <= xor <= 0xFF:
            raise ConfigError(f"corrupt: xor must be an int in 1..255, got {xor!r}")
        return self._add(Fault("corrupt", direction, self._offset("corrupt", at_byte), xor=xor))

    def delay(self, seconds: float, direction: Direction) -> FaultPlan:
        """Hold each chunk ``seconds`` before forwarding it (in order, one chunk at a time)."""
        if not (isinstance(seconds, int | float) and math.isfinite(seconds) and seconds >= 0):
            raise ConfigError(f"delay: expected finite seconds >= 0, got {seconds!r}")
        return self._add(Fault("delay", direction, seconds=float(seconds)))

    def drip(self, bytes_per_second: float, direction: Direction) -> FaultPlan:
        """Forward at most ``bytes_per_second`` in ``direction``, in small timed pieces."""
        rate = bytes_per_second
        if not (isinstance(rate, int | float) and math.isfinite(rate) and rate > 0):
            raise ConfigError(f"drip: expected a finite bytes_per_second > 0, got {rate!r}")
        return self._add(Fault("drip", direction, rate=float(rate)))

    def reset(self, after_bytes: int | None = None, direction: Direction = "both") -> FaultPlan:
        """RST the connection: at once (the default), or once ``after_bytes`` passed."""
        offset = None if after_bytes is None else self._offset("reset", after_bytes)
        return self._add(Fault("reset", direction, offset))

    @property
    def resets_at_once(self) -> bool:
        """Whether the plan resets the connection before any byte passes."""
        return any(f.kind == "reset" and f.offset is None for f in self._faults)

    def schedule(self, direction: Literal["up", "down"]) -> _Schedule:
        """Compile the faults that apply to one direction."""
        mine = [f for f in self._faults if f.direction in (direction, "both")]

        def first(kind: str) -> int | None:
            offsets = [f.offset for f in mine if f.kind == kind and f.offset is not None]
            return min(offsets) if offsets else None

        corrupt: dict[int, int] = {}
        for f in mine:
            if f.kind == "corrupt" and f.offset is not None:
                corrupt[f.offset] = corrupt.get(f.offset, 0) ^ f.xor
        rates = [f.rate for f in mine if f.kind == "drip"]
        return _Schedule(
            cut_at=first("cut"),
            stall_at=first("stall"),
            reset_at=0 if self.resets_at_once else first("reset"),
            corrupt={at: mask for at, mask in corrupt.items() if mask},
            delay=sum(f.seconds for f in mine if f.kind == "delay"),
            rate=min(rates) if rates else None,
        )

    def __repr__(self) -> str:
        return f"FaultPlan({', '.join(f'{f.kind}@{f.offset}:{f.direction}' for f in self._faults)})"


def _loopback(address: tuple[str, int], what: str, *, port_zero_ok: bool) -> tuple[str, int]:
    try:
        host, port = address
    except (TypeError, ValueError):
        raise ConfigError(f"{what}: expected a (host, port) tuple, got {address!r}") from None
    host = "127.0.0.1" if host == "localhost" else host
    try:
        is_loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        is_loopback = False
    if not is_loopback:
        raise ConfigError(f"{what}: the chaos proxy only uses 127.0.0.0/8 or ::1, got {host!r}")
    lowest = 0 if port_zero_ok else 1
    if isinstance(port, bool) or not isinstance(port, int) or not lowest <= port <= 65535:
        raise ConfigError(f"{what}: expected a port in {lowest}..65535, got {port!r}")
    return host, port


class ProxiedConnection:
    """One connection through a :class:`ChaosProxy`.

    Attributes:
        index: accept order, from 0.
        client_address: the dialer's (host, port).
        bytes_up: bytes forwarded client→server.
        bytes_down: bytes forwarded server→client.
        plan: the :class:`FaultPlan` in force (changing it applies from the next chunk on).
        ended_by: why it ended: ``"eof"``, ``"cut"``, ``"reset"``, ``"kill"``, ``"error"``,
            ``"target refused"`` or ``"proxy closed"``; None while live.
    """

    def __init__(self, index: int, client: trio.SocketStream, plan: FaultPlan) -> None:
        self.index = index
        try:
            peer_host, peer_port, *_ = client.socket.getpeername()
        except OSError:  # the dialer already went away; keep the record anyway
            peer_host, peer_port = "?", 0
        self.client_address: tuple[str, int] = (peer_host, peer_port)
        self.bytes_up = 0
        self.bytes_down = 0
        self.plan = plan
        self.ended_by: str | None = None
        self._client = client
        self._server: trio.SocketStream | None = None
        self._scope = trio.CancelScope()
        self._done = trio.Event()

    @property
    def closed(self) -> bool:
        """Whether both sockets of this connection are closed."""
        return self._done.is_set()

    def _end(self, how: str) -> None:
        if self.ended_by is None:
            self.ended_by = how
        self._scope.cancel()

    async def close(self) -> None:
        """Close both sides now and wait until they are closed."""
        self._end("kill")
        await self._done.wait()

    async def reset(self) -> None:
        """RST the client side, close the server side, and wait until both are closed."""
        self._end("reset")
        await self._done.wait()

    def __repr__(self) -> str:
        state = f"ended by {self.ended_by}" if self.closed else "live"
        return (
            f"<ProxiedConnection #{self.index} up={self.bytes_up} down={self.bytes_down} {state}>"
        )


class ChaosProxy:
    """A fault-injecting TCP proxy on loopback; create it with :func:`open_chaos_proxy`.

    Attributes:
        address: the (host, port) it listens on; dial this instead of ``target``.
        target: the (host, port) it forwards to.
    """

    def __init__(
        self,
        listener: trio.SocketListener,
        target: tuple[str, int],
        nursery: trio.Nursery,
        close_grace: float,
    ) -> None:
        host, port, *_ = listener.socket.getsockname()
        self.address: tuple[str, int] = (host, port)
        self.target = target
        self._listener = listener
        self._nursery = nursery
        self._close_grace = close_grace
        self._default_plan = FaultPlan()
        self._plans: dict[int, FaultPlan] = {}
        self._connections: list[ProxiedConnection] = []

    @property
    def connections(self) -> list[ProxiedConnection]:
        """Every connection accepted so far, in accept order."""
        return list(self._connections)

    def plan(self, fault_plan: FaultPlan, connection: int | None = None) -> None:
        """Set the faults of every future connection (None) or of the ``connection``-th one.

        A plan for a specific index wins over the default. Set for a connection that is already
        live, it applies from its next chunk on (offsets still count from its first byte).
        """
        if connection is None:
            self._default_plan = fault_plan
            return
        if isinstance(connection, bool) or not isinstance(connection, int) or connection < 0:
            raise ConfigError(f"plan: connection must be an index >= 0, got {connection!r}")
        self._plans[connection] = fault_plan
        if connection < len(self._connections):
            self._connections[connection].plan = fault_plan

    async def kill_all(self) -> None:
        """Close every live connection now (both sides) and wait until they are closed."""
        await self._end_all("kill")

    async def reset_all(self) -> None:
        """RST every live connection on its client side and wait until they are closed."""
        await self._end_all("reset")

    async def _end_all(self, how: str) -> None:
        live = [c for c in self._connections if not c.closed]
        for record in live:
            record._end(how)
        for record in live:
            await record._done.wait()
        await trio.lowlevel.checkpoint()

    async def _serve(self) -> None:
        try:
            while True:
                client = await self._listener.accept()
                index = len(self._connections)
                plan = self._plans.get(index, self._default_plan)
                record = ProxiedConnection(index, client, plan)
                self._connections.append(record)
                self._nursery.start_soon(self._run, record, name=f"chaos-proxy#{index}")
        finally:
            with trio.CancelScope(shield=True):
                await self._listener.aclose()

    async def _run(self, record: ProxiedConnection) -> None:
        try:
            with record._scope:
                if record.plan.resets_at_once:
                    record._end("reset")
                    return
                try:
                    record._server = await trio.open_tcp_stream(*self.target)
                except OSError:
                    record._end("target refused")
                    return
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump, record, "up", record._client, record._server)
                    nursery.start_soon(self._pump, record, "down", record._server, record._client)
            if record.ended_by is None:
                record.ended_by = "eof"
        finally:
            # Still unset here means the proxy's own nursery was cancelled: the block was left.
            if record.ended_by is None:
                record.ended_by = "proxy closed"
            with trio.CancelScope(shield=True):
                await self._finish(record)
            record._done.set()

    async def _pump(
        self,
        record: ProxiedConnection,
        direction: Literal["up", "down"],
        source: trio.SocketStream,
        sink: trio.SocketStream,
    ) -> None:
        offset = 0
        try:
            while True:
                schedule = await _obey_due_fault(record, direction, offset)
                room = schedule.room(offset)
                data = await source.receive_some(_CHUNK if room is None else min(room, _CHUNK))
                if not data:
                    await sink.send_eof()
                    return
                if schedule.delay:
                    await trio.sleep(schedule.delay)
                sent = 0
                while sent < len(data):
                    # Re-read the plan for every piece: ChaosProxy.plan() may change it meanwhile.
                    schedule = await _obey_due_fault(record, direction, offset)
                    room = schedule.room(offset)
                    step = len(data) - sent if room is None else min(room, len(data) - sent)
                    if schedule.rate is not None:
                        step = min(step, _drip_piece(schedule.rate))
                        await trio.sleep(step / schedule.rate)
                    await sink.send_all(schedule.corrupted(data[sent : sent + step], offset))
                    sent += step
                    offset += step
                    if direction == "up":
                        record.bytes_up += step
                    else:
                        record.bytes_down += step
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            record._end("error")

    async def _finish(self, record: ProxiedConnection) -> None:
        ends = [s for s in (record._client, record._server) if s is not None]
        if record.ended_by == "reset":
            # SO_LINGER {on, 0 s}: close() sends RST at once instead of FIN.
            with suppress(OSError):
                linger = struct.pack("ii", 1, 0)
                record._client.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        elif record.ended_by == "cut":
            # FIN both ways first, then swallow what the peers still send: closing a socket with
            # unread bytes makes the kernel send RST, which would turn the graceful cut into a
            # reset and lose the bytes delivered before it.
            for end in ends:
                with suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await end.send_eof()
            with trio.move_on_after(self._close_grace):
                async with trio.open_nursery() as nursery:
                    for end in ends:
                        nursery.start_soon(_drain, end)
        for end in ends:
            await end.aclose()


async def _obey_due_fault(
    record: ProxiedConnection, direction: Literal["up", "down"], offset: int
) -> _Schedule:
    """Return the current schedule if no fault is due at ``offset``; otherwise never return.

    A stall just sleeps; a cut or reset ends the connection, whose cancelled scope then unwinds
    this sleep along with the rest of the connection's tasks.
    """
    schedule = record.plan.schedule(direction)
    action = schedule.action_at(offset)
    if action is not None:
        if action != "stall":
            record._end(action)
        await trio.sleep_forever()
    return schedule


async def _drain(stream: trio.SocketStream) -> None:
    with suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        while await stream.receive_some(_CHUNK):
            pass


@asynccontextmanager
async def open_chaos_proxy(
    target: tuple[str, int],
    *,
    listen: tuple[str, int] = ("127.0.0.1", 0),
    close_grace: float = 0.5,
) -> AsyncIterator[ChaosProxy]:
    """Run a fault-injecting TCP proxy in front of ``target`` for the duration of the block.

    Args:
        target: the loopback (host, port) to forward to.
        listen: the loopback (host, port) to listen on; port 0 picks a free one.
        close_grace: after a cut, how long to swallow late bytes before closing the sockets.

    Yields:
        The :class:`ChaosProxy`; leaving the block closes every connection and the listener.

    Raises:
        ConfigError: an address is not loopback (127.0.0.0/8 or ::1) or a port is invalid.
    """
    target = _loopback(target, "target", port_zero_ok=False)
    if not (
        isinstance(close_grace, int | float) and math.isfinite(close_grace) and close_grace >= 0
    ):
        raise ConfigError(f"close_grace: expected finite seconds >= 0, got {close_grace!r}")
    host, port = _loopback(listen, "listen", port_zero_ok=True)
    listener, *extra = await trio.open_tcp_listeners(port, host=host)
    for other in extra:
        await other.aclose()
    body_error: BaseException | None = None
    async with trio.open_nursery() as nursery:
        proxy = ChaosProxy(listener, target, nursery, close_grace)
        nursery.start_soon(proxy._serve, name="chaos-proxy-accept")
        try:
            yield proxy
        except BaseException as exc:
            # Re-raised below, outside the nursery, so callers see their own exception and not
            # an ExceptionGroup wrapping it.
            body_error = exc
        finally:
            nursery.cancel_scope.cancel()
    if body_error is not None:
        raise body_error


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
        # Bytes already taken from the wrapped stream but not returned yet: a receive cancelled
        # during its delay/drip sleep must not lose them.
        self._held = b""
        self._send_guard = _ConflictGuard("send_all on a FaultyStream")
        self._receive_guard = _ConflictGuard("receive_some on a FaultyStream")

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

    def _broken(self, what: str) -> trio.BrokenResourceError:
        return trio.BrokenResourceError(
            f"{what} after the fault plan's {self._ended} ({self.plan})"
        )

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Send ``data`` through the plan's faults for the send direction."""
        with self._send_guard.hold():
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
        await self.stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        """Half-close the wrapped stream (it must be a :class:`trio.abc.HalfCloseableStream`)."""
        if not isinstance(self.stream, trio.abc.HalfCloseableStream):
            raise TypeError(f"{type(self.stream).__name__} cannot half-close (no send_eof)")
        with self._send_guard.hold():
            if self._ended is not None:
                raise self._broken("send_eof")
            await self.stream.send_eof()

    async def aclose(self) -> None:
        """Close the wrapped stream."""
        await self.stream.aclose()
