"""Backpressure through the chaos proxy: a writer whose far side stops reading blocks once the
proxy holds its documented bound, however much went through before."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

import pytest
import trio

from flodl_trio import ConfigError
from flodl_trio.chaos import FaultPlan, ProxiedConnection, open_chaos_proxy

PIECE = 65536
LINUX_BOUND = 64 * 1024 + 2 * (2 * 64 * 1024)  # one read + two sockets of 64 KiB, doubled
PATIENCE = 10  # real seconds; each test below takes well under one


@asynccontextmanager
async def _proxied_pair(
    plan: FaultPlan | None = None,
) -> AsyncIterator[tuple[trio.SocketStream, trio.SocketStream, ProxiedConnection]]:
    target = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    try:
        async with open_chaos_proxy(("127.0.0.1", target.socket.getsockname()[1])) as proxy:
            if plan is not None:
                proxy.plan(plan)
            client = await trio.open_tcp_stream(*proxy.address)
            server = await target.accept()
            async with client, server:
                yield client, server, proxy.connections[0]
    finally:
        await target.aclose()


async def _move(writer: trio.SocketStream, reader: trio.SocketStream, size: int) -> None:
    async def read_all() -> None:
        got = 0
        for _ in range(size):  # bounded: every read returns at least one byte
            if got >= size:
                return
            got += len(await reader.receive_some(PIECE))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_all)
        for _ in range(size // PIECE):
            await writer.send_all(b"w" * PIECE)


async def _write_until_blocked(
    writer: trio.SocketStream, conn: ProxiedConnection, direction: Literal["up", "down"],
) -> tuple[int, int]:
    """Write until a write makes no progress for 0.25 s; return (bytes written, peak buffered)."""
    peak = 0
    written = 0

    async def sample() -> None:
        nonlocal peak
        for _ in range(100_000):  # bounded; cancelled when the writer blocks
            peak = max(peak, conn.buffered(direction))
            await trio.sleep(0.001)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample)
        for _ in range(512):  # 32 MiB at most: far more than any kernel buffers on the path
            with trio.move_on_after(0.25) as blocked:
                await writer.send_all(b"b" * PIECE)
            peak = max(peak, conn.buffered(direction))
            if blocked.cancelled_caught:
                break
            written += PIECE
        else:
            pytest.fail(f"the {direction} writer never blocked after {written} bytes")
        nursery.cancel_scope.cancel()
    return written, peak


@pytest.mark.parametrize("direction", ["up", "down"])
async def test_proxy_holds_at_most_its_bound_when_the_far_side_stops_reading(
    direction: Literal["up", "down"],
) -> None:
    with trio.fail_after(PATIENCE):
        async with _proxied_pair() as (client, server, conn):
            writer, reader = (client, server) if direction == "up" else (server, client)
            # 16 MiB read at full speed first: kernel autotuning would have grown the proxy's
            # socket buffers by now, and with them what it swallows once the reader stops.
            await _move(writer, reader, 16 * 2**20)
            written, peak = await _write_until_blocked(writer, conn, direction)
            bound = conn.buffer_bound(direction)
            assert 0 < peak <= bound <= LINUX_BOUND, (written, peak, bound)


@pytest.mark.parametrize("direction", ["up", "down"])
async def test_stalled_proxy_blocks_the_writer_at_the_same_bound(
    direction: Literal["up", "down"],
) -> None:
    stall_at = 4 * 2**20
    with trio.fail_after(PATIENCE):
        async with _proxied_pair(FaultPlan().stall(stall_at, direction)) as (client, server, conn):
            writer, reader = (client, server) if direction == "up" else (server, client)
            await _move(writer, reader, stall_at)  # exactly up to the stall
            written, peak = await _write_until_blocked(writer, conn, direction)
            forwarded = conn.bytes_up if direction == "up" else conn.bytes_down
            assert forwarded == stall_at  # the stall forwarded nothing more
            assert 0 < peak <= conn.buffer_bound(direction) <= LINUX_BOUND, (written, peak)
        await conn.wait_closed()
        assert conn.buffered(direction) == 0  # closed: it holds nothing any more


async def test_buffered_names_a_direction_it_does_not_know() -> None:
    async with _proxied_pair() as (_, _, conn):
        with pytest.raises(ConfigError, match="'up' or 'down', got 'sideways'"):
            conn.buffered("sideways")  # type: ignore[arg-type]
