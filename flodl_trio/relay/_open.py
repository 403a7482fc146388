"""The host relay (SPEC §5): terminates its local ranks' handshakes on loopback and carries all
their frames over one sealed upstream connection to the coordinator.

Phases: (1) accept every local rank within ``rank_accept_timeout``; (2) dial the coordinator and
run the upstream handshake; (3) pump: one reader per local rank feeds a bounded queue drained by
the single upstream writer, and one upstream reader routes DATA and FANOUT records to ranks.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import ExitStack, asynccontextmanager
from typing import Any

import trio

from .._config import RelayConfig
from .._errors import ConfigError, FlodlError, MembershipError
from .._gc import gc_paused
from .._lifecycle import open_lifecycle
from ..net._transport import DialTarget, close_all
from ..store import SessionStore
from ..timeline import Timeline
from ..wire import SessionSalt
from ._args import RankListen, bound_address, check_relay_args, rank_listeners
from ._leader import LeaderWatch, StoreDialer
from ._link import RelayExit
from ._upstream import WRONG_SALT_ATTEMPTS, UpstreamDialer
from .notices import RankNotices
from .pump import Pump
from .ranks import LocalRanks, accept_ranks
from .resume import Durable, Reconnector

log = logging.getLogger("flodl_trio.relay")

__all__ = ["WRONG_SALT_ATTEMPTS", "Relay", "open_relay"]


class Relay:
    """A running relay, as yielded by :func:`open_relay`.

    Attributes:
        host: this relay's host name.
        ranks: the global ranks it carries (ascending).
        rank_address: ``(host, port)`` where local ranks dial (a property; a ``ConfigError``
            when it was given listeners instead of binding TCP itself).
        model_sigs: the model signatures it announces (name -> digest; may be empty).
        generation: the highest coordinator generation seen (0 until a durable coordinator
            sent ``Generation``; a property).
        reconnects: how many times it resumed with a durable coordinator (a property).
        reconnecting: why its durable coordinator is away, while it rides that out (a
            property; None otherwise); ``last_lost``: why it was lost the last time.
        leader_moves: how many times it left its coordinator for a newer leader its store
            named (a property).
        waiting: what its join waits for and until when, while it waits (a property).
        fenced: the fenced ranks whose links it holds, and ``wakeups``: how many times it
            joined again with them (``rejoin_when_fenced``; properties).
        dropped_while_reconnecting: frames from its ranks dropped while reconnecting, over
            ``reconnect_queue`` (a property).
    """

    def __init__(self, *, target: DialTarget | SessionStore, salt: SessionSalt, host: str,
                 ranks: tuple[int, ...], world_size: int, config: RelayConfig,
                 timeline: Timeline | None, ssl_context: ssl.SSLContext | None,
                 server_hostname: str | None, rank_address: tuple[str, int] | None,
                 model_sigs: dict[str, bytes] | None = None) -> None:
        self.host = host
        self.ranks = ranks
        self.model_sigs: dict[str, bytes] = dict(model_sigs or {})
        self.world_size = world_size
        self.config = config
        self.timeline = timeline
        self._rank_address = rank_address
        self._local = LocalRanks(host=host, ranks=ranks, world_size=world_size, salt=salt,
                                 config=config)
        self._connected = trio.Event()
        self._closed = trio.Event()
        self._exit: RelayExit | None = None
        self._error: FlodlError | None = None
        self._body_scope: trio.CancelScope | None = None
        self._notices = RankNotices(self._local, salt)
        if isinstance(target, SessionStore):  # the relay reads the leader's address from it
            target = StoreDialer(target, config=config)
        self._pump: Pump | None = None
        self._dialer = UpstreamDialer(target=target, salt=salt, host=host, ranks=ranks,
                                      world_size=world_size, model_sigs=self.model_sigs,
                                      config=config, notices=self._notices,
                                      ssl_context=ssl_context, server_hostname=server_hostname)
        # A relay that reads the leader's address from a store watches it (issue 34).
        self._watch = (LeaderWatch(target, self._dialer, host=host, config=config)
                       if isinstance(target, StoreDialer) else None)

    @property
    def rank_address(self) -> tuple[str, int]:
        """``(host, port)`` where local ranks dial (set for the whole block when it bound TCP).

        Raises:
            ConfigError: it was given listeners (e.g. a ``MemoryNetwork``'s) to accept on.
        """
        if self._rank_address is None:
            raise ConfigError(f"relay {self.host!r}: rank_address: expected a relay that bound "
                              "TCP itself, got one accepting on listeners it was given")
        return self._rank_address

    @property
    def connected_ranks(self) -> frozenset[int]:
        """Local ranks whose connection is up."""
        return self._local.connected

    @property
    def generation(self) -> int:
        """The highest coordinator generation seen (0: no durable coordinator so far)."""
        return self._pump.generation if self._pump is not None else 0

    @property
    def _resume(self) -> Reconnector | None:
        """What the pump keeps across connections to a durable coordinator (None: not one)."""
        return self._pump.resume if self._pump is not None else None

    @property
    def reconnects(self) -> int:
        """How many times the relay resumed with its durable coordinator."""
        resume = self._resume
        return resume.reconnects if resume is not None else 0

    @property
    def reconnecting(self) -> str | None:
        """Why the durable coordinator is away, while the relay rides it out; else None."""
        resume = self._resume
        return resume.away if resume is not None else None

    @property
    def last_lost(self) -> str | None:
        """Why the durable coordinator was lost the last time (kept once resumed); None if
        it never was."""
        resume = self._resume
        return resume.last_lost if resume is not None else None

    @property
    def dropped_while_reconnecting(self) -> int:
        """Frames from the ranks dropped while reconnecting (over ``reconnect_queue``)."""
        resume = self._resume
        return resume.dropped if resume is not None else 0

    @property
    def waiting(self) -> tuple[str, float] | None:
        """While the join re-dials because nothing can be dialed yet (a store that names no
        leader, a resolver that failed for now): what it waits for and until when (wall
        clock, ``time.time()``); None otherwise."""
        waiting = self._dialer.waiting
        if waiting is None:
            return None
        what, deadline = waiting
        return what, time.time() + max(0.0, deadline - trio.current_time())

    @property
    def leader_moves(self) -> int:
        """How many times the relay left its connection for a newer leader the store named
        (issue 34)."""
        return self._watch.moves if self._watch is not None else 0

    @property
    def fenced(self) -> dict[int, str]:
        """With ``rejoin_when_fenced``: the ranks the coordinator fenced whose links the relay
        holds open (rank -> the coordinator's reason), until they are back or released."""
        wakeup = self._pump.wakeup if self._pump is not None else None
        return dict(wakeup.held) if wakeup is not None else {}

    @property
    def rejoining(self) -> tuple[tuple[int, ...], str] | None:
        """While the relay joins again after every rank it carried was fenced: the ranks it
        brings back and why they were fenced; else None."""
        wakeup = self._pump.wakeup if self._pump is not None else None
        return wakeup.waking if wakeup is not None else None

    @property
    def last_wakeup(self) -> tuple[tuple[int, ...], str] | None:
        """The ranks the last wake-up brought back (or tried to) and why they were fenced."""
        wakeup = self._pump.wakeup if self._pump is not None else None
        return wakeup.last if wakeup is not None else None

    @property
    def wakeups(self) -> int:
        """How many times the relay joined again after every rank it carried was fenced
        (``rejoin_when_fenced``, docs/elastic.rst)."""
        wakeup = self._pump.wakeup if self._pump is not None else None
        return wakeup.wakeups if wakeup is not None else 0

    @property
    def error(self) -> FlodlError | None:
        """Why the relay failed (what ``open_relay`` raises), else None."""
        return self._error

    @property
    def joined(self) -> bool:
        """The relay joined the cohort (:meth:`wait_connected` returned) and has not ended."""
        return self._connected.is_set() and not self._closed.is_set()

    @property
    def draining(self) -> str | None:
        """Why the host leaves, once :meth:`drain` was called; else None."""
        return self._pump.draining if self._pump is not None else None

    async def drain(self, reason: str = "drained") -> None:
        """The host leaves the run on purpose (issue 37, docs/elastic.rst): each local rank
        is told (``Drain``) to finish its current sync and exit cleanly, and the coordinator
        (``Draining``) retires each one as it exits, not counting it as a failure. The relay
        ends once its last rank exited (``RelayExit("all ranks exited")``); wait for it with
        :meth:`wait_closed`.

        Raises:
            MembershipError: the relay has not joined (or has ended), or it drains already.
        """
        pump = self._pump
        if pump is None or self._closed.is_set():
            state = "ended" if self._closed.is_set() else "not joined yet"
            raise MembershipError(f"relay {self.host!r}: expected a relay that joined the "
                                  f"cohort to drain, but it has {state}")
        if pump.draining is not None:
            raise MembershipError(f"relay {self.host!r}: expected a relay that is not "
                                  f"draining, but it drains already ({pump.draining}); its "
                                  "ranks leave after their current sync")
        log.warning("relay %r: draining (%s): ranks %s finish their current sync and exit",
                    self.host, reason, list(self.ranks))
        pump.drain(reason, self._notices.drain_frame(reason))
        await trio.lowlevel.checkpoint()

    def cancel_on_error(self, scope: trio.CancelScope) -> None:
        """Cancel ``scope`` (the user's block) when the relay fails."""
        self._body_scope = scope

    @property
    def rank_port_rejects(self) -> dict[str, int]:
        """Connections to the rank port rejected so far, by reason (``"bad mac"``, ...)."""
        return self._local.rejects

    async def wait_connected(self) -> None:
        """Return once both sides confirmed the join (FT/2: ``HelloAck`` verified, ``Ready``
        sent, and the coordinator's first record after it arrived)."""
        await self._connected.wait()

    async def wait_closed(self) -> RelayExit:
        """Return how the relay ended, once it has."""
        await self._closed.wait()
        assert self._exit is not None
        return self._exit

    # ------------------------------------------------------------------ lifecycle

    @asynccontextmanager
    async def running(self, listeners: list[trio.abc.Listener[Any]]) -> AsyncIterator[None]:
        """Run the relay on ``listeners`` (its rank port) for the block, which is cancelled
        when the relay fails (``open_relay`` then raises the error)."""
        async with open_lifecycle(f"relay {self.host!r}", failure=lambda: self.error) as life:
            life.nursery.start_soon(self.run, listeners)
            with life.body() as body_scope:
                self.cancel_on_error(body_scope)
                yield

    async def run(self, listeners: list[trio.abc.Listener[Any]]) -> None:
        """Phases 1 to 3, then close every connection (``open_relay`` runs it)."""
        # The collector is paused for the join (RelayConfig.pause_gc_in_join), until the pump
        # started its tasks or the join failed.
        join = ExitStack()
        join.enter_context(gc_paused(self.config.pause_gc_in_join))
        try:
            stop_notices = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._notices.keep_informed, stop_notices)
                pump = await self._join(listeners, stop_notices)
            if isinstance(pump, FlodlError):
                raise pump  # outside the nursery: not wrapped in an ExceptionGroup
            self._connected.set()
            if log.isEnabledFor(logging.INFO):
                log.info("relay %r connected upstream with ranks %s", self.host,
                         list(self.ranks))
            exit_ = await self._run_pump(pump, join.close)
            self._error = pump.error
        except FlodlError as exc:
            self._error = exc
            exit_ = RelayExit(f"failed: {exc}", False)
            # The ranks would otherwise only see their link end: tell them why first.
            await self._notices.tell(f"relay {self.host!r} gave up: {exc}")
        finally:
            join.close()  # once only: the pump's start closed it already
            # Runs on cancellation too: no rank or upstream socket outlives the relay.
            await self._close_all()
        self._exit = exit_
        self._closed.set()
        if self._error is not None and self._body_scope is not None:
            self._body_scope.cancel()

    async def _run_pump(self, pump: Pump, running: Callable[[], None]) -> RelayExit:
        """Phase 3 (``running``: called once the pump started its tasks); with a durable
        coordinator and a store, the leader watch beside it."""
        watch = self._watch
        if watch is None or pump.resume is None:
            return await pump.run(running)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch.run, pump)
            exit_ = await pump.run(running)
            nursery.cancel_scope.cancel()
        return exit_

    async def _join(self, listeners: list[trio.abc.Listener[Any]], stop_notices: trio.Event,
                    ) -> Pump | FlodlError:
        """Phases 1 and 2: the pump over the joined connection, which owns it from then on; a
        FlodlError is returned, not raised, so no group wraps it."""
        try:
            await accept_ranks(self._local, listeners)
            stream, established = await self._dialer.connect()
        except FlodlError as exc:
            return exc
        finally:
            stop_notices.set()  # the notice task ends after its current write
        durable = None
        if established.generation is not None:
            log.info("relay %r: the coordinator is durable (generation %d)", self.host,
                     established.generation)
            # A resume re-dials (the leader watch's connection to a newer one, if it made one).
            redial = self._dialer.resume if self._watch is None else self._watch.resume
            durable = Durable(established.generation, redial)
        self._pump = Pump(self._local, stream, established.sealer, established.opener,
                          self.timeline, first=established.records, durable=durable,
                          rejoin=self._dialer.rejoin)
        return self._pump

    async def _close_all(self) -> None:
        links = list(self._local.links())
        for link in links:
            link.stop()
        streams: list[Any] = [link.stream for link in links]
        if self._pump is not None:
            streams.append(self._pump.stream)  # the earlier legs' were closed as they ended
        if self._watch is not None:
            streams.extend(self._watch.unused())  # a newer leader's, made as the pump ended
        await close_all(streams)


