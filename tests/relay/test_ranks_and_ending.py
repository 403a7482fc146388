"""The host relay (SPEC §2.3, §5): rank handshakes, rank loss, the end of the relay, and what
upstream EOF does to its ranks."""

from __future__ import annotations

from typing import Any

import pytest
import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.events import RankDeclaredDead, RankExited, RelayLost
from flodl_trio.testing import MemoryNetwork, open_local_cluster
from flodl_trio.wire import DeclareDead, SetGlobalStep, Shutdown

from helpers import COORD, Recorder, events_of, hosts_by_hand, start_host, start_rank, wait_until
from helpers.raw import raw_coordinator_accept, read_one_record


async def raw_rank_hello(net: MemoryNetwork, relay: str, hello: bytes) -> bytes:
    """Send a hello as a rank would; return whatever the relay answers before it closes."""
    stream = await net.connect(relay)
    try:
        await stream.send_all(hello)
        answer = b""
        with trio.fail_after(30):
            while chunk := await stream.receive_some(65536):
                answer += chunk
        return answer
    finally:
        await stream.aclose()


async def test_bad_rank_hellos_are_rejected_while_the_relay_keeps_accepting(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt, other_salt = ft.SessionSalt.generate(), ft.SessionSalt.generate()
    listener = memory_network.listener(COORD)
    async with trio.open_nursery() as nursery:
        host_a = await start_host(nursery, memory_network, "host-a", [0, 1], salt=salt, world=4,
                                  start_ranks=[0])
        host_b = await start_host(nursery, memory_network, "host-b", [2, 3], salt=salt, world=4)
        await wait_until(lambda: host_a.ranks[0].entered.is_set())
        relay = "relay:host-a"
        bad_hellos = {
            "wrong salt": wire.encode_rank_hello(other_salt, 1, 4),
            "wrong world_size": wire.encode_rank_hello(salt, 1, 5),
            "rank of another host": wire.encode_rank_hello(salt, 2, 4),
            "duplicate": wire.encode_rank_hello(salt, 0, 4),
            "short": wire.encode_rank_hello(salt, 1, 4)[:10],
            "garbage": b"GET / HTTP/1.1\r\n\r\n\x00\x00\x00\x00\x00\x00",
        }
        for what, hello in bad_hellos.items():
            answer = await raw_rank_hello(memory_network, relay, hello)
            assert answer == b"", f"{what}: the relay must close without an ack"
        assert host_a.relay is not None
        assert host_a.relay.connected_ranks == frozenset({0})
        # The relay is still accepting: the genuine rank 1 completes it.
        start_rank(nursery, memory_network, host_a.ranks[1], salt=salt, world=4)
        async with ft.open_coordinator(listener, salt=salt,
                                       config=ft.CoordinatorConfig(world_size=4)) as coord:
            assert coord.covered_ranks == frozenset(range(4))
            await coord.broadcast_control(SetGlobalStep(global_step=5))
        await wait_until(lambda: host_a.all_done and host_b.all_done)
    for run in [*host_a.ranks.values(), *host_b.ranks.values()]:
        assert run.received == [SetGlobalStep(global_step=5), Shutdown()]


async def test_rank_accept_timeout_raises_formation_timeout_naming_missing_ranks_and_rejects(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt, other_salt = ft.SessionSalt.generate(), ft.SessionSalt.generate()
    cfg = ft.RelayConfig(rank_accept_timeout=5)
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        host = await start_host(nursery, memory_network, "host-a", [0, 1, 2], salt=salt, world=3,
                                relay_config=cfg, start_ranks=[0])
        await wait_until(lambda: host.ranks[0].entered.is_set())
        assert await raw_rank_hello(memory_network, "relay:host-a",
                                    wire.encode_rank_hello(other_salt, 1, 3)) == b""
        with trio.fail_after(60):
            await host.done.wait()
        relay_ended = trio.current_time() - started
        await wait_until(lambda: host.ranks[0].done.is_set())
    assert relay_ended == pytest.approx(5)
    error = host.exit
    assert type(error) is ft.FormationTimeout
    text = str(error)
    assert "host-a" in text
    assert "1/3 local ranks connected" in text
    assert "missing [1, 2]" in text
    assert "1 rejected connection(s)" in text
    assert "HMAC verification failed" in text
    # It never dialed the coordinator, and its connected rank was let go.
    assert all(conn.name != COORD for conn in memory_network.connections)
    assert isinstance(host.ranks[0].outcome, ft.CoordinatorLost)


async def test_relay_survives_a_local_rank_dying_and_the_others_keep_receiving(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    hosts = {"host-a": [0, 1, 2], "host-b": [3]}
    rec = Recorder()
    async with open_local_cluster(hosts, network=memory_network, rank_main=rec) as c:
        c.kill_rank(1)  # no Exiting: its connection just ends
        await wait_until(lambda: 1 in c.coord.dead_ranks)
        (dead,) = events_of(c.coord.timeline, RankDeclaredDead)
        assert dead.rank == 1 and dead.host == "host-a"
        assert "without Exiting" in dead.reason
        rec[2].leave()  # Exiting first: never declared dead
        await wait_until(lambda: 2 in c.coord.exited_ranks)
        await trio.sleep(1)
        assert c.coord.dead_ranks == frozenset({1})
        assert [ev.rank for ev in events_of(c.coord.timeline, RankExited)] == [2]
        result = await c.coord.broadcast_control(SetGlobalStep(global_step=5))
        assert result.delivered == frozenset({0, 3})
        assert "host-a" not in c.relay_exits
        assert not events_of(c.coord.timeline, RelayLost)
    assert rec[0].received == [DeclareDead(rank=1), SetGlobalStep(global_step=5), Shutdown()]
    assert 1 not in c.outcomes  # killed: it never ended on its own
    assert c.outcomes[2] == "left"


async def test_relay_ends_with_all_ranks_exited_when_its_last_rank_leaves(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    hosts = {"host-a": [0], "host-b": [1, 2]}
    rec = Recorder()
    async with open_local_cluster(hosts, network=memory_network, rank_main=rec) as c:
        rec[1].leave()
        await wait_until(lambda: 1 in c.coord.exited_ranks)
        rec[2].leave()
        await wait_until(lambda: "host-b" in c.relay_exits)
        assert c.relay_exits["host-b"] == ft.RelayExit("all ranks exited")
        await wait_until(lambda: bool(events_of(c.coord.timeline, RelayLost)))
        await trio.sleep(1)
        # Both said Exiting: neither the last RankExit nor the relay's EOF makes them dead.
        assert c.coord.exited_ranks == frozenset({1, 2})
        assert c.coord.dead_ranks == frozenset()
        assert c.coord.live_ranks == frozenset({0})
    assert rec[0].received == [Shutdown()]


async def test_relay_forwards_the_last_ranks_exit_before_it_ends(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    """Every local rank's EOF sends RankExit, the last one's included (SPEC §5)."""
    hosts = {"host-a": [0], "host-b": [1, 2]}
    async with open_local_cluster(hosts, network=memory_network, rank_main=Recorder()) as c:
        c.kill_rank(1)
        await wait_until(lambda: 1 in c.coord.dead_ranks)
        c.kill_rank(2)
        await wait_until(lambda: 2 in c.coord.dead_ranks)
        reasons = {ev.rank: ev.reason for ev in events_of(c.coord.timeline, RankDeclaredDead)}
    assert "reported that rank 2's connection ended without Exiting" in reasons[2]


async def test_upstream_eof_closes_every_rank_connection(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with hosts_by_hand(memory_network, 4, {"host-a": [0, 1, 2]}) as hosts:
        salt, host = hosts.salt, hosts.runs["host-a"]
        side = await raw_coordinator_accept(hosts.listener, salt)
        assert side.hello.host == "host-a" and side.hello.ranks == (0, 1, 2)
        assert host.relay is not None
        await host.relay.wait_connected()
        records = [
            side.sealer.seal(wire.RecordKind.DATA, 0, wire.encode_frame(salt, Shutdown())),
            # A FANOUT that also lists rank 3, which is not local: the relay drops that part.
            side.sealer.seal(wire.RecordKind.FANOUT, 0, wire.encode_fanout(
                [1, 2, 3], wire.encode_frame(salt, SetGlobalStep(global_step=8)))),
        ]
        await side.stream.send_all(b"".join(records))
        await side.stream.send_eof()  # the coordinator goes away without Shutdown for 1 and 2
        # It still reads: the relay says goodbye for every rank, then closes.
        got: list[Any] = []
        with trio.fail_after(30):
            while (rec := await read_one_record(side.stream, side.opener)) is not None:
                got.append(rec)
        await side.stream.aclose()
        await hosts.listener.aclose()
        await wait_until(lambda: host.all_done)
    assert host.ranks[0].received == [Shutdown()]
    assert host.ranks[0].outcome == "ended"
    for rank in (1, 2):
        assert host.ranks[rank].received == [SetGlobalStep(global_step=8)]
        assert isinstance(host.ranks[rank].outcome, ft.CoordinatorLost)
        assert "without Shutdown" in str(host.ranks[rank].outcome)
    assert isinstance(host.exit, ft.RelayExit)
    control = [wire.decode_relay(r.payload) for r in got if r.kind == wire.RecordKind.CONTROL]
    exits = sorted(m.rank for m in control if isinstance(m, wire.RankExit))
    assert exits == [0, 1, 2]
    assert all(isinstance(m, wire.RankExit | wire.Liveness) for m in control)
    frames = [wire.frame_message(wire.decode_frame(salt, r.payload)) for r in got
              if r.kind == wire.RecordKind.DATA]
    # Rank 0 left cleanly after its Shutdown; the others did not get one.
    assert wire.Exiting(rank=0) in frames
    assert all(not isinstance(m, wire.Exiting) or m.rank == 0 for m in frames)


async def test_upstream_reset_ends_the_relay_and_its_ranks_see_coordinator_lost(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with hosts_by_hand(memory_network, 2, {"host-a": [0, 1]}) as hosts:
        host = hosts.runs["host-a"]
        side = await raw_coordinator_accept(hosts.listener, hosts.salt)
        assert host.relay is not None
        await host.relay.wait_connected()
        side.stream.reset()  # type: ignore[attr-defined]
        await wait_until(lambda: host.all_done)
    assert isinstance(host.exit, ft.RelayExit)
    assert not host.exit.clean
    assert "upstream" in host.exit.reason
    for run in host.ranks.values():
        assert isinstance(run.outcome, ft.CoordinatorLost)


async def test_relay_with_rank_port_on_real_loopback_tcp_forms(
) -> None:
    """``rank_listen=None`` binds 127.0.0.1 on an ephemeral port; ranks dial ``rank_address``."""
    salt = ft.SessionSalt.generate()
    net = MemoryNetwork()
    got: list[Any] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:

            async def rank(address: tuple[str, int]) -> None:
                async with ft.open_rank(address, salt=salt, rank=0, world_size=1) as ep:
                    async for msg in ep:
                        got.append(msg)

            async def relay(task_status: Any) -> None:
                async with ft.open_relay(lambda: net.connect(COORD), salt=salt, host="host-tcp",
                                         ranks=[0], world_size=1) as r:
                    assert r.rank_address[0] == "127.0.0.1"
                    task_status.started(r.rank_address)
                    await r.wait_closed()

            listener = net.listener(COORD)
            address = await nursery.start(relay)
            nursery.start_soon(rank, address)
            async with ft.open_coordinator(listener, salt=salt,
                                           config=ft.CoordinatorConfig(world_size=1)) as coord:
                await coord.send_control(0, SetGlobalStep(global_step=3))
    assert got == [SetGlobalStep(global_step=3), Shutdown()]
    net.assert_all_closed()
