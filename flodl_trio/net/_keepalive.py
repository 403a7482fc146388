"""TCP keepalive on every connection the library opens or accepts (SPEC §4.5).

Heartbeats find a silent *process*; they do not tell the kernel that a connection is dead, so a
link that went silent without FIN or RST (a pulled cable, a frozen host) stayed open until
shutdown. With keepalive the kernel probes an idle connection and fails it (the next read or
write raises ``BrokenResourceError``), and the existing "connection lost" paths take over.

The rule: a silent peer is found within the deadline after which that end gives up on a silent
peer anyway (the coordinator's ``heartbeat_timeout``, a rank's ``coord_liveness_timeout``, a
relay's ``write_stall_timeout``):

* ``TCP_KEEPCNT`` = 3 unanswered probes;
* ``TCP_KEEPINTVL`` = deadline / 6 (at least 1 s);
* ``TCP_KEEPIDLE`` = deadline minus the probes' time (at least 1 s), so that idle + 3 probes
  = the deadline: 30 s gives 15 s idle, then probes at 5 s intervals.

Keepalive probes only a connection with nothing unacknowledged in flight, and the coordinator
writes heartbeats to every joined relay (during formation too), so a peer that went silent
mid-write was left to TCP's retransmissions (about 15 minutes). ``TCP_USER_TIMEOUT`` bounds
that: unacknowledged data older than ``unacked`` ends the connection. Linux applies it to a peer
that keeps a zero window too, so ``unacked`` is *twice* the longer of the silent-peer deadline
and the end's ``write_stall_timeout``: a slow reader is still ended by the write-stall rule
first, with its own reason (``KeepAlive.within(deadline, unacked=...)``; unset when not given).

An infinite deadline keeps ``SO_KEEPALIVE`` on with the system's intervals. Options the
platform lacks are skipped; a socket that refuses one is left as it is (never an error).

Where one listener accepts many connections (the coordinator's port, a relay's rank port),
:class:`AcceptedKeepAlive` sets the options once on the listening socket: Linux copies a
listening socket's options into every connection it accepts, so each accepted connection
needs no system calls of its own (five per connection before; issue 38). The first accepted
connection is checked, and on a kernel that did not copy them (or any other platform, or a
listener that is not a plain TCP one) each connection is set as before.
"""

from __future__ import annotations

import logging
import math
import socket
import sys
from typing import Any

import attrs

__all__ = ["KEEPALIVE_PROBES", "AcceptedKeepAlive", "KeepAlive", "enable_keepalive",
           "socket_of"]

log = logging.getLogger("flodl_trio.transport")

KEEPALIVE_PROBES = 3
# The kernel takes these in whole seconds, and Linux caps the idle time at 32767 s.
_MAX_IDLE = 32767


@attrs.frozen
class KeepAlive:
    """Keepalive settings for one end of a connection.

    Attributes:
        deadline: seconds within which a silent peer must be found (``math.inf``: system
            defaults).
        idle: seconds of silence before the first probe (``TCP_KEEPIDLE``).
        interval: seconds between probes (``TCP_KEEPINTVL``).
        probes: unanswered probes that end the connection (``TCP_KEEPCNT``).
    """

    deadline: float
    idle: int
    interval: int
    probes: int
    unacked: float = math.inf  # seconds before unacknowledged data ends it (TCP_USER_TIMEOUT)

    @classmethod
    def within(cls, deadline: float, *, write_stall: float | None = None) -> KeepAlive:
        """The settings that find a silent peer within ``deadline`` seconds (module docstring);
        with ``write_stall`` (that end's ``write_stall_timeout``), also ``TCP_USER_TIMEOUT`` at
        twice the longer of the two."""
        unacked = math.inf if write_stall is None else 2 * max(deadline, write_stall)
        if math.isinf(deadline):
            return cls(deadline, 0, 0, KEEPALIVE_PROBES, unacked)
        interval = max(1, int(deadline / (2 * KEEPALIVE_PROBES)))
        idle = min(_MAX_IDLE, max(1, int(deadline - KEEPALIVE_PROBES * interval)))
        return cls(deadline, idle, interval, KEEPALIVE_PROBES, unacked)

    def options(self) -> list[tuple[int, int, int]]:
        """``(level, option, value)`` for every option this platform has."""
        opts = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
        user_timeout = getattr(socket, "TCP_USER_TIMEOUT", None)
        if user_timeout is not None and not math.isinf(self.unacked):
            opts.append((socket.IPPROTO_TCP, user_timeout,
                         min(2**31 - 1, max(1, int(self.unacked * 1000)))))
        if math.isinf(self.deadline):
            return opts
        for name, value in (("TCP_KEEPIDLE", self.idle), ("TCP_KEEPINTVL", self.interval),
                            ("TCP_KEEPCNT", self.probes)):
            option = getattr(socket, name, None)
            if option is not None:
                opts.append((socket.IPPROTO_TCP, option, value))
        return opts


