"""Listening: bind TCP on one port for every address, and accept connections into tasks.

One accept loop serves the four places that accept (formation, the relay's rank port, the port
mux, the status page): it ends when its listener closes, backs off on the accept errors that
mean "out of file descriptors or memory right now" (as ``trio.serve_listeners`` does) and hands
each connection to its own task.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ._keepalive import AcceptedKeepAlive, KeepAlive
from ._transport import STREAM_GONE, close_all

log = logging.getLogger("flodl_trio.transport")

# The errnos trio.serve_listeners also treats as "back off and retry" rather than fatal.
ACCEPT_RETRY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
ACCEPT_RETRY_SLEEP = 0.1
# As trio.open_tcp_listeners: the kernel truncates it to its own ceiling (net.core.somaxconn,
# 4,096 on current Linux), which is what a burst of relays waiting for a pending-handshake slot
# needs; socket.SOMAXCONN is only what this Python was built with (128 on some builds).
LISTEN_BACKLOG = 0xFFFF
# Connections accepted at most per pass through the scheduler with ``drain_while``.
DRAIN_MAX = 256


async def serve_each(
    listener: trio.abc.Listener[Any],
    handler: Callable[[Any], Awaitable[object]],
    *,
    what: str,
    handler_nursery: trio.Nursery | None = None,
    on_accept: Callable[[Any], None] | None = None,
    keepalive: KeepAlive | None = None,
    room: Callable[[], Awaitable[object]] | None = None,
    dispatch: Callable[[Any], Any] | None = None,
    drain_while: Callable[[], bool] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept from ``listener`` until it is closed; run ``handler(stream)`` in a task each.

    Args:
        listener: any ``trio.abc.Listener``.
        handler: owns the stream it is given (closes it).
        what: who accepts, for the log (``"relay 'host-a'"``).
        handler_nursery: where the handlers run (default: a nursery of this call, which then
            returns only once they are done).
        on_accept: called with each stream before its handler starts.
        keepalive: TCP keepalive for each accepted TCP connection (``AcceptedKeepAlive``).
        room: awaited before each ``accept``: while it waits, connections stay in the
            listener's backlog (a bound on pending handshakes, ``_pending``).
        dispatch: called with each stream (after ``on_accept``): returns None when it dealt
            with the connection itself (no task), else the stream to give ``handler``.
        drain_while: with a ``trio.SocketListener`` (or a listener with an
            ``accept_nowait()`` that returns None when none waits, as the port mux's legs):
            after each ``accept``, also accept the connections already waiting, while this
            returns True, without a pass through the scheduler each (``SocketListener.accept``
            makes one per connection, so a burst of thousands overflows the kernel's backlog:
            dialers then wait for TCP retransmits, a second and more).
        task_status: ``started()`` once the loop runs.

    Raises:
        OSError: an accept error other than running out of descriptors or memory.
    """
    def take(stream: Any) -> None:
        give_keepalive(stream)
        if on_accept is not None:
            on_accept(stream)
        if dispatch is not None:
            stream = dispatch(stream)
            if stream is None:
                return
        nursery.start_soon(handler, stream)

    give_keepalive = AcceptedKeepAlive(listener, keepalive).apply  # Linux: on the listener
    raw = _shared_socket(listener) if drain_while is not None else None
    try:
        # Given a handler nursery, no nursery of our own: its exit is a schedule point.
        async with (trio.open_nursery() if handler_nursery is None
                    else contextlib.nullcontext(handler_nursery)) as nursery:
            task_status.started()
            await _accept_loop(listener, take, what=what, room=room, raw=raw,
                               drain_while=drain_while)
    finally:
        if raw is not None:
            raw.detach()  # the listener owns the descriptor


def _shared_socket(listener: Any) -> socket.socket | None:
    """A stdlib socket object on the listening descriptor of a ``trio.SocketListener`` (not
    owning it: detach it, never close it), to accept without a checkpoint; else None."""
    if not isinstance(listener, trio.SocketListener):
        return None
    fd = listener.socket.fileno()
    if fd < 0:
        return None
    # The descriptor stays non-blocking (trio's): accept() raises BlockingIOError when none wait.
    return socket.socket(fileno=fd)


async def _accept_loop(listener: trio.abc.Listener[Any], take: Callable[[Any], None], *,
                       what: str, room: Callable[[], Awaitable[object]] | None,
                       raw: socket.socket | None,
                       drain_while: Callable[[], bool] | None) -> None:
    while True:
        if room is not None:
            await room()
        try:
            stream = await listener.accept()
        except STREAM_GONE:
            return
        except OSError as exc:
            if exc.errno not in ACCEPT_RETRY_ERRNOS:
                raise
            # Out of file descriptors and the like: back off instead of spinning.
            log.warning("%s: accept failed (%r); retrying in %gs", what, exc,
                        ACCEPT_RETRY_SLEEP)
            await trio.sleep(ACCEPT_RETRY_SLEEP)
            continue
        take(stream)
        if drain_while is None:
            continue
        queued = getattr(listener, "accept_nowait", None)  # the port mux's legs
        for _ in range(DRAIN_MAX):  # bounded: then the scheduler's turn again
            if not drain_while():
                break
            if raw is not None:
                try:
                    conn, _ = raw.accept()
                except OSError:  # none waiting (EAGAIN), or an error the next accept meets
                    break
                take(trio.SocketStream(trio.socket.from_stdlib_socket(conn)))
            elif queued is not None and (stream := queued()) is not None:
                take(stream)
            else:
                break


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
        sock.listen(LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return trio.SocketListener(sock)
