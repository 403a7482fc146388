"""A durable coordinator lost in every way (EOF, reset, a forged record, a write stall) is ridden
out; the coordinator target is resolved again on each re-dial; a coordinator that is not durable,
or a grace of 0, is lost exactly as before (issue 22). The durable coordinator is scripted
(``durable_peer``), over the in-memory network under MockClock."""

from __future__ import annotations

import math
from typing import Any

import pytest
import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.testing import MemoryNetwork

from helpers import wait_until
from helpers.durable_peer import RANK_CFG, accept_leg, durably_joined, send_snapshots
from helpers.raw import read_one_record


@pytest.mark.parametrize("how", ["eof", "reset", "forged record", "write stall"])
async def test_every_way_of_losing_a_durable_coordinator_is_ridden_out(
    autojump_clock: trio.abc.Clock, how: str
) -> None:
    # A 64-byte buffer that the first coordinator never reads: the relay's writes stall.
    net = MemoryNetwork(buffer_size=64)
    async with durably_joined(net, write_stall_timeout=2) as joined:
        if how == "write stall":
            # The ranks' frames fill the 64-byte buffer at once (their heartbeats no longer
            # do: the relay coalesces them into one Liveness record per second, issue 23).
            await send_snapshots(joined.host, 0, [1, 2, 3])
        if how == "eof":
            await joined.first.stream.aclose()
        elif how == "reset":
            joined.first.stream.reset()
        elif how == "forged record":
            forger = wire.RecordSealer(b"k" * 32, wire.COORD_TO_RELAY)
            await joined.first.stream.send_all(forger.seal(wire.RecordKind.DATA, 0, b"x"))
        lost_at = trio.current_time()
        leg = await joined.next_leg(generation=2)
        assert leg.received.resumed
        elapsed = trio.current_time() - lost_at
        assert (2 if how == "write stall" else 0) <= elapsed < (3 if how == "write stall" else 1)
        await wait_until(lambda: joined.relay.reconnects == 1)
        await joined.finish(leg)
        if how != "reset":
            await joined.first.stream.aclose()
    net.assert_all_closed()
    assert all(run.outcome == "ended" for run in joined.host.ranks.values()), joined.host.ranks
    assert isinstance(joined.host.exit, ft.RelayExit) and joined.host.exit.clean


async def test_the_coordinator_target_is_resolved_again_on_every_attempt(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    # The coordinator moves to another address; the store that says where is briefly down.
    salt = ft.SessionSalt.generate()
    old, new = memory_network.listener("coord-old"), memory_network.listener("coord-new")
    calls: list[str] = []

    async def resolve() -> trio.abc.Stream:
        calls.append("call")
        if len(calls) == 1:
            return await memory_network.connect("coord-old")
        if len(calls) == 2:
            raise ft.StoreUnavailable("etcd at 127.0.0.1:2379: no leader")
        return await memory_network.connect("coord-new")

    done = trio.Event()
    exit_: list[Any] = []

    async def relay_task() -> None:
        async with ft.open_relay(resolve, salt=salt, host="host-a", ranks=[0], world_size=1,
                                 rank_listen=memory_network.listener("relay:host-a"),
                                 config=ft.RelayConfig(coord_liveness_timeout=math.inf)
                                 ) as relay:
            async with ft.open_rank(lambda: memory_network.connect("relay:host-a"), salt=salt,
                                    rank=0, world_size=1, config=RANK_CFG) as ep:
                exit_.append(relay)
                async for msg in ep:
                    exit_.append(msg)
            exit_.append(await relay.wait_closed())
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay_task)
        first = await accept_leg(old, salt, generation=1)
        assert first is not None
        await first.stream.aclose()
        leg = await accept_leg(new, salt, generation=2)
        assert leg is not None and leg.received.resumed
        await wait_until(lambda: exit_[0].reconnects == 1)
        await leg.end_run([0])
        await done.wait()
        await old.aclose()
        await new.aclose()
    assert len(calls) == 3
    assert exit_[1:-1] == [wire.CoordinatorReconnecting(
        host="host-a", detail=exit_[1].detail), wire.CoordinatorResumed(2), wire.Shutdown()]
    assert exit_[-1].clean


# ---------------------------------------------------------------- as before


@pytest.mark.parametrize(("generation", "grace"), [(None, 30.0), (3, 0.0)],
                         ids=["no-store", "grace-0"])
async def test_a_coordinator_that_is_not_ridden_out_is_lost_as_before(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, generation: int | None,
    grace: float
) -> None:
    async with durably_joined(memory_network, generation=generation,
                              coordinator_grace=grace) as joined:
        assert joined.relay.generation == (generation or 0)
        await joined.first.stream.aclose()
        lost_at = trio.current_time()
        await wait_until(lambda: joined.host.all_done, limit=30)
        assert trio.current_time() - lost_at < 2
        await joined.listener.aclose()
    for run in joined.host.ranks.values():
        assert run.received == []
        assert isinstance(run.outcome, ft.CoordinatorLost)
        assert "without Shutdown" in str(run.outcome)
    assert isinstance(joined.host.exit, ft.RelayExit) and not joined.host.exit.clean
    assert joined.relay.reconnects == 0


async def test_a_durable_coordinators_goodbye_ends_the_relay_cleanly_without_a_redial(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with durably_joined(memory_network) as joined:
        await joined.finish(joined.first)
    assert isinstance(joined.host.exit, ft.RelayExit) and joined.host.exit.clean
    assert joined.relay.reconnects == 0
    for run in joined.host.ranks.values():
        assert run.received == [wire.Shutdown()] and run.outcome == "ended"


async def test_ranks_that_leave_while_the_coordinator_is_away_are_reported_to_the_resumed_one(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with durably_joined(memory_network) as joined:
        await joined.first.stream.aclose()
        await wait_until(lambda: joined.relay.reconnecting is not None)
        for run in joined.host.ranks.values():
            run.leave()  # each says Exiting and closes its link
        await wait_until(lambda: all(run.done.is_set() for run in joined.host.ranks.values()))
        leg = await joined.next_leg(generation=2)
        got: list[Any] = []
        with trio.fail_after(30):  # everything, then the relay's half-close
            while (rec := await read_one_record(leg.stream, leg.opener)) is not None:
                got.append(rec)
        await leg.stream.aclose()
        await joined.listener.aclose()
        await wait_until(lambda: joined.host.all_done)
    exiting = [wire.frame_message(wire.decode_frame(joined.salt, r.payload)) for r in got
               if r.kind == wire.RecordKind.DATA]
    exits = [m for m in (wire.decode_relay(r.payload) for r in got
                         if r.kind == wire.RecordKind.CONTROL)
             if not isinstance(m, wire.Liveness)]  # the ranks' coalesced heartbeats
    assert sorted(int(m.rank) for m in exiting if isinstance(m, wire.Exiting)) == [0, 1]
    assert sorted(int(m.rank) for m in exits) == [0, 1]
    assert all(isinstance(m, wire.RankExit) for m in exits)
    assert isinstance(joined.host.exit, ft.RelayExit) and joined.host.exit.clean
    assert joined.host.exit.reason == "all ranks exited"
