"""Relay phase 1 (SPEC §5): accept every local rank and terminate its handshake (§2.3).

A bad hello is rejected and the relay keeps accepting until ``rank_accept_timeout``. FT/2: a rank
counts as connected only once its first frame after the ack arrived (the ack may be lost on the
way); until then a re-dial of the same rank takes over its slot, and a rank whose connection
breaks before every rank is in gets its slot back too, so its re-dial is accepted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import trio

from .._config import RelayConfig
from .._errors import FormationTimeout, HandshakeError, WireError
from .._timeouts import clock_time_in
from ..net._keepalive import KeepAlive
from ..net._listen import serve_each
from ..net._ratelimit import JunkCounter
from ..net._socket_io import Reader, run_handshake_on
from ..net._transport import STREAM_GONE, close_all, peer_of
from ..wire import (
    READ_SIZE,
    FrameCodec,
    RankAcceptHandshake,
    RankConfirmed,
    RankHelloReceived,
    SessionSalt,
)
from ._link import EARLY_LIMIT, RankLink

log = logging.getLogger("flodl_trio.relay")



class LocalRanks:
    """The relay's local ranks: which may connect, which did, and the connections refused."""

    def __init__(self, *, host: str, ranks: tuple[int, ...], world_size: int,
                 salt: SessionSalt, config: RelayConfig) -> None:
        self.host = host
        self.ranks = ranks
        self.world_size = world_size
        self.salt = salt
        # Verifies the ranks' Heartbeats, which the pump coalesces into Liveness records.
        self.codec = FrameCodec(salt)
        self.config = config
        self.rank_set = frozenset(ranks)
        self._links: dict[int, RankLink] = {}
        # Hello verified, the rank's first frame after the ack not yet arrived (FT/2): the
        # attempt's cancel scope, so that a re-dial of the same rank takes over its slot.
        self._reserved: dict[int, trio.CancelScope] = {}
        self._rejects = JunkCounter()  # rank-port rejects, by reason
        self._all_in = trio.Event()
        # Called once, as the last local rank comes in (phase 1 then ends at once).
        self._on_all_in: Callable[[], None] | None = None

    @property
    def all_in(self) -> bool:
        """Every local rank connected (phase 1 is over)."""
        return self._all_in.is_set()

    async def wait_all_in(self) -> None:
        await self._all_in.wait()

    def links(self) -> Iterator[RankLink]:
        """The connected ranks' links (a snapshot)."""
        return iter(list(self._links.values()))

    def link(self, rank: int) -> RankLink | None:
        return self._links.get(rank)

    @property
    def connected(self) -> frozenset[int]:
        """Local ranks whose connection is up."""
        return frozenset(r for r, link in self._links.items() if not link.gone)

    def reserve(self, rank: int, peer: str, attempt: trio.CancelScope) -> None:
        """Hold ``rank``'s slot while its ack is written and its first frame awaited.

        An earlier attempt of the same rank that is still unconfirmed is cancelled: its ack
        may never have reached the rank, which re-dialed (FT/2).

        Raises:
            HandshakeError: ``rank`` is connected (confirmed) already.
        """
        if rank in self._links:
            raise HandshakeError(f"rank hello from {peer}: rank {rank} is already connected")
        older = self._reserved.get(rank)
        if older is not None:
            older.cancel()
        self._reserved[rank] = attempt

    def release(self, rank: int, attempt: trio.CancelScope) -> None:
        if self._reserved.get(rank) is attempt:
            del self._reserved[rank]

    def end_phase_with(self, end: Callable[[], None] | None) -> None:
        """``end()`` is called once, as the last local rank comes in (None: nothing is)."""
        self._on_all_in = end

    def add(self, link: RankLink) -> bool:
        """``link``'s first frame arrived; True when this was the last local rank."""
        self._reserved.pop(link.rank, None)
        self._links[link.rank] = link
        if len(self._links) == len(self.ranks) and not self._all_in.is_set():
            self._all_in.set()
            if self._on_all_in is not None:
                self._on_all_in()
        return self._all_in.is_set()

    def remove(self, link: RankLink) -> None:
        """Free ``link``'s slot (its link ended before every local rank was in)."""
        if self._links.get(link.rank) is link:
            del self._links[link.rank]

    @property
    def rejects(self) -> dict[str, int]:
        """Connections to the rank port rejected so far, by reason."""
        return self._rejects.by_reason()

    def reject(self, reason: str, detail: str) -> None:
        """Count one rank-port reject; a few become WARNINGs, the rest are folded into
        summaries (a rank retrying with the wrong salt every 0.5 s logged a WARNING each)."""
        report = self._rejects.add(reason, detail, trio.current_time())
        if report is not None:
            log.warning("relay %r rejected a rank connection: %s", self.host, report.text())

    def report_rejects_tail(self) -> None:
        """At the end of phase 1, one summary of the rejects that were not logged."""
        report = self._rejects.flush(trio.current_time(), force=True)
        if report is not None:
            log.warning("relay %r rank port: %s", self.host, report.text())

    def waiting_text(self) -> str:
        """What phase 1 waits for, and why: the rejects by reason, the latest in full (a
        wrong-salt or wrong-world rank is named here, not only in the log)."""
        missing = sorted(self.rank_set - set(self._links))
        rejects = self._rejects
        text = (f"{len(self._links)}/{len(self.ranks)} local ranks connected (missing "
                f"{missing}); {rejects.total} rejected connection(s)")
        if rejects.total:
            text += f" by reason: {rejects.summary()}; latest: {'; '.join(rejects.recent[-3:])}"
        return text

    def timeout_error(self, timeout: float) -> FormationTimeout:
        return FormationTimeout(
            f"relay {self.host!r}: rank accept timed out after {timeout:g}s: "
            f"{self.waiting_text()}"
        )


