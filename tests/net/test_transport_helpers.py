"""The shared transport helpers: one accept loop (``serve_each``) and one dial-with-retry
(``dial_and_handshake``), under MockClock over the in-memory transport."""

from __future__ import annotations

import errno
from functools import partial

import pytest
import trio

import flodl_trio as ft
from flodl_trio.net._listen import serve_each
from flodl_trio.net._transport import dial_and_handshake
from flodl_trio.testing import MemoryNetwork, MemoryStream


class ScriptedListener(trio.abc.Listener[MemoryStream]):
    """Raises or returns what its script says, one item per accept; then ClosedResourceError."""

    def __init__(self, script: list[BaseException | MemoryStream]) -> None:
        self.script = script

    async def accept(self) -> MemoryStream:
        await trio.lowlevel.checkpoint()
        if not self.script:
            raise trio.ClosedResourceError("listener closed")
        item = self.script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self) -> None:
        self.script.clear()
        await trio.lowlevel.checkpoint()


async def test_serve_each_runs_one_task_per_connection_and_returns_when_the_listener_closes(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    listener = memory_network.listener("svc")
    greeted: list[bytes] = []

    async def handler(stream: trio.abc.Stream) -> None:
        greeted.append(await stream.receive_some(100))
        await trio.sleep(5)  # both handlers are in flight at once
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(serve_each, listener, handler, what="test"))
        ends = [await memory_network.connect("svc") for _ in range(2)]
        for i, end in enumerate(ends):
            await end.send_all(b"hello %d" % i)
        await trio.sleep(1)
        assert sorted(greeted) == [b"hello 0", b"hello 1"]
        await listener.aclose()  # serve_each returns once the handlers are done
        started = trio.current_time()
    assert trio.current_time() - started == pytest.approx(4)
    for end in ends:
        assert await end.receive_some(10) == b""
        await end.aclose()
    memory_network.assert_all_closed()


async def test_serve_each_backs_off_when_out_of_descriptors_and_raises_other_accept_errors(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    peer_listener = memory_network.listener("peer")
    client = await memory_network.connect("peer")
    handled: list[float] = []

    async def handler(stream: trio.abc.Stream) -> None:
        handled.append(trio.current_time())
        await stream.aclose()

    listener = ScriptedListener([OSError(errno.EMFILE, "Too many open files"), client])
    await serve_each(listener, handler, what="test")
    assert handled == [pytest.approx(0.1)]
    refused = ScriptedListener([OSError(errno.EACCES, "Permission denied")])
    with pytest.raises(ExceptionGroup) as excinfo:  # from inside its handlers' nursery
        await serve_each(refused, handler, what="test")
    assert excinfo.group_contains(PermissionError, match="Permission denied")
    await (await peer_listener.accept()).aclose()
    await peer_listener.aclose()


async def test_dial_and_handshake_retries_every_half_second_until_an_attempt_succeeds(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    listener = memory_network.listener("peer")
    attempts: list[float] = []

    async def handshake(stream: trio.abc.Stream) -> trio.abc.Stream:
        attempts.append(trio.current_time())
        if len(attempts) < 3:
            raise ft.WireError("peer closed mid-handshake")
        return stream

    async with trio.open_nursery() as nursery:
        accepted: list[MemoryStream] = []

        async def accept_all() -> None:
            while True:
                accepted.append(await listener.accept())

        nursery.start_soon(accept_all)
        got = await dial_and_handshake(
            lambda: memory_network.connect("peer"), handshake, connect_timeout=10,
            what="rank 0", peer="relay test", expected="an ack", retry_on=(ft.WireError,))
        nursery.cancel_scope.cancel()
    assert attempts == [0, 0.5, 1.0]
    # The failed attempts' streams were closed; the third is the caller's.
    assert [s.peer.is_open for s in accepted] == [False, False, True]
    assert got is accepted[2].peer
    for stream in [got, *accepted]:
        await stream.aclose()
    await listener.aclose()


async def test_dial_and_handshake_gives_up_at_connect_timeout_and_says_why(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    listener = memory_network.listener("peer")

    async def handshake(stream: trio.abc.Stream) -> None:
        raise ft.WireError("peer closed the connection before sending anything")

    with pytest.raises(ft.HandshakeError) as excinfo:
        await dial_and_handshake(
            lambda: memory_network.connect("peer"), handshake, connect_timeout=3,
            what="relay 'host-a'", peer="127.0.0.1:5000", expected="an upstream handshake",
            retry_on=(ft.WireError,))
    assert trio.current_time() == pytest.approx(2.5)
    assert str(excinfo.value) == (
        "relay 'host-a': expected an upstream handshake from 127.0.0.1:5000 within "
        "connect_timeout=3s; last attempt failed: WireError('peer closed the connection before "
        "sending anything')")
    for _ in range(6):  # attempts at 0, 0.5, ... 2.5
        await (await listener.accept()).aclose()
    await listener.aclose()


async def test_dial_and_handshake_stops_at_once_on_a_final_error_and_closes_the_stream(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    listener = memory_network.listener("peer")
    dialed: list[MemoryStream] = []

    async def dialer() -> MemoryStream:
        dialed.append(await memory_network.connect("peer"))
        return dialed[-1]

    async def handshake(stream: trio.abc.Stream) -> None:
        raise ft.AuthError("Challenge MAC did not verify: wrong session salt?")

    with pytest.raises(ft.AuthError):
        await dial_and_handshake(dialer, handshake, connect_timeout=30, what="relay 'a'",
                                 peer="x", expected="y", retry_on=(ft.WireError,),
                                 final=(ft.AuthError,))
    assert trio.current_time() == 0 and len(dialed) == 1 and not dialed[0].is_open
    server = await listener.accept()
    await server.aclose()
    await listener.aclose()
