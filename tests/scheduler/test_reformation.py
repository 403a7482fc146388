"""The scheduler's process-group re-formation (issue 16): RequestNewNcclId to one survivor, its
NewNcclIdGenerated, NewNcclSession to each survivor; simulated ranks over an in-memory cluster
under MockClock, including a survivor that dies during re-formation."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import trio

import flodl_trio as ft
from flodl_trio.local_cluster import layout
from flodl_trio.scheduler import ReformationError, RunSummary, SyncScheduler
from flodl_trio.scheduler._epoch_math import coverage, processed_ranges, unprocessed_ranges
from flodl_trio.scheduler._reformation import Reformation
from flodl_trio.sim import SimRecord, SimulatedCrash
from flodl_trio.testing import MemoryNetwork
from flodl_trio.wire import NewNcclSession, RequestNewNcclId, StartEpoch

from helpers.sims import SimCluster, sim_cluster


def args(**per_rank: dict[int, Any]) -> Callable[[int], dict[str, Any]]:
    def make(rank: int) -> dict[str, Any]:
        kw: dict[str, Any] = {"batch_size": 4, "batch_ms": 10.0 + rank, "seed": rank}
        for name, values in per_rank.items():
            if rank in values:
                kw[name] = values[rank]
        return kw
    return make


async def run(c: SimCluster, **kw: Any) -> tuple[RunSummary, SyncScheduler]:
    scheduler = SyncScheduler(c.coord, total_samples=96, batch_size=4, num_epochs=2, **kw)
    with trio.fail_after(600):  # virtual time
        return await scheduler.run(), scheduler


def sessions(rec: SimRecord) -> list[tuple[bytes, int, int]]:
    return [(m.uid, int(m.new_rank), int(m.new_world_size)) for m in rec.of_type(NewNcclSession)]


def assert_covered_once(records: list[SimRecord], epochs: int) -> None:
    for epoch in range(epochs):
        counts = Counter(i for rec in records for i in rec.synced_samples(epoch))
        assert sorted(counts) == list(range(96)) and max(counts.values()) == 1, epoch


async def test_first_session_before_any_epoch_and_a_new_one_among_survivors_of_a_dead_host(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    # host-1 (ranks 2, 3) dies mid-epoch: both its ranks crash after 3 batches
    sims = args(fail_after_batches={2: 3, 3: 3})
    async with sim_cluster(memory_network, layout(2, 2), sims) as c:
        summary, scheduler = await run(c, process_group=True, reform_timeout=5)
    records = [c.sims[r].record for r in range(4)]
    assert isinstance(c.outcomes[2], SimulatedCrash) and isinstance(c.outcomes[3], SimulatedCrash)
    # the first session: rank 0 asked, every rank joins it before its first StartEpoch
    first_uid = b"sim://rank-0/1"
    for r, rec in enumerate(records):
        assert sessions(rec)[0] == (first_uid, r, 4)
        kinds = [type(m) for m in rec.received]
        assert kinds.index(NewNcclSession) < kinds.index(StartEpoch)
    # after the deaths the survivors' last session is theirs alone; rank 0 serves it
    assert sessions(records[0])[-1][1:] == (0, 2) and sessions(records[1])[-1][1:] == (1, 2)
    assert sessions(records[0])[-1][0] == sessions(records[1])[-1][0] != first_uid
    assert sessions(records[2]) == [(first_uid, 2, 4)]  # the first to die
    # rank 3 died later: it may have seen a session of the three then alive, never a later one
    assert all(ws in (4, 3) for _, _, ws in sessions(records[3]))
    assert [len(rec.of_type(RequestNewNcclId)) for rec in records] == [
        len(sessions(records[0])), 0, 0, 0]  # only rank 0 was ever asked
    assert_covered_once(records, 2)
    assert summary.epochs_completed == 2 and sorted(summary.deaths) == [2, 3]
    assert [c.exact for c in scheduler.coverage] == [True, True]
    dead_part = scheduler.coverage[0].per_rank
    # 3 batches of 4, then the crash: it is credited only with what it synced
    assert len(records[2].samples(0)) == 12
    assert dead_part.get(2, 0) == len(records[2].synced_samples(0)) < 12
    assert sorted(scheduler.coverage[1].per_rank) == [0, 1]  # epoch 1 planned over the survivors


async def test_asked_survivor_dying_during_reformation_hands_the_request_to_the_next(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    # rank 3 crashes mid-epoch; rank 0, asked for the new id, crashes instead of answering
    sims = args(fail_after_batches={3: 2}, fail_on_new_nccl_id={0: 2})
    async with sim_cluster(memory_network, layout(2, 2), sims) as c:
        summary, scheduler = await run(c, process_group=True, reform_timeout=5)
    records = [c.sims[r].record for r in range(4)]
    assert isinstance(c.outcomes[0], SimulatedCrash)
    assert len(records[1].of_type(RequestNewNcclId)) == 1
    uid = sessions(records[1])[-1][0]
    assert uid == b"sim://rank-1/1"
    assert sessions(records[1])[-1] == (uid, 0, 2) and sessions(records[2])[-1] == (uid, 1, 2)
    assert_covered_once(records, 2)
    assert sorted(summary.deaths) == [0, 3] and summary.epochs_completed == 2
    assert [cov.exact for cov in scheduler.coverage] == [True, True]


async def test_asked_rank_that_never_answers_fails_the_run_at_reform_timeout(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    sims = args(fail_on_new_nccl_id={0: 1}, fail_mode={0: "hang"})
    async with sim_cluster(memory_network, layout(1, 2), sims) as c:
        started = trio.current_time()
        with pytest.raises(ReformationError) as excinfo:
            await run(c, process_group=True, reform_timeout=5)
        elapsed = trio.current_time() - started
    message = str(excinfo.value)
    assert "the first session" in message
    assert "rank 0 was asked and did not answer within reform_timeout=5s" in message
    assert 5 <= elapsed < 6
    assert c.sims[1].record.of_type(StartEpoch) == []  # no epoch without a group


async def test_without_process_group_no_rank_is_asked_for_a_session(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    async with sim_cluster(memory_network, layout(1, 3), args(fail_after_batches={2: 2})) as c:
        summary, scheduler = await run(c)
    records = [c.sims[r].record for r in range(3)]
    assert all(rec.of_type(RequestNewNcclId) == [] and sessions(rec) == [] for rec in records)
    assert_covered_once(records, 2)
    assert summary.epochs_completed == 2
    assert [cov.exact for cov in scheduler.coverage] == [True, True]


def test_reformation_names_every_asked_rank_when_none_is_left() -> None:
    state = Reformation(7.0)
    assert state.begin([0, 1], 0.0, "after rank(s) [2] left") == 0
    assert state.on_gone([(0, "relay host-a lost")], [1]) == 1
    with pytest.raises(ReformationError) as excinfo:
        state.on_gone([(1, "heartbeat stale (>30s)")], [])
    message = str(excinfo.value)
    assert "rank 0 was asked and was declared dead (relay host-a lost)" in message
    assert "rank 1 was asked and was declared dead (heartbeat stale (>30s))" in message
    assert "no live rank is left to ask" in message and "after rank(s) [2] left" in message
    assert not state.active


def test_invalid_reform_timeout_and_sim_option_are_config_errors() -> None:
    with pytest.raises(ft.ConfigError, match="fail_on_new_nccl_id"):
        from flodl_trio.sim import SimulatedRank
        SimulatedRank(object(), batch_size=1, batch_ms=1,  # type: ignore[arg-type]
                      fail_on_new_nccl_id=0)


def test_coverage_accounting_reports_overlaps_and_gaps() -> None:
    exact = coverage(0, 10, {0: [(0, 4)], 1: [(4, 3), (7, 3)]})
    assert exact.exact and exact.per_rank == {0: 4, 1: 6}
    twice = coverage(1, 10, {0: [(0, 6)], 1: [(4, 6)]})
    assert (twice.overlaps, twice.gaps, twice.exact) == (2, 0, False)
    hole = coverage(2, 10, {0: [(0, 3)], 1: [(5, 4)]})
    assert (hole.overlaps, hole.gaps, hole.exact) == (0, 3, False)
    ranges = [(0, 10), (20, 3)]
    for batches in range(6):
        done = processed_ranges(ranges, batches, 4)
        rest = unprocessed_ranges(ranges, batches, 4)
        assert coverage(0, 23, {0: done, 1: rest, 2: [(10, 10)]}).exact, batches


def test_survivor_not_asked_leaving_mid_reformation_is_left_out_of_the_sessions() -> None:
    state = Reformation(5.0)
    assert state.begin([0, 1, 2], 0.0, "after rank(s) [3] left") == 0
    assert state.on_gone([(2, "relay host-b lost")], [0, 1]) is None  # rank 0 is still asked
    state.on_uid(0, b"store-0")
    assert state.answered
    assert state.sessions([0, 1]) == {0: NewNcclSession(uid=b"store-0", new_rank=0,
                                                        new_world_size=2),
                                      1: NewNcclSession(uid=b"store-0", new_rank=1,
                                                        new_world_size=2)}
    assert not state.active


def test_asked_rank_dying_after_its_answer_voids_the_uid_and_asks_the_next() -> None:
    state = Reformation(5.0)
    assert state.begin([0, 1, 2], 0.0, "after rank(s) [3] left") == 0
    state.on_uid(0, b"store-0")
    # its rendezvous died with it: the next lowest survivor is asked, and serves the new one
    assert state.on_gone([(0, "heartbeat stale (>5s)")], [1, 2]) == 1
    assert not state.answered
    state.on_uid(0, b"late")  # from the dead rank: ignored
    state.check_deadline(4.9)
    state.on_uid(1, b"store-1")
    assert {r: (s.uid, s.new_rank) for r, s in state.sessions([1, 2]).items()} == {
        1: (b"store-1", 0), 2: (b"store-1", 1)}
