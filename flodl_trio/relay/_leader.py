"""A relay that dials the leader a session store names, and watches it (issue 34).

:class:`StoreDialer` is the relay's coordinator target when it is given a store (``open_relay(
store, ...)``, ``flodl-trio relay --coordinator etcd://...``): on every attempt it reads the
leader's published addresses (``store.resolve_address()``, one read) and connects to the first
that answers.

:class:`LeaderWatch` covers the leader that *freezes* (``SIGSTOP``, a hung VM, a stalled
disk): its connection stays open and silent, its lease runs out, a standby leads within the
lease's TTL -- and a relay that only waited for silence stayed on the frozen connection for
``coord_liveness_timeout``. While the relay is connected to a durable coordinator, the watch
reads the published addresses once per heartbeat period (jittered); when they differ from the
ones it dialed, it sends one ``Resume`` to the new addresses, and only a coordinator there that
answers it with a ``Generation`` strictly higher than the relay has seen replaces the connection
(the old one is dropped as a lost coordinator and the Reconnector resumes onto the new one at
once). A stale read, an address that does not answer, or a deposed coordinator changes nothing.
"""

from __future__ import annotations

import logging
import random
import socket
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from .._config import RelayConfig
from .._errors import StoreAuthError, StoreError
from ..net._keepalive import KeepAlive, enable_keepalive
from ..net._transport import format_address, open_tcp, peer_of, unresolvable
from ..store import SessionStore
from ..wire import Established

log = logging.getLogger("flodl_trio.relay")

Addresses = tuple[tuple[str, int], ...]

# Periods before published addresses that did not take a Resume are probed again.
RETRY_PERIODS = 5
Connect = Callable[[str, int], Awaitable[trio.abc.Stream]]
Joined = tuple[trio.abc.Stream, Established]


class NoLeaderPublished(ConnectionError):
    """The store names no coordinator now (none leads, or the leader has not published its
    address yet): one more failed attempt, retried.

    Attributes:
        store: the store's description (``etcd://HOST:PORT/PREFIX``).
    """

    def __init__(self, store: str) -> None:
        super().__init__(f"{store}: no coordinator leads the store now (no address published)")
        self.store = store


class StoreDialer:
    """An async callable that connects to the coordinator a session store names.

    Args:
        store: the coordinators' store; the relay only reads it (``resolve_address``).
        config: the relay's config (the TCP keepalive of each connection).
        connect: how to connect to one published ``(host, port)`` (default: TCP with
            ``TCP_NODELAY`` and keepalive; tests pass an in-memory network's).

    Attributes:
        __name__ / description: how errors name it (the store's description).
        store: the store.
        dialed: the published addresses of the last connection made (empty before one).
    """

    def __init__(self, store: SessionStore, *, config: RelayConfig | None = None,
                 connect: Connect | None = None) -> None:
        cfg = config if config is not None else RelayConfig()
        self.store = store
        self.description = self.__name__ = store.description
        self.dialed: Addresses = ()
        self._connect = connect
        self._keepalive = KeepAlive.within(cfg.write_stall_timeout,
                                           write_stall=cfg.write_stall_timeout)

    async def published(self) -> Addresses:
        """The leader's published addresses now (empty: none). One store read.

        Raises:
            StoreError: the store cannot be read.
        """
        return tuple(await self.store.resolve_address())

    async def check(self) -> None:
        """Read the store once, at start: an etcd that refuses this relay's certificate or
        user ends it now (``StoreAuthError``), not once its ranks joined; anything else (etcd
        not up yet, no leader yet) is left to the dial attempts."""
        try:
            await self.published()
        except StoreAuthError:
            raise
        except StoreError:
            pass

    async def __call__(self) -> trio.abc.Stream:
        try:
            found = await self.published()
        except StoreAuthError:  # no attempt can change a refused certificate or user
            raise
        except StoreError as exc:  # etcd restarting, ...: this attempt fails, the next reads
            raise ConnectionError(f"{self.description}: cannot read the leader's address: "
                                  f"{exc}") from exc
        if not found:
            raise NoLeaderPublished(self.description)
        errors: list[OSError] = []
        for address in found:
            try:
                stream = await self.connect_to(address)
            except OSError as exc:
                errors.append(exc)
                continue
            self.dialed = found
            return stream
        # A published name that does not resolve says the most: raise it first.
        raise next((exc for exc in errors if unresolvable(exc)), errors[-1])

    async def connect_to(self, address: tuple[str, int], *,
                         keepalive: KeepAlive | None = None) -> trio.abc.Stream:
        """One connection to one published address.

        Raises:
            OSError: it failed; a ``socket.gaierror`` names the published host.
        """
        host, port = address
        if self._connect is not None:
            return await self._connect(host, port)
        try:
            stream = await open_tcp(host, port)
        except OSError as exc:
            if unresolvable(exc):
                raise socket.gaierror(exc.errno, f"cannot resolve {host!r} ({exc.strerror}), "
                                      f"the address the coordinator published at "
                                      f"{self.description}") from exc
            raise
        enable_keepalive(stream, keepalive or self._keepalive)
        return stream

    def dialed_now(self, addresses: Addresses) -> None:
        """A connection to ``addresses`` was made outside ``__call__`` (a probe)."""
        self.dialed = addresses

    async def aclose(self) -> None:
        """Close the store (shielded)."""
        with trio.CancelScope(shield=True):
            await self.store.aclose()