async def accept_ranks(local: LocalRanks, listeners: list[trio.abc.Listener[Any]]) -> None:
    timeout = local.config.rank_accept_timeout
    log.info("relay %r: waiting for ranks %s until %s (rank_accept_timeout %g s)", local.host,
             list(local.ranks), clock_time_in(timeout), timeout)
    try:
        with trio.move_on_after(timeout):
            async with trio.open_nursery() as nursery:
                # The handshake that brings the last rank in ends phase 1 (its accept loops
                # and the other ranks' watches are cancelled). The first listener's accept
                # loop runs in this task: no task of its own, no wake-up to notice the end.
                local.end_phase_with(nursery.cancel_scope.cancel)
                for listener in listeners[1:]:
                    nursery.start_soon(rank_accept_loop, local, listener, nursery)
                if listeners:
                    await rank_accept_loop(local, listeners[0], nursery)
                await local.wait_all_in()  # every listener closed before every rank came in
    finally:
        local.end_phase_with(None)
        await close_all([lst for lst in listeners if not closed_now(lst)])
    local.report_rejects_tail()
    if not local.all_in:
        raise local.timeout_error(timeout)


def closed_now(listener: trio.abc.Listener[Any]) -> bool:
    """Close a TCP listener at once (``SocketListener.aclose`` is this and a pass through the
    scheduler, one more step of every join); False for any other, left to ``aclose``."""
    if not isinstance(listener, trio.SocketListener):
        return False
    listener.socket.close()
    return True


async def rank_accept_loop(local: LocalRanks, listener: trio.abc.Listener[Any],
                           nursery: trio.Nursery) -> None:
    await serve_each(listener, partial(rank_handshake, local), what=f"relay {local.host!r}",
                     handler_nursery=nursery,
                     keepalive=KeepAlive.within(local.config.write_stall_timeout,
                                                write_stall=local.config.write_stall_timeout))


