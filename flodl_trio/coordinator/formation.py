"""Formation (SPEC §4.2): accept, one handshake task per connection, coverage, rejects.

A connection that fails before authenticating is rejected, recorded and dropped; an
authenticated Hello that contradicts the world fails formation at once; a relay that lost its
connection mid-handshake and re-dials with the same host and ranks simply replaces it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import trio

from .._errors import FormationAborted, FormationError, FormationTimeout
from .._transport import close_all, is_local_or_private, peer_of
from ..events import FormationComplete, FormationFailed, HandshakeRejected, RelayJoined
from . import liveness, readers
from ._handshake import Rejected, coordinator_handshake, send_hello_ack
from ._relayconn import RelayConn, ranks_text

if TYPE_CHECKING:
    from ._core import Coordinator

log = logging.getLogger("flodl_trio.coordinator")


async def accept_loop(coord: Coordinator, listener: trio.abc.Listener[Any]) -> None:
    while True:
        try:
            stream = await listener.accept()
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return
        except OSError as exc:
            # Out of file descriptors and the like: back off instead of spinning.
            log.warning("accept failed: %r; retrying in 0.1 s", exc)
            await trio.sleep(0.1)
            continue
        coord._nursery.start_soon(serve_connection, coord, stream)


def reject(coord: Coordinator, peer: str, category: str, detail: str) -> None:
    coord._rejects[category] += 1
    log.info("handshake rejected (%s): %s", category, detail)
    coord._timeline.event(HandshakeRejected(peer=peer, reason=f"{category}: {detail}"))
    if coord._phase != "forming":
        return
    total = sum(coord._rejects.values())
    if coord.config.strict_formation:
        fail_formation(coord, FormationError(formation_text(coord,
            f"strict formation: handshake from {peer} rejected ({category}: {detail})")))
    elif total > coord.config.max_rejected_handshakes:
        fail_formation(coord, FormationError(formation_text(coord,
            f"more than max_rejected_handshakes={coord.config.max_rejected_handshakes} "
            "rejected handshakes")))


def fail_formation(coord: Coordinator, exc: FormationError) -> None:
    if coord._formation_failure is None and coord._phase == "forming":
        coord._formation_failure = exc
        coord._formation_settled.set()


def formation_text(coord: Coordinator, headline: str) -> str:
    covered = len(coord._conn_of_rank)
    joined = ", ".join(f"{c.host} {ranks_text(c.ranks)}" for c in coord._relays) or "none"
    rejects = ", ".join(f"{k} x{n}" for k, n in sorted(coord._rejects.items())) or "none"
    return (
        f"{headline}: {covered}/{coord.world_size} ranks covered; hosts joined: {joined}; "
        f"rejected connections: {rejects}"
    )


def hello_problem(coord: Coordinator, host: str, ranks: tuple[int, ...], peer: str) -> str | None:
    who = f"authenticated Hello from relay {host!r} at {peer}"
    if not ranks:
        return f"{who}: expected at least one rank, got an empty rank list"
    if list(ranks) != sorted(ranks):
        return f"{who}: expected ranks in ascending order, got {list(ranks)[:16]}"
    seen: set[int] = set()
    for r in ranks:
        if r in seen:
            return f"{who}: rank {r} is announced twice in one Hello"
        seen.add(r)
        if r >= coord.world_size:
            return f"{who}: rank {r} is out of range for world_size {coord.world_size}"
        owner = coord._conn_of_rank.get(r)
        if owner is not None:
            return (f"{who}: rank {r} was already announced by relay {owner.host!r} at "
                    f"{owner.peer}")
    return None


def unregister(coord: Coordinator, conn: RelayConn) -> None:
    if conn in coord._relays:
        coord._relays.remove(conn)
    for r in conn.ranks:
        if coord._conn_of_rank.get(r) is conn:
            del coord._conn_of_rank[r]
            coord._last_seen.pop(r, None)


async def serve_connection(coord: Coordinator, stream: trio.abc.Stream) -> None:
    peer = peer_of(stream)
    if coord._phase != "forming":
        await trio.aclose_forcefully(stream)
        reject(coord, peer, "cohort formed", f"{peer}: connection after formation completed")
        return
    try:
        with trio.fail_after(coord.config.handshake_timeout):
            machine, received = await coordinator_handshake(stream, coord._salt, peer)
    except trio.TooSlowError:
        await trio.aclose_forcefully(stream)
        reject(coord, peer, "timeout", f"{peer}: no authenticated Hello within "
                     f"handshake_timeout={coord.config.handshake_timeout:g}s")
        return
    except Rejected as rej:
        await trio.aclose_forcefully(stream)
        reject(coord, peer, rej.category, rej.detail)
        return
    except BaseException:
        await close_all([stream])  # cancelled mid-handshake: the stream must not leak
        raise
    hello = received.hello
    if coord._phase != "forming":
        await trio.aclose_forcefully(stream)
        reject(coord, peer, "cohort formed", f"relay {hello.host!r} at {peer}: Hello after "
                     "formation completed")
        return
    # A relay that lost its connection mid-handshake re-dials with the same host and ranks;
    # that is a reconnect, not a contradiction.
    ranks = tuple(hello.ranks)
    for old in list(coord._relays):
        if old.host == hello.host and old.ranks == ranks:
            log.info("relay %r re-joined from %s; dropping its old connection", hello.host,
                     peer)
            old.lost_reason = "superseded by a new connection"
            unregister(coord, old)
            coord._nursery.start_soon(old.close)
    problem = hello_problem(coord, hello.host, ranks, peer)
    if problem is not None:
        await trio.aclose_forcefully(stream)
        fail_formation(coord, FormationError(formation_text(coord, problem)))
        return
    coord._conn_counter += 1
    conn = RelayConn(
        host=hello.host, ranks=ranks, peer=peer, stream=stream, sealer=machine.sealer,
        opener=machine.opener, write_stall_timeout=coord.config.write_stall_timeout,
        index=coord._conn_counter,
    )
    coord._relays.append(conn)
    coord._acks_in_flight.add(conn)
    now = trio.current_time()
    for r in ranks:
        coord._conn_of_rank[r] = conn
        coord._last_seen[r] = now
    try:
        with trio.fail_after(coord.config.handshake_timeout):
            await send_hello_ack(stream, machine)
    except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        coord._acks_in_flight.discard(conn)
        unregister(coord, conn)
        conn.lost_reason = "HelloAck not delivered"
        await conn.close()
        reject(coord, peer, "connection error", f"relay {hello.host!r} at {peer}: HelloAck "
                     f"not delivered ({type(exc).__name__})")
        return
    coord._acks_in_flight.discard(conn)
    conn.on_lost = coord._on_write_failure
    coord._writers.start_soon(conn.run_writer)
    warn_cleartext(coord, peer)
    log.info("relay %r joined from %s with ranks %s", hello.host, peer, ranks_text(ranks))
    coord._timeline.event(RelayJoined(host=hello.host, ranks=ranks, peer=peer))
    if (len(coord._conn_of_rank) == coord.world_size and not coord._acks_in_flight
            and coord._phase == "forming"):
        complete_formation(coord)
    await readers.read_relay(coord, conn)


def warn_cleartext(coord: Coordinator, peer: str) -> None:
    host = peer.rsplit(":", 1)[0].strip("[]")
    if coord._tls or host in coord._warned_hosts or is_local_or_private(host):
        return
    if host.startswith("<") or host.startswith("mem:"):
        return
    coord._warned_hosts.add(host)
    log.warning("relay at %s joined over cleartext from outside loopback/private ranges: "
                "frames are authenticated but readable on the network; use TLS "
                "(ssl_context=)", peer)


def complete_formation(coord: Coordinator) -> None:
    coord._phase = "running"
    now = trio.current_time()
    for r in coord._conn_of_rank:
        coord._last_seen[r] = now
    elapsed = (now - coord._formation_started) * 1000.0
    coord._timeline.event(FormationComplete(
        relays=len(coord._relays), world_size=coord.world_size, elapsed_ms=round(elapsed, 3)))
    log.info("formation complete: %d ranks over %d relays in %.1f ms", coord.world_size,
             len(coord._relays), elapsed)
    coord._formation_settled.set()
    coord._liveness_wake.set()


async def form(coord: Coordinator, control: list[trio.abc.Listener[Any]],
               abort: trio.Event | None) -> None:
    """Run formation in ``coord``'s nursery; return once every rank is covered.

    Raises:
        FormationTimeout / FormationAborted / FormationError: the c/W text says why.
    """
    nursery = coord._nursery
    coord._writers = await nursery.start(coord._host_writers)
    coord._formation_started = trio.current_time()
    for listener in control:
        nursery.start_soon(accept_loop, coord, listener)
    nursery.start_soon(liveness.death_worker, coord)
    nursery.start_soon(liveness.coord_heartbeats, coord)
    nursery.start_soon(liveness.staleness_watch, coord)
    if abort is not None:
        nursery.start_soon(watch_abort, coord, abort)
    timeout = coord.config.formation_timeout
    with trio.move_on_after(timeout):
        await coord._formation_settled.wait()
    failure = coord._formation_failure
    if failure is None and coord._phase == "forming":
        failure = FormationTimeout(formation_text(coord,
            f"formation timed out after {timeout:g}s"))
    if failure is not None:
        coord._formation_failure = failure
        coord._timeline.event(FormationFailed(reason=str(failure),
                                             covered=len(coord._conn_of_rank)))
        log.error("%s", failure)
        raise failure


async def watch_abort(coord: Coordinator, abort: trio.Event) -> None:
    await abort.wait()
    if coord._phase == "forming":
        fail_formation(coord, FormationAborted(formation_text(coord, "formation aborted")))
