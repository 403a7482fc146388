"""Relay phase 2 (SPEC §5): dialing the coordinator and the upstream handshake -- a join with
``Hello``, a resume with ``Resume`` -- and one *probe* of a newly published leader (issue 34):
a single ``Resume`` to an address the session store names, while the relay is still connected
to the coordinator it had.

What the relay tells its waiting ranks (``RankNotices.upstream_status``) and, for the command
line, what a join waits for (:attr:`UpstreamDialer.waiting`) are kept here, where the attempts
fail.
"""

from __future__ import annotations

import logging
import socket
import ssl
import types
from functools import partial

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
from ..net._keepalive import KeepAlive
from ..net._socket_io import Reader, run_handshake_on
from ..net._transport import STREAM_GONE, DialTarget, dial_and_handshake, format_address
from ..wire import Established, RefusalReceived, RelayHandshake, SessionSalt
from ._leader import Joined, NoLeaderPublished, StoreDialer
from .notices import RankNotices

log = logging.getLogger("flodl_trio.relay")

# Challenges in a row that do not verify with our salt before the relay gives up with
# WrongSession: one could be a corrupted byte, three (about a second of re-dials at
# CONNECT_RETRY_INTERVAL) are a salt that differs.
WRONG_SALT_ATTEMPTS = 3


def target_text(target: DialTarget) -> str:
    """How messages name ``target``: ``host:port``, a dialer's ``__name__`` (the store's URL,
    the list of addresses), or ``name()`` for a plain function."""
    if not callable(target):
        return format_address(target)
    name = getattr(target, "__name__", None) or type(target).__name__
    if isinstance(target, types.FunctionType | types.MethodType | partial):
        return f"{name}()"
    return str(name)


def waiting_text(exc: OSError, where: str) -> str | None:
    """What a join waits for, when a failed dial says it (a store with no leader, a resolver
    that failed for now); None for any other failure."""
    if isinstance(exc, NoLeaderPublished):
        return f"no coordinator published at {exc.store} yet"
    if isinstance(exc, socket.gaierror) and exc.errno == socket.EAI_AGAIN:
        return f"cannot resolve the coordinator at {where} yet ({exc.strerror or exc})"
    return None


