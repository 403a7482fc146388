"""Listen/dial helpers, dial retry, exact reads under deadlines, and peer naming.

Nothing here resolves names: peers are reported by numeric address (a reverse lookup per accept
stalls for seconds on a machine whose resolver is unreachable).
"""

from __future__ import annotations

import ipaddress
import logging
import math
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ._errors import HandshakeError, WireError
from ._timeouts import CONNECT_RETRY_INTERVAL

log = logging.getLogger("flodl_trio.transport")

# What a read, write or accept raises once the stream (or listener) is gone: the peer reset or
# closed it (Broken), or we closed it ourselves (Closed). Every "the link ended" handler uses it.
STREAM_GONE = (trio.BrokenResourceError, trio.ClosedResourceError)

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


async def listen_tcp(port: int, *, host: str | None,
                     attempts: int = 16) -> list[trio.SocketListener]:
    """Bind every address of ``host`` (None: every interface, IPv4 and IPv6) on **one** port.

    ``trio.open_tcp_listeners(0)`` gives each address family its own free port, so a peer that
    resolves the name to the other family (``localhost`` to ``::1``) dials a port nobody
    published. Here port 0 picks the first family's free port and binds the others to it,
    retrying with a fresh port when that one is taken in another family.

    Raises:
        OSError: the OS refused the bind, or no port was free in every family after
            ``attempts`` tries.
    """
    last: OSError | None = None
    for _ in range(attempts):
        listeners = list(await trio.open_tcp_listeners(port, host=host))
        ports = {lst.socket.getsockname()[1] for lst in listeners}
        if port != 0 or len(ports) == 1:
            return listeners
        chosen = int(listeners[0].socket.getsockname()[1])
        others = [(lst.socket.family, lst.socket.getsockname()) for lst in listeners[1:]]
        await close_all(listeners[1:])
        bound = listeners[:1]
        try:
            for family, sockname in others:
                bound.append(await _listen_on(family, (sockname[0], chosen, *sockname[2:])))
        except OSError as exc:
            await close_all(bound)
            last = exc
            continue
        return bound
    raise OSError(f"expected one free port for every address of {host or 'every interface'}, "
                  f"got none after {attempts} tries; last error: {last!r}")


async def _listen_on(family: int, sockaddr: tuple[Any, ...]) -> trio.SocketListener:
    # What trio.open_tcp_listeners does for one address, with the port given.
    sock = trio.socket.socket(family, trio.socket.SOCK_STREAM)
    try:
        if hasattr(trio.socket, "SO_REUSEADDR") and not hasattr(trio.socket, "SO_EXCLUSIVEADDRUSE"):
            sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
        if family == trio.socket.AF_INET6:
            sock.setsockopt(trio.socket.IPPROTO_IPV6, trio.socket.IPV6_V6ONLY, 1)
        await sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return trio.SocketListener(sock)


async def dial(target: DialTarget, *, connect_timeout: float, what: str) -> trio.abc.Stream:
    """Connect to ``target``, retrying every 0.5 s until ``connect_timeout`` passes.

    Raises:
        HandshakeError: no connection within the deadline; names the target and the last error.
    """
    deadline = trio.current_time() + connect_timeout
    attempts = 0
    last: BaseException | None = None
    while True:
        attempts += 1
        try:
            with trio.move_on_at(deadline):
                if callable(target):
                    return await target()
                stream = await trio.open_tcp_stream(target[0], target[1])
                _set_nodelay(stream)
                return stream
        except OSError as exc:
            last = exc
        if trio.current_time() + CONNECT_RETRY_INTERVAL > deadline:
            break
        await trio.sleep(CONNECT_RETRY_INTERVAL)
    where = format_address(target) if not callable(target) else getattr(target, "__name__", "?")
    raise HandshakeError(
        f"{what}: expected a connection to {where} within {connect_timeout:g}s, got none after "
        f"{attempts} attempt(s); last error: {last!r}"
    )


def _set_nodelay(stream: Any) -> None:
    sock = getattr(stream, "socket", None)
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


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
