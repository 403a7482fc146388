"""Relay phase 3 (SPEC §5): the pump.

One reader per local rank feeds a bounded queue drained by the single upstream writer; one
upstream reader routes DATA records to a rank and FANOUT records to each listed local rank.
Every end is graceful: what was verified and queued is delivered before a link closes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import trio

from .._errors import WireError
from ..wire import (
    MAX_LEN_FRAME,
    LenFrameDecoder,
    RankExit,
    RecordKind,
    RecordOpener,
    RecordSealer,
    decode_fanout,
    encode,
    frames_before,
    len_frame,
)
from ._link import RankLink, RelayExit

if TYPE_CHECKING:
    from . import Relay

log = logging.getLogger("flodl_trio.relay")

_GONE = (trio.BrokenResourceError, trio.ClosedResourceError)


async def pump(relay: Relay, stream: trio.abc.Stream, sealer: RecordSealer,
                opener: RecordOpener) -> RelayExit:
    up_send, up_recv = trio.open_memory_channel[tuple[int, int, bytes]](relay.config.queue_size)
    outcome: list[RelayExit] = []
    with trio.CancelScope() as scope:
        relay._pump_scope = scope

        def finish(reason: str, clean: bool = True, *, now: bool = True) -> None:
            if not outcome:
                outcome.append(RelayExit(reason, clean))
                log.info("relay %r ending: %s", relay.host, reason)
            if now:
                scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(upstream_writer, relay, stream, sealer, up_recv, finish)
            nursery.start_soon(upstream_reader, relay, stream, opener, finish)
            # One queue clone per rank reader: the queue ends (and the writer with it) only
            # once every reader has queued its last frame and its RankExit.
            with up_send:
                for link in relay._links.values():
                    nursery.start_soon(rank_reader, relay, link, up_send.clone(), finish)
                    nursery.start_soon(rank_writer, relay, link)
    return outcome[0] if outcome else RelayExit("stopped", True)

async def upstream_writer(relay: Relay, stream: trio.abc.Stream, sealer: RecordSealer,
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
            with trio.fail_after(relay.config.write_stall_timeout):
                await stream.send_all(data)
        except trio.TooSlowError:
            finish(f"upstream write stall: no progress for "
                   f"{relay.config.write_stall_timeout:g}s", False)
            return
        except _GONE as exc:
            finish(f"upstream connection lost while writing ({type(exc).__name__})", False)
            return
    # Every rank reader closed its queue clone: the last local rank is gone, and what the
    # ranks queued before leaving (Exiting, RankExit) is written. Ending before this point
    # cancelled the writer with the last rank's records still queued.
    relay._no_ranks_left.set()
    finish("all ranks exited", now=False)
    # Half-close and let the coordinator close first: closing a socket with unread data
    # in it sends a reset, which can destroy the records we just wrote before they are read.
    with trio.move_on_after(relay.config.shutdown_grace):
        try:
            if isinstance(stream, trio.abc.HalfCloseableStream):
                await stream.send_eof()
                await relay._upstream_done.wait()
        except (trio.BusyResourceError, *_GONE):
            pass
    finish("all ranks exited")

async def upstream_reader(relay: Relay, stream: trio.abc.Stream, opener: RecordOpener,
                           finish: Any) -> None:
    try:
        await read_upstream(relay, stream, opener, finish)
    finally:
        relay._upstream_done.set()

async def read_upstream(relay: Relay, stream: trio.abc.Stream, opener: RecordOpener,
                         finish: Any) -> None:
    try:
        data: bytes | bytearray = b""  # the first feed opens what came with HelloAck
        while True:
            try:
                records = opener.feed(data)
            except WireError as exc:
                # Records authenticated before the bad one are delivered; then it ends.
                for rec in frames_before(exc):
                    await route(relay, rec)
                raise
            for rec in records:
                await route(relay, rec)
            data = await stream.receive_some(65536)
            if not data:
                break
    except WireError as exc:
        relay._error = exc
        await flush_ranks(relay)
        finish(f"upstream protocol error: {exc}", False)
        return
    except _GONE as exc:
        await flush_ranks(relay)
        finish(f"upstream connection lost ({type(exc).__name__})", False)
        return
    # The coordinator closed: deliver what is queued to the ranks, let them say goodbye
    # (their Exiting still flows upstream), then end.
    for link in relay._links.values():
        link.out_send.close()
    with trio.move_on_after(relay.config.shutdown_grace):
        await relay._no_ranks_left.wait()
    finish("coordinator closed the connection")

async def flush_ranks(relay: Relay) -> None:
    """Let the rank writers deliver what was verified and queued before the link broke."""
    for link in relay._links.values():
        link.out_send.close()
    with trio.move_on_after(min(1.0, relay.config.shutdown_grace)):
        for link in relay._links.values():
            await link.writer_done.wait()

async def route(relay: Relay, rec: Any) -> None:
    await trio.lowlevel.checkpoint_if_cancelled()
    if rec.kind == RecordKind.DATA:
        await to_rank(relay, rec.rank, len_frame(rec.payload))
    elif rec.kind == RecordKind.FANOUT:
        ranks, frame = decode_fanout(rec.payload)
        blob = len_frame(frame)
        for rank in ranks:
            await to_rank(relay, rank, blob)
    else:
        log.warning("relay %r: unexpected record kind %d from the coordinator; dropped",
                    relay.host, rec.kind)

async def to_rank(relay: Relay, rank: int, blob: bytes) -> None:
    link = relay._links.get(rank)
    if link is None:
        log.warning("relay %r: frame for rank %d, which is not local; dropped", relay.host, rank)
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

async def rank_writer(relay: Relay, link: RankLink) -> None:
    try:
        await write_to_rank(relay, link)
    finally:
        link.writer_done.set()

async def write_to_rank(relay: Relay, link: RankLink) -> None:
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
            log.warning("relay %r: rank %d stopped reading (%s); closing it", relay.host,
                        link.rank, type(exc).__name__)
        await trio.aclose_forcefully(link.stream)

async def rank_reader(relay: Relay, link: RankLink,
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
        log.warning("relay %r: rank %d sent a bad length frame (%s); closing it", relay.host,
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