@asynccontextmanager
async def open_relay(
    coordinator: DialTarget | SessionStore,
    *,
    salt: SessionSalt,
    host: str,
    ranks: Sequence[int],
    world_size: int,
    rank_listen: RankListen = None,
    config: RelayConfig | None = None,
    timeline: Timeline | None = None,
    ssl_context: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
    model_sigs: Mapping[str, bytes] | None = None,
) -> AsyncIterator[Relay]:
    """Run a host relay. The block is entered once the rank port is bound.

    Args:
        coordinator: ``(host, port)`` of the coordinator; an async callable returning a
            stream (called on every attempt); or the coordinators' :class:`SessionStore`
            (or a :class:`StoreDialer` of it): the relay reads the leader's published address
            on every attempt and, while connected, watches it (once per heartbeat period), so
            that it leaves a frozen leader for the standby that took over at once.
        salt: the run's :class:`SessionSalt`.
        host: this host's name (1-255 UTF-8 bytes), as the coordinator will report it.
        ranks: the global ranks this host carries.
        world_size: the world size every rank must agree on.
        rank_listen: where local ranks dial: None (loopback, ephemeral port), a port on
            127.0.0.1, or any ``trio.abc.Listener`` (or several).
        config: deadlines (:class:`RelayConfig`).
        ssl_context: wrap the upstream connection in TLS (the channel magic travels inside).
        server_hostname: the name to verify the coordinator's certificate against.
        model_sigs: this host's model signatures, name -> digest (flodl's ``model_sigs``,
            supplied by the orchestrator; at most 64 names of 1-128 UTF-8 bytes, digests of
            1-64 bytes). A relay whose digest for a name differs from an already joined
            relay's fails formation, naming both hosts and the names.

    Raises:
        ConfigError: invalid arguments.
        FormationTimeout: not every local rank connected within ``rank_accept_timeout``.
        JoinRefused: the coordinator authenticated our Hello and refused it (world size, model
            signatures, ranks); at once, without re-dialing. ``reason`` says why.
        WrongSession: the coordinator's Challenge did not verify with our salt on
            ``WRONG_SALT_ATTEMPTS`` (3) connections in a row (about a second): the salt
            differs, or the address is not a coordinator of this session.
        HandshakeError: no confirmed upstream handshake within ``connect_timeout`` (the
            message names the last failure: a coordinator of another session, a HelloAck that
            did not echo us, EOF before the welcome, ...); at once, a coordinator name that
            does not resolve (a ``socket.gaierror`` other than ``EAI_AGAIN``).
        WireError: the coordinator broke the protocol after the join.
    """
    ordered, sigs = check_relay_args(host, ranks, world_size, salt=salt, model_sigs=model_sigs)
    listeners = await rank_listeners(rank_listen)
    relay = Relay(target=coordinator, salt=salt, host=host, ranks=ordered,
                  world_size=world_size, config=config if config is not None else RelayConfig(),
                  timeline=timeline, ssl_context=ssl_context, server_hostname=server_hostname,
                  rank_address=bound_address(listeners), model_sigs=sigs)
    async with relay.running(listeners):
        yield relay
