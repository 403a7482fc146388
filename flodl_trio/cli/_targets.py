"""Where ``flodl-trio relay --coordinator`` dials: one ``HOST:PORT``, a fixed list of them
(tried in turn on every attempt, each attempt beginning after the address the previous one
connected to), or ``etcd://HOST:PORT/PREFIX`` / ``etcds://...`` (a
:class:`~flodl_trio.relay.StoreDialer`: the leader's address, read from the coordinators'
session store again on every attempt, and watched while connected, so that a relay that lost
its coordinator, or whose coordinator froze, finds the standby that took over; the same TLS
and user options as the coordinators' ``--store``).

The relay calls a dialer again on every attempt (``open_relay`` accepts an async callable that
returns a stream); an ``OSError`` from it is a failed attempt, retried until the relay's
deadline, so every failure here -- no coordinator listening, no leader in the store, an etcd that
does not answer -- is raised as one; except an etcd that refuses this relay's certificate or user
(:class:`~flodl_trio.StoreAuthError`): no attempt can change that, so it ends the relay at once.
A name that does not resolve is not retried either: :func:`check_names` refuses it before the
relay starts.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import trio

from .._config import RelayConfig
from ..net._keepalive import KeepAlive, enable_keepalive
from ..net._transport import format_address, unresolvable
from ..relay import StoreDialer
from ._common import CommandFailed, UsageError, parse_address
from ._durable import store_from


class CoordinatorDialer:
    """An async callable that connects to the first of a fixed list of addresses that answers.

    Attributes:
        __name__: how the relay's errors name the target (the ``--coordinator`` text).
    """

    def __init__(self, text: str, *, config: RelayConfig,
                 addresses: Sequence[tuple[str, int]]) -> None:
        self.__name__ = text
        self.addresses = tuple(addresses)
        self.keepalive = KeepAlive.within(config.write_stall_timeout,
                                          write_stall=config.write_stall_timeout)
        self._start = 0  # where the next attempt begins in a fixed list

    async def __call__(self) -> trio.abc.Stream:
        found = self.addresses
        # A fixed list: each attempt begins after the address the previous one connected to. A
        # standby binds its port and waits for the leadership, so the kernel accepts
        # connections it never answers (so does a proxy in front of a dead coordinator): began
        # at the first address every time, every attempt connected there, timed out in its
        # handshake, and the leader listed after it was never reached.
        start = self._start % len(found)
        last: OSError | None = None
        for offset in range(len(found)):
            host, port = found[(start + offset) % len(found)]
            try:
                stream = await trio.open_tcp_stream(host, port)
            except OSError as exc:
                last = exc
                continue
            self._start = start + offset + 1
            stream.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            enable_keepalive(stream, self.keepalive)
            return stream
        assert last is not None  # the list is never empty
        raise last


def coordinator_target(text: str, *, config: RelayConfig) -> Any:
    """``--coordinator`` as ``open_relay``'s target: a ``(host, port)`` for one address, a
    :class:`CoordinatorDialer` for a list, a :class:`~flodl_trio.relay.StoreDialer` for an
    ``etcd://`` store (close its store once done: ``await target.aclose()``).

    >>> coordinator_target("127.0.0.1:7000", config=RelayConfig())
    ('127.0.0.1', 7000)
    >>> coordinator_target("a:1,b:2", config=RelayConfig()).addresses
    (('a', 1), ('b', 2))
    """
    if text.startswith(("etcd://", "etcds://")):
        return StoreDialer(store_from(text, option="--coordinator"), config=config)
    if "://" in text or text.startswith(("sqlite:", "memory:")):
        raise UsageError(f"--coordinator: expected HOST:PORT[,HOST:PORT...] or "
                         f"etcd://HOST:PORT/PREFIX, got {text!r}")
    parts = [p.strip() for p in text.split(",")]
    addresses = [parse_address(p, what="--coordinator") for p in parts if p]
    if len(addresses) == 1:
        return addresses[0]
    if not addresses:
        raise UsageError(f"--coordinator: expected at least one HOST:PORT, got {text!r}")
    return CoordinatorDialer(", ".join(format_address(a) for a in addresses), config=config,
                             addresses=addresses)


def names_in(text: str) -> list[str]:
    """The host names ``--coordinator`` dials (an ``etcd://`` URL's endpoints, the
    addresses of a list).

    >>> names_in("etcd://10.0.0.5:2379,etcd-2:2379/flodl/run1")
    ['10.0.0.5', 'etcd-2']
    >>> names_in("etcds://etcd-1:2379,etcd-2:2379/flodl/run1?ca=/etc/ca.pem")
    ['etcd-1', 'etcd-2']
    >>> names_in("box-1:7000,[::1]:7000")
    ['box-1', '::1']
    """
    if text.startswith(("etcd://", "etcds://")):
        hosts = text.partition("://")[2].partition("/")[0].partition("?")[0]
        hosts = hosts.rpartition("@")[2]  # a user name before the endpoints is not one
    else:
        hosts = text
    return [parse_address(part.strip(), what="--coordinator")[0]
            for part in hosts.split(",") if part.strip()]


async def check_names(text: str, *, host: str) -> None:
    """Resolve every host name ``--coordinator`` names once, before the relay starts: one
    that does not resolve ends the command at once (retrying cannot make it resolve; a
    temporary failure of the resolver, ``EAI_AGAIN``, is left to the relay's attempts).

    Raises:
        CommandFailed: a name does not resolve (the line names it).
    """
    for name in names_in(text):
        problem = None
        try:
            await trio.socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except OSError as exc:
            if unresolvable(exc):
                problem = exc.strerror or str(exc)
        if problem is not None:  # raised outside the handler: the line is this one
            raise CommandFailed(f"relay {host}: cannot resolve {name!r} ({problem}), named by "
                                f"--coordinator {text}: check the address")
