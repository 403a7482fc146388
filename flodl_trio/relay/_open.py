"""The host relay (SPEC §5): terminates its local ranks' handshakes on loopback and carries all
their frames over one sealed upstream connection to the coordinator.

Phases: (1) accept every local rank within ``rank_accept_timeout``; (2) dial the coordinator and
run the upstream handshake; (3) pump: one reader per local rank feeds a bounded queue drained by
the single upstream writer, and one upstream reader routes DATA and FANOUT records to ranks.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from .._config import RelayConfig
from .._errors import (
    ConfigError,
    FlodlError,
    HandshakeError,
    JoinRefused,
    StoreError,
    WireError,
    WrongSession,
)
from .._lifecycle import open_lifecycle
from ..net._keepalive import KeepAlive
from ..net._socket_io import Reader, run_handshake_on
from ..net._transport import STREAM_GONE, DialTarget, close_all, dial_and_handshake, format_address
from ..timeline import Timeline
from ..wire import (
    Established,
    RefusalReceived,
    RelayHandshake,
    SessionSalt,
)
from ._args import RankListen, check_model_sigs, check_relay_args, rank_listeners
from ._link import RelayExit
from .notices import RankNotices
from .pump import Pump
from .ranks import LocalRanks, accept_ranks
from .resume import Reconnector

log = logging.getLogger("flodl_trio.relay")

# Challenges in a row that do not verify with our salt before the relay gives up with
# WrongSession: one could be a corrupted byte, three (about a second of re-dials at
# CONNECT_RETRY_INTERVAL) are a salt that differs.
WRONG_SALT_ATTEMPTS = 3


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
            property; None otherwise).
        dropped_while_reconnecting: frames from its ranks dropped while reconnecting, over
            ``reconnect_queue`` (a property).
    """

    def __init__(self, *, target: DialTarget, salt: SessionSalt, host: str,
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
        self._target = target
        self._salt = salt
        self._ssl_context = ssl_context
        self._server_hostname = server_hostname
        self._local = LocalRanks(host=host, ranks=ranks, world_size=world_size, salt=salt,
                                 config=config)
        self._connected = trio.Event()
        self._closed = trio.Event()
        self._exit: RelayExit | None = None
        self._error: FlodlError | None = None
        self._upstream: trio.abc.Stream | None = None
        self._body_scope: trio.CancelScope | None = None
        self._notices = RankNotices(self._local, salt)
        self._pump: Pump | None = None

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
        resume = self._pump.resume if self._pump is not None else None
        return resume.generation if resume is not None else 0

    @property
    def reconnects(self) -> int:
        """How many times the relay resumed with its durable coordinator."""
        resume = self._pump.resume if self._pump is not None else None
        return resume.reconnects if resume is not None else 0

    @property
    def reconnecting(self) -> str | None:
        """Why the durable coordinator is away, while the relay rides it out; else None."""
        resume = self._pump.resume if self._pump is not None else None
        return resume.away if resume is not None else None

    @property
    def dropped_while_reconnecting(self) -> int:
        """Frames from the ranks dropped while reconnecting (over ``reconnect_queue``)."""
        resume = self._pump.resume if self._pump is not None else None
        return resume.dropped if resume is not None else 0

    @property
    def error(self) -> FlodlError | None:
        """Why the relay failed (what ``open_relay`` raises), else None."""
        return self._error

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

    # ------------------------------------------------------------------ phase 2

    async def _connect_upstream(self, generation: int | None = None,
                                connect_timeout: float | None = None,
                                ) -> tuple[trio.abc.Stream, Established]:
        """Dial and join (``Hello``), or, given the generation seen, resume (``Resume``)."""
        what = f"relay {self.host!r}"
        coordinator = _target_text(self._target)
        self._notices.upstream_status = f"dialing the coordinator at {coordinator}"

        wrong_salt = 0  # Challenges in a row that did not verify with our salt

        async def handshake(stream: trio.abc.Stream) -> tuple[trio.abc.Stream, Established]:
            nonlocal wrong_salt
            machine = RelayHandshake(self._salt, host=self.host, ranks=self.ranks,
                                     world_size=self.world_size,
                                     model_sigs=self.model_sigs, coordinator=coordinator,
                                     generation=generation)
            try:
                with trio.fail_after(self.config.handshake_timeout):
                    if self._ssl_context is not None:
                        stream = trio.SSLStream(stream, self._ssl_context,
                                                server_hostname=self._server_hostname,
                                                https_compatible=False)
                        await stream.do_handshake()
                    done = await run_handshake_on(stream, Reader(stream), machine)
            except BaseException as exc:
                wrong_salt = wrong_salt + 1 if machine.failure_category == "wrong salt" else 0
                if wrong_salt >= WRONG_SALT_ATTEMPTS:
                    raise WrongSession(host=self.host, peer=coordinator,
                                       attempts=wrong_salt) from exc
                raise
            if isinstance(done, RefusalReceived):
                raise JoinRefused(done.reason, host=self.host, peer=coordinator)
            assert isinstance(done, Established)
            return stream, done

        def on_retry(exc: BaseException) -> None:
            if isinstance(exc.__cause__, ssl.SSLCertVerificationError):
                # Retrying cannot make an untrusted certificate trusted: say so now.
                raise HandshakeError(
                    f"{what}: TLS: the coordinator at {coordinator} presented a certificate we "
                    f"do not trust ({exc.__cause__.verify_message}); pass an ssl_context that "
                    "trusts its CA"
                ) from None
            self._notices.upstream_status = (f"re-dialing the coordinator at {coordinator} "
                                             f"(last attempt: {exc!r})")

        # FT/2: any failure before the coordinator confirmed our Ready (EOF, a bad MAC, a
        # HelloAck that does not echo us, a forged or replayed record) is a failed attempt:
        # re-dial until connect_timeout, and name the last failure if none succeeds. A verified
        # Refused (JoinRefused) and an untrusted TLS certificate (on_retry) end the attempts at
        # once, a salt that differs (WrongSession) after WRONG_SALT_ATTEMPTS in a row.
        target = self._target if generation is None else self._resolving_target()
        return await dial_and_handshake(
            target, handshake, what=what, peer=coordinator,
            connect_timeout=self.config.connect_timeout if connect_timeout is None
            else connect_timeout,
            expected="a confirmed upstream handshake (HelloAck, Ready, welcome)"
            if generation is None else "a confirmed resume (HelloAck, Ready, Generation, "
            "welcome)", on_retry=on_retry, final=(JoinRefused, WrongSession),
            retry_on=(WireError, HandshakeError, trio.TooSlowError, *STREAM_GONE),
            keepalive=KeepAlive.within(self.config.write_stall_timeout,
                                       write_stall=self.config.write_stall_timeout),
        )

    def _resolving_target(self) -> DialTarget:
        """The target for a resume: a callable is called on every attempt (so one that reads
        the store's published address re-resolves); a store it cannot reach yet is one more
        attempt that failed, not the end of the relay."""
        target = self._target
        if not callable(target):
            return target
        call = target

        async def resolve() -> trio.abc.Stream:
            try:
                return await call()
            except StoreError as exc:
                raise ConnectionError(f"resolving the coordinator: {exc}") from exc

        return resolve

    async def _resume_upstream(self, generation: int, deadline: float,
                               ) -> tuple[trio.abc.Stream, Established]:
        """Re-dial a durable coordinator with ``Resume`` until ``deadline``."""
        joined = await self._connect_upstream(
            generation, connect_timeout=max(0.0, deadline - trio.current_time()))
        self._upstream = joined[0]
        return joined

    # ------------------------------------------------------------------ lifecycle

    async def run(self, listeners: list[trio.abc.Listener[Any]]) -> None:
        """Phases 1 to 3, then close every connection (``open_relay`` runs it)."""
        try:
            stop_notices = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._notices.keep_informed, stop_notices)
                joined = await self._join(listeners, stop_notices)
            if isinstance(joined, FlodlError):
                raise joined  # outside the nursery: not wrapped in an ExceptionGroup
            stream, established = joined
            self._connected.set()
            log.info("relay %r connected upstream with ranks %s", self.host, list(self.ranks))
            pump = self._pump = Pump(self._local, stream, established.sealer,
                                     established.opener, self.timeline,
                                     first=established.records)
            if established.generation is not None:
                log.info("relay %r: the coordinator is durable (generation %d)", self.host,
                         established.generation)
                pump.resume = Reconnector(self._local, established.generation,
                                          self._resume_upstream, drop_rank=pump.drop_rank)
            exit_ = await pump.run()
            self._error = pump.error
        except FlodlError as exc:
            self._error = exc
            exit_ = RelayExit(f"failed: {exc}", False)
            # The ranks would otherwise only see their link end: tell them why first.
            await self._notices.tell(f"relay {self.host!r} gave up: {exc}")
        finally:
            # Runs on cancellation too: no rank or upstream socket outlives the relay.
            await self._close_all()
        self._exit = exit_
        self._closed.set()
        if self._error is not None and self._body_scope is not None:
            self._body_scope.cancel()

    async def _join(self, listeners: list[trio.abc.Listener[Any]], stop_notices: trio.Event,
                    ) -> tuple[trio.abc.Stream, Established] | FlodlError:
        """Phases 1 and 2; a FlodlError is returned, not raised, so no group wraps it."""
        try:
            await accept_ranks(self._local, listeners)
            joined = await self._connect_upstream()
            self._upstream = joined[0]
            return joined
        except FlodlError as exc:
            return exc
        finally:
            stop_notices.set()  # the notice task ends after its current write

    async def _close_all(self) -> None:
        links = list(self._local.links())
        for link in links:
            link.gone = True
        streams: list[Any] = [link.stream for link in links]
        if self._upstream is not None:
            streams.append(self._upstream)
        if self._pump is not None and self._pump.stream is not self._upstream:
            streams.append(self._pump.stream)
        await close_all(streams)


