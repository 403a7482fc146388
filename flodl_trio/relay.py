"""The host relay (SPEC §5): terminates its local ranks' handshakes on loopback and carries all
their frames over one sealed upstream connection to the coordinator.

Phases: (1) accept every local rank within ``rank_accept_timeout``; (2) dial the coordinator and
run the upstream handshake; (3) pump: one reader per local rank feeds a bounded queue drained by
the single upstream writer, and one upstream reader routes DATA and FANOUT records to ranks.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from ._config import RelayConfig
from ._errors import (
    AuthError,
    ConfigError,
    FlodlError,
    FormationTimeout,
    HandshakeError,
    WireError,
)
from ._transport import (
    DialTarget,
    StreamWriter,
    close_all,
    dial,
    format_address,
    peer_of,
    receive_exactly,
)
from .coordinator import pick_one_exception
from .coordinator._handshake import relay_handshake
from .timeline import Timeline
from .wire import (
    MAX_LEN_FRAME,
    RANK_HELLO_LEN,
    LenFrameDecoder,
    RankExit,
    RecordKind,
    RecordOpener,
    RecordSealer,
    SessionSalt,
    decode_fanout,
    decode_rank_hello,
    encode,
    encode_rank_ack,
    frames_before,
    len_frame,
)

log = logging.getLogger("flodl_trio.relay")

# Bytes a rank may send before the pump starts that the relay reads ahead (SPEC §5 phase 1).
_EARLY_LIMIT = 1 << 20
RankListen = None | int | trio.abc.Listener[Any] | Sequence[trio.abc.Listener[Any]]
_GONE = (trio.BrokenResourceError, trio.ClosedResourceError)


@attrs.frozen
class RelayExit:
    """How a relay ended. ``clean`` is False when the upstream link broke rather than closed."""

    reason: str
    clean: bool = True


class _RankLink:
    """One local rank's loopback connection and its outbound queue."""

    def __init__(self, rank: int, stream: trio.abc.Stream, config: RelayConfig) -> None:
        self.rank = rank
        self.stream = stream
        self.writer = StreamWriter(stream, write_stall_timeout=config.write_stall_timeout)
        self.out_send, self.out_recv = trio.open_memory_channel[bytes](config.queue_size)
        self.gone = False
        self.writer_done = trio.Event()
        # What the rank sent while the relay was still accepting ranks, and whether its link
        # already ended then; the pump starts from these.
        self.early = bytearray()
        self.early_eof = False


