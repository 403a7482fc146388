"""Listen/dial helpers, dial retry, exact reads under deadlines, and peer naming.

Nothing here resolves names: peers are reported by numeric address (a reverse lookup per accept
stalls for seconds on a machine whose resolver is unreachable).
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import math
import os
import select
import socket
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from .._errors import HandshakeError, WireError
from .._timeouts import CONNECT_RETRY_INTERVAL
from ._keepalive import KeepAlive, enable_keepalive

log = logging.getLogger("flodl_trio.transport")

# What a read, write or accept raises once the stream (or listener) is gone: the peer reset or
# closed it (Broken), or we closed it ourselves (Closed). Every "the link ended" handler uses it.
STREAM_GONE = (trio.BrokenResourceError, trio.ClosedResourceError)

T = TypeVar("T")

Address = tuple[str, int]
Dialer = Callable[[], Awaitable[trio.abc.Stream]]
DialTarget = Address | Dialer


def format_address(addr: Any) -> str:
    """``"host:port"`` (``"[v6]:port"``) for a socket address tuple; ``str()`` otherwise."""
    if isinstance(addr, tuple) and len(addr) >= 2:
        host, port = addr[0], addr[1]
        if isinstance(host, str) and ":" in host and _is_ipv6(host):
            return f"[{host}]:{port}"
        return f"{host}:{port}"
    return str(addr)


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).version == 6
    except ValueError:
        return False


def peer_of(stream: Any) -> str:
    """The numeric peer address of a stream, whatever wrappers it is inside."""
    for _ in range(8):  # bounded walk down wrapper chains (SSLStream, PrefixedStream, ...)
        remote = getattr(stream, "remote_address", None)
        if remote is not None:
            return format_address(remote)
        sock = getattr(stream, "socket", None)
        if sock is not None:
            try:
                return format_address(sock.getpeername())
            except OSError:
                return "<disconnected>"
        inner = getattr(stream, "transport_stream", None)
        if inner is None:
            break
        stream = inner
    return "<unknown peer>"


def is_local_or_private(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return False
    return ip.is_loopback or ip.is_private or ip.is_link_local


def unresolvable(exc: BaseException) -> bool:
    """``exc`` says a name does not resolve and asking again will not help: a
    ``socket.gaierror`` other than ``EAI_AGAIN`` (a temporary failure of the resolver, which
    is worth retrying)."""
    return isinstance(exc, socket.gaierror) and exc.errno != socket.EAI_AGAIN


# Told of the first failed connection attempt of a series: the error and the series' deadline
# (Trio time), so that the caller can say at once what it waits for and until when.
OnWaiting = Callable[[OSError, float], None]


async def dial(target: DialTarget, *, connect_timeout: float, what: str,
               keepalive: KeepAlive | None = None,
               on_error: Callable[[OSError, float], None] | None = None,
               retry_unresolvable: bool = False,
               on_waiting: OnWaiting | None = None) -> trio.abc.Stream:
    """Connect to ``target``, retrying every 0.5 s until ``connect_timeout`` passes.

    A TCP connection gets ``TCP_NODELAY`` and the ``keepalive`` settings (see ``_keepalive``).
    ``on_error(exc, deadline)`` is told of each failed attempt (``deadline``: when the attempts
    end, Trio clock); ``on_waiting`` the same, once, on the first attempt that fails.
    ``retry_unresolvable``: a name that does not resolve is one more failed attempt (a relay
    re-dialing a coordinator it had reached: its DNS may be catching up).

    Raises:
        HandshakeError: no connection within the deadline, names the target and the last error;
            or at once, a name that does not resolve (:func:`unresolvable`: retrying cannot
            make it resolve), naming it.
    """
    deadline = trio.current_time() + connect_timeout
    attempts = 0
    last: BaseException | None = None
    where = format_address(target) if not callable(target) else getattr(target, "__name__", "?")
    while True:
        attempts += 1
        try:
            with trio.move_on_at(deadline):
                if callable(target):
                    return await target()
                stream = await open_tcp(target[0], target[1])  # TCP_NODELAY: SocketStream's
                enable_keepalive(stream, keepalive)
                return stream
        except OSError as exc:
            if unresolvable(exc) and not retry_unresolvable:
                why = (exc.strerror or str(exc)) if callable(target) else (
                    f"cannot resolve {target[0]!r} ({exc.strerror or exc})")
                raise HandshakeError(f"{what}: {why}; a name that does not resolve is not "
                                     "retried") from exc
            last = exc
            if on_error is not None:
                on_error(exc, deadline)
            if attempts == 1 and on_waiting is not None:
                on_waiting(exc, deadline)
        if trio.current_time() + CONNECT_RETRY_INTERVAL > deadline:
            break
        await trio.sleep(CONNECT_RETRY_INTERVAL)
    raise HandshakeError(
        f"{what}: expected a connection to {where} within {connect_timeout:g}s, got none after "
        f"{attempts} attempt(s); last error: {last!r}"
    ) from last


async def open_tcp(host: str, port: int) -> trio.SocketStream:
    """``trio.open_tcp_stream(host, port)``; a numeric address is dialed with one socket and
    one ``connect``, without its happy-eyeballs machinery (a nursery, a task and a resolver
    call per attempt, about a tenth of a relay's join CPU at hundreds of relays per process).

    A connection the kernel made within the ``connect`` call (loopback always does) is used at
    once, without a pass through the scheduler to wait for it.

    Raises:
        OSError: the connection failed (refused, unreachable).
    """
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return await trio.open_tcp_stream(host, port)
    await trio.lowlevel.checkpoint_if_cancelled()
    raw = socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET,
                        socket.SOCK_STREAM)
    address: Any = (host, port)
    if "%" in host:  # a scoped IPv6 address: its scope id is only in the resolved 4-tuple
        address = socket.getaddrinfo(host, port, socket.AF_INET6, socket.SOCK_STREAM, 0,
                                     socket.AI_NUMERICHOST)[0][4]
    try:
        raw.setblocking(False)
        err = raw.connect_ex(address)
        sock = trio.socket.from_stdlib_socket(raw)
    except BaseException:
        raw.close()
        raise
    try:
        if err == errno.EINPROGRESS:
            if not _writable_now(raw):
                await trio.lowlevel.wait_writable(sock)
            err = raw.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err != 0:
            raise OSError(err, f"Error connecting to {(host, port)!r}: {os.strerror(err)}")
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


def _writable_now(raw: socket.socket) -> bool:
    """The connection ``connect`` began is made (or failed) already: no wait."""
    poller = select.poll()
    poller.register(raw, select.POLLOUT)
    return bool(poller.poll(0))


async def dial_and_handshake(
    target: DialTarget, handshake: Callable[[trio.abc.Stream], Awaitable[T]], *,
    connect_timeout: float, what: str, peer: str, expected: str,
    retry_on: tuple[type[BaseException], ...], final: tuple[type[BaseException], ...] = (),
    on_retry: Callable[[BaseException], None] | None = None,
    retry_interval: float = CONNECT_RETRY_INTERVAL, keepalive: KeepAlive | None = None,
    on_dial_error: Callable[[OSError, float], None] | None = None,
    retry_unresolvable: bool = False, on_waiting: OnWaiting | None = None,
) -> T:
    """Dial ``target`` and run ``handshake`` on the stream, re-dialing until ``connect_timeout``.

    The relay (to its coordinator) and the rank (to its relay) both need this: a peer that is
    not up yet, or that drops an attempt before confirming it, is retried every
    ``retry_interval`` seconds; anything else ends the attempts. The stream of a failed attempt
    is closed; the stream of the successful one is the caller's, inside what ``handshake``
    returns.

    Args:
        target: ``(host, port)`` or an async callable returning a stream.
        handshake: runs on each fresh stream (the caller bounds its time).
        connect_timeout: the deadline for the whole series of attempts.
        what: who is dialing, for messages (``"rank 3"``).
        peer: who is dialed, for messages (``"relay 127.0.0.1:5000"``).
        expected: what a successful attempt gives, for the final message.
        retry_on: the exceptions of ``handshake`` that mean "try again".
        final: subclasses of ``retry_on`` that end the attempts all the same.
        on_retry: told of each retried failure; it may raise to stop retrying.
        retry_interval: seconds between attempts (a cadence, never scaled).
        keepalive: TCP keepalive for each connection (see ``_keepalive``).
        on_dial_error: told of each connection that could not be made, and when the attempts
            end (see :func:`dial`).
        retry_unresolvable: see :func:`dial`.
        on_waiting: told once, of the series' first connection attempt that fails (the
            error and the deadline of the whole series, in Trio time).

    Raises:
        HandshakeError: no attempt succeeded within ``connect_timeout``; names the target and
            the last failure.
    """
    deadline = trio.current_time() + connect_timeout
    last: BaseException | None = None
    dial_failed = _DialFailures(on_dial_error, on_waiting, deadline)
    while True:
        stream = await dial(target, connect_timeout=max(0.0, deadline - trio.current_time()),
                            what=what, keepalive=keepalive, on_error=dial_failed.tell,
                            retry_unresolvable=retry_unresolvable)
        try:
            return await _handshake_or_close(stream, handshake)
        except final:
            raise
        except retry_on as exc:
            last = exc
            if on_retry is not None:
                on_retry(exc)
        if trio.current_time() + retry_interval >= deadline:
            break
        log.info("%s: attempt failed (%r); re-dialing in %gs", what, last, retry_interval)
        await trio.sleep(retry_interval)
    raise HandshakeError(f"{what}: expected {expected} from {peer} within connect_timeout="
                         f"{connect_timeout:g}s; last attempt failed: {last!r}")


class _DialFailures:
    """Tells ``on_dial_error`` of every connection of a series that could not be made, and
    ``on_waiting`` of the first one only (with the whole series' deadline)."""

    def __init__(self, on_dial_error: Callable[[OSError, float], None] | None,
                 on_waiting: OnWaiting | None, deadline: float) -> None:
        self._on_dial_error = on_dial_error
        self._on_waiting = on_waiting
        self._deadline = deadline

    def tell(self, exc: OSError, until: float) -> None:
        if self._on_dial_error is not None:
            self._on_dial_error(exc, until)
        if self._on_waiting is not None:
            on_waiting, self._on_waiting = self._on_waiting, None
            on_waiting(exc, self._deadline)


async def _handshake_or_close(
    stream: trio.abc.Stream, handshake: Callable[[trio.abc.Stream], Awaitable[T]],
) -> T:
    """What ``handshake`` returns on ``stream``; the stream is closed if it raises."""
    try:
        return await handshake(stream)
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise


async def receive_exactly(stream: trio.abc.ReceiveStream, n: int, *, what: str) -> bytes:
    """Read exactly ``n`` bytes (the caller bounds the time).

    Raises:
        WireError: EOF first; says how many bytes had arrived.
    """
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.receive_some(n - len(buf))
        if not chunk:
            if buf:
                raise WireError(f"{what}: peer closed mid-frame after {len(buf)} of {n} bytes")
            raise WireError(f"{what}: peer closed the connection before sending anything")
        buf += chunk
    return bytes(buf)


class StreamWriter:
    """The single writer of a stream: one lock, and every ``send_all`` under a stall deadline."""

    def __init__(self, stream: trio.abc.SendStream, *, write_stall_timeout: float) -> None:
        self.stream = stream
        self.write_stall_timeout = write_stall_timeout
        self._lock = trio.Lock()

    @property
    def idle(self) -> bool:
        """No write in progress (nor waiting): the caller may write directly to the socket,
        as long as it does not checkpoint before its bytes are written or handed to
        :meth:`send`."""
        return not self._lock.locked()

    async def send(self, data: bytes | Callable[[], bytes]) -> None:
        """Write ``data`` (or what ``data()`` returns, computed under the lock).

        Raises:
            trio.TooSlowError: the write did not finish within ``write_stall_timeout``.
            trio.BrokenResourceError / trio.ClosedResourceError: the stream is gone.
        """
        async with self._lock:
            payload = data() if callable(data) else data
            # A bare CancelScope is cheaper than fail_after on this per-frame path.
            with trio.CancelScope(deadline=trio.current_time() + self.write_stall_timeout) as cs:
                await self.stream.send_all(payload)
            if cs.cancelled_caught:
                raise trio.TooSlowError

    async def send_eof(self) -> bool:
        """Half-close after every queued write; False when the stream cannot half-close."""
        send_eof = getattr(self.stream, "send_eof", None)
        if send_eof is None:
            return False
        async with self._lock:
            with trio.fail_after(self.write_stall_timeout):
                await send_eof()
        return True


async def close_all(resources: Any) -> None:
    """Close every resource now, even inside a cancelled scope.

    ``aclose_forcefully`` alone is not enough in a loop: under an outer cancellation its first
    checkpoint re-raises ``Cancelled`` and the remaining resources would stay open.
    """
    with trio.CancelScope(shield=True):
        for resource in resources:
            await trio.aclose_forcefully(resource)


def deadline_text(seconds: float) -> str:
    return "no deadline" if math.isinf(seconds) else f"{seconds:g}s"
