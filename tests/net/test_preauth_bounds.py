"""Pre-authentication resources are bounded (issue 12, SPEC §4.2 FT/2): at most
``max_pending_handshakes`` unauthenticated connections (the oldest is shed), and a Hello ceiling
fitted to the largest legal Hello instead of 256 KiB."""

from __future__ import annotations

import struct

import pytest
import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.events import HandshakeRejected
from flodl_trio.port_mux import open_port_mux
from flodl_trio.status import render_prometheus
from flodl_trio.testing import MemoryNetwork

from helpers import COORD, events_of, start_host


@pytest.mark.parametrize("world", [1, 8, 300, 16_384, 70_000])
def test_the_hello_ceiling_holds_the_largest_legal_hello_and_grows_only_with_the_world(
    world: int,
) -> None:
    sigs = {f"{i:03d}" + "n" * (wire.MAX_MODEL_SIG_NAME - 3): bytes(wire.MAX_MODEL_SIG_DIGEST)
            for i in range(wire.MAX_MODEL_SIGS)}
    hello = wire.Hello(host="h" * wire.MAX_HOST_BYTES, world_size=(1 << 32) - 1,
                       model_sigs=sigs, ranks=tuple(range(world)), nonce=bytes(16))
    ceiling = wire.max_hello_payload(world)
    assert len(wire.encode(hello)) <= ceiling
    # About five bytes per rank over a fixed part, never the flat 256 KiB of FT/1.
    assert ceiling <= 14_000 + 5 * world or ceiling == 16 * 1024
    assert wire.max_hello_payload(1) == 16 * 1024


async def test_a_hello_declared_over_the_ceiling_is_rejected_before_its_bytes_arrive(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    timeline = ft.Timeline()
    cfg = ft.CoordinatorConfig(world_size=2, formation_timeout=60, handshake_timeout=10)
    ceiling = wire.max_hello_payload(2)
    async with trio.open_nursery() as nursery:

        async def oversized_hello_then_relay() -> None:
            stream = await memory_network.connect(COORD)
            await stream.send_all(wire.CHANNEL_MAGIC_CONTROL)
            assert await stream.receive_some(65536)  # the Challenge
            started = trio.current_time()
            head = struct.pack("<IIBII", wire.RECORD_MAGIC, wire.PROTOCOL_VERSION,
                               int(wire.RecordKind.CONTROL), 0, ceiling + 1)
            await stream.send_all(head + bytes(8))
            with trio.fail_after(30):
                while await stream.receive_some(65536):
                    pass  # the coordinator closes without waiting for the payload
            assert trio.current_time() - started < 1
            await stream.aclose()
            await start_host(nursery, memory_network, "host-a", [0, 1], salt=salt, world=2)

        nursery.start_soon(oversized_hello_then_relay)
        async with ft.open_coordinator(memory_network.listener(COORD), salt=salt, config=cfg,
                                       timeline=timeline) as coord:
            assert coord.state()["rejected_handshakes"] == {"malformed": 1}
    (rejected,) = events_of(timeline, HandshakeRejected)
    assert f"over the ceiling of {ceiling}" in rejected.reason


async def test_silent_dialers_beyond_max_pending_are_shed_oldest_first_and_a_relay_joins(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    cfg = ft.CoordinatorConfig(world_size=2, formation_timeout=60, handshake_timeout=10,
                               max_pending_handshakes=20)
    silent: list[trio.abc.Stream] = []
    closed_by_coordinator: list[int] = []
    async with trio.open_nursery() as nursery:

        async def hold(index: int, stream: trio.abc.Stream) -> None:
            await stream.send_all(wire.CHANNEL_MAGIC_CONTROL)  # then nothing: a slowloris
            with trio.move_on_after(5):  # well inside handshake_timeout
                while await stream.receive_some(65536):
                    pass
                closed_by_coordinator.append(index)

        async def flood_then_relay() -> None:
            for i in range(100):
                stream = await memory_network.connect(COORD)
                silent.append(stream)
                nursery.start_soon(hold, i, stream)
                await trio.sleep(0.001)  # each one older than the next
            await start_host(nursery, memory_network, "host-a", [0, 1], salt=salt, world=2)

        started = trio.current_time()
        nursery.start_soon(flood_then_relay)
        async with ft.open_coordinator(memory_network.listener(COORD), salt=salt,
                                       config=cfg) as coord:
            formed_after = trio.current_time() - started
            state = coord.state()
            rejects = state["rejected_handshakes"]
            # The 19 youngest silent ones still hold a slot (the relay's was freed at its Hello).
            assert state["pending_handshakes"] == 19
            assert "flodl_trio_pending_handshakes 19" in render_prometheus(state)
            await trio.sleep(6)  # the holders give up listening
        for stream in silent:
            await stream.aclose()
    assert formed_after < 1  # not after the silent ones' handshake_timeout
    assert rejects == {"shed": 81}  # 100 silent + 1 relay through 20 slots
    # Oldest first: the 81 closed are exactly the first 81 that arrived.
    assert sorted(closed_by_coordinator) == list(range(81))


async def test_the_port_mux_sheds_the_oldest_silent_dialer_beyond_max_peeking(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    silent: list[trio.abc.Stream] = []
    async with open_port_mux(memory_network.listener("mux"), peek_timeout=5,
                             max_peeking=10) as mux:
        for _ in range(30):
            silent.append(await memory_network.connect("mux"))
            await trio.sleep(0.001)  # each one older than the next
        relay = await memory_network.connect("mux")
        await relay.send_all(wire.CHANNEL_MAGIC_CONTROL)
        with trio.fail_after(1):  # well before peek_timeout
            routed = await mux.control.accept()
        assert await routed.receive_some(4) == wire.CHANNEL_MAGIC_CONTROL
        assert mux.stats.dropped["shed"] == 21  # 30 silent + 1 relay through 10 slots
        # The shed ones are the oldest: the first 21 are closed, the last 9 still wait.
        for stream in silent[:21]:
            assert await stream.receive_some(10) == b""
        await routed.aclose()
        for stream in [*silent, relay]:
            await stream.aclose()
