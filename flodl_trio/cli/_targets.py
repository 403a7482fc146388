"""Where ``flodl-trio relay --coordinator`` dials: one ``HOST:PORT``, a fixed list of them
(tried in turn on every attempt, each attempt beginning after the address the previous one
connected to), or ``etcd://HOST:PORT/PREFIX`` (the leader's address, read
from the coordinators' session store again on every attempt, so that a relay that lost its
coordinator finds the standby that took over).

The relay calls a dialer again on every attempt (``open_relay`` accepts an async callable that
returns a stream); an ``OSError`` from it is a failed attempt, retried until the relay's
deadline, so every failure here -- no coordinator listening, no leader in the store, an etcd that
does not answer -- is raised as one.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import trio

from .._config import RelayConfig
from .._errors import StoreError
from ..net._keepalive import KeepAlive, enable_keepalive
from ..net._transport import format_address
from ..store import SessionStore
from ._common import UsageError, parse_address
from ._durable import store_from


class CoordinatorDialer:
    """An async callable that connects to the first address that answers.

    Attributes:
        __name__: how the relay's errors name the target (the ``--coordinator`` text).
    """

    def __init__(self, text: str, *, config: RelayConfig,
                 addresses: Sequence[tuple[str, int]] = (),
                 store: SessionStore | None = None) -> None:
        self.__name__ = text
        self.addresses = tuple(addresses)
        self.store = store
        self.keepalive = KeepAlive.within(config.write_stall_timeout,
                                          write_stall=config.write_stall_timeout)
        self._start = 0  # where the next attempt begins in a fixed list

    async def _candidates(self) -> tuple[tuple[str, int], ...]:
        if self.store is None:
            return self.addresses
        try:
            found = await self.store.resolve_address()
        except StoreError as exc:  # etcd restarting, ...: this attempt fails, the next reads
            raise OSError(f"{self.__name__}: cannot read the leader's address: {exc}") from exc
        if not found:
            raise OSError(f"{self.__name__}: no coordinator leads the store now (no address "
                          "published)")
        return found

    async def __call__(self) -> trio.abc.Stream:
        found = await self._candidates()
        # A fixed list: each attempt begins after the address the previous one connected to. A
        # standby binds its port and waits for the leadership, so the kernel accepts
        # connections it never answers (so does a proxy in front of a dead coordinator): began
        # at the first address every time, every attempt connected there, timed out in its
        # handshake, and the leader listed after it was never reached.
        start = self._start % len(found) if self.store is None else 0
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
        assert last is not None  # _candidates is never empty
        raise last

    async def aclose(self) -> None:
        if self.store is not None:
            with trio.CancelScope(shield=True):
                await self.store.aclose()


def coordinator_target(text: str, *, config: RelayConfig) -> Any:
    """``--coordinator`` as ``open_relay``'s target: a ``(host, port)`` for one address, else
    a :class:`CoordinatorDialer` (a list, or an ``etcd://`` store).

    >>> coordinator_target("127.0.0.1:7000", config=RelayConfig())
    ('127.0.0.1', 7000)
    >>> coordinator_target("a:1,b:2", config=RelayConfig()).addresses
    (('a', 1), ('b', 2))
    """
    if text.startswith("etcd://"):
        return CoordinatorDialer(text, config=config, store=store_from(text,
                                                                       option="--coordinator"))
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