class UpstreamDialer:
    """Dials the coordinator and runs the relay's end of the upstream handshake.

    Attributes:
        text: how messages name the target.
        waiting: while a join is retrying because the store names no leader yet (or the
            resolver failed for now): what it waits for and until when (Trio clock); None
            otherwise.
    """

    def __init__(self, *, target: DialTarget, salt: SessionSalt, host: str,
                 ranks: tuple[int, ...], world_size: int, model_sigs: dict[str, bytes],
                 config: RelayConfig, notices: RankNotices,
                 ssl_context: ssl.SSLContext | None, server_hostname: str | None) -> None:
        self.target = target
        self.text = target_text(target)
        self.waiting: tuple[str, float] | None = None
        self._salt = salt
        self._host = host
        self._ranks = ranks
        self._world_size = world_size
        self._model_sigs = model_sigs
        self._config = config
        self._notices = notices
        self._ssl_context = ssl_context
        self._server_hostname = server_hostname
        self._keepalive = KeepAlive.within(config.write_stall_timeout,
                                           write_stall=config.write_stall_timeout)

    @property
    def what(self) -> str:
        return f"relay {self._host!r}"

    async def handshake(self, stream: trio.abc.Stream, *, generation: int | None, peer: str,
                        wrong_salt: list[int], ranks: tuple[int, ...] | None = None) -> Joined:
        """The relay's end of one handshake on ``stream`` (a join, or a resume given the
        generation seen), within ``handshake_timeout``; ``wrong_salt[0]`` counts the attempts
        in a row whose Challenge did not verify with our salt. ``ranks``: the ranks to name
        (default: all of the relay's).

        Raises:
            JoinRefused: a verified ``Refused``.
            WrongSession: the ``WRONG_SALT_ATTEMPTS``-th such attempt in a row.
            WireError / HandshakeError / trio.TooSlowError / a stream error: this attempt
                failed.
        """
        machine = RelayHandshake(self._salt, host=self._host,
                                 ranks=self._ranks if ranks is None else ranks,
                                 world_size=self._world_size, model_sigs=self._model_sigs,
                                 coordinator=peer, generation=generation)
        try:
            with trio.fail_after(self._config.handshake_timeout):
                if self._ssl_context is not None:
                    stream = trio.SSLStream(stream, self._ssl_context,
                                            server_hostname=self._server_hostname,
                                            https_compatible=False)
                    await stream.do_handshake()
                # We speak first (Hello): nothing can be there to read before our write.
                done = await run_handshake_on(stream, Reader(stream, drained=True), machine)
        except BaseException as exc:
            wrong_salt[0] = wrong_salt[0] + 1 if machine.failure_category == "wrong salt" else 0
            if wrong_salt[0] >= WRONG_SALT_ATTEMPTS:
                raise WrongSession(host=self._host, peer=peer, attempts=wrong_salt[0]) from exc
            raise
        if isinstance(done, RefusalReceived):
            raise JoinRefused(done.reason, host=self._host, peer=peer)
        assert isinstance(done, Established)
        return stream, done

    async def connect(self, generation: int | None = None, *,
                      connect_timeout: float | None = None,
                      ranks: tuple[int, ...] | None = None) -> Joined:
        """Dial and join (``Hello``), or, given the generation seen, resume (``Resume``),
        re-dialing until ``connect_timeout`` (default: the config's). ``ranks``: the ranks the
        ``Hello`` names (default: all of the relay's; a wake-up names those still connected).

        Raises:
            JoinRefused / WrongSession / HandshakeError: see ``open_relay``.
        """
        coordinator = self.text
        at = "through" if coordinator.endswith("()") else "at"
        self._notices.status(f"dialing the coordinator {at} {coordinator}")
        self.waiting = None
        wrong_salt = [0]
        on_retry = partial(self._on_retry, f"{at} {coordinator}")

        def on_dial_error(exc: OSError, deadline: float) -> None:
            waiting = waiting_text(exc, coordinator)
            if waiting is None:
                return
            self._notices.status(f"waiting: {waiting}")
            if generation is None and self.waiting is None:  # a join; a resume says its own
                self.waiting = (waiting, deadline)
                log.warning("%s: %s; retrying for up to connect_timeout=%gs", self.what,
                            waiting, self._config.connect_timeout)

        # FT/2: any failure before the coordinator confirmed our Ready (EOF, a bad MAC, a
        # HelloAck that does not echo us, a forged or replayed record) is a failed attempt:
        # re-dial until connect_timeout, and name the last failure if none succeeds. A verified
        # Refused (JoinRefused) and an untrusted TLS certificate (on_retry) end the attempts at
        # once, a salt that differs (WrongSession) after WRONG_SALT_ATTEMPTS in a row.
        target = self.target if generation is None else self._resolving_target()
        try:
            return await dial_and_handshake(
                target, partial(self.handshake, generation=generation, peer=coordinator,
                                wrong_salt=wrong_salt, ranks=ranks),
                what=self.what, peer=coordinator,
                connect_timeout=self._config.connect_timeout if connect_timeout is None
                else connect_timeout,
                expected="a confirmed upstream handshake (HelloAck, Ready, welcome)"
                if generation is None else "a confirmed resume (HelloAck, Ready, Generation, "
                "welcome)", on_retry=on_retry, on_dial_error=on_dial_error,
                # Riding a loss out, a name that does not resolve may yet (a new leader's DNS
                # record): retried for the grace. At the join it is a mistake: said at once.
                retry_unresolvable=generation is not None,
                final=(JoinRefused, WrongSession),
                retry_on=(WireError, HandshakeError, trio.TooSlowError, *STREAM_GONE),
                keepalive=self._keepalive,
            )
        finally:
            self.waiting = None

    def _on_retry(self, where: str, exc: BaseException) -> None:
        """A failed attempt: said to the ranks; an untrusted certificate ends the attempts."""
        if isinstance(exc.__cause__, ssl.SSLCertVerificationError):
            # Retrying cannot make an untrusted certificate trusted: say so now.
            raise HandshakeError(
                f"{self.what}: TLS: the coordinator {where} presented a certificate we do not "
                f"trust ({exc.__cause__.verify_message}); pass an ssl_context that trusts its "
                "CA") from None
        self._notices.status(f"re-dialing the coordinator {where} (last attempt: {exc!r})")

    async def rejoin(self, ranks: tuple[int, ...]) -> Joined:
        """Join again with a fresh ``Hello`` naming ``ranks``, as a restarted host does: the
        wake-up of a relay whose ranks were fenced (issue 37), within ``connect_timeout``.

        Raises:
            JoinRefused / WrongSession / HandshakeError: see ``open_relay``.
        """
        return await self.connect(ranks=ranks)

    async def resume(self, generation: int, deadline: float) -> Joined:
        """Re-dial a durable coordinator with ``Resume`` until ``deadline`` (Trio clock).

        Raises:
            JoinRefused / WrongSession / HandshakeError: see ``open_relay``.
        """
        return await self.connect(generation,
                                  connect_timeout=max(0.0, deadline - trio.current_time()))

    def _resolving_target(self) -> DialTarget:
        """The target for a resume: a callable is called on every attempt (so one that reads
        the store's published address re-resolves); a store it cannot reach yet is one more
        attempt that failed, not the end of the relay."""
        target = self.target
        if not callable(target):
            return target
        call = target

        async def resolve() -> trio.abc.Stream:
            try:
                return await call()
            except StoreError as exc:
                raise ConnectionError(f"resolving the coordinator: {exc}") from exc

        resolve.__name__ = self.text
        return resolve

    async def probe(self, addresses: tuple[tuple[str, int], ...], generation: int
                    ) -> Joined | None:
        """One ``Resume`` to the coordinator the store now names at ``addresses`` (tried in
        turn, each within ``handshake_timeout``), while the relay is still connected to the
        one it had; the joined connection, or None (each failure is logged).

        Raises:
            ConfigError: the target is not a :class:`StoreDialer`.
        """
        dialer = self.target
        if not isinstance(dialer, StoreDialer):
            raise ConfigError(f"{self.what}: a probe needs a store to dial, got {self.text}")
        for address in addresses:
            peer = format_address(address)
            stream: trio.abc.Stream | None = None
            try:
                with trio.fail_after(self._config.handshake_timeout):
                    stream = await dialer.connect_to(address, keepalive=self._keepalive)
                joined = await self.handshake(stream, generation=generation, peer=peer,
                                              wrong_salt=[0])
            except (OSError, FlodlError, trio.TooSlowError, *STREAM_GONE) as exc:
                if stream is not None:
                    await trio.aclose_forcefully(stream)
                log.info("%s: the coordinator %s names at %s did not take a Resume: %r",
                         self.what, dialer.description, peer, exc)
                continue
            except BaseException:
                if stream is not None:
                    await trio.aclose_forcefully(stream)
                raise
            dialer.dialed_now(addresses)
            return joined
        return None


__all__ = ["WRONG_SALT_ATTEMPTS", "Joined", "UpstreamDialer", "target_text"]
