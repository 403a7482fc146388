"""FT/2's confirmed joins and clean ends, end to end on the in-memory transport (SPEC §2.6,
§4.2, §4.6): model signatures that disagree fail formation; a graceful coordinator says
``Goodbye`` before its half-close, so its relays end clean, and a coordinator that vanishes
without one leaves its relays ending unclean."""

from __future__ import annotations

from typing import Any

import pytest
import trio

import flodl_trio as ft
from flodl_trio.testing import MemoryNetwork

from helpers import COORD, start_host, wait_until
from helpers.raw import drain_and_close, raw_coordinator_accept


async def test_relays_with_agreeing_model_signatures_form(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    cfg = ft.CoordinatorConfig(world_size=2, formation_timeout=60, heartbeat_interval=3600)
    sigs = {"model": bytes(range(32))}
    async with trio.open_nursery() as nursery:
        for host, ranks in (("host-a", [0]), ("host-b", [1])):
            nursery.start_soon(_relay_with_sigs, memory_network, host, ranks, salt, sigs)
        async with ft.open_coordinator(memory_network.listener(COORD), salt=salt,
                                       config=cfg) as coord:
            assert coord.covered_ranks == frozenset({0, 1})
        nursery.cancel_scope.cancel()


async def _relay_with_sigs(net: MemoryNetwork, host: str, ranks: list[int], salt: ft.SessionSalt,
                           sigs: dict[str, bytes]) -> None:
    async with ft.open_relay(lambda: net.connect(COORD), salt=salt, host=host, ranks=ranks,
                             world_size=2, rank_listen=net.listener(f"relay:{host}"),
                             model_sigs=sigs) as relay:
        async with trio.open_nursery() as nursery:
            for rank in ranks:
                nursery.start_soon(_idle_rank, net, host, rank, salt)
            await relay.wait_closed()


async def _idle_rank(net: MemoryNetwork, host: str, rank: int, salt: ft.SessionSalt) -> None:
    async with ft.open_rank(lambda: net.connect(f"relay:{host}"), salt=salt, rank=rank,
                            world_size=2) as ep:
        async for _ in ep:
            pass


@pytest.mark.parametrize("sigs", [
    {"": b"\x01"}, {"m": b""}, {"m": b"x" * 65}, {"n" * 129: b"\x01"},
    {f"m{i}": b"\x01" for i in range(65)},
], ids=["empty-name", "empty-digest", "long-digest", "long-name", "too-many"])
async def test_model_signatures_out_of_their_limits_are_a_config_error(
    memory_network: MemoryNetwork, sigs: dict[str, bytes]
) -> None:
    with pytest.raises(ft.ConfigError, match="model signature"):
        async with ft.open_relay(lambda: memory_network.connect(COORD),
                                 salt=ft.SessionSalt.generate(), host="h", ranks=[0],
                                 world_size=1, model_sigs=sigs):
            pytest.fail("not reached")


async def test_a_graceful_coordinator_says_goodbye_and_its_relays_end_clean(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    cfg = ft.CoordinatorConfig(world_size=4)
    async with trio.open_nursery() as nursery:
        hosts = [await start_host(nursery, memory_network, h, r, salt=salt, world=4)
                 for h, r in (("host-a", [0, 1]), ("host-b", [2, 3]))]
        async with ft.open_coordinator(memory_network.listener(COORD), salt=salt, config=cfg):
            pass
        await wait_until(lambda: all(h.all_done for h in hosts))
    for host in hosts:
        assert isinstance(host.exit, ft.RelayExit)
        assert host.exit.clean, host.exit
        # Its ranks saw Shutdown and left; or the Goodbye came first and it said why.
        assert host.exit.reason.startswith("coordinator said Goodbye: ")
    memory_network.assert_all_closed()


async def test_a_coordinator_that_vanishes_without_goodbye_leaves_its_relay_unclean(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    listener = memory_network.listener(COORD)
    exits: list[Any] = []
    async with trio.open_nursery() as nursery:

        async def relay() -> None:
            async with ft.open_relay(lambda: memory_network.connect(COORD), salt=salt,
                                     host="host-a", ranks=[0], world_size=1,
                                     rank_listen=memory_network.listener("relay:a")) as r:
                async with ft.open_rank(lambda: memory_network.connect("relay:a"), salt=salt,
                                        rank=0, world_size=1) as ep:
                    with pytest.raises(ft.CoordinatorLost):
                        async for _ in ep:
                            pass
                exits.append(await r.wait_closed())

        nursery.start_soon(relay)
        side = await raw_coordinator_accept(listener, salt)
        # It confirms the join (the welcome), then half-closes with no Goodbye: a coordinator
        # that died after writing everything looks exactly like this to the relay.
        await side.stream.send_all(b"")
        await side.stream.send_eof()
        await wait_until(lambda: bool(exits))
        await trio.aclose_forcefully(side.stream)
        await listener.aclose()
    (exit_,) = exits
    assert not exit_.clean
    assert "without a Goodbye" in exit_.reason
    memory_network.assert_all_closed()


async def test_records_that_arrive_in_the_same_read_as_ready_are_acted_on_at_once(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    from flodl_trio import wire

    salt = ft.SessionSalt.generate()
    cfg = ft.CoordinatorConfig(world_size=1, heartbeat_interval=3600, heartbeat_timeout=3600)
    listener = memory_network.listener(COORD)
    async with trio.open_nursery() as nursery:

        async def relay_that_writes_a_frame_behind_its_ready() -> None:
            stream = await memory_network.connect(COORD)
            machine = wire.RelayHandshake(salt, host="host-a", ranks=(0,), world_size=1,
                                          coordinator=COORD)
            await stream.send_all(machine.data_to_send())  # the magic
            written = 0
            for _ in range(20):  # Challenge -> Hello, HelloAck -> Ready
                machine.receive_data(bytes(await stream.receive_some(4096)))
                assert machine.next_event() is wire.NEED_DATA
                out = machine.data_to_send()
                if not out:
                    continue
                written += 1
                if written == 2:  # the Ready: one write with a DATA record right behind it
                    assert machine.sealer is not None
                    frame = wire.encode_frame(salt, wire.Heartbeat(rank=0, step_count=7))
                    out += machine.sealer.seal(wire.RecordKind.DATA, 0, frame)
                await stream.send_all(out)
                if written == 2:
                    break
            nursery.start_soon(drain_and_close, stream)  # then silence, the link open

        nursery.start_soon(relay_that_writes_a_frame_behind_its_ready)
        async with ft.open_coordinator(listener, salt=salt, config=cfg) as coord:
            with trio.fail_after(1):
                msg = await coord.timing.receive()
            assert msg == wire.Heartbeat(rank=0, step_count=7)
        nursery.cancel_scope.cancel()