async def rank_handshake(local: LocalRanks, stream: trio.abc.Stream) -> None:
    peer = peer_of(stream)
    reserved: int | None = None
    machine = RankAcceptHandshake(local.salt, world_size=local.world_size, host=local.host,
                                  ranks=local.rank_set, peer=peer)
    confirmed: RankConfirmed | None = None
    reader = Reader(stream)
    try:
        with trio.CancelScope() as attempt:
            with trio.fail_after(local.config.handshake_timeout):
                hello = await run_handshake_on(stream, reader, machine)
                assert isinstance(hello, RankHelloReceived)
                rank = hello.rank
                local.reserve(rank, peer, attempt)
                reserved = rank
                machine.accept()
                event = await run_handshake_on(stream, reader, machine)
                assert isinstance(event, RankConfirmed)
                confirmed = event
    except (trio.TooSlowError, WireError, HandshakeError, *STREAM_GONE) as exc:
        if reserved is not None:
            local.release(reserved, attempt)
        if isinstance(exc, trio.TooSlowError):
            text = (f"rank hello from {peer}: no hello within handshake_timeout="
                    f"{local.config.handshake_timeout:g}s" if reserved is None else
                    f"rank {reserved} at {peer}: no first frame after the ack within "
                    f"handshake_timeout={local.config.handshake_timeout:g}s")
        else:
            text = str(exc) or type(exc).__name__
        local.reject("no first frame" if reserved is not None and not isinstance(
            exc, HandshakeError) else reject_reason(exc), text)
        await trio.aclose_forcefully(stream)
        return
    except BaseException:
        if reserved is not None:
            local.release(reserved, attempt)
        await trio.aclose_forcefully(stream)
        raise
    if confirmed is None:  # superseded by a re-dial of the same rank
        if reserved is not None:
            local.release(reserved, attempt)
        await trio.aclose_forcefully(stream)
        return
    link = RankLink(rank, stream, local.config, host=local.host, codec=local.codec,
                    reader=reader)
    link.read_early(confirmed.leftover)
    log.info("relay %r: rank %d connected from %s", local.host, rank, peer)
    if not local.add(link):
        await watch_while_accepting(local, link)


async def watch_while_accepting(local: LocalRanks, link: RankLink) -> None:
    """Until every local rank is in (this task is then cancelled), notice a link that ends.

    A written ack may still not reach the rank (the link broke, or the rank's own handshake
    deadline fired first); that rank re-dials, so its slot must be free again, as the
    coordinator frees the ranks of a relay lost during formation. Without this the re-dial
    was refused as "already connected" and the rank was lost.
    """
    try:
        while len(link.early) < EARLY_LIMIT:
            data = await link.reader.receive_some(READ_SIZE)
            if not data:
                break
            link.read_early(data)
        else:
            await trio.sleep_forever()  # past the limit the rank's writes wait for the pump
    except STREAM_GONE:
        pass
    if local.all_in:
        link.early_ended()  # too late to free the slot: the pump reports RankExit
        return
    local.remove(link)
    local.reject("link ended early", f"rank {link.rank}: its link ended after the ack, before "
                 "every local rank connected (a re-dial is accepted)")
    await trio.aclose_forcefully(link.stream)


# Reasons by the words of the hello check that failed (SPEC §2.3 validation order).
_HELLO_REASONS = (
    ("magic", "bad magic"),
    ("version", "wrong version"),
    ("world_size", "world_size mismatch"),
    ("HMAC", "bad mac"),
    ("does not belong", "rank of another host"),
    ("already connected", "duplicate rank"),
)


def reject_reason(exc: BaseException) -> str:
    if isinstance(exc, trio.TooSlowError):
        return "timeout"
    if isinstance(exc, HandshakeError):
        text = str(exc)
        return next((reason for word, reason in _HELLO_REASONS if word in text), "malformed")
    if isinstance(exc, WireError):
        return "eof before hello"
    return "connection error"
