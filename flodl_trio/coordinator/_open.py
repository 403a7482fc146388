"""The coordinator: formation, readers, sending, liveness and shutdown (SPEC §4)."""

from __future__ import annotations

import logging
import math
import ssl
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from typing import Any

import trio

from .._config import CoordinatorConfig
from .._errors import ConfigError
from .._gc import gc_paused
from .._lifecycle import Lifecycle, open_lifecycle
from ..events import Listening
from ..net._interfaces import dialable_addresses, interface_addresses
from ..net._keepalive import KeepAlive
from ..net._listen import listen_tcp
from ..net._transport import close_all, format_address
from ..port_mux import open_port_mux
from ..status import serve_status
from ..store import SessionStore
from ..timeline import Timeline
from ..wire import SessionSalt
from ._core import Coordinator

log = logging.getLogger("flodl_trio.coordinator")

# Connections routed to a leg but not yet accepted (each a socket and what its peek read: a
# relay's 4-byte magic, at most 4 KiB from anyone).
# Formation takes them as max_pending_handshakes allows; while a leg's queue is full the mux
# stops accepting, and a kernel backlog (net.core.somaxconn, 4,096 here) that overflows delays
# a dialer by TCP retransmits (its magic arrives 0.2 to 1 s late, or its SYN is retried 1 s
# later). Room for a burst of 8,192 relays (65,536 ranks at 8 per host) and then some.
MUX_QUEUE = 16384

ListenSpec = int | tuple[str, int] | trio.abc.Listener[Any] | Sequence[trio.abc.Listener[Any]]


class CoordinatorBind:
    """TCP listeners bound ahead of :func:`open_coordinator`, so the port can be published first.

    Use it as an async context manager, or pass it as ``listen=`` (the coordinator then owns and
    closes it).

    Attributes:
        address: ``(host, port)`` actually bound (the real port when 0 was asked for); the
            first of :attr:`addresses`. After a wildcard bind it is ``("0.0.0.0", port)``,
            which no peer can dial: publish :meth:`addresses_for_peers` instead.
        addresses: every ``(host, port)`` bound, one per address family or resolved address,
            all on the same port.
        listeners: the ``trio.SocketListener`` objects.
    """

    def __init__(self, listeners: list[Any], addresses: Sequence[tuple[str, int]]) -> None:
        self.listeners = listeners
        self.addresses = tuple(addresses)
        self.address = self.addresses[0]
        self._closed = False

    def addresses_for_peers(self) -> tuple[tuple[str, int], ...]:
        """The ``(host, port)`` pairs to publish to relays: what they can dial.

        A wildcard bind (``0.0.0.0``, ``::``, or a bare port) becomes this machine's interface
        addresses of that family, the others first and loopback last (found without DNS; IPv6
        link-local addresses are left out); a specific bind is that address itself.
        """
        return dialable_addresses(self.addresses, interface_addresses())

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await close_all(self.listeners)

    async def __aenter__(self) -> CoordinatorBind:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def bind_coordinator(
    listen: int | tuple[str, int] = ("0.0.0.0", 0), *, timeline: Timeline | None = None
) -> CoordinatorBind:
    """Bind the coordinator's TCP port now (port 0 picks a free one).

    A bare port (``bind_coordinator(0)``) binds every interface, IPv4 and IPv6, on one port, so
    a relay reaches it whichever family its resolver picks; ``("0.0.0.0", 0)`` binds IPv4 only.

    Raises:
        ConfigError: ``listen`` is not a port or a ``(host, port)`` pair.
        OSError: the OS refused the bind (port in use, ...).
    """
    if isinstance(listen, bool):
        raise ConfigError(f"bind_coordinator: expected a port or (host, port), got {listen!r}")
    if isinstance(listen, int):
        host: str | None = None
        port = listen
    elif (isinstance(listen, tuple) and len(listen) == 2 and isinstance(listen[0], str)
          and isinstance(listen[1], int)):
        host, port = listen
    else:
        raise ConfigError(f"bind_coordinator: expected a port or (host, port), got {listen!r}")
    if not 0 <= port <= 65535:
        raise ConfigError(f"bind_coordinator: expected a port in [0, 65535], got {port}")
    listeners = await listen_tcp(port, host=host)
    addresses = [(str(name[0]), int(name[1]))
                 for name in (lst.socket.getsockname() for lst in listeners)]
    if timeline is not None:
        for address in addresses:
            timeline.event(Listening(address=format_address(address)))
    log.info("coordinator listening on %s", ", ".join(format_address(a) for a in addresses))
    return CoordinatorBind(listeners, addresses)


