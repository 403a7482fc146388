"""Relay phase 1 (SPEC §5): accept every local rank and terminate its handshake (§2.3).

A bad hello is rejected and the relay keeps accepting until ``rank_accept_timeout``; a rank whose
connection breaks before every rank is in gets its slot back, so its re-dial is accepted.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import trio

from .._errors import FormationTimeout, HandshakeError, WireError
from .._handshake_io import run_handshake
from .._transport import close_all, peer_of
from ..wire import RankAcceptHandshake, RankConfirmed, RankHelloReceived
from ._link import EARLY_LIMIT, RankLink

if TYPE_CHECKING:
    from . import Relay

log = logging.getLogger("flodl_trio.relay")

_GONE = (trio.BrokenResourceError, trio.ClosedResourceError)


async def accept_ranks(relay: Relay, listeners: list[trio.abc.Listener[Any]]) -> None:
    timeout = relay.config.rank_accept_timeout
    try:
        with trio.move_on_after(timeout):
            async with trio.open_nursery() as nursery:
                for listener in listeners:
                    nursery.start_soon(rank_accept_loop, relay, listener, nursery)
                await relay._all_ranks.wait()
                nursery.cancel_scope.cancel()
    finally:
        await close_all(listeners)
    if not relay._all_ranks.is_set():
        missing = sorted(relay._rank_set - set(relay._links))
        rejects = "; ".join(relay._rejects[-5:]) or "none"
        raise FormationTimeout(
            f"relay {relay.host!r}: rank accept timed out after {timeout:g}s: "
            f"{len(relay._links)}/{len(relay.ranks)} local ranks connected (missing {missing}); "
            f"{len(relay._rejects)} rejected connection(s): {rejects}"
        )

async def rank_accept_loop(relay: Relay, listener: trio.abc.Listener[Any],
                            nursery: trio.Nursery) -> None:
    while True:
        try:
            stream = await listener.accept()
        except _GONE:
            return
        except OSError as exc:
            log.warning("relay %r: accept failed: %r", relay.host, exc)
            await trio.sleep(0.1)
            continue
        nursery.start_soon(rank_handshake, relay, stream)

async def rank_handshake(relay: Relay, stream: trio.abc.Stream) -> None:
    peer = peer_of(stream)
    reserved: int | None = None
    machine = RankAcceptHandshake(relay._salt, world_size=relay.world_size, host=relay.host,
                                  ranks=relay._rank_set, peer=peer)
    try:
        with trio.fail_after(relay.config.handshake_timeout):
            hello = await run_handshake(stream, machine)
            assert isinstance(hello, RankHelloReceived)
            rank = hello.rank
            if rank in relay._links or rank in relay._reserved:
                raise HandshakeError(f"rank hello from {peer}: rank {rank} is already "
                                     "connected")
            reserved = rank
            relay._reserved.add(rank)
            machine.accept()
            confirmed = await run_handshake(stream, machine)
            assert isinstance(confirmed, RankConfirmed)
    except (trio.TooSlowError, WireError, HandshakeError, *_GONE) as exc:
        if reserved is not None:
            relay._reserved.discard(reserved)
        text = (f"rank hello from {peer}: no hello within handshake_timeout="
                f"{relay.config.handshake_timeout:g}s" if isinstance(exc, trio.TooSlowError)
                else str(exc) or type(exc).__name__)
        relay._rejects.append(text)
        log.warning("relay %r rejected a rank connection: %s", relay.host, text)
        await trio.aclose_forcefully(stream)
        return
    except BaseException:
        if reserved is not None:
            relay._reserved.discard(reserved)
        await trio.aclose_forcefully(stream)
        raise
    relay._reserved.discard(rank)
    link = RankLink(rank, stream, relay.config)
    link.early += confirmed.leftover
    relay._links[rank] = link
    log.info("relay %r: rank %d connected from %s", relay.host, rank, peer)
    if len(relay._links) == len(relay.ranks):
        relay._all_ranks.set()
    else:
        await watch_while_accepting(relay, link)

async def watch_while_accepting(relay: Relay, link: RankLink) -> None:
    """Until every local rank is in (this task is then cancelled), notice a link that ends.

    A written ack may still not reach the rank (the link broke, or the rank's own handshake
    deadline fired first); that rank re-dials, so its slot must be free again, as the
    coordinator frees the ranks of a relay lost during formation. Without this the re-dial
    was refused as "already connected" and the rank was lost.
    """
    try:
        while len(link.early) < EARLY_LIMIT:
            data = await link.stream.receive_some(65536)
            if not data:
                break
            link.early += data
        else:
            await trio.sleep_forever()  # past the limit the rank's writes wait for the pump
    except _GONE:
        pass
    if relay._all_ranks.is_set():
        link.early_eof = True  # too late to free the slot: the pump reports RankExit
        return
    del relay._links[link.rank]
    relay._rejects.append(f"rank {link.rank}: its link ended after the ack, before every "
                         "local rank connected (a re-dial is accepted)")
    log.warning("relay %r: rank %d's link ended before every local rank connected; "
                "accepting it again", relay.host, link.rank)
    await trio.aclose_forcefully(link.stream)
