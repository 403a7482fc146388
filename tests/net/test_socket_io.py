"""The relay's and the rank endpoint's socket fast paths (issue 23) behave as the streams do.

``net._socket_io.Reader`` reads a plain TCP socket with one read per wake-up, ``write_now`` /
``send_direct`` hand bytes to the kernel without Trio's stream machinery (the coordinator's
reader of each relay and its handshakes use them too, through the port mux's
``PrefixedStream``), ``open_tcp`` dials a numeric address with one socket, and FANOUT payloads
are CBOR-encoded by hand: each must give what the generic path gives (bytes, end of stream,
errors), on real loopback sockets.
"""

from __future__ import annotations

import socket
import struct

import cbor2
import pytest
import trio
import trio.testing
from hypothesis import given, settings, strategies as st

import flodl_trio as ft
from flodl_trio.net import _transport
from flodl_trio.net._prefixed_stream import PrefixedStream
from flodl_trio.net._socket_io import Reader, plain_socket, send_direct, write_now
from flodl_trio.wire import (
    MAX_LEN_FRAME,
    FrameCodec,
    LenFrameDecoder,
    Metrics,
    decode_fanout,
    decode_metrics,
    encode_fanout,
)

from helpers.raw import raw_rank_accept


async def _connected_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with listeners[0]:
        client = await trio.testing.open_stream_to_socket_listener(listeners[0])
        server = await listeners[0].accept()
    assert isinstance(client, trio.SocketStream) and isinstance(server, trio.SocketStream)
    return client, server


async def test_reader_returns_every_byte_in_order_then_the_end_of_stream() -> None:
    client, server = await _connected_pair()
    reader = Reader(server)
    chunks = [b"a" * 10, b"b" * 70000, b"c"]
    received = bytearray()
    async with client, server:
        async with trio.open_nursery() as nursery:
            async def write_all() -> None:
                for chunk in chunks:
                    await client.send_all(chunk)
                    await trio.testing.wait_all_tasks_blocked()
                await client.send_eof()

            nursery.start_soon(write_all)
            for _ in range(1000):  # bounded: 70 kB arrives in far fewer reads
                data = await reader.receive_some(4096)
                if not data:
                    break
                received += data
    assert bytes(received) == b"".join(chunks)


async def test_reader_waiting_on_a_drained_socket_sees_the_stream_closed_by_another_task(
) -> None:
    client, server = await _connected_pair()
    reader = Reader(server)
    async with client:
        await client.send_all(b"x")
        assert await reader.receive_some(100) == b"x"  # drained: the next read waits first
        async def close_soon() -> None:
            await trio.testing.wait_all_tasks_blocked()
            await server.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(close_soon)
            with pytest.raises(trio.ClosedResourceError):
                await reader.receive_some(100)
        with pytest.raises(trio.ClosedResourceError):
            await reader.receive_some(100)


async def test_reader_reports_a_reset_connection_as_broken() -> None:
    client, server = await _connected_pair()
    reader = Reader(server)
    # SO_LINGER 0: closing sends a reset instead of a FIN.
    client.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await client.send_all(b"x")
    await client.aclose()
    async with server:
        with pytest.raises(trio.BrokenResourceError):
            for _ in range(3):  # the byte may come first, then the reset
                await reader.receive_some(100)


async def test_reader_of_a_stream_that_is_not_plain_tcp_uses_the_streams_own_reads() -> None:
    left, right = trio.testing.memory_stream_pair()
    reader = Reader(right)
    assert plain_socket(right) is None
    await left.send_all(b"hello")
    assert await reader.receive_some(100) == b"hello"
    await left.aclose()
    assert await reader.receive_some(100) == b""


async def test_reader_of_a_port_mux_stream_gives_back_the_peeked_bytes_then_reads_its_socket(
) -> None:
    # The coordinator's handshake and relay reader read PrefixedStreams (issue 23).
    client, server = await _connected_pair()
    stream = PrefixedStream(server, b"MAGIC")
    reader = Reader(stream, drained=True)
    assert plain_socket(stream) is None  # still replaying
    async with client, server:
        await client.send_all(b"after")
        with trio.fail_after(5):
            assert await reader.receive_some(3) == b"MAG"
            assert await reader.receive_some(3) == b"IC"
            assert plain_socket(stream) is server.socket  # read back: its socket from now on
            assert await reader.receive_some(3) == b"aft"
            assert await reader.receive_some(3) == b"er"


async def test_a_cancelled_wait_of_the_reader_loses_nothing() -> None:
    client, server = await _connected_pair()
    reader = Reader(PrefixedStream(server, b""), drained=True)
    async with client, server:
        with trio.move_on_after(0.05) as scope:
            await reader.receive_some(100)
        assert scope.cancelled_caught
        await client.send_all(b"late")
        with trio.fail_after(5):
            assert await reader.receive_some(100) == b"late"