@asynccontextmanager
async def open_coordinator(
    listen: ListenSpec | CoordinatorBind, *, salt: SessionSalt, config: CoordinatorConfig,
    abort: trio.Event | None = None, timeline: Timeline | None = None,
    ssl_context: ssl.SSLContext | None = None, store: SessionStore | None = None,
    fresh: bool = False, standby: bool = False,
) -> AsyncIterator[Coordinator]:
    """Run a coordinator; the block is entered once every rank is covered.

    Args:
        listen: a port or ``(host, port)`` to bind TCP (served through the port mux, so the status
            page answers on the same port), a :class:`CoordinatorBind`, or any
            ``trio.abc.Listener`` (or several) that yields relay connections directly.
        salt: the run's :class:`SessionSalt`.
        config: a :class:`CoordinatorConfig`.
        abort: set it to stop formation early (``FormationAborted``).
        timeline: where events are recorded (a fresh one by default, as ``coord.timeline``).
        ssl_context: serve TLS (a server context): every connection to the port, the channel
            magic included, runs inside TLS. Without it the control plane is authenticated and
            replay-protected but not encrypted.
        store: a :class:`~flodl_trio.store.SessionStore` that makes the run survive its
            coordinator (SPEC §4.7): the coordinator first becomes its leader (a standby
            blocks here until the leader's leadership ends), publishes its dialable addresses,
            and saves the session at each change that matters. A store that holds a session
            is *adopted*: its relays resume without a new formation, and the block is entered
            at once when that session had formed (``coord.resumed``). A session that *ended*
            (its coordinator shut the cohort down; the end is recorded as the block ends) is
            not: a new session starts on the store, its generation counting on.
        fresh: with ``store``, start a new session whatever the store holds (an unfinished
            session, even another run's, is discarded) instead of adopting it.
        standby: with ``store``, stand by for the run the store holds: if that run ended
            (before this coordinator asked for the leadership, or while it waited), raise
            ``SessionEnded`` rather than start a new session. A coordinator that has to wait
            for the leadership stands by for that run anyway; an empty store is led as usual.

    Raises:
        FormationTimeout / FormationAborted / FormationError: formation did not complete.
        ClusterFailure: the failure policy stopped the run (the body was cancelled).
        StoreCorrupt: the store holds a damaged state; nothing was loaded.
        ForeignSession: (a ``StoreCorrupt``) the store holds another run's unfinished session
            (salt, world size); nothing was loaded; ``fresh=True`` would discard it.
        SessionEnded: this coordinator waited for the store's leadership, or was opened with
            ``standby=True``, and the run it stood by for ended: there is nothing to adopt.
        StoreUnavailable: the store cannot be reached.
        LeadershipLost: another coordinator took the session over: this one stepped down
            (the body was cancelled) without a word to the relays.
        FlodlInternalError: an unexpected internal failure (``from`` the original group).
    """
    bind, direct, coord = await _new_coordinator(
        listen, salt=salt, config=config, timeline=timeline, tls=ssl_context is not None,
        store=store, fresh=fresh, standby=standby)
    mux_listeners, direct = _legs_of(coord, bind, direct, ssl_context, told=timeline is not None)
    async with open_lifecycle("coordinator", failure=lambda: coord.failure) as life:
        coord.on_deposed(life.stop_tasks)
        async with AsyncExitStack() as stack:
            control = await _control_legs(stack, life, coord, config, bind=bind,
                                          mux_listeners=mux_listeners, direct=direct)
            async with _run(coord, life, stack, control, abort=abort, store=store, bind=bind,
                            fresh=fresh, standby=standby) as formed:
                yield formed