def socket_of(stream: Any) -> Any:
    """The socket under ``stream`` and its wrappers (SSLStream, the port mux's), or None."""
    for _ in range(8):  # bounded walk down wrapper chains
        sock = getattr(stream, "socket", None)
        if sock is not None:
            return sock
        inner = getattr(stream, "transport_stream", None) or getattr(stream, "stream", None)
        if inner is None:
            return None
        stream = inner
    return None


def _tcp_socket(obj: Any) -> Any:
    """The TCP (IPv4 or IPv6) socket under ``obj``, or None."""
    sock = socket_of(obj)
    if sock is None or getattr(sock, "type", None) != socket.SOCK_STREAM:
        return None
    if getattr(sock, "family", None) not in (socket.AF_INET, socket.AF_INET6):
        return None
    return sock


def enable_keepalive(stream: Any, keepalive: KeepAlive | None) -> bool:
    """Turn keepalive on for the TCP socket under ``stream``.

    Returns:
        Whether there was a TCP socket to set (in-memory streams have none).
    """
    if keepalive is None:
        return False
    sock = _tcp_socket(stream)
    if sock is None:
        return False
    for level, option, value in keepalive.options():
        try:
            sock.setsockopt(level, option, value)
        except OSError as exc:  # a platform that lists an option but refuses it
            log.debug("keepalive option %d=%d refused: %r", option, value, exc)
    return True


class AcceptedKeepAlive:
    """Keepalive for every connection one listener accepts (module docstring): set once on
    the listening socket where the kernel copies it into each accepted connection, else on
    each connection (:meth:`apply`)."""

    def __init__(self, listener: Any, keepalive: KeepAlive | None) -> None:
        self._keepalive = keepalive
        # None: set on each connection; False: on the listener, not yet seen on a connection.
        self._inherited: bool | None = None
        if keepalive is None or not sys.platform.startswith("linux"):
            return
        sock = _tcp_socket(listener)
        if sock is None:
            return
        try:
            for level, option, value in keepalive.options():
                sock.setsockopt(level, option, value)
        except OSError as exc:
            log.debug("keepalive on the listening socket refused (%r): set per connection", exc)
            return
        self._inherited = False

    def apply(self, stream: Any) -> None:
        """Give the accepted ``stream`` the settings (nothing to do once the kernel was seen
        copying them from the listener)."""
        keepalive = self._keepalive
        if keepalive is None or self._inherited:
            return
        if self._inherited is False:
            sock = _tcp_socket(stream)
            if sock is not None and _has(sock, keepalive):
                self._inherited = True
                return
            self._inherited = None
        enable_keepalive(stream, keepalive)


def _has(sock: Any, keepalive: KeepAlive) -> bool:
    """``sock`` has the last option of ``keepalive`` at its value (one system call: a kernel
    that copies a listening socket's options copies them all)."""
    level, option, value = keepalive.options()[-1]
    try:
        return bool(sock.getsockopt(level, option) == value)
    except OSError:
        return False
