"""Formation under hostile or broken peers (SPEC §4.2, §2.6): pre-auth rejects never kill the
run, authenticated contradictions fail it at once, and every stream is closed either way."""

from __future__ import annotations

from typing import Any

import pytest
import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.events import (
    FormationComplete,
    FormationFailed,
    HandshakeRejected,
    InvalidFrame,
    RelayJoined,
)
from flodl_trio.testing import MemoryNetwork, open_local_cluster

from helpers import (
    COORD,
    Recorder,
    events_of,
    failed_formation,
    live_task_names,
    start_host,
    wait_until,
)
from helpers.raw import drain_and_close, raw_relay_handshake
from helpers.streams import Relayed

SERVE = "flodl_trio.coordinator.formation.Formation.serve_connection"


def rejected_total(coord_or_timeline: Any) -> int:
    return len(events_of(coord_or_timeline, HandshakeRejected))


# ------------------------------------------------------------------ pre-auth rejects


async def test_relay_with_wrong_salt_is_rejected_and_gives_up_as_wrong_session_while_good_forms(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt, other_salt = ft.SessionSalt.generate(), ft.SessionSalt.generate()
    timeline = ft.Timeline()
    cfg = ft.CoordinatorConfig(world_size=2, formation_timeout=60)
    listener = memory_network.listener(COORD)
    async with trio.open_nursery() as nursery:

        async def coordinator() -> None:
            async with ft.open_coordinator(listener, salt=salt, config=cfg,
                                           timeline=timeline) as coord:
                assert coord.covered_ranks == frozenset({0, 1})
                assert [r.host for r in coord.relays] == ["host-good"]
                state = coord.state()
                assert sum(state["rejected_handshakes"].values()) == attempts
                assert state["phase"] == "running"

        nursery.start_soon(coordinator)
        # The bad relay (and its own rank) share a salt, but not the coordinator's.
        # A relay gives up after 3 Challenges in a row that do not verify (one every 0.5 s),
        # well before its connect_timeout.
        bad = await start_host(nursery, memory_network, "host-bad", [0], salt=other_salt,
                               world=2, relay_config=ft.RelayConfig(connect_timeout=30))
        await wait_until(lambda: bad.all_done)
        attempts = rejected_total(timeline)
        assert attempts == 3
        good = await start_host(nursery, memory_network, "host-good", [0, 1], salt=salt,
                                world=2)
    assert isinstance(bad.exit, ft.WrongSession)
    assert "salt differs" in str(bad.exit) and "host-bad" in str(bad.exit)
    assert "Challenge did not verify" in str(bad.exit.__cause__)  # the last failure, kept
    rejected = events_of(timeline, HandshakeRejected)
    assert all("mem:coordinator" in ev.peer for ev in rejected)  # numeric peers
    assert [ev.host for ev in events_of(timeline, RelayJoined)] == ["host-good"]
    assert len(events_of(timeline, FormationComplete)) == 1
    assert all(run.outcome == "ended" for run in good.ranks.values())


async def record_relay_handshake(net: MemoryNetwork, salt: ft.SessionSalt) -> bytes:
    """The bytes a real relay sends before HelloAck: control magic, then its sealed Hello."""
    sent: list[bytes] = []

    class Recording(Relayed):
        async def send_all(self, data: bytes | bytearray | memoryview) -> None:
            sent.append(bytes(data))
            await self.inner.send_all(data)

    async def dial() -> trio.abc.Stream:
        return Recording(await net.connect("recording-coordinator"))

    listener = net.listener("recording-coordinator")
    cfg = ft.CoordinatorConfig(world_size=1, formation_timeout=10)
    async with trio.open_nursery() as nursery:

        async def relay() -> None:
            async with ft.open_relay(dial, salt=salt, host="host-rec", ranks=[0], world_size=1,
                                     rank_listen=net.listener("relay:host-rec")) as r:
                await r.wait_closed()

        async def rank() -> None:
            async with ft.open_rank(lambda: net.connect("relay:host-rec"), salt=salt, rank=0,
                                    world_size=1) as ep:
                async for _ in ep:
                    pass

        nursery.start_soon(relay)
        nursery.start_soon(rank)
        async with ft.open_coordinator(listener, salt=salt, config=cfg):
            pass
    magic, hello = sent[0], sent[1]
    assert magic == wire.CHANNEL_MAGIC_CONTROL
    assert hello[:4] == wire.RECORD_MAGIC.to_bytes(4, "little")
    assert len(hello) > wire.RECORD_HEADER_LEN
    return magic + hello


async def test_connection_closing_after_every_prefix_of_a_valid_handshake_never_fails_formation(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    recorded = await record_relay_handshake(memory_network, salt)
    # magic (4) + record header (25) + a CBOR Hello of a few dozen bytes.
    assert 4 + wire.RECORD_HEADER_LEN + 20 < len(recorded) < 200
    timeline = ft.Timeline()
    cfg = ft.CoordinatorConfig(world_size=2, formation_timeout=600, handshake_timeout=5)
    listener = memory_network.listener(COORD)
    started = trio.current_time()
    async with trio.open_nursery() as nursery:

        async def replay_prefixes(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            # The replay follows the protocol's turns: magic, read the Challenge, then the rest.
            for k in range(len(recorded) + 1):
                stream = await memory_network.connect(COORD)
                await stream.send_all(recorded[:min(k, 4)])
                if k > 4:
                    assert await stream.receive_some(65536)  # the Challenge
                    await stream.send_all(recorded[4:k])
                await stream.aclose()
                # Rejected once its handshake task is gone (rejects are counted, and only a
                # rate-limited few become events).
                await wait_until(lambda: live_task_names().count(SERVE) == 0)
            task_status.started()

        async def coordinator() -> None:
            async with ft.open_coordinator(listener, salt=salt, config=cfg,
                                           timeline=timeline) as coord:
                assert coord.covered_ranks == frozenset({0, 1})
                state = coord.state()
                assert sum(state["rejected_handshakes"].values()) == len(recorded) + 1
                # The whole recorded Hello replayed under a fresh coordinator nonce fails its
                # MAC.
                assert state["rejected_handshakes"]["bad mac"] == 1
                # Every rejected connection's task is gone: only the joined relay's remains.
                assert live_task_names().count(SERVE) == 1
                assert coord.state()["phase"] == "running"

        nursery.start_soon(coordinator)
        await nursery.start(replay_prefixes)
        assert not events_of(timeline, FormationFailed)
        host = await start_host(nursery, memory_network, "host-a", [0, 1], salt=salt, world=2)
    # No prefix waited for handshake_timeout: each close was noticed at once.
    assert trio.current_time() - started < 1
    reasons = [ev.reason for ev in events_of(timeline, HandshakeRejected)]
    assert reasons[0].startswith("eof before magic")
    assert "bad mac x1" in reasons[-1]  # the summary at the end of formation
    assert all(run.outcome == "ended" for run in host.ranks.values())
    memory_network.assert_all_closed()


async def test_connection_that_sends_nothing_is_rejected_at_handshake_timeout(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    timeline = ft.Timeline()
    cfg = ft.CoordinatorConfig(world_size=1, formation_timeout=60, handshake_timeout=7)
    listener = memory_network.listener(COORD)
    async with trio.open_nursery() as nursery:

        async def coordinator() -> None:
            async with ft.open_coordinator(listener, salt=salt, config=cfg, timeline=timeline):
                pass

        nursery.start_soon(coordinator)
        silent = await memory_network.connect(COORD)
        started = trio.current_time()
        await wait_until(lambda: rejected_total(timeline) == 1)
        assert trio.current_time() - started == pytest.approx(7, abs=0.05)
        assert await silent.receive_some(100) == b""  # the coordinator closed it
        await silent.aclose()
        await start_host(nursery, memory_network, "host-a", [0], salt=salt, world=1)
    (rejected,) = events_of(timeline, HandshakeRejected)
    assert rejected.reason.startswith("timeout")


async def test_strict_formation_makes_a_pre_auth_reject_fatal(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    cfg = ft.CoordinatorConfig(world_size=2, formation_timeout=60, strict_formation=True)
    listener = memory_network.listener(COORD)
    timeline = ft.Timeline()
    async with trio.open_nursery() as nursery:

        async def scanner() -> None:
            stream = await memory_network.connect(COORD)
            await stream.send_all(b"SSH-2.0-scanner\r\n")
            await stream.receive_some(100)
            await stream.aclose()

        nursery.start_soon(scanner)
        error, took = await failed_formation(
            ft.open_coordinator(listener, salt=ft.SessionSalt.generate(), config=cfg,
                                timeline=timeline), ft.FormationError,
            why="strict formation must fail on the first reject")
    assert took == pytest.approx(0)
    text = str(error)
    assert "strict formation" in text
    assert "bad magic" in text
    assert "0/2 ranks covered" in text
    assert len(events_of(timeline, FormationFailed)) == 1


async def test_1100_magic_and_close_connections_do_not_fail_formation_and_are_summarised(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    # FT/1 failed formation past max_rejected_handshakes=1024: 1,100 connections that sent
    # the public control magic and closed killed it without the salt.
    cfg = ft.CoordinatorConfig(world_size=2, formation_timeout=60)
    listener = memory_network.listener(COORD)
    timeline = ft.Timeline()
    salt = ft.SessionSalt.generate()
    flood = 1100
    async with trio.open_nursery() as nursery:

        async def scanners() -> None:
            for _ in range(flood):
                stream = await memory_network.connect(COORD)
                await stream.send_all(wire.CHANNEL_MAGIC_CONTROL)
                await stream.aclose()
            await start_host(nursery, memory_network, "host-a", [0, 1], salt=salt, world=2)

        nursery.start_soon(scanners)
        async with ft.open_coordinator(listener, salt=salt, config=cfg,
                                       timeline=timeline) as coord:
            assert coord.covered_ranks == frozenset({0, 1})
            rejects = coord.state()["rejected_handshakes"]
    assert sum(rejects.values()) == flood
    assert set(rejects) <= {"eof before hello", "connection error"}
    # A handful of events (the first few, then summaries with the folded counts), not 1,100.
    events = events_of(timeline, HandshakeRejected)
    assert 1 <= len(events) <= 10
    assert f"{flood - 5} more not logged" in events[-1].reason
    assert len(events_of(timeline, FormationComplete)) == 1


# ------------------------------------------------------------------ authenticated contradictions


async def form_with_raw_relays(
    net: MemoryNetwork, world: int, hellos: list[tuple[str, list[int]]],
    model_sigs: list[dict[str, bytes]] | None = None,
) -> tuple[ft.FormationError, list[bool], ft.Timeline]:
    """Raw relays send these Hellos (with these model signatures, one dict per Hello) one after
    the other; formation must fail."""
    salt = ft.SessionSalt.generate()
    timeline = ft.Timeline()
    cfg = ft.CoordinatorConfig(world_size=world, formation_timeout=60)
    listener = net.listener(COORD)
    acked: list[bool] = []
    async with trio.open_nursery() as nursery:

        async def raw_relays() -> None:
            for i, (host, ranks) in enumerate(hellos):
                sigs = model_sigs[i] if model_sigs is not None else None
                raw = await raw_relay_handshake(await net.connect(COORD), salt, host, ranks,
                                                world_size=world, model_sigs=sigs)
                acked.append(raw.acked)
                nursery.start_soon(drain_and_close, raw.stream)

        nursery.start_soon(raw_relays)
        error, took = await failed_formation(
            ft.open_coordinator(listener, salt=salt, config=cfg, timeline=timeline),
            ft.FormationError, why="a contradicting Hello must fail formation")
    assert took == pytest.approx(0)  # "at once": no deadline was waited for
    assert len(events_of(timeline, FormationFailed)) == 1
    return error, acked, timeline


async def test_rank_already_announced_by_another_relay_fails_formation_at_once(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    error, acked, timeline = await form_with_raw_relays(
        memory_network, 4, [("host-a", [0, 1]), ("host-b", [1, 2, 3])])
    assert acked == [True, False]
    text = str(error)
    assert "rank 1 was already announced by relay 'host-a'" in text
    assert "relay 'host-b'" in text
    assert "2/4 ranks covered" in text
    assert [ev.host for ev in events_of(timeline, RelayJoined)] == ["host-a"]


async def test_rank_announced_twice_in_one_hello_fails_formation_at_once(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    error, acked, _ = await form_with_raw_relays(memory_network, 3, [("host-a", [0, 1, 1])])
    assert acked == [False]
    assert "rank 1 is announced twice in one Hello" in str(error)
    assert "0/3 ranks covered" in str(error)


async def test_rank_out_of_range_fails_formation_at_once(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    error, acked, _ = await form_with_raw_relays(memory_network, 4, [("host-a", [0, 7])])
    assert acked == [False]
    text = str(error)
    assert "rank 7 is out of range for world_size 4" in text
    assert "host-a" in text


async def test_empty_rank_list_fails_formation_at_once(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    error, acked, _ = await form_with_raw_relays(memory_network, 2, [("host-empty", [])])
    assert acked == [False]
    assert "empty rank list" in str(error)


async def test_open_relay_refuses_duplicate_and_out_of_range_ranks_before_any_io() -> None:
    salt = ft.SessionSalt.generate()
    dialed: list[int] = []

    async def dial() -> trio.abc.Stream:
        dialed.append(1)
        raise AssertionError("must not dial")

    with pytest.raises(ft.ConfigError, match="duplicates"):
        async with ft.open_relay(dial, salt=salt, host="h", ranks=[0, 0], world_size=2):
            pytest.fail("unreachable")
    with pytest.raises(ft.ConfigError, match=r"rank 2 is outside \[0, 2\)"):
        async with ft.open_relay(dial, salt=salt, host="h", ranks=[0, 2], world_size=2):
            pytest.fail("unreachable")
    with pytest.raises(ft.ConfigError, match="at least one rank"):
        async with ft.open_relay(dial, salt=salt, host="h", ranks=[], world_size=2):
            pytest.fail("unreachable")
    assert dialed == []


# ------------------------------------------------------------------ readers: who speaks for whom


async def test_timing_message_for_a_rank_of_another_host_is_dropped(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    hosts = {"host-a": [0, 1], "host-b": [2, 3]}
    async with open_local_cluster(hosts, network=memory_network, rank_main=Recorder()) as c:
        ep = c.ranks[0]
        forged = wire.Batch(rank=2, batch_ms=1.0, data_ms=0.5, step_count=99, param_norm=None,
                            batch_loss=0.25, sync_divergence=None)
        genuine = wire.Batch(rank=0, batch_ms=1.0, data_ms=0.5, step_count=100,
                             param_norm=None, batch_loss=0.25, sync_divergence=None)
        await ep.send(forged)
        await ep.send(genuine)  # same link, so it arrives after the forged one
        seen: list[wire.TimingMsg] = []
        with trio.fail_after(10):
            async for msg in c.coord.timing:
                seen.append(msg)
                if msg == genuine:
                    break
        assert forged not in seen
        assert all(not (isinstance(m, wire.Batch) and m.rank == 2) for m in seen)
        invalid = events_of(c.coord.timeline, InvalidFrame)
        assert len(invalid) == 1
        assert invalid[0].rank == 2 and invalid[0].host == "host-a"
        assert "does not carry" in invalid[0].reason
        # Dropping the frame did not hurt anyone.
        assert c.coord.live_ranks == frozenset(range(4))


async def test_relays_whose_model_signatures_differ_fail_formation_naming_hosts_and_names(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    sigs_a = {"encoder": b"\x01" * 32, "head": b"\x02" * 32}
    sigs_b = {"encoder": b"\x01" * 32, "head": b"\x0f" * 32}
    error, acked, _ = await form_with_raw_relays(
        memory_network, 3, [("host-a", [0, 1]), ("host-b", [2])], model_sigs=[sigs_a, sigs_b])
    text = str(error)
    assert "model signature mismatch" in text
    assert "'host-a'" in text and "'host-b'" in text and "'head'" in text
    assert "'encoder'" not in text  # only the names that differ
    assert acked == [True, False]  # host-b, a host with another model build, never joined
    memory_network.assert_all_closed()