def _legs_of(coord: Coordinator, bind: CoordinatorBind | None,
             direct: list[trio.abc.Listener[Any]], ssl_context: ssl.SSLContext | None, *,
             told: bool) -> tuple[list[Any], list[trio.abc.Listener[Any]]]:
    """The listeners for the port mux (what ``bind`` bound) and the direct ones, inside TLS
    with ``ssl_context``; the bound addresses go on the coordinator's own timeline unless
    the caller gave its own timeline (``told``: ``bind_coordinator`` tells that one)."""
    if bind is not None and not told:
        for address in bind.addresses:
            coord.timeline.event(Listening(address=format_address(address)))
    mux_listeners: list[Any] = list(bind.listeners) if bind is not None else []
    if ssl_context is None:
        return mux_listeners, direct
    # The TLS handshake happens on the first read, i.e. inside the mux's bounded peek (or the
    # handshake deadline), so a client that never finishes it cannot wedge anything.
    return ([trio.SSLListener(lst, ssl_context, https_compatible=False) for lst in mux_listeners],
            [trio.SSLListener(lst, ssl_context, https_compatible=False) for lst in direct])


async def _listen_on(listen: ListenSpec | CoordinatorBind, timeline: Timeline | None
                     ) -> tuple[CoordinatorBind | None, list[trio.abc.Listener[Any]]]:
    """What ``listen`` asks for: a bind (made now for a port or an address) or listeners."""
    if isinstance(listen, CoordinatorBind):
        return listen, []
    if isinstance(listen, int | tuple):
        return await bind_coordinator(listen, timeline=timeline), []
    if isinstance(listen, trio.abc.Listener):
        return None, [listen]
    if isinstance(listen, Sequence) and listen and all(
        isinstance(item, trio.abc.Listener) for item in listen
    ):
        return None, [item for item in listen if isinstance(item, trio.abc.Listener)]
    raise ConfigError(
        "open_coordinator: expected listen to be a port, (host, port), CoordinatorBind or "
        f"trio.abc.Listener(s), got {listen!r}"
    )


async def _new_coordinator(
    listen: ListenSpec | CoordinatorBind, *, salt: SessionSalt, config: CoordinatorConfig,
    timeline: Timeline | None, tls: bool, store: SessionStore | None, fresh: bool, standby: bool,
) -> tuple[CoordinatorBind | None, list[trio.abc.Listener[Any]], Coordinator]:
    """What ``listen`` asks for (a bind, or listeners) and the coordinator, its arguments
    checked; on an error the listeners are closed (they are its to close, as they would be at
    the end of the block)."""
    bind, direct = await _listen_on(listen, timeline)
    try:
        if (fresh or standby) and store is None:
            raise ConfigError(f"open_coordinator: {'fresh' if fresh else 'standby'}=True is "
                              "about the session in a store: expected store=, got none")
        if fresh and standby:
            raise ConfigError("open_coordinator: fresh=True discards the store's session, "
                              "standby=True stands by for it: expected one of them, got both")
        return bind, direct, Coordinator(salt=salt, config=config, timeline=timeline,
                                         address=bind.address if bind else None, tls=tls)
    except BaseException:
        with trio.CancelScope(shield=True):
            if bind is not None:
                await bind.aclose()
            await close_all(direct)
        raise