def _target_text(target: DialTarget) -> str:
    return format_address(target) if not callable(target) else "the coordinator"


@asynccontextmanager
async def open_relay(
    coordinator: DialTarget,
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
        coordinator: ``(host, port)`` of the coordinator, or an async callable returning a stream.
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
            did not echo us, EOF before the welcome, ...).
        WireError: the coordinator broke the protocol after the join.
    """
    ordered = check_relay_args(host, ranks, world_size)
    sigs = check_model_sigs(host, model_sigs)
    if not isinstance(salt, SessionSalt):
        raise ConfigError(f"open_relay: expected a SessionSalt, got {type(salt).__name__}")
    cfg = config if config is not None else RelayConfig()
    listeners = await rank_listeners(rank_listen)
    sock = getattr(listeners[0], "socket", None)
    rank_address = None
    if sock is not None:
        name = sock.getsockname()
        rank_address = (str(name[0]), int(name[1]))
    relay = Relay(target=coordinator, salt=salt, host=host, ranks=ordered, world_size=world_size,
                  config=cfg, timeline=timeline, ssl_context=ssl_context,
                  server_hostname=server_hostname, rank_address=rank_address,
                  model_sigs=sigs)
    async with open_lifecycle(f"relay {host!r}", failure=lambda: relay.error) as life:
        life.nursery.start_soon(relay.run, listeners)
        with life.body() as body_scope:
            relay.cancel_on_error(body_scope)
            yield relay
