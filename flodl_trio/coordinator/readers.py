"""Readers (SPEC §4.3): one task per relay connection turns records into messages.

TIMING goes to ``coord.timing`` (refreshing the sender's liveness clock first), METRICS to
``coord.metrics``; a message that speaks for a rank its relay does not carry is dropped. When a
channel is full the reader waits, and that time does not count towards heartbeat staleness.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import trio

from .._errors import AuthError, WireError
from ..events import InvalidFrame, RankExited
from ..wire import (
    Exiting,
    Metrics,
    MsgKind,
    RankExit,
    Record,
    RecordKind,
    TimingMsg,
    decode_metrics,
    decode_relay,
    decode_timing,
    frames_before,
)
from . import liveness
from ._relayconn import RelayConn, ranks_text

if TYPE_CHECKING:
    from ._core import Coordinator

log = logging.getLogger("flodl_trio.coordinator")


async def read_relay(coord: Coordinator, conn: RelayConn) -> None:
    coord._readers_active += 1
    coord._readers_idle = trio.Event() if coord._readers_active == 1 else coord._readers_idle
    cause: str | None = None
    try:
        while cause is None:
            data = await conn.stream.receive_some(65536)
            if not data:
                err = conn.opener.eof_error(f"relay {conn.host!r}")
                cause = str(err) if err is not None else "connection closed by the relay (EOF)"
                break
            try:
                records = conn.opener.feed(data)
            except WireError as exc:
                # Records authenticated before the bad one are acted on; then it ends.
                for rec in frames_before(exc):
                    await on_record(coord, conn, rec)
                raise
            for rec in records:
                await on_record(coord, conn, rec)
    except AuthError as exc:
        cause = f"authentication failure: {exc}"
    except WireError as exc:
        cause = f"protocol error: {exc}"
    except trio.BrokenResourceError as exc:
        cause = f"connection reset ({exc.__cause__!r})" if exc.__cause__ else "connection reset"
    except trio.ClosedResourceError:
        cause = "connection closed"
    finally:
        coord._readers_active -= 1
        if coord._readers_active == 0:
            coord._readers_idle.set()
    if cause is not None and conn.lost_reason is None:
        liveness.relay_lost(coord, conn, cause)


async def on_record(coord: Coordinator, conn: RelayConn, rec: Record) -> None:
    if rec.kind == RecordKind.DATA:
        await on_frame(coord, conn, rec)
    elif rec.kind == RecordKind.CONTROL:
        on_relay_control(coord, conn, rec.payload)
    else:
        invalid(coord, conn, rec.rank, f"record of kind {rec.kind}, which only flows "
                "coordinator→relay", category="wrong direction")


def invalid(coord: Coordinator, conn: RelayConn, rank: int, reason: str, *,
            category: str) -> None:
    """Count a dropped frame; only a rate-limited few become a WARNING and an event (one
    each let a relay with the salt turn 100k forged frames into 19.6 MB of log and evict the
    real events from the bounded timeline)."""
    report = coord._invalid_frames.add(category, f"{conn.describe()}, rank {rank}: {reason}",
                                       trio.current_time())
    if report is None:
        return
    log.warning("frame dropped: %s", report.text())
    coord._timeline.event(InvalidFrame(rank=rank, host=conn.host, reason=report.text()))


async def on_frame(coord: Coordinator, conn: RelayConn, rec: Record) -> None:
    try:
        frame = coord._codec.open(rec.payload)
    except AuthError as exc:
        invalid(coord, conn, rec.rank, str(exc), category="bad mac")
        return
    except WireError as exc:
        invalid(coord, conn, rec.rank, str(exc), category="malformed")
        return
    msg: TimingMsg | Metrics
    try:
        if frame.kind == MsgKind.TIMING:
            msg = decode_timing(frame.payload)
        elif frame.kind == MsgKind.METRICS:
            msg = decode_metrics(frame.payload)
        else:
            if frame.kind not in (MsgKind.RESERVED_4, MsgKind.RESERVED_5):
                log.info("%s: frame of kind %d is not for this direction; dropped",
                         conn.describe(), frame.kind)
            return
    except WireError as exc:
        invalid(coord, conn, rec.rank, str(exc), category="undecodable")
        return
    rank = int(msg.rank)
    if rank not in conn.rank_set:
        invalid(coord, conn, rank, f"{type(msg).__name__} speaks for rank {rank}, which relay "
                f"{conn.host!r} does not carry {ranks_text(conn.ranks)}",
                category="foreign rank")
        return
    if rank in coord._dead:
        log.debug("rank %d was declared dead; its late %s is dropped", rank,
                  type(msg).__name__)
        return
    if isinstance(msg, TimingMsg):
        coord._last_seen[rank] = trio.current_time()
        if isinstance(msg, Exiting) and rank not in coord._exited:
            coord._exited.add(rank)
            coord._timeline.event(RankExited(rank=rank))
        await deliver(coord, conn, coord._timing_send, msg)
    else:
        await deliver(coord, conn, coord._metrics_send, msg)


async def deliver(coord: Coordinator, conn: RelayConn, send: trio.MemorySendChannel[Any],
                  msg: Any) -> None:
    if coord._shutting_down:
        try:
            send.send_nowait(msg)
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # nobody is reading any more; never block shutdown on it
        return
    try:
        send.send_nowait(msg)
        return
    except trio.WouldBlock:
        pass
    except (trio.ClosedResourceError, trio.BrokenResourceError):
        return
    paused_at = trio.current_time()
    conn.paused_since = paused_at
    try:
        with trio.CancelScope() as conn.delivery_scope:
            await send.send(msg)  # shutdown cancels this wait: nobody will read any more
    except (trio.ClosedResourceError, trio.BrokenResourceError):
        return
    finally:
        conn.delivery_scope = None
        paused = trio.current_time() - paused_at
        conn.paused_since = None
        # The coordinator was not reading this relay; that time is not the ranks' silence.
        for r in conn.ranks:
            if r in coord._last_seen:
                coord._last_seen[r] += paused
        coord._liveness_wake.set()


def on_relay_control(coord: Coordinator, conn: RelayConn, payload: bytes) -> None:
    try:
        msg = decode_relay(payload)
    except WireError as exc:
        invalid(coord, conn, 0, f"relay control record: {exc}", category="undecodable")
        return
    if not isinstance(msg, RankExit):
        invalid(coord, conn, 0, f"{type(msg).__name__} after the handshake",
                category="unexpected control")
        return
    rank = int(msg.rank)
    if rank not in conn.rank_set:
        invalid(coord, conn, rank, f"RankExit for rank {rank}, which relay {conn.host!r} does "
                "not carry", category="foreign rank")
        return
    if rank in coord._exited:
        log.info("rank %d disconnected after Exiting", rank)
        return
    liveness.mark_dead(coord, rank, f"relay {conn.host!r} reported that rank {rank}'s "
                       "connection ended without Exiting")
