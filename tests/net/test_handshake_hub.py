"""The handshake hub (issue 23): one task advances many coordinator handshakes over real sockets.

Each test drives ``wire.CoordinatorHandshake`` in a ``HandshakeHub`` against a relay's
``wire.RelayHandshake`` on the other end of a socket pair, and checks what the owner of the
connection hears: exactly one callback, with the event or the error a user would see."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from flodl_trio import FlodlError, wire
from flodl_trio.net._handshake_hub import HandshakeHub, HubConn, hub_socket

pytestmark = pytest.mark.skipif(not HandshakeHub.supported(), reason="needs select.epoll")

SALT = wire.SessionSalt(bytes(range(16)))


def pair() -> tuple[trio.SocketStream, trio.socket.SocketType]:
    a, b = trio.socket.socketpair()
    return trio.SocketStream(a), b


class Outcome:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.done = trio.Event()

    def event(self, ev: Any) -> None:
        self.calls.append(("event", ev))
        self.done.set()

    def error(self, exc: BaseException) -> None:
        self.calls.append(("error", exc))
        self.done.set()


def held(stream: trio.SocketStream, outcome: Outcome, deadline: float) -> HubConn:
    sock = hub_socket(stream)
    assert sock is not None
    machine = wire.CoordinatorHandshake(SALT, peer="peer-a", max_hello=4096)
    return HubConn(stream, sock, machine, deadline=deadline, on_event=outcome.event,
                   on_error=outcome.error)


def relay() -> wire.RelayHandshake:
    return wire.RelayHandshake(SALT, host="host-a", ranks=(0, 1), world_size=2,
                               coordinator="coord")


async def relay_turn(peer: trio.socket.SocketType, machine: wire.RelayHandshake) -> Any:
    """Read what the coordinator wrote until the relay's machine has an event; write its answer."""
    while True:
        event = machine.next_event()
        if out := machine.data_to_send():
            await peer.send(out)
        if event is not wire.NEED_DATA:
            return event
        data = await peer.recv(65536)
        machine.receive_data(data)


async def test_the_hub_runs_a_whole_join_and_holds_nothing_after() -> None:
    hub = HandshakeHub()
    stream, peer = pair()
    outcome = Outcome()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.run)
        conn = held(stream, outcome, trio.current_time() + 10)
        hub.add(conn)
        relay_end: list[Any] = []
        relay_done = trio.Event()

        async def relay_side() -> None:
            relay_end.append(await relay_turn(peer, relay()))
            relay_done.set()

        nursery.start_soon(relay_side)
        with trio.fail_after(10):
            await outcome.done.wait()
        [(kind, hello)] = outcome.calls
        assert kind == "event" and isinstance(hello, wire.HelloReceived)
        assert hello.hello.host == "host-a" and tuple(hello.hello.ranks) == (0, 1)
        assert len(hub) == 0
        # The owner gives it back for the confirmed join: HelloAck, the relay's Ready, welcome.
        outcome.calls.clear()
        outcome.done = trio.Event()
        conn.machine.accept()  # type: ignore[attr-defined]
        hub.add(conn)
        with trio.fail_after(10):
            await relay_done.wait()
            await outcome.done.wait()
        assert isinstance(relay_end[0], wire.Established)
        [(kind, established)] = outcome.calls
        assert kind == "event" and isinstance(established, wire.Established)
        assert len(hub) == 0 and hub.peak == 1
        hub.drain()
    stream.socket.close()
    peer.close()


async def test_a_connection_given_back_from_its_callback_goes_on_and_ends_unregistered() -> None:
    # Formation's path: the Hello's callback accepts and gives the connection straight back
    # (its socket stays registered in between); once the join ends the hub holds nothing,
    # and the same socket can be held again (it was unregistered, or add would fail).
    hub = HandshakeHub()
    stream, peer = pair()
    outcome = Outcome()
    conn = held(stream, outcome, trio.current_time() + 10)

    def on_hello(event: Any) -> None:
        assert isinstance(event, wire.HelloReceived)
        conn.machine.accept()  # type: ignore[attr-defined]
        conn.on_event = outcome.event
        hub.add(conn)

    conn.on_event = on_hello
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.run)
        hub.add(conn)
        relay_machine = relay()
        with trio.fail_after(10):
            relay_end = await relay_turn(peer, relay_machine)
            await outcome.done.wait()
        assert isinstance(relay_end, wire.Established)
        [(kind, established)] = outcome.calls
        assert kind == "event" and isinstance(established, wire.Established)
        assert len(hub) == 0 and hub.peak == 1
        # Held again (a fresh machine): the peer's close now ends it with an error.
        outcome.calls.clear()
        outcome.done = trio.Event()
        hub.add(held(stream, outcome, trio.current_time() + 10))
        peer.close()
        with trio.fail_after(10):
            await outcome.done.wait()
        [(kind, exc)] = outcome.calls
        assert kind == "error" and isinstance(exc, FlodlError)
        hub.drain()
    stream.socket.close()


