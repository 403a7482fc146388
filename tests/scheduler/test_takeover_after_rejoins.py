"""A scheduler that takes a run over (a coordinator adopted the session, or its previous
scheduler was cancelled) while ranks that came back from a death wait for the next epoch, and
every member of the current epoch dies before or during the anchoring sync (issue 35's nemesis:
``ClusterFailure ALL_RANKS_LOST ... no live rank left in epoch 3 of 17`` with ranks 0 and 1
live). The ranks that are live take the epoch over, as outside a resume, and every epoch is
still covered exactly once. Simulated hosts over the in-memory transport under MockClock."""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, example, given, settings, strategies as st

import flodl_trio as ft
from flodl_trio.events import Note
from flodl_trio.scheduler import SyncScheduler
from flodl_trio.testing import EventLog, MemoryNetwork

from helpers import COORD, wait_until
from helpers.sims import SimHost, batches, start_sim_host

BATCH = 4
SAMPLES = 160  # 10 batches a rank per epoch: time for a host to die and come back in one
EPOCHS = 3


def noted(log: EventLog, what: str) -> list[dict[str, Any]]:
    return [ev.fields for _, ev in log.of(Note) if ev.what == what]


def sim_truth(hosts: list[SimHost], epoch: int) -> Counter[int]:
    """How many times each sample of ``epoch`` was synced by the ranks (every incarnation)."""
    return Counter(i for h in hosts for rec in h.records.values()
                   for i in rec.synced_samples(epoch))


