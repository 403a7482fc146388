"""The chaos proxy's sockets: fixed kernel buffers, and how many bytes they hold."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
import termios
from contextlib import suppress
from typing import Literal

import trio

SOCKET_BUFFER = 65536
"""SO_RCVBUF and SO_SNDBUF asked for on every proxy socket (Linux reserves twice the value)."""

_SIOCOUTQNSD = 0x894B  # Linux: bytes written to a TCP socket and not sent yet


def fix_buffers(sock: trio.socket.SocketType) -> None:
    """Give ``sock`` fixed kernel buffers, which also turns the kernel's autotuning of them off."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)


async def dial(target: tuple[str, int]) -> trio.SocketStream:
    """Connect to ``target`` (an already checked loopback address) with fixed buffers.

    They are set before ``connect`` because the window scale is agreed in the handshake.

    Raises:
        OSError: the target refused or could not be reached.
    """
    host, port = target
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    sock = trio.socket.socket(family, socket.SOCK_STREAM)
    try:
        fix_buffers(sock)
        await sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


def queued(stream: trio.SocketStream | None, which: Literal["unread", "unsent"]) -> int:
    """Bytes the kernel holds for ``stream``: received and unread, or written and unsent.

    0 for a missing or closed stream, and for "unsent" where the kernel cannot tell (not Linux).
    """
    if stream is None or stream.socket.fileno() < 0:
        return 0
    request = termios.FIONREAD if which == "unread" else _SIOCOUTQNSD
    with suppress(OSError):
        raw = fcntl.ioctl(stream.socket.fileno(), request, bytes(4))
        return int(struct.unpack("i", raw)[0])
    return 0


def kernel_buffer(stream: trio.SocketStream | None, which: Literal["receive", "send"]) -> int:
    """The size the kernel gave ``stream``'s receive or send buffer (0 for a missing/closed one)."""
    if stream is None or stream.socket.fileno() < 0:
        return 0
    option = socket.SO_RCVBUF if which == "receive" else socket.SO_SNDBUF
    return int(stream.socket.getsockopt(socket.SOL_SOCKET, option))