async def _control_legs(stack: AsyncExitStack, life: Lifecycle, coord: Coordinator,
                        config: CoordinatorConfig, *, bind: CoordinatorBind | None,
                        mux_listeners: list[Any], direct: list[trio.abc.Listener[Any]]
                        ) -> list[trio.abc.Listener[Any]]:
    """Where relay connections come from: the port mux's control leg over what ``bind``
    bound (its status leg is served here), else the listeners given; each closed by
    ``stack``."""
    if bind is None:
        for listener in direct:
            stack.push_async_callback(listener.aclose)
        return direct
    stack.push_async_callback(bind.aclose)
    mux = await stack.enter_async_context(
        open_port_mux(mux_listeners, peek_timeout=config.peek_timeout,
                      legs=("control", "status"), queue_size=MUX_QUEUE,
                      max_peeking=config.max_pending_handshakes,
                      keepalive=KeepAlive.within(config.heartbeat_timeout,
                                                 write_stall=config.write_stall_timeout))
    )
    life.nursery.start_soon(partial(serve_status, mux.status, coord.state,
                                    request_timeout=config.peek_timeout,
                                    board_fn=coord.board))
    return [mux.control]


@asynccontextmanager
async def _run(coord: Coordinator, life: Lifecycle, stack: AsyncExitStack,
               control: list[trio.abc.Listener[Any]], *, abort: trio.Event | None,
               store: SessionStore | None, bind: CoordinatorBind | None, fresh: bool,
               standby: bool) -> AsyncIterator[Coordinator]:
    """Start the run's background tasks, lead the store, wait for formation, hold the user's
    block; whatever happens, end with the graceful shutdown."""
    setup_exc: BaseException | None = None
    try:
        # Every background task of the run starts here, and only here, in the lifecycle's
        # nursery: out of the caller's reach until the block ends.
        with trio.CancelScope(shield=True):  # see open_lifecycle: a cancelled start
            await life.nursery.start(coord.host_writers)  # strands a shielded host
        if store is not None:
            await coord.lead(store, fresh=fresh, standby=standby)  # a standby waits
            stack.push_async_callback(_release, store, coord)
        # Formation, with the garbage collector paused (issue 38; see .._gc).
        with gc_paused(coord.config.pause_gc_in_formation):
            for task in coord.background_tasks(control, abort):
                life.nursery.start_soon(task)
            if store is not None and bind is not None:
                life.nursery.start_soon(coord.publish_address, bind.addresses_for_peers())
            await coord.formed()
        with life.body() as body_scope:
            coord.cancel_on_failure(body_scope)
            yield coord
    except BaseException as exc:
        setup_exc = exc  # for the shutdown reason only
        raise
    finally:
        reason = _shutdown_reason(coord, life.body_exc or setup_exc)
        # Shielded, and the readers and writers it needs are out of the caller's reach: an
        # outside cancellation still ends with Shutdown, half-close and drain.
        with trio.CancelScope(shield=True):
            await coord.shutdown(reason)


# How long a coordinator that stepped down may spend giving up a leadership it no longer holds
# (an etcd that does not answer would otherwise hold it for a whole request timeout): with the
# shutdown that sends nothing, it bounds how soon a deposed coordinator leaves (docs/failover).
DEPOSED_RELEASE_S = 0.5


async def _release(store: SessionStore, coord: Coordinator) -> None:
    """Give the store's leadership up as the coordinator ends (a standby need not wait for a
    lease to run out); shielded: an outside cancellation must not keep it held."""
    with trio.CancelScope(shield=True):
        with trio.move_on_after(DEPOSED_RELEASE_S if coord.deposed is not None else math.inf):
            await store.release()


def _shutdown_reason(coord: Coordinator, body_exc: BaseException | None) -> str:
    if coord.deposed is not None:
        return f"stepped down: {coord.deposed}"
    if coord.failure is not None:
        return f"cluster failure: {coord.failure}"
    if coord.formation_failure is not None:
        return f"formation failed: {type(coord.formation_failure).__name__}"
    if body_exc is not None and not isinstance(body_exc, trio.Cancelled):
        return f"the block raised {type(body_exc).__name__}"
    if body_exc is not None:
        return "cancelled"
    return "the block exited"
