"""The chaos proxy: a real loopback TCP proxy that applies fault plans per connection.

Backpressure: per direction the proxy holds at most one read of ``_CHUNK`` bytes in its own
memory, plus what the kernel queues on its two sockets on that path (unread on the receiving one,
unsent on the sending one). Both sockets get fixed ``SO_RCVBUF`` / ``SO_SNDBUF`` sizes
(``_sockets.SOCKET_BUFFER``). Left to autotuning, a socket the proxy reads at full speed grows
towards ``net.ipv4.tcp_rmem``'s maximum, so how much the proxy swallowed before the writer
blocked depended on the connection's history, and a writer that had just blocked was woken again
tens of milliseconds later by late ACKs and retransmissions into the grown window (trio's
clogged-stream checks saw exactly that). 64 KiB asked (128 KiB granted on Linux, the size a
socket that is never read keeps by default) is the size at which the clog stays put; measured on
Linux 6.18, fixed sizes of 128 KiB asked and more un-clogged like autotuning, and 16 KiB asked
made the kernel drop and retransmit 64 KiB loopback segments.
"""

from __future__ import annotations

import ipaddress
import math
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Literal

import trio

from .._errors import ConfigError
from ..net._transport import STREAM_GONE
from ._plan import _CHUNK, FaultPlan, _drip_piece, _Schedule
from ._sockets import dial, fix_buffers, kernel_buffer, queued


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
            A stall or a delay holds back at most the one chunk the proxy has read; the writer
            then blocks on the proxy's full socket buffers (see :meth:`buffered`).
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
        # Bytes read from one side and not yet written to the other, per direction.
        self._held: dict[str, int] = {"up": 0, "down": 0}
        self._scope = trio.CancelScope()
        self._done = trio.Event()

    @property
    def closed(self) -> bool:
        """Whether both sockets of this connection are closed."""
        return self._done.is_set()

    def use_plan(self, plan: FaultPlan) -> None:
        """Put ``plan`` in force from the next chunk on (offsets still count from the first
        byte)."""
        self.plan = plan

    def _path(self, direction: str) -> tuple[trio.SocketStream | None, ...]:
        if direction not in ("up", "down"):
            raise ConfigError(f"direction must be 'up' or 'down', got {direction!r}")
        ends = (self._client, self._server)
        return ends if direction == "up" else ends[::-1]

    def buffered(self, direction: Literal["up", "down"]) -> int:
        """Bytes of ``direction`` inside the proxy now: taken from the sender, not yet sent on.

        That is the chunk the proxy has read and not finished writing, plus the bytes its
        receiving socket holds unread and its sending socket holds unsent (Linux; elsewhere only
        the chunk and the unread bytes are counted); 0 once the connection is closed. It never
        exceeds :meth:`buffer_bound`.

        Raises:
            ConfigError: ``direction`` is not ``"up"`` or ``"down"``.
        """
        source, sink = self._path(direction)
        if self.closed:
            return 0  # whatever was left in it went with the sockets
        return self._held[direction] + queued(source, "unread") + queued(sink, "unsent")

    def buffer_bound(self, direction: Literal["up", "down"]) -> int:
        """The most :meth:`buffered` can reach in ``direction``.

        That is one read of 64 KiB plus the receive buffer of the socket the bytes arrive on and
        the send buffer of the one they leave by, as the kernel sized them (64 KiB asked for
        each, 128 KiB granted on Linux: 320 KiB per direction there). Once the proxy holds that
        much, what the writer sends stays in its own socket until that is full too, and then its
        ``send_all`` blocks: backpressure.
        """
        source, sink = self._path(direction)
        return _CHUNK + kernel_buffer(source, "receive") + kernel_buffer(sink, "send")

    def end(self, how: str) -> None:
        """Start ending the connection (``"kill"``, ``"reset"``, ...) without waiting."""
        if self.ended_by is None:
            self.ended_by = how
        self._scope.cancel()

    async def wait_closed(self) -> None:
        """Return once both sockets are closed."""
        await self._done.wait()

    async def close(self) -> None:
        """Close both sides now and wait until they are closed."""
        self.end("kill")
        await self._done.wait()

    async def reset(self) -> None:
        """RST the client side, close the server side, and wait until both are closed."""
        self.end("reset")
        await self._done.wait()

    def __repr__(self) -> str:
        state = f"ended by {self.ended_by}" if self.closed else "live"
        return (
            f"<ProxiedConnection #{self.index} up={self.bytes_up} down={self.bytes_down} {state}>"
        )

    async def run(self, target: tuple[str, int], close_grace: float) -> None:
        """Dial ``target`` and forward both ways under the plan (the proxy runs this)."""
        try:
            with self._scope:
                if self.plan.resets_at_once:
                    self.end("reset")
                    return
                try:
                    self._server = await dial(target)
                except OSError:
                    self.end("target refused")
                    return
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump, "up", self._client, self._server)
                    nursery.start_soon(self._pump, "down", self._server, self._client)
            if self.ended_by is None:
                self.ended_by = "eof"
        finally:
            # Still unset here means the proxy's own nursery was cancelled: the block was left.
            if self.ended_by is None:
                self.ended_by = "proxy closed"
            with trio.CancelScope(shield=True):
                await self._finish(close_grace)
            self._done.set()

    async def _pump(
        self,
        direction: Literal["up", "down"],
        source: trio.SocketStream,
        sink: trio.SocketStream,
    ) -> None:
        offset = 0
        try:
            while True:
                schedule = await self._obey_due_fault(direction, offset)
                room = schedule.room(offset)
                # Nothing more is read until the previous chunk is written: the one chunk is
                # all the proxy itself holds, so a sink that stops reading stops the source.
                data = await source.receive_some(_CHUNK if room is None else min(room, _CHUNK))
                if not data:
                    await sink.send_eof()
                    return
                self._held[direction] = len(data)
                if schedule.delay:
                    await trio.sleep(schedule.delay)
                sent = 0
                while sent < len(data):
                    # Re-read the plan for every piece: ChaosProxy.plan() may change it meanwhile.
                    schedule = await self._obey_due_fault(direction, offset)
                    room = schedule.room(offset)
                    step = len(data) - sent if room is None else min(room, len(data) - sent)
                    if schedule.rate is not None:
                        step = min(step, _drip_piece(schedule.rate))
                        await trio.sleep(step / schedule.rate)
                    await sink.send_all(schedule.corrupted(data[sent : sent + step], offset))
                    sent += step
                    offset += step
                    self._held[direction] = len(data) - sent
                    if direction == "up":
                        self.bytes_up += step
                    else:
                        self.bytes_down += step
        except STREAM_GONE:
            self.end("error")

    async def _obey_due_fault(self, direction: Literal["up", "down"], offset: int) -> _Schedule:
        """Return the current schedule if no fault is due at ``offset``; otherwise never return.

        A stall just sleeps; a cut or reset ends the connection, whose cancelled scope then
        unwinds this sleep along with the rest of the connection's tasks.
        """
        schedule = self.plan.schedule(direction)
        action = schedule.action_at(offset)
        if action is not None:
            if action != "stall":
                self.end(action)
            await trio.sleep_forever()
        return schedule

    async def _finish(self, close_grace: float) -> None:
        ends = [s for s in (self._client, self._server) if s is not None]
        if self.ended_by == "reset":
            # SO_LINGER {on, 0 s}: close() sends RST at once instead of FIN.
            with suppress(OSError):
                linger = struct.pack("ii", 1, 0)
                self._client.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        elif self.ended_by == "cut":
            # FIN both ways first, then swallow what the peers still send: closing a socket with
            # unread bytes makes the kernel send RST, which would turn the graceful cut into a
            # reset and lose the bytes delivered before it.
            for end in ends:
                with suppress(*STREAM_GONE):
                    await end.send_eof()
            with trio.move_on_after(close_grace):
                async with trio.open_nursery() as nursery:
                    for end in ends:
                        nursery.start_soon(_drain, end)
        for end in ends:
            await end.aclose()


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
            self._connections[connection].use_plan(fault_plan)

    async def kill_all(self) -> None:
        """Close every live connection now (both sides) and wait until they are closed."""
        await self._end_all("kill")

    async def reset_all(self) -> None:
        """RST every live connection on its client side and wait until they are closed."""
        await self._end_all("reset")

    async def _end_all(self, how: str) -> None:
        live = [c for c in self._connections if not c.closed]
        for record in live:
            record.end(how)
        for record in live:
            await record.wait_closed()
        await trio.lowlevel.checkpoint()

    async def serve(self) -> None:
        """Accept and forward until cancelled (:func:`open_chaos_proxy` runs this)."""
        try:
            while True:
                client = await self._listener.accept()
                index = len(self._connections)
                plan = self._plans.get(index, self._default_plan)
                record = ProxiedConnection(index, client, plan)
                self._connections.append(record)
                self._nursery.start_soon(record.run, self.target, self._close_grace,
                                         name=f"chaos-proxy#{index}")
        finally:
            with trio.CancelScope(shield=True):
                await self._listener.aclose()


async def _drain(stream: trio.SocketStream) -> None:
    with suppress(*STREAM_GONE):
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
    fix_buffers(listener.socket)  # accepted sockets inherit them, from their first SYN on
    body_error: BaseException | None = None
    async with trio.open_nursery() as nursery:
        proxy = ChaosProxy(listener, target, nursery, close_grace)
        nursery.start_soon(proxy.serve, name="chaos-proxy-accept")
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