async def test_a_relay_cut_at_every_byte_of_its_first_flight_is_rejected_never_held() -> None:
    # The relay's magic and Hello, cut after each byte (0 .. all but one): the connection is
    # rejected with the machine's own error (an "eof" category) and never waits for its
    # deadline; one hub serves them all.
    relay_machine = relay()
    relay_machine.next_event()
    first = relay_machine.data_to_send()  # the magic
    coord = wire.CoordinatorHandshake(SALT, peer="probe", max_hello=4096)
    coord.receive_data(first)
    coord.next_event()
    relay_machine.receive_data(coord.data_to_send())  # the Challenge
    relay_machine.next_event()
    flight = first + relay_machine.data_to_send()  # magic + Hello, as one relay sends them
    hub = HandshakeHub()
    outcomes = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.run)
        for cut in range(len(flight)):
            stream, peer = pair()
            outcome = Outcome()
            outcomes.append((cut, outcome, stream))
            hub.add(held(stream, outcome, trio.current_time() + 60))
            if cut:
                await peer.send(flight[:cut])
            peer.close()
        with trio.fail_after(10):
            for _, outcome, _ in outcomes:
                await outcome.done.wait()
        hub.drain()
    for cut, outcome, stream in outcomes:
        [(kind, exc)] = outcome.calls
        assert kind == "error", cut
        # Not the deadline: the end of the stream, or the Challenge meeting a closed socket.
        assert isinstance(exc, (FlodlError, trio.BrokenResourceError)), (cut, exc)
        stream.socket.close()


async def test_a_silent_peer_ends_at_its_deadline(autojump_clock: trio.testing.MockClock
                                                  ) -> None:
    hub = HandshakeHub()
    stream, peer = pair()
    outcome = Outcome()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.run)
        start = trio.current_time()
        hub.add(held(stream, outcome, start + 5))
        await outcome.done.wait()
        [(kind, exc)] = outcome.calls
        assert kind == "error" and isinstance(exc, trio.TooSlowError)
        assert trio.current_time() - start == pytest.approx(5)
        assert len(hub) == 0
        hub.drain()
    stream.socket.close()
    peer.close()


async def test_a_socket_closed_from_outside_is_noticed_and_its_number_reused_safely(
        autojump_clock: trio.testing.MockClock) -> None:
    hub = HandshakeHub()
    first, first_peer = pair()
    gone = Outcome()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.run)
        hub.add(held(first, gone, trio.current_time() + 30))
        fd = first.socket.fileno()
        first.socket.close()  # someone else closes it while the hub holds it
        first_peer.close()
        # The next socket may get the same number: the hub ends the stale one first.
        second, second_peer = pair()
        fresh = Outcome()
        hub.add(held(second, fresh, trio.current_time() + 30))
        if second.socket.fileno() == fd:
            [(kind, exc)] = gone.calls
            assert kind == "error" and isinstance(exc, trio.ClosedResourceError)
        relay_machine = relay()
        nursery.start_soon(relay_turn, second_peer, relay_machine)
        await fresh.done.wait()
        assert fresh.calls[0][0] == "event"
        await gone.done.wait()  # by its deadline at the latest
        assert gone.calls[0][0] == "error"
        nursery.cancel_scope.cancel()  # the relay still waits for its HelloAck
    second.socket.close()
    second_peer.close()


async def test_cancelling_the_hub_closes_what_it_holds() -> None:
    hub = HandshakeHub()
    stream, peer = pair()
    outcome = Outcome()
    with trio.move_on_after(0.2):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hub.run)
            hub.add(held(stream, outcome, trio.current_time() + 60))
    assert stream.socket.fileno() == -1
    assert outcome.calls == []
    late, late_peer = pair()
    with pytest.raises(trio.ClosedResourceError):
        hub.add(held(late, outcome, 0))
    late.socket.close()
    late_peer.close()
    peer.close()
