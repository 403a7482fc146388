"""One port for everything: the status page on the coordinator's port, and TLS end to end."""

from __future__ import annotations

import ssl
from typing import Any

import pytest
import trio
import trustme
from prometheus_client.parser import text_string_to_metric_families

import flodl_trio as ft
from flodl_trio.status import fetch_state
from flodl_trio.wire import SetGlobalStep


async def _relay_with_ranks(address: Any, salt: ft.SessionSalt, host: str, ranks: list[int],
                            world: int, got: dict[int, list[Any]], **kw: Any) -> None:
    async with trio.open_nursery() as nursery:
        async with ft.open_relay(address, salt=salt, host=host, ranks=ranks, world_size=world,
                                 **kw) as relay:
            for r in ranks:
                nursery.start_soon(_rank, relay.rank_address, salt, r, world, got)
            await relay.wait_closed()


async def _rank(addr: Any, salt: ft.SessionSalt, rank: int, world: int,
                got: dict[int, list[Any]]) -> None:
    try:
        async with ft.open_rank(addr, salt=salt, rank=rank, world_size=world) as ep:
            async for msg in ep:
                got.setdefault(rank, []).append(msg)
    except ft.CoordinatorLost:
        got.setdefault(rank, []).append("lost")  # a rank declared dead is never told Shutdown


async def test_status_page_answers_on_the_coordinator_port_during_and_after_formation() -> None:
    salt = ft.SessionSalt.generate()
    cfg = ft.CoordinatorConfig(world_size=3, formation_timeout=20)
    bound = await ft.bind_coordinator(("127.0.0.1", 0))
    got: dict[int, list[Any]] = {}
    seen: dict[str, Any] = {}
    with trio.fail_after(15):
        async with trio.open_nursery() as nursery:

            async def run() -> None:
                async with ft.open_coordinator(bound, salt=salt, config=cfg) as coord:
                    seen["running"] = await fetch_state(bound.address, timeout=5)
                    metrics = await _get(bound.address, "/metrics")
                    seen["metrics"] = metrics
                    seen["health"] = await _get(bound.address, "/healthz")
                    await coord.declare_dead(2, "test kills rank 2")
                    seen["after_death"] = await fetch_state(bound.address, timeout=5)

            nursery.start_soon(run)
            await trio.sleep(0.2)  # only host-a joins first: formation is still running
            nursery.start_soon(_relay_with_ranks, bound.address, salt, "host-a", [0, 1], 3, got)
            for _ in range(100):  # bounded: until host-a's two ranks are covered
                state = await fetch_state(bound.address, timeout=5)
                if state["covered"] == 2:
                    break
                await trio.sleep(0.05)
            seen["forming"] = state
            nursery.start_soon(_relay_with_ranks, bound.address, salt, "host-b", [2], 3, got)
    assert seen["forming"]["phase"] == "forming" and seen["forming"]["covered"] == 2
    assert seen["running"]["phase"] == "running" and seen["running"]["covered"] == 3
    assert sorted(r["host"] for r in seen["running"]["relays"]) == ["host-a", "host-b"]
    assert seen["health"].startswith("HTTP/1.1 200")
    families = {f.name: f for f in text_string_to_metric_families(
        seen["metrics"].split("\r\n\r\n", 1)[1])}
    assert families["flodl_trio_world_size"].samples[0].value == 3
    assert families["flodl_trio_ranks_live"].samples[0].value == 3
    after = seen["after_death"]
    assert after["dead"] == [{"rank": 2, "reason": "declared by the orchestrator: test kills "
                                                   "rank 2"}]
    assert after["live"] == [0, 1]


async def _get(address: tuple[str, int], path: str) -> str:
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        data = b""
        with trio.fail_after(5):
            while chunk := await stream.receive_some(65536):
                data += chunk
    return data.decode()


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


async def test_formation_and_broadcast_over_tls(ca: trustme.CA) -> None:
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("coordinator.test").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    salt = ft.SessionSalt.generate()
    bound = await ft.bind_coordinator(("127.0.0.1", 0))
    got: dict[int, list[Any]] = {}
    with trio.fail_after(15):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _relay_with_ranks(
                bound.address, salt, "host-a", [0, 1], 2, got, ssl_context=client_ctx,
                server_hostname="coordinator.test"))
            async with ft.open_coordinator(bound, salt=salt, ssl_context=server_ctx,
                                           config=ft.CoordinatorConfig(world_size=2)) as coord:
                await coord.broadcast_control(SetGlobalStep(global_step=7))
    assert [type(m).__name__ for m in got[0]] == ["SetGlobalStep", "Shutdown"]
    assert got[1][0] == SetGlobalStep(global_step=7)


async def test_relay_rejects_a_coordinator_certificate_it_does_not_trust(ca: trustme.CA) -> None:
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("coordinator.test").configure_cert(server_ctx)
    untrusting = ssl.create_default_context()
    untrusting.load_verify_locations(cadata=trustme.CA().cert_pem.bytes().decode())
    salt = ft.SessionSalt.generate()
    bound = await ft.bind_coordinator(("127.0.0.1", 0))
    cfg = ft.CoordinatorConfig(world_size=1, formation_timeout=3)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            async def coordinator() -> None:
                with pytest.raises(ft.FormationTimeout):
                    async with ft.open_coordinator(bound, salt=salt, ssl_context=server_ctx,
                                                   config=cfg):
                        pass  # pragma: no cover - formation cannot complete

            nursery.start_soon(coordinator)
            with pytest.raises(ft.HandshakeError, match="certificate we do not trust"):
                async with ft.open_relay(bound.address, salt=salt, host="host-a", ranks=[0],
                                         world_size=1, ssl_context=untrusting,
                                         server_hostname="coordinator.test") as relay:
                    nursery.start_soon(_rank, relay.rank_address, salt, 0, 1, {})
                    await relay.wait_closed()
            nursery.cancel_scope.cancel()