class Relay:
    """A running relay, as yielded by :func:`open_relay`.

    Attributes:
        host: this relay's host name.
        ranks: the global ranks it carries (ascending).
        rank_address: ``(host, port)`` where local ranks dial, when it bound TCP itself.
    """

    def __init__(self, *, target: DialTarget, salt: SessionSalt, host: str,
                 ranks: tuple[int, ...], world_size: int, config: RelayConfig,
                 timeline: Timeline | None, ssl_context: ssl.SSLContext | None,
                 server_hostname: str | None) -> None:
        self.host = host
        self.ranks = ranks
        self.world_size = world_size
        self.config = config
        self.timeline = timeline
        self.rank_address: tuple[str, int] | None = None
        self._target = target
        self._salt = salt
        self._ssl_context = ssl_context
        self._server_hostname = server_hostname
        self._rank_set = frozenset(ranks)
        self._links: dict[int, _RankLink] = {}
        self._reserved: set[int] = set()  # hello verified, ack not yet written
        self._rejects: list[str] = []
        self._all_ranks = trio.Event()
        self._connected = trio.Event()
        self._closed = trio.Event()
        self._exit: RelayExit | None = None
        self._error: FlodlError | None = None
        self._no_ranks_left = trio.Event()
        self._upstream_done = trio.Event()
        self._upstream: trio.abc.Stream | None = None
        self._pump_scope: trio.CancelScope | None = None
        self._body_scope: trio.CancelScope | None = None

    @property
    def connected_ranks(self) -> frozenset[int]:
        """Local ranks whose connection is up."""
        return frozenset(r for r, link in self._links.items() if not link.gone)

    async def wait_connected(self) -> None:
        """Return once the coordinator acknowledged this relay (``HelloAck``)."""
        await self._connected.wait()

    async def wait_closed(self) -> RelayExit:
        """Return how the relay ended, once it has."""
        await self._closed.wait()
        assert self._exit is not None
        return self._exit

    # ------------------------------------------------------------------ phase 1

    async def _accept_ranks(self, listeners: list[trio.abc.Listener[Any]]) -> None:
        timeout = self.config.rank_accept_timeout
        try:
            with trio.move_on_after(timeout):
                async with trio.open_nursery() as nursery:
                    for listener in listeners:
                        nursery.start_soon(self._rank_accept_loop, listener, nursery)
                    await self._all_ranks.wait()
                    nursery.cancel_scope.cancel()
        finally:
            await close_all(listeners)
        if not self._all_ranks.is_set():
            missing = sorted(self._rank_set - set(self._links))
            rejects = "; ".join(self._rejects[-5:]) or "none"
            raise FormationTimeout(
                f"relay {self.host!r}: rank accept timed out after {timeout:g}s: "
                f"{len(self._links)}/{len(self.ranks)} local ranks connected (missing {missing}); "
                f"{len(self._rejects)} rejected connection(s): {rejects}"
            )

    async def _rank_accept_loop(self, listener: trio.abc.Listener[Any],
                                nursery: trio.Nursery) -> None:
        while True:
            try:
                stream = await listener.accept()
            except _GONE:
                return
            except OSError as exc:
                log.warning("relay %r: accept failed: %r", self.host, exc)
                await trio.sleep(0.1)
                continue
            nursery.start_soon(self._rank_handshake, stream)

    async def _rank_handshake(self, stream: trio.abc.Stream) -> None:
        peer = peer_of(stream)
        reserved: int | None = None
        try:
            with trio.fail_after(self.config.handshake_timeout):
                data = await receive_exactly(stream, RANK_HELLO_LEN, what=f"rank hello from {peer}")
                rank = decode_rank_hello(self._salt, data, world_size=self.world_size)
                if rank not in self._rank_set:
                    raise HandshakeError(
                        f"rank hello from {peer}: rank {rank} does not belong to host "
                        f"{self.host!r} (its ranks are {list(self.ranks)})"
                    )
                if rank in self._links or rank in self._reserved:
                    raise HandshakeError(f"rank hello from {peer}: rank {rank} is already "
                                         "connected")
                reserved = rank
                self._reserved.add(rank)
                await stream.send_all(encode_rank_ack(self._salt))
        except (trio.TooSlowError, WireError, HandshakeError, *_GONE) as exc:
            if reserved is not None:
                self._reserved.discard(reserved)
            text = (f"rank hello from {peer}: no hello within handshake_timeout="
                    f"{self.config.handshake_timeout:g}s" if isinstance(exc, trio.TooSlowError)
                    else str(exc) or type(exc).__name__)
            self._rejects.append(text)
            log.warning("relay %r rejected a rank connection: %s", self.host, text)
            await trio.aclose_forcefully(stream)
            return
        except BaseException:
            if reserved is not None:
                self._reserved.discard(reserved)
            await trio.aclose_forcefully(stream)
            raise
        self._reserved.discard(rank)
        link = _RankLink(rank, stream, self.config)
        self._links[rank] = link
        log.info("relay %r: rank %d connected from %s", self.host, rank, peer)
        if len(self._links) == len(self.ranks):
            self._all_ranks.set()
        else:
            await self._watch_while_accepting(link)

    async def _watch_while_accepting(self, link: _RankLink) -> None:
        """Until every local rank is in (this task is then cancelled), notice a link that ends.

        A written ack may still not reach the rank (the link broke, or the rank's own handshake
        deadline fired first); that rank re-dials, so its slot must be free again, as the
        coordinator frees the ranks of a relay lost during formation. Without this the re-dial
        was refused as "already connected" and the rank was lost.
        """
        try:
            while len(link.early) < _EARLY_LIMIT:
                data = await link.stream.receive_some(65536)
                if not data:
                    break
                link.early += data
            else:
                await trio.sleep_forever()  # past the limit the rank's writes wait for the pump
        except _GONE:
            pass
        if self._all_ranks.is_set():
            link.early_eof = True  # too late to free the slot: the pump reports RankExit
            return
        del self._links[link.rank]
        self._rejects.append(f"rank {link.rank}: its link ended after the ack, before every "
                             "local rank connected (a re-dial is accepted)")
        log.warning("relay %r: rank %d's link ended before every local rank connected; "
                    "accepting it again", self.host, link.rank)
        await trio.aclose_forcefully(link.stream)

    # ------------------------------------------------------------------ phase 2

    async def _connect_upstream(self) -> tuple[trio.abc.Stream, RecordSealer, RecordOpener]:
        deadline = trio.current_time() + self.config.connect_timeout
        what = f"relay {self.host!r}"
        last: BaseException | None = None
        while True:
            remaining = max(0.0, deadline - trio.current_time())
            stream = await dial(self._target, connect_timeout=remaining, what=what)
            try:
                with trio.fail_after(self.config.handshake_timeout):
                    if self._ssl_context is not None:
                        stream = trio.SSLStream(stream, self._ssl_context,
                                                server_hostname=self._server_hostname,
                                                https_compatible=False)
                        await stream.do_handshake()
                    sealer, opener = await relay_handshake(
                        stream, self._salt, host=self.host, ranks=self.ranks,
                        coordinator=_target_text(self._target))
                return stream, sealer, opener
            except AuthError:
                await trio.aclose_forcefully(stream)
                raise
            except (WireError, trio.TooSlowError, *_GONE) as exc:
                await trio.aclose_forcefully(stream)
                if isinstance(exc.__cause__, ssl.SSLCertVerificationError):
                    # Retrying cannot make an untrusted certificate trusted: say so now.
                    raise HandshakeError(
                        f"{what}: TLS: the coordinator at {_target_text(self._target)} presented "
                        f"a certificate we do not trust ({exc.__cause__.verify_message}); pass "
                        "an ssl_context that trusts its CA"
                    ) from None
                last = exc
                if trio.current_time() + 0.5 >= deadline:
                    break
                log.info("%s: upstream handshake failed (%r); re-dialing", what, exc)
                await trio.sleep(0.5)
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
        raise HandshakeError(
            f"{what}: expected an upstream handshake with {_target_text(self._target)} within "
            f"connect_timeout={self.config.connect_timeout:g}s, last attempt failed: {last!r}"
        )

    # ------------------------------------------------------------------ phase 3

    async def _pump(self, stream: trio.abc.Stream, sealer: RecordSealer,
                    opener: RecordOpener) -> RelayExit:
        up_send, up_recv = trio.open_memory_channel[tuple[int, int, bytes]](self.config.queue_size)
        outcome: list[RelayExit] = []
        with trio.CancelScope() as scope:
            self._pump_scope = scope

            def finish(reason: str, clean: bool = True, *, now: bool = True) -> None:
                if not outcome:
                    outcome.append(RelayExit(reason, clean))
                    log.info("relay %r ending: %s", self.host, reason)
                if now:
                    scope.cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._upstream_writer, stream, sealer, up_recv, finish)
                nursery.start_soon(self._upstream_reader, stream, opener, finish)
                # One queue clone per rank reader: the queue ends (and the writer with it) only
                # once every reader has queued its last frame and its RankExit.
                with up_send:
                    for link in self._links.values():
                        nursery.start_soon(self._rank_reader, link, up_send.clone(), finish)
                        nursery.start_soon(self._rank_writer, link)
        return outcome[0] if outcome else RelayExit("stopped", True)

    async def _upstream_writer(self, stream: trio.abc.Stream, sealer: RecordSealer,
                               up_recv: trio.MemoryReceiveChannel[tuple[int, int, bytes]],
                               finish: Any) -> None:
        async for item in up_recv:
            batch = [item]
            while len(batch) < 64:  # coalesce a burst into one write; each record stays whole
                try:
                    batch.append(up_recv.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            data = b"".join(sealer.seal(kind, rank, payload) for kind, rank, payload in batch)
            try:
                with trio.fail_after(self.config.write_stall_timeout):
                    await stream.send_all(data)
            except trio.TooSlowError:
                finish(f"upstream write stall: no progress for "
                       f"{self.config.write_stall_timeout:g}s", False)
                return
            except _GONE as exc:
                finish(f"upstream connection lost while writing ({type(exc).__name__})", False)
                return
        # Every rank reader closed its queue clone: the last local rank is gone, and what the
        # ranks queued before leaving (Exiting, RankExit) is written. Ending before this point
        # cancelled the writer with the last rank's records still queued.
        self._no_ranks_left.set()
        finish("all ranks exited", now=False)
        # Half-close and let the coordinator close first: closing a socket with unread data
        # in it sends a reset, which can destroy the records we just wrote before they are read.
        with trio.move_on_after(self.config.shutdown_grace):
            try:
                if isinstance(stream, trio.abc.HalfCloseableStream):
                    await stream.send_eof()
                    await self._upstream_done.wait()
            except (trio.BusyResourceError, *_GONE):
                pass
        finish("all ranks exited")

    async def _upstream_reader(self, stream: trio.abc.Stream, opener: RecordOpener,
                               finish: Any) -> None:
        try:
            await self._read_upstream(stream, opener, finish)
        finally:
            self._upstream_done.set()

    async def _read_upstream(self, stream: trio.abc.Stream, opener: RecordOpener,
                             finish: Any) -> None:
        try:
            data: bytes | bytearray = b""  # the first feed opens what came with HelloAck
            while True:
                try:
                    records = opener.feed(data)
                except WireError as exc:
                    # Records authenticated before the bad one are delivered; then it ends.
                    for rec in frames_before(exc):
                        await self._route(rec)
                    raise
                for rec in records:
                    await self._route(rec)
                data = await stream.receive_some(65536)
                if not data:
                    break
        except WireError as exc:
            self._error = exc
            await self._flush_ranks()
            finish(f"upstream protocol error: {exc}", False)
            return
        except _GONE as exc:
            await self._flush_ranks()
            finish(f"upstream connection lost ({type(exc).__name__})", False)
            return
        # The coordinator closed: deliver what is queued to the ranks, let them say goodbye
        # (their Exiting still flows upstream), then end.
        for link in self._links.values():
            link.out_send.close()
        with trio.move_on_after(self.config.shutdown_grace):
            await self._no_ranks_left.wait()
        finish("coordinator closed the connection")

    async def _flush_ranks(self) -> None:
        """Let the rank writers deliver what was verified and queued before the link broke."""
        for link in self._links.values():
            link.out_send.close()
        with trio.move_on_after(min(1.0, self.config.shutdown_grace)):
            for link in self._links.values():
                await link.writer_done.wait()

    async def _route(self, rec: Any) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        if rec.kind == RecordKind.DATA:
            await self._to_rank(rec.rank, len_frame(rec.payload))
        elif rec.kind == RecordKind.FANOUT:
            ranks, frame = decode_fanout(rec.payload)
            blob = len_frame(frame)
            for rank in ranks:
                await self._to_rank(rank, blob)
        else:
            log.warning("relay %r: unexpected record kind %d from the coordinator; dropped",
                        self.host, rec.kind)

    async def _to_rank(self, rank: int, blob: bytes) -> None:
        link = self._links.get(rank)
        if link is None:
            log.warning("relay %r: frame for rank %d, which is not local; dropped", self.host, rank)
            return
        if link.gone:
            return
        try:
            # No checkpoint per rank on the fast path: a FANOUT to 8 ranks is one pass.
            link.out_send.send_nowait(blob)
        except trio.WouldBlock:
            try:
                await link.out_send.send(blob)  # that rank is behind: wait for its writer
            except _GONE:
                pass
        except _GONE:
            pass

    async def _rank_writer(self, link: _RankLink) -> None:
        try:
            await self._write_to_rank(link)
        finally:
            link.writer_done.set()

    async def _write_to_rank(self, link: _RankLink) -> None:
        try:
            async for blob in link.out_recv:
                batch = [blob]
                while len(batch) < 64:  # one write for a burst of frames (each stays whole)
                    try:
                        batch.append(link.out_recv.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                await link.writer.send(batch[0] if len(batch) == 1 else b"".join(batch))
            await link.writer.send_eof()
        except (trio.TooSlowError, *_GONE) as exc:
            if not link.gone:
                log.warning("relay %r: rank %d stopped reading (%s); closing it", self.host,
                            link.rank, type(exc).__name__)
            await trio.aclose_forcefully(link.stream)

    async def _rank_reader(self, link: _RankLink,
                           up_send: trio.MemorySendChannel[tuple[int, int, bytes]],
                           finish: Any) -> None:
        decoder = LenFrameDecoder(max_len=MAX_LEN_FRAME)
        try:
            data: bytes | bytearray = bytes(link.early)  # read while accepting ranks
            link.early.clear()
            while True:
                try:
                    blobs = decoder.feed(data)
                except WireError as exc:
                    for blob in frames_before(exc):  # whole frames before the bad length
                        await up_send.send((int(RecordKind.DATA), link.rank, blob))
                    raise
                for blob in blobs:
                    await up_send.send((int(RecordKind.DATA), link.rank, blob))
                if link.early_eof:
                    break
                data = await link.stream.receive_some(65536)
                if not data:
                    break
        except WireError as exc:
            log.warning("relay %r: rank %d sent a bad length frame (%s); closing it", self.host,
                        link.rank, exc)
        except _GONE:
            pass
        link.gone = True
        link.out_send.close()
        await trio.aclose_forcefully(link.stream)
        with up_send:  # closing this reader's clone; the writer ends after the last one
            try:
                await up_send.send((int(RecordKind.CONTROL), 0,
                                    encode(RankExit(rank=link.rank))))
            except _GONE:
                pass

    # ------------------------------------------------------------------ lifecycle

    async def _run(self, listeners: list[trio.abc.Listener[Any]]) -> None:
        try:
            await self._accept_ranks(listeners)
            stream, sealer, opener = await self._connect_upstream()
            self._upstream = stream
            self._connected.set()
            log.info("relay %r connected upstream with ranks %s", self.host, list(self.ranks))
            exit_ = await self._pump(stream, sealer, opener)
        except FlodlError as exc:
            self._error = exc
            exit_ = RelayExit(f"failed: {exc}", False)
        finally:
            # Runs on cancellation too: no rank or upstream socket outlives the relay.
            await self._close_all()
        self._exit = exit_
        self._closed.set()
        if self._error is not None and self._body_scope is not None:
            self._body_scope.cancel()

    async def _close_all(self) -> None:
        for link in self._links.values():
            link.gone = True
        streams: list[Any] = [link.stream for link in self._links.values()]
        if self._upstream is not None:
            streams.append(self._upstream)
        await close_all(streams)


def _target_text(target: DialTarget) -> str:
    return format_address(target) if not callable(target) else "the coordinator"


def _check_relay_args(host: str, ranks: Sequence[int], world_size: int) -> tuple[int, ...]:
    if not isinstance(host, str) or not 1 <= len(host.encode("utf-8")) <= 255:
        raise ConfigError(f"open_relay: expected host to be 1-255 UTF-8 bytes, got {host!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        raise ConfigError(f"open_relay({host!r}): expected world_size > 0, got {world_size!r}")
    out = sorted(ranks)
    if not out:
        raise ConfigError(f"open_relay({host!r}): expected at least one rank, got none")
    for r in out:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size:
            raise ConfigError(f"open_relay({host!r}): rank {r!r} is outside [0, {world_size})")
    if len(set(out)) != len(out):
        raise ConfigError(f"open_relay({host!r}): ranks contain duplicates: {list(ranks)}")
    return tuple(out)


async def _rank_listeners(rank_listen: RankListen) -> list[trio.abc.Listener[Any]]:
    if rank_listen is None or (isinstance(rank_listen, int) and not isinstance(rank_listen, bool)):
        port = 0 if rank_listen is None else rank_listen
        return list(await trio.open_tcp_listeners(port, host="127.0.0.1"))
    if isinstance(rank_listen, trio.abc.Listener):
        return [rank_listen]
    if isinstance(rank_listen, Sequence) and all(
            isinstance(x, trio.abc.Listener) for x in rank_listen):
        return list(rank_listen)
    raise ConfigError(f"open_relay: expected rank_listen None, a port or Listener(s), got "
                      f"{rank_listen!r}")


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

    Raises:
        ConfigError: invalid arguments.
        FormationTimeout: not every local rank connected within ``rank_accept_timeout``.
        HandshakeError: no upstream handshake within ``connect_timeout``.
        AuthError / WireError: the coordinator is of another session, or broke the protocol.
    """
    ordered = _check_relay_args(host, ranks, world_size)
    if not isinstance(salt, SessionSalt):
        raise ConfigError(f"open_relay: expected a SessionSalt, got {type(salt).__name__}")
    cfg = config if config is not None else RelayConfig()
    relay = Relay(target=coordinator, salt=salt, host=host, ranks=ordered, world_size=world_size,
                  config=cfg, timeline=timeline, ssl_context=ssl_context,
                  server_hostname=server_hostname)
    listeners = await _rank_listeners(rank_listen)
    sock = getattr(listeners[0], "socket", None)
    if sock is not None:
        name = sock.getsockname()
        relay.rank_address = (str(name[0]), int(name[1]))
    body_exc: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(relay._run, listeners)
            with trio.CancelScope() as body_scope:
                relay._body_scope = body_scope
                try:
                    yield relay
                except BaseException as exc:
                    body_exc = exc
                    raise
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        chosen = pick_one_exception(group, body_exc, relay._error)
        if chosen is None:
            raise
        error: BaseException = chosen
    else:
        if relay._error is None:
            return
        error = relay._error
    raise error