async def test_direct_writes_arrive_whole_and_a_closed_socket_takes_nothing() -> None:
    client, server = await _connected_pair()
    async with server:
        assert write_now(client.socket, b"one") == 3
        await send_direct(client, b"two")
        got = b""
        for _ in range(10):
            got += await server.receive_some(100)
            if len(got) == 6:
                break
        assert got == b"onetwo"
        await client.aclose()
        assert write_now(client.socket, b"three") == 0  # closed: never written anywhere
        with pytest.raises(trio.ClosedResourceError):
            await send_direct(client, b"three")


async def test_open_tcp_dials_a_numeric_address_without_open_tcp_stream(
        monkeypatch: pytest.MonkeyPatch) -> None:
    names: list[str] = []

    async def by_name(host: str, port: int) -> trio.SocketStream:
        names.append(host)
        raise OSError("no resolver here")

    monkeypatch.setattr(_transport.trio, "open_tcp_stream", by_name)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with listeners[0]:
        stream = await _transport.open_tcp("127.0.0.1", port)
        async with stream, await listeners[0].accept() as server:
            await stream.send_all(b"hi")
            assert await server.receive_some(10) == b"hi"
        with pytest.raises(OSError, match="no resolver"):
            await _transport.open_tcp("localhost", port)
    assert names == ["localhost"]  # only a name goes through open_tcp_stream


async def test_open_tcp_to_a_closed_port_raises_oserror() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused
        with pytest.raises(OSError):
            await _transport.open_tcp("127.0.0.1", port)


@settings(max_examples=300, deadline=None)
@given(ranks=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40, unique=True),
       frame=st.binary(max_size=300), as_tuple=st.booleans())
def test_fanout_payload_of_ascending_ranks_is_the_cbor_cbor2_writes(
        ranks: list[int], frame: bytes, as_tuple: bool) -> None:
    ordered = sorted(ranks)
    given_ranks = tuple(ordered) if as_tuple else ordered
    payload = encode_fanout(given_ranks, frame)
    assert payload == cbor2.dumps([ordered, frame])
    assert decode_fanout(payload) == (tuple(ordered), frame)


def test_fanout_payload_of_unsorted_or_repeated_ranks_is_still_sorted_and_unique() -> None:
    assert decode_fanout(encode_fanout([5, 1, 5, 3], b"f")) == ((1, 3, 5), b"f")
    assert encode_fanout([1, 2], b"x" * 70000) == cbor2.dumps([[1, 2], b"x" * 70000])


async def test_a_rank_send_cancelled_after_a_partial_direct_write_still_sends_the_whole_frame(
        autojump_clock: trio.abc.Clock) -> None:
    """A rank endpoint writes a frame directly while its writer is idle; when the kernel takes
    only part of it, the rest is written before anything else even if the sender is cancelled
    meanwhile: the relay never sees a cut frame (which would corrupt the link)."""
    def big(step: int) -> Metrics:  # about 200 kB: far more than the socket buffers hold
        series = {f"s{i:05d}": (float(i), i) for i in range(8000)}
        return Metrics(0, step, 0.5, 2, 3.0, 4, 1.0, 1.0, 1.0, series, None)

    salt = ft.SessionSalt.generate()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    listener = listeners[0]
    listener.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    address = listener.socket.getsockname()

    async def dial() -> trio.abc.Stream:
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        await sock.connect(address)
        return trio.SocketStream(sock)

    cfg = ft.RankConfig(coord_liveness_timeout=1e6, write_stall_timeout=1e5,
                        heartbeat_interval=1e5)
    codec, decoder = FrameCodec(salt), LenFrameDecoder(max_len=MAX_LEN_FRAME)
    frames: list[bytes] = []
    async with listener, trio.open_nursery() as nursery:
        accepted: list[trio.SocketStream] = []

        async def relay_side() -> None:
            stream = await listener.accept()
            accepted.append(stream)
            await raw_rank_accept(stream, salt, world_size=1, ranks=[0])

        nursery.start_soon(relay_side)
        async with ft.open_rank(dial, salt=salt, rank=0, world_size=1, config=cfg) as ep:
            async with accepted[0] as relay, trio.open_nursery() as reading:

                async def read_later() -> None:
                    await trio.sleep(10)  # long after the sender's deadline below
                    with trio.move_on_after(30):
                        while True:
                            frames.extend(decoder.feed(await relay.receive_some(65536)))

                reading.start_soon(read_later)
                with trio.move_on_after(1):
                    await ep.send(big(1))  # the kernel takes part of it at once
                await ep.send(big(2))
    opened = [decode_metrics(codec.open(f).payload) for f in frames]  # each one verifies
    assert opened == [big(1), big(2)]
