"""One listening port, many protocols: connections are routed by their first 4 bytes (SPEC §2.2).

:func:`open_port_mux` accepts on the given listeners and reads each connection's channel magic in
its *own* task under ``peek_timeout``, so a silent dialer (a port scanner, a wedged relay) never
delays anyone else. The routed stream is a :class:`PrefixedStream` that replays the bytes the peek
consumed, so code behind a leg reads exactly what it would have read from a direct listener.

Example::

    async with open_port_mux(listeners, peek_timeout=5.0) as mux:
        relay_stream = await mux.control.accept()   # starts with b"\\xe2\\x17\\x0d\\xf1"
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import trio

from ._errors import ConfigError
from .net._keepalive import KeepAlive
from .net._listen import serve_each
from .net._pending import PendingHandshakes, min_shed_age, unread_probe
from .net._prefixed_stream import PeerAddress, PrefixedStream, remote_address_of
from .net._transport import STREAM_GONE

__all__ = [
    "CHANNEL_MAGIC_CONTROL",
    "CHANNEL_MAGIC_DATA",
    "CHANNEL_MAGIC_JOIN",
    "CHANNEL_MAGIC_RENDEZVOUS",
    "LEG_NAMES",
    "MAGIC_LEN",
    "MuxLeg",
    "MuxStats",
    "PortMux",
    "PrefixedStream",
    "open_port_mux",
]

logger = logging.getLogger(__name__)

# Shown (repr, errors, docs) as this module's own, where users import it from.
PrefixedStream.__module__ = __name__

# Same values as the wire package; repeated here so the mux does not depend on the codec.
CHANNEL_MAGIC_RENDEZVOUS = b"\xe0\x17\x0d\xf1"
CHANNEL_MAGIC_DATA = b"\xe1\x17\x0d\xf1"
CHANNEL_MAGIC_CONTROL = b"\xe2\x17\x0d\xf1"
CHANNEL_MAGIC_JOIN = b"\xe3\x17\x0d\xf1"
MAGIC_LEN = 4

LEG_NAMES = ("control", "data", "rendezvous", "join", "status")
DROP_REASONS = ("unknown_magic", "eof_before_magic", "peek_timeout", "no_listener", "queue_full",
                "shed")
_LEG_BY_PREFIX = (
    (CHANNEL_MAGIC_CONTROL, "control"),
    (CHANNEL_MAGIC_DATA, "data"),
    (CHANNEL_MAGIC_RENDEZVOUS, "rendezvous"),
    (CHANNEL_MAGIC_JOIN, "join"),
)
_HTTP_METHOD_CHARS = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ")
_PEEK_CHUNK = 4096

def leg_for_magic(prefix: bytes) -> str | None:
    """The leg name for a connection's first 4 bytes, or None when they match no leg.

    Status (HTTP) connections start with the request line itself: any method token (``GET``,
    ``HEAD``, ``PUT``, ``OPTIONS``, ...), so that the status responder can answer every method,
    with 405 where it must, instead of the mux dropping the connection unanswered. The binary
    magics start with a non-ASCII byte, so the two can never be confused.

    >>> [leg_for_magic(p) for p in (b"GET ", b"HEAD", b"PUT ", b"OPTI", CHANNEL_MAGIC_CONTROL)]
    ['status', 'status', 'status', 'status', 'control']
    >>> leg_for_magic(b"get ") is None and leg_for_magic(b"SSH-") is None
    True
    """
    head = bytes(prefix[:MAGIC_LEN])
    leg = next((leg for magic, leg in _LEG_BY_PREFIX if head == magic), None)
    if leg is None and len(head) == MAGIC_LEN and _is_http_method_start(head):
        leg = "status"
    return leg


def _is_http_method_start(head: bytes) -> bool:
    # An upper-case method token, then (if it is shorter than 4) the space after it.
    token, space, _ = head.partition(b" ")
    return bool(token) and all(c in _HTTP_METHOD_CHARS for c in token) and (
        bool(space) or len(token) == MAGIC_LEN)


class MuxStats:
    """Counters of one mux; read them at any time.

    Attributes:
        accepted: connections accepted from the listeners.
        routed: connections handed to each leg, by leg name.
        dropped: connections closed by the mux, by reason (see ``DROP_REASONS``).
    """

    def __init__(self) -> None:
        self.accepted = 0
        self.routed: dict[str, int] = dict.fromkeys(LEG_NAMES, 0)
        self.dropped: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)

    def count_accepted(self) -> None:
        """One more connection accepted from the listeners."""
        self.accepted += 1

    def count_routed(self, leg: str) -> None:
        """One more connection handed to ``leg``."""
        self.routed[leg] += 1

    def count_dropped(self, reason: str) -> None:
        """One more connection closed by the mux, for ``reason`` (see ``DROP_REASONS``)."""
        self.dropped[reason] += 1

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready copy of the counters."""
        return {
            "accepted": self.accepted,
            "routed": dict(self.routed),
            "dropped": dict(self.dropped),
        }


