"""The coordinator's membership rules, without trio: a Roster is plain data and time is a float."""

from __future__ import annotations

import math

from hypothesis import given, strategies as st

import flodl_trio as ft
from flodl_trio.coordinator._roster import Roster, ranks_text
from flodl_trio.wire import SaveReason

from helpers.board import FakeRelay


def formed(world: int, per_relay: int) -> tuple[Roster[FakeRelay], list[FakeRelay]]:
    roster: Roster[FakeRelay] = Roster(world)
    relays = [FakeRelay(f"host-{i}", tuple(range(i, min(i + per_relay, world))))
              for i in range(0, world, per_relay)]
    for relay in relays:
        roster.register(relay, 0.0)
        roster.confirm(relay)
    roster.start_running(10.0)
    return roster, relays


def test_formation_completes_only_when_every_rank_is_covered_and_acknowledged() -> None:
    roster: Roster[FakeRelay] = Roster(4)
    a, b = FakeRelay("a", (0, 1)), FakeRelay("b", (2, 3))
    roster.register(a, 0.0)
    assert roster.confirm(a) is False
    roster.register(b, 0.0)
    assert roster.complete is False  # b's HelloAck is still being written
    assert roster.confirm(b) is True
    roster.start_running(1.0)
    assert roster.phase == "running" and roster.complete is False
    assert roster.live == frozenset(range(4))


def test_hello_problem_names_the_contradiction_and_the_owner() -> None:
    roster: Roster[FakeRelay] = Roster(4)
    roster.register(FakeRelay("a", (0, 1), "10.0.0.7:99"), 0.0)
    assert roster.hello_problem("b", (), "p") == (
        "authenticated Hello from relay 'b' at p: expected at least one rank, got an empty "
        "rank list")
    assert "ascending order" in str(roster.hello_problem("b", (3, 2), "p"))
    assert "rank 2 is announced twice" in str(roster.hello_problem("b", (2, 2), "p"))
    assert "rank 4 is out of range for world_size 4" in str(
        roster.hello_problem("b", (2, 4), "p"))
    assert roster.hello_problem("b", (1, 2), "p") == (
        "authenticated Hello from relay 'b' at p: rank 1 was already announced by relay 'a' "
        "at 10.0.0.7:99")
    assert roster.hello_problem("b", (2, 3), "p") is None


def test_unregister_uncovers_only_the_relays_own_ranks() -> None:
    roster: Roster[FakeRelay] = Roster(4)
    a, b = FakeRelay("a", (0, 1)), FakeRelay("b", (2, 3))
    roster.register(a, 0.0)
    roster.register(b, 0.0)
    assert roster.covered == frozenset()  # FT/2: covered only once Ready verified
    roster.confirm(a)
    roster.confirm(b)
    roster.unregister(a)
    assert roster.covered == frozenset({2, 3})
    assert roster.relays == (b,)
    assert roster.same_relay("b", (2, 3)) == [b]
    assert roster.same_relay("b", (2,)) == []


def test_coverage_text_reports_coverage_hosts_and_rejects() -> None:
    roster: Roster[FakeRelay] = Roster(16)
    roster.register(FakeRelay("a", tuple(range(10))), 0.0)
    roster.register(FakeRelay("b", (10, 11)), 0.0)
    roster.confirm(roster.relays[0])
    first = roster.reject("bad mac", "peer 1: Hello MAC did not verify", 0.0)
    assert first is not None and first.detail == "peer 1: Hello MAC did not verify"
    roster.reject("bad mac", "peer 2", 0.0)
    roster.reject("timeout", "peer 3", 0.0)
    assert roster.coverage_text("formation timed out after 5s") == (
        "formation timed out after 5s: 10/16 ranks covered; hosts joined: a [0..9, 10 ranks]; "
        "awaiting Ready from: b; rejected connections: bad mac x2, timeout x1")
    assert roster.rejects == {"bad mac": 2, "timeout": 1}


def test_mark_dead_is_once_and_never_after_exit_or_during_shutdown() -> None:
    roster, _ = formed(4, 2)
    assert roster.mark_dead(0, "heartbeat stale") is True
    assert roster.mark_dead(0, "again") is False
    assert roster.dead_reason(0) == "heartbeat stale"
    assert roster.mark_exited(1) is True and roster.mark_exited(1) is False
    assert roster.mark_dead(1, "late") is False
    assert roster.mark_dead(9, "never covered") is False
    roster.begin_shutdown()
    assert roster.mark_dead(2, "during shutdown") is False
    assert roster.live == frozenset({2, 3})


def test_stale_uses_the_last_seen_clock_and_skips_paused_relays() -> None:
    roster, (a, b) = formed(4, 2)
    roster.seen(0, 14.0)
    assert roster.stale(19.0, 10.0) == ([], 20.0)
    assert roster.stale(20.0, 10.0) == ([1, 2, 3], 24.0)
    # b's reader waits on a full channel: its ranks are not declared, and are looked at again
    # within PAUSED_RECHECK (nobody wakes the watch when the pause ends).
    assert roster.stale(20.0, 10.0, lambda relay: relay is b) == ([1], 21.0)
    # A paused rank that is not overdue is looked at again at its uncredited deadline.
    roster.seen(2, 15.0)
    assert roster.stale(20.0, 10.0, lambda relay: relay is b) == ([1], 21.0)
    roster.seen(3, 19.5)
    assert roster.stale(20.0, 10.0, lambda relay: relay is b) == ([1], 24.0)
    roster.seen(2, 10.0)
    roster.seen(3, 10.0)
    roster.credit_pause(a, 5.0)  # the coordinator did not read a for 5 s
    assert roster.stale(20.0, 10.0) == ([2, 3], 25.0)