@pytest.mark.parametrize("when", ["before the takeover", "during the anchoring sync"])
async def test_live_ranks_take_the_epoch_over_when_its_members_die_around_a_takeover(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, when: str
) -> None:
    salt = ft.SessionSalt.generate()
    log = EventLog()
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=60, heartbeat_timeout=30)
    settings: dict[str, Any] = {"total_samples": SAMPLES, "batch_size": BATCH,
                                "num_epochs": EPOCHS}
    async with trio.open_nursery() as nursery:
        a = start_sim_host(nursery, memory_network, "host-a", [0, 1], salt=salt, world=4,
                           sim_args=batches(BATCH))
        b = start_sim_host(nursery, memory_network, "host-b", [2, 3], salt=salt, world=4,
                           sim_args=batches(BATCH))
        async with ft.open_coordinator(memory_network.listener(COORD), salt=salt, config=cfg,
                                       timeline=log) as coord:
            first = SyncScheduler(coord, **settings)
            with trio.CancelScope() as first_scope:
                async def a_dies_and_comes_back() -> None:
                    await wait_until(lambda: a.worked_in(1), limit=60)
                    await a.kill_and_wait()
                    await wait_until(lambda: coord.dead_ranks == {0, 1}, limit=5)
                    back.append(start_sim_host(nursery, memory_network, "host-a", [0, 1],
                                               salt=salt, world=4, sim_args=batches(BATCH)))
                    await wait_until(lambda: coord.live_ranks == {0, 1, 2, 3}, limit=3)
                    first_scope.cancel()  # the scheduler dies; its run is taken over

                back: list[SimHost] = []
                nursery.start_soon(a_dies_and_comes_back)
                await first.run()
            assert len(first.coverage) == 1, "epoch 1 closed before the takeover"
            if when == "before the takeover":
                await b.kill_and_wait()
                await wait_until(lambda: coord.dead_ranks == {2, 3}, limit=5)

            async def b_dies_at_the_anchor(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                async with log.subscribe() as seen:
                    task_status.started()
                    async for stamped in seen:  # the resumed scheduler's first sync: the anchor
                        if isinstance(stamped.event, Note) and stamped.event.what == "sync":
                            await b.kill_and_wait()
                            return

            if when == "during the anchoring sync":
                await nursery.start(b_dies_at_the_anchor)
            second = SyncScheduler(coord, **settings)
            with trio.fail_after(600):
                summary = await second.run()
        await wait_until(lambda: back[0].done.is_set(), limit=10)
        nursery.cancel_scope.cancel()

    assert summary.resumed and summary.first_epoch == 1
    assert summary.epochs_completed == EPOCHS
    assert set(summary.deaths) == {2, 3}
    coverage = first.coverage + second.coverage
    assert [c.epoch for c in coverage] == list(range(EPOCHS))
    assert all(c.exactly_once for c in coverage), coverage
    # The ranks that came back took epoch 1 over (a plan for it, then epoch 2's).
    for rank in (0, 1):
        started = [m.plan.epoch for m in back[0].records[rank].of_type(ft.wire.StartEpoch)]
        assert started == [1, 2], (rank, started)
    assert noted(log, "ranks_enlisted") == [{"ranks": [0, 1], "epoch": 1}]
    # What the ranks synced is the data set exactly once, each epoch, every incarnation.
    for epoch in range(EPOCHS):
        assert sim_truth([a, b, *back], epoch) == Counter(range(SAMPLES)), epoch
    assert isinstance(back[0].exit, ft.RelayExit) and back[0].exit.clean


# ---------------------------------------------------------------------------- the property


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(a_dies_at=st.floats(0.05, 0.6), a_away=st.sampled_from([0.0, 0.05, 0.3]),
       takeover_after=st.floats(0.0, 0.3), outage=st.sampled_from([0.0, 0.02, 0.2]),
       b_dies=st.sampled_from(["never", "in the outage", "at the anchor", "later"]),
       b_dies_after=st.floats(0.0, 0.3), b_back=st.booleans(),
       b_ms=st.sampled_from([30.0, 50.0, 80.0]), process_group=st.booleans())
# Host b restarted in the outage: at the resume its new processes look like the share holders
# until their anchoring SyncAck; then every rank takes the epoch over, b's with nothing of the
# remainder (their earlier process's settled share was sent again: done twice).
@example(a_dies_at=0.46875, a_away=0.05, takeover_after=0.25, outage=0.02,
         b_dies="in the outage", b_dies_after=0.0, b_back=True, b_ms=50.0, process_group=False)
def test_whenever_hosts_die_and_come_back_around_a_takeover_every_epoch_is_covered_once(
        a_dies_at: float, a_away: float, takeover_after: float, outage: float, b_dies: str,
        b_dies_after: float, b_back: bool, b_ms: float, process_group: bool) -> None:
    """Host a dies at some point and comes back; the scheduler is taken over a while after;
    host b dies (or not) in the outage, at the anchoring sync or later, and comes back (or
    not). The run completes and each epoch's accounting, and what the ranks synced, is the data
    set exactly once."""
    trio.run(functools.partial(_around_a_takeover, a_dies_at, a_away, takeover_after, outage,
                               b_dies, b_dies_after, b_back, b_ms, process_group),
             clock=trio.testing.MockClock(autojump_threshold=0))


async def _around_a_takeover(a_dies_at: float, a_away: float, takeover_after: float,
                             outage: float, b_dies: str, b_dies_after: float, b_back: bool,
                             b_ms: float, process_group: bool) -> None:
    net = MemoryNetwork()
    salt = ft.SessionSalt.generate()
    log = EventLog()
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=60, heartbeat_timeout=30)
    settings_: dict[str, Any] = {"total_samples": 96, "batch_size": BATCH, "num_epochs": EPOCHS,
                                 "process_group": process_group, "reform_timeout": 5.0}
    hosts: list[SimHost] = []

    def host(name: str, ranks: list[int], ms: float) -> SimHost:
        hosts.append(start_sim_host(nursery, net, name, ranks, salt=salt, world=4,
                                    sim_args=batches(BATCH, ms)))
        return hosts[-1]

    async def b_dies_now(coord: ft.Coordinator, b: SimHost) -> None:
        await b.kill_and_wait()
        await wait_until(lambda: {2, 3} <= coord.dead_ranks, limit=5)
        if b_back:
            await trio.sleep(0.05)
            host("host-b", [2, 3], b_ms)

    async with trio.open_nursery() as nursery:
        a, b = host("host-a", [0, 1], 50.0), host("host-b", [2, 3], b_ms)
        async with ft.open_coordinator(net.listener(COORD), salt=salt, config=cfg,
                                       timeline=log) as coord:
            first = SyncScheduler(coord, **settings_)
            with trio.CancelScope() as first_scope:
                async def a_dies_and_comes_back() -> None:
                    await trio.sleep(a_dies_at)
                    await a.kill_and_wait()
                    await wait_until(lambda: {0, 1} <= coord.dead_ranks, limit=5)
                    await trio.sleep(a_away)
                    host("host-a", [0, 1], 50.0)
                    await wait_until(lambda: coord.rejoins.get(1) == 1
                                     and {0, 1} <= coord.live_ranks, limit=5)
                    await trio.sleep(takeover_after)
                    first_scope.cancel()

                nursery.start_soon(a_dies_and_comes_back)
                await first.run()
            if not first_scope.cancel_called:  # the run ended before the takeover
                nursery.cancel_scope.cancel()
                await trio.sleep_forever()
            if b_dies == "in the outage":
                await b_dies_now(coord, b)
            await trio.sleep(outage)

            async def b_dies_in_the_run(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                async with log.subscribe() as seen:
                    task_status.started()
                    async for stamped in seen:  # the resumed scheduler's first sync
                        if isinstance(stamped.event, Note) and stamped.event.what == "sync":
                            break
                await trio.sleep(b_dies_after if b_dies == "later" else 0.0)
                await b_dies_now(coord, b)

            if b_dies in ("at the anchor", "later"):
                await nursery.start(b_dies_in_the_run)
            second = SyncScheduler(coord, **settings_)
            with trio.fail_after(600):
                summary = await second.run()
        nursery.cancel_scope.cancel()

    if not first_scope.cancel_called:
        return  # the run ended before the takeover: the other tests' subject
    assert summary.resumed and summary.epochs_completed == EPOCHS
    coverage = first.coverage + second.coverage
    assert [c.epoch for c in coverage] == list(range(EPOCHS))
    assert all(c.exactly_once for c in coverage), coverage
    for epoch in range(EPOCHS):
        assert sim_truth(hosts, epoch) == Counter(range(96)), epoch