class MuxLeg(trio.abc.Listener[PrefixedStream]):
    """One leg of a :class:`PortMux`: a listener of the connections that carried its magic.

    Attributes:
        name: the leg name (``"control"``, ``"status"``, ...).
        wanted: whether connections for this leg are queued (True once ``accept`` was called or
            when the leg was named in ``legs=``); otherwise they are dropped as ``no_listener``.
    """

    def __init__(self, name: str, *, queue_size: int, wanted: bool) -> None:
        self.name = name
        self.wanted = wanted
        self._queue_size = queue_size
        self._send, self._receive = trio.open_memory_channel[PrefixedStream](queue_size)
        self._closed = False
        self._taken: trio.Event | None = None  # set when accept takes one, while someone waits

    async def accept(self) -> PrefixedStream:
        """Wait for the next connection routed to this leg.

        Raises:
            trio.ClosedResourceError: the leg or its mux is closed (also in a task blocked here).
        """
        self.wanted = True
        try:
            stream = await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise trio.ClosedResourceError(f"port mux leg {self.name!r} is closed") from None
        self._wake()
        return stream

    def accept_nowait(self) -> PrefixedStream | None:
        """The next connection routed to this leg if one is queued, else None (no checkpoint:
        an accept loop takes a burst of them in one pass through the scheduler)."""
        try:
            stream = self._receive.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            return None
        self._wake()
        return stream

    def _wake(self) -> None:
        if self._taken is not None:
            self._taken.set()
            self._taken = None

    @property
    def full(self) -> bool:
        """True while the leg queues as many routed connections as it may (its taker is
        behind): the mux then stops accepting, so the kernel's backlog holds the dialers."""
        return (not self._closed and self.wanted
                and self._send.statistics().current_buffer_used >= self._queue_size)

    async def wait_not_full(self) -> None:
        """Return once :attr:`full` is False (the taker took one, or the leg closed)."""
        while self.full:  # each round ends when accept takes a stream or the leg closes
            if self._taken is None:
                self._taken = trio.Event()
            await self._taken.wait()

    async def _offer_within(self, stream: PrefixedStream, seconds: float) -> str | None:
        """Queue ``stream``, waiting up to ``seconds`` for room; the drop reason when it was
        not queued."""
        reason = self._offer(stream)
        if reason != "queue_full":
            return reason
        with trio.move_on_after(seconds):
            while (reason := self._offer(stream)) == "queue_full":  # ends at the deadline
                await self.wait_not_full()
        return reason

    def _offer(self, stream: PrefixedStream) -> str | None:
        """Queue ``stream``; returns the drop reason when it was not queued."""
        if self._closed or not self.wanted:
            return "no_listener"
        try:
            self._send.send_nowait(stream)
        except trio.WouldBlock:
            return "queue_full"
        except STREAM_GONE:
            return "no_listener"
        return None

    async def aclose(self) -> None:
        """Close the leg: queued streams are closed, ``accept`` raises ``ClosedResourceError``.

        Idempotent; the mux keeps routing other legs and drops this one's connections.
        """
        self._closed = True
        self._wake()
        queued: list[PrefixedStream] = []
        while True:  # bounded by the queue size
            try:
                queued.append(self._receive.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
        self._send.close()
        self._receive.close()
        for stream in queued:
            await trio.aclose_forcefully(stream)
        await trio.lowlevel.checkpoint()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("serving" if self.wanted else "unserved")
        return f"<MuxLeg {self.name} {state}>"


class PortMux:
    """The legs of a running port mux; made by :func:`open_port_mux`.

    Attributes:
        control, data, rendezvous, join, status: the :class:`MuxLeg` for each channel.
        stats: the :class:`MuxStats` counters.
        listeners: the underlying listeners (closed when the mux stops).
    """

    def __init__(
        self,
        listeners: Sequence[trio.abc.Listener[trio.abc.Stream]],
        *,
        peek_timeout: float,
        legs: Sequence[str],
        queue_size: int,
        max_peeking: int | None = None,
        keepalive: KeepAlive | None = None,
    ) -> None:
        self.listeners = tuple(listeners)
        self.keepalive = keepalive
        self.peek_timeout = peek_timeout
        self._peeking = PendingHandshakes(max_peeking if max_peeking is not None else 1 << 62,
                                          min_age=min_shed_age(peek_timeout))
        self.stats = MuxStats()
        self._legs = {
            name: MuxLeg(name, queue_size=queue_size, wanted=name in legs) for name in LEG_NAMES
        }
        self.control = self._legs["control"]
        self.data = self._legs["data"]
        self.rendezvous = self._legs["rendezvous"]
        self.join = self._legs["join"]
        self.status = self._legs["status"]
        self._cancel_scope = trio.CancelScope()
        self._stopped = trio.Event()

    def stop(self) -> None:
        """Stop accepting and close everything (synchronous; :meth:`aclose` also waits)."""
        self._cancel_scope.cancel()

    async def wait_closed(self) -> None:
        """Wait until the mux has stopped (``abort``, :meth:`stop` or leaving the block)."""
        await self._stopped.wait()

    async def aclose(self) -> None:
        """Stop the mux and wait until every leg, queued stream and listener is closed."""
        self.stop()
        await self._stopped.wait()

    async def run(self, abort: trio.Event | None, *, task_status: trio.TaskStatus[None]) -> None:
        try:
            with self._cancel_scope:
                async with trio.open_nursery() as nursery:
                    for listener in self.listeners:
                        nursery.start_soon(self._accept_loop, listener, nursery)
                    if abort is not None:
                        nursery.start_soon(self._stop_on, abort)
                    task_status.started()
        finally:
            # Close even when cancelled from outside; every step below is bounded.
            with trio.CancelScope(shield=True):
                for leg in self._legs.values():
                    await leg.aclose()
                for listener in self.listeners:
                    await trio.aclose_forcefully(listener)
                self._stopped.set()

    async def _stop_on(self, abort: trio.Event) -> None:
        await abort.wait()
        self.stop()

    async def _accept_loop(
        self, listener: trio.abc.Listener[trio.abc.Stream], nursery: trio.Nursery
    ) -> None:
        # Ends when the listener closes or the mux is cancelled.
        await serve_each(listener, self._route, what="port mux", handler_nursery=nursery,
                         keepalive=self.keepalive, room=self._room, dispatch=self._dispatch,
                         drain_while=self._has_room)

    def _has_room(self) -> bool:
        # _room's condition, without waiting.
        return self._peeking.has_room() and not any(leg.full for leg in self._legs.values())

    async def _room(self) -> None:
        # Accept only while a connection can wait for its magic without shedding a fresh one,
        # and no leg's queue is full: otherwise the kernel's listen backlog holds the dialers
        # (a burst of relays waits there instead of being shed and re-dialing).
        await self._peeking.room()
        for leg in self._legs.values():
            await leg.wait_not_full()

    def _dispatch(self, stream: trio.abc.Stream) -> trio.abc.Stream | None:
        """Route a connection whose magic is already here at once, without a task of its own
        (a relay sends it as it connects, so in a burst it waits in the backlog with it);
        else the stream (holding what was read) for a ``_route`` task, which waits for it."""
        self.stats.count_accepted()
        if isinstance(stream, trio.SocketStream) and (fd := stream.socket.fileno()) >= 0:
            try:
                data = os.read(fd, _PEEK_CHUNK)
            except OSError:  # nothing yet (EAGAIN), or an error _route's read meets again
                data = b""
            if data:
                remote = remote_address_of(stream)
                leg_name = leg_for_magic(data) if len(data) >= MAGIC_LEN else None
                routed = PrefixedStream(stream, data, remote_address=remote)
                if leg_name is not None and self._legs[leg_name]._offer(routed) is None:
                    self.stats.count_routed(leg_name)
                    return None
                stream = routed  # _route reads the rest of the magic, or drops it
        self._peeking.admit()
        return stream

    async def _route(self, stream: trio.abc.Stream) -> None:
        remote: PeerAddress | None = remote_address_of(stream)
        routed = False
        try:
            received = bytearray()
            saw_eof = False
            # At most max_peeking connections wait for their magic (the accept loop waits for
            # room); the oldest is shed once stale, so silent dialers cannot pile up (or keep a
            # relay out) until peek_timeout.
            # One scope for both ends of the wait: shed (cancelled) or peek_timeout.
            with self._peeking.slot(unread=unread_probe(stream),
                                    deadline=trio.current_time() + self.peek_timeout) as pending:
                scope = pending.scope
                with scope:
                    saw_eof = await _peek(stream, received)
            if scope.cancelled_caught and trio.current_time() < scope.deadline:
                reason = "shed"
            elif len(received) >= MAGIC_LEN:
                leg_name = leg_for_magic(bytes(received))
                if leg_name is None:
                    reason = "unknown_magic"
                else:
                    # What _dispatch read is in ``received`` now: wrap the socket's stream.
                    base = stream.transport_stream if isinstance(stream, PrefixedStream) \
                        else stream
                    routed_stream = PrefixedStream(base, bytes(received), remote_address=remote)
                    # A leg filled since this connection was accepted: wait for its taker.
                    dropped = await self._legs[leg_name]._offer_within(routed_stream,
                                                                       self.peek_timeout)
                    if dropped is None:
                        routed = True
                        self.stats.count_routed(leg_name)
                        return
                    reason = dropped
            else:
                reason = "eof_before_magic" if saw_eof else "peek_timeout"
            self.stats.count_dropped(reason)
            logger.debug("port mux: dropped connection from %s (%s)", remote, reason)
        finally:
            if not routed:
                await trio.aclose_forcefully(stream)


async def _peek(stream: trio.abc.Stream, received: bytearray) -> bool:
    """Read into ``received`` until it holds the magic; True if the stream ended first."""
    while len(received) < MAGIC_LEN:  # at most 4 rounds: each adds >= 1 byte
        try:
            chunk = await stream.receive_some(_PEEK_CHUNK)
        except trio.BrokenResourceError:  # reset before sending the magic
            chunk = b""
        if not chunk:
            return True
        received += chunk
    return False


async def _checked_or_closed(
    listeners: Sequence[trio.abc.Listener[trio.abc.Stream]], *, peek_timeout: float,
    queue_size: int, legs: Sequence[str],
) -> tuple[str, ...]:
    """The legs served from the start, or ``ConfigError`` once ``listeners`` are closed (they
    were handed to the mux: a bad call must not leak them)."""
    try:
        if math.isnan(peek_timeout) or peek_timeout < 0:
            raise ConfigError(f"peek_timeout must be >= 0 seconds, got {peek_timeout!r}")
        if queue_size < 1:
            raise ConfigError(f"queue_size must be >= 1, got {queue_size!r}")
        return _check_legs(legs)
    except ConfigError:
        for listener in listeners:
            await trio.aclose_forcefully(listener)
        raise


def _check_legs(legs: Sequence[str]) -> tuple[str, ...]:
    if isinstance(legs, str):
        legs = (legs,)
    unknown = [name for name in legs if name not in LEG_NAMES]
    if unknown:
        raise ConfigError(f"unknown port mux leg(s) {unknown}; expected some of {list(LEG_NAMES)}")
    return tuple(legs)


@asynccontextmanager
async def open_port_mux(
    listeners: trio.abc.Listener[trio.abc.Stream] | Sequence[trio.abc.Listener[trio.abc.Stream]],
    *,
    peek_timeout: float,
    abort: trio.Event | None = None,
    legs: Sequence[str] = ("control", "status"),
    queue_size: int = 64,
    max_peeking: int | None = None,
    keepalive: KeepAlive | None = None,
) -> AsyncIterator[PortMux]:
    """Route the connections of ``listeners`` to legs by their channel magic.

    Args:
        listeners: one listener or several (e.g. from :func:`trio.open_tcp_listeners`); the mux
            owns them and closes them when it stops.
        peek_timeout: seconds a connection has to deliver its first 4 bytes.
        abort: when set, the mux stops as if the block had been left.
        legs: the legs served from the start. Connections to any other leg are dropped
            (``no_listener``) until someone calls that leg's ``accept``.
        queue_size: routed connections each leg queues. While a leg's queue is full the mux
            stops accepting; a connection routed to a full leg waits up to ``peek_timeout`` for
            room, then is dropped (``queue_full``).
        max_peeking: at most this many connections may be waiting for their magic. With that
            many, the mux stops accepting (the kernel's listen backlog holds the dialers) until
            one is routed or the oldest has waited ``min(0.5, peek_timeout / 20)`` seconds;
            that one is then shed (dropped as ``shed``) for the next. None: no limit.
        keepalive: TCP keepalive for every accepted TCP connection (see ``_keepalive``).

    Yields:
        The running :class:`PortMux`. Leaving the block (or ``abort``) stops accepting, closes
        queued streams and the listeners; ``accept`` on any leg then raises
        :class:`trio.ClosedResourceError`. Streams already handed out belong to their taker.

    Raises:
        ConfigError: an unknown leg name, a negative or NaN ``peek_timeout``, or
            ``queue_size`` < 1 (the listeners are closed).
    """
    if isinstance(listeners, trio.abc.Listener):
        listeners = [listeners]
    served = await _checked_or_closed(listeners, peek_timeout=peek_timeout,
                                      queue_size=queue_size, legs=legs)
    mux = PortMux(listeners, peek_timeout=peek_timeout, legs=served, queue_size=queue_size,
                  max_peeking=max_peeking, keepalive=keepalive)
    body_error: Exception | None = None
    async with trio.open_nursery() as nursery:
        await nursery.start(mux.run, abort)
        try:
            yield mux
        except Exception as exc:
            # Re-raised below, outside the nursery, so the caller sees its own exception
            # rather than an ExceptionGroup wrapping it.
            body_error = exc
        finally:
            mux.stop()
    if body_error is not None:
        raise body_error