class _Pump(Protocol):
    """What the watch needs of the relay's pump."""

    @property
    def stream(self) -> trio.abc.Stream: ...

    @property
    def period(self) -> float: ...

    @property
    def generation(self) -> int: ...

    def connected(self) -> bool: ...

    def lose_leg(self, reason: str) -> None: ...


class _Prober(Protocol):
    """Who sends the probe and the Reconnector's re-dials (``UpstreamDialer``)."""

    async def probe(self, addresses: Addresses, generation: int) -> Joined | None: ...

    async def resume(self, generation: int, deadline: float) -> Joined: ...


class LeaderWatch:
    """Moves a relay off a frozen leader as soon as the store names a newer one.

    Attributes:
        reads: store reads so far; probes: ``Resume`` probes sent; moves: connections
            replaced by a newer leader's.
    """

    def __init__(self, dialer: StoreDialer, upstream: _Prober, *, host: str,
                 config: RelayConfig, rng: random.Random | None = None) -> None:
        self._dialer = dialer
        self._upstream = upstream
        self._host = host
        self._config = config
        self._rng = rng if rng is not None else random.Random()
        # Never a probe while the Reconnector re-dials (and the reverse): two Resumes of one
        # host at one coordinator would supersede each other.
        self._dialing = trio.Lock()
        self._handover: Joined | None = None
        # Published addresses that did not take a Resume, and when: tried again only after
        # RETRY_PERIODS periods (a deposed coordinator or a dead address is not probed at every
        # read; the relay's own coord_liveness_timeout still applies meanwhile).
        self._failed: tuple[Addresses, float] = ((), 0.0)
        self.reads = self.probes = self.moves = 0

    async def resume(self, generation: int, deadline: float) -> Joined:
        """The Reconnector's re-dial: the connection a probe already made, else a ``Resume``
        re-dialed until ``deadline``; never alongside a probe."""
        async with self._dialing:
            joined, self._handover = self._handover, None
            if joined is not None:
                return joined
            return await self._upstream.resume(generation, deadline)

    def unused(self) -> list[trio.abc.Stream]:
        """The connection a probe made that no re-dial took (the pump ended first)."""
        joined, self._handover = self._handover, None
        return [] if joined is None else [joined[0]]

    async def run(self, pump: _Pump) -> None:
        """Read the store once per ``pump.period`` (0.5 to 1.5 times it, at random: relays
        that resumed together do not read together) while the pump is connected; until
        cancelled."""
        while True:
            await trio.sleep(pump.period * self._rng.uniform(0.5, 1.5))
            if not pump.connected():
                continue  # riding out: the Reconnector's re-dial reads the store itself
            found: Addresses = ()
            with trio.move_on_after(self._config.handshake_timeout):
                try:
                    self.reads += 1
                    found = await self._dialer.published()
                except StoreError as exc:  # no evidence either way: keep the connection
                    log.debug("relay %r: reading the leader's address: %s", self._host, exc)
            # Outside the read's deadline: a probe cut short after its Ready would leave the
            # new coordinator holding a relay that then vanishes (its ranks declared dead).
            if self._names_another(found, pump):
                await self._try_move(found, pump)

    def _names_another(self, found: Addresses, pump: _Pump) -> bool:
        """The store names addresses the relay did not dial, none of them its peer now, and
        not ones that just failed a probe."""
        if not found or found == self._dialer.dialed:
            return False
        failed, at = self._failed
        if found == failed and trio.current_time() < at + RETRY_PERIODS * pump.period:
            return False
        peer = peer_of(pump.stream)
        return not any(format_address(address) == peer for address in found)

    async def _try_move(self, found: Addresses, pump: _Pump) -> None:
        async with self._dialing:
            if not pump.connected() or not self._names_another(found, pump):
                return  # a ride-out began, or resumed, while we waited
            seen = pump.generation
            self.probes += 1
            joined = await self._upstream.probe(found, seen)
            if joined is None:
                self._failed = (found, trio.current_time())
                return
            generation = joined[1].generation
            where = ", ".join(format_address(a) for a in found)
            if generation is None or generation <= seen:
                # Only a coordinator of our generation at an address we did not dial: ours,
                # published again. It took our Resume as the same relay re-dialing, so the
                # old connection is the one to drop.
                log.warning("relay %r: the coordinator at %s answered a Resume with generation "
                            "%s (seen: %d); moving to that connection", self._host, where,
                            generation, seen)
            self._handover = joined
            self.moves += 1
            pump.lose_leg(f"a newer coordinator leads: generation {generation} at {where}, "
                          f"published at {self._dialer.description}")


__all__ = ["Addresses", "LeaderWatch", "NoLeaderPublished", "StoreDialer"]