def test_stale_watches_nothing_before_formation_completes() -> None:
    roster: Roster[FakeRelay] = Roster(2)
    roster.register(FakeRelay("a", (0, 1)), 0.0)
    assert roster.stale(1e9, 1.0) == ([], math.inf)


def test_failure_reason_follows_the_policy() -> None:
    roster, _ = formed(4, 2)
    policy = ft.MaxFailure.absolute(2)
    assert roster.failure_reason(policy) is None
    roster.mark_dead(0, "x")
    assert roster.failure_reason(policy) is None
    roster.mark_dead(1, "x")
    assert roster.failure_reason(policy) is SaveReason.MAX_FAILURE_EXCEEDED
    roster2, _ = formed(2, 1)
    roster2.mark_exited(0)
    roster2.mark_dead(1, "x")
    assert roster2.failure_reason(None) is SaveReason.ALL_RANKS_LOST


def test_state_fields_describe_membership() -> None:
    roster, _ = formed(3, 2)
    roster.mark_dead(2, "relay lost")
    roster.mark_exited(0)
    assert roster.state_fields() == {
        "phase": "running", "world_size": 3, "covered": 3,
        "relays": [{"host": "host-0", "ranks": [0, 1], "peer": "10.0.0.1:4000",
                    "connected": True},
                   {"host": "host-2", "ranks": [2], "peer": "10.0.0.1:4000",
                    "connected": True}],
        "live": [1], "dead": [{"rank": 2, "reason": "relay lost"}], "exited": [0],
        "rejoins": {}, "world": {"min": 3, "max": 3, "current": 3}, "retired": [],
        "retirements": [], "joins": {},
    }


@given(st.lists(st.tuples(st.sampled_from(["dead", "exit", "seen"]), st.integers(0, 7)),
                max_size=40))
def test_live_dead_and_exited_always_partition_the_covered_ranks(
        steps: list[tuple[str, int]]) -> None:
    roster, _ = formed(8, 3)
    for clock, (action, rank) in enumerate(steps):
        if action == "dead":
            roster.mark_dead(rank, "x")
        elif action == "exit":
            if not roster.is_dead(rank):
                roster.mark_exited(rank)
        else:
            roster.seen(rank, float(clock))
    dead = frozenset(roster.dead)
    assert roster.live | dead | roster.exited == roster.covered
    assert not (roster.live & dead) and not (roster.live & roster.exited)
    assert not (dead & roster.exited)


@given(st.lists(st.integers(0, 9), max_size=12))
def test_hello_problem_accepts_exactly_the_sorted_unique_in_range_free_ranks(
        ranks: list[int]) -> None:
    roster: Roster[FakeRelay] = Roster(8)
    roster.register(FakeRelay("a", (0,)), 0.0)
    fits = (bool(ranks) and ranks == sorted(set(ranks)) and max(ranks) < 8 and 0 not in ranks)
    assert (roster.hello_problem("b", tuple(ranks), "p") is None) == fits


def test_ranks_text_shortens_long_lists() -> None:
    assert ranks_text([1, 2]) == "[1, 2]"
    assert ranks_text(range(100)) == "[0..99, 100 ranks]"


# ------------------------------------------------------------------ FT/2 Hello checks


def test_a_world_size_disagreement_names_both_numbers_in_either_direction() -> None:
    for ours, theirs in ((2, 4), (4, 2)):
        roster: Roster[FakeRelay] = Roster(ours)
        problem = roster.hello_problem("host-a", (0,), "10.0.0.2:1", world_size=theirs)
        assert problem is not None
        assert f"world_size is {ours}" in problem and f"relay's is {theirs}" in problem
        assert "host-a" in problem and "10.0.0.2:1" in problem
        assert roster.hello_problem("host-a", (0,), "p", world_size=ours) is None


def test_model_signatures_that_differ_name_both_hosts_and_the_names() -> None:
    roster: Roster[FakeRelay] = Roster(4)
    a = FakeRelay("host-a", (0, 1), model_sigs={"encoder": b"\x01" * 32, "head": b"\x02" * 32})
    roster.register(a, 0.0)
    roster.confirm(a)
    same = {"encoder": b"\x01" * 32, "head": b"\x02" * 32, "extra": b"\x09"}
    assert roster.hello_problem("host-b", (2, 3), "p", world_size=4, model_sigs=same) is None
    other = {"encoder": b"\x01" * 32, "head": b"\x03" * 32}
    problem = roster.hello_problem("host-b", (2, 3), "10.0.0.3:1", world_size=4,
                                   model_sigs=other)
    assert problem is not None
    assert "model signature mismatch" in problem
    assert "'host-b'" in problem and "'host-a'" in problem and "'head'" in problem
    assert "'encoder'" not in problem
