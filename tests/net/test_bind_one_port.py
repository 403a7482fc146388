"""``bind_coordinator`` binds every address on one port and reports each of them (real sockets:
the point is what the OS hands out for port 0 in each address family)."""

from __future__ import annotations

import trio

import flodl_trio as ft
from flodl_trio.events import Listening

from helpers import needs_ipv6


@needs_ipv6
async def test_bare_port_zero_binds_ipv4_and_ipv6_on_one_port_and_reports_both() -> None:
    timeline = ft.Timeline()
    async with await ft.bind_coordinator(0, timeline=timeline) as bound:
        hosts = {host for host, _ in bound.addresses}
        ports = {port for _, port in bound.addresses}
        assert hosts == {"0.0.0.0", "::"}
        assert len(ports) == 1 and ports != {0}
        assert bound.address == bound.addresses[0]
        assert len(bound.listeners) == len(bound.addresses) == 2
        listened = sorted(ev.address for ev in timeline.events() if isinstance(ev, Listening))
        (port,) = ports
        assert listened == sorted([f"0.0.0.0:{port}", f"[::]:{port}"])
        # Both families answer on the published port.
        for host in ("127.0.0.1", "::1"):
            with trio.fail_after(5):
                stream = await trio.open_tcp_stream(host, port)
            await stream.aclose()


async def test_an_ipv4_address_binds_one_listener_and_reports_it() -> None:
    async with await ft.bind_coordinator(("127.0.0.1", 0)) as bound:
        assert len(bound.addresses) == 1
        assert bound.addresses[0][0] == "127.0.0.1"


@needs_ipv6
async def test_relays_dialing_either_family_of_a_port_zero_coordinator_form_one_cohort() -> None:
    salt = ft.SessionSalt.generate()
    cfg = ft.CoordinatorConfig(world_size=2, formation_timeout=10)
    bound = await ft.bind_coordinator(0)
    port = bound.address[1]
    async with trio.open_nursery() as nursery:

        async def relay(host: str, dial_host: str, rank: int) -> None:
            async with ft.open_relay((dial_host, port), salt=salt, host=host, ranks=[rank],
                                     world_size=2) as r:
                nursery.start_soon(rank_task, r.rank_address, rank)
                await r.wait_closed()

        async def rank_task(addr: tuple[str, int], rank: int) -> None:
            async with ft.open_rank(addr, salt=salt, rank=rank, world_size=2) as ep:
                async for _ in ep:
                    pass

        nursery.start_soon(relay, "host-v4", "127.0.0.1", 0)
        nursery.start_soon(relay, "host-v6", "::1", 1)
        with trio.fail_after(10):
            async with ft.open_coordinator(bound, salt=salt, config=cfg) as coord:
                peers = {info.host: info.peer for info in coord.relays}
                assert coord.covered_ranks == frozenset({0, 1})
    assert peers["host-v4"].startswith("127.0.0.1:")
    assert peers["host-v6"].startswith("[::1]:")
