"""Elastic membership in the roster (issue 37), without trio: the world's range and its current
size in the status document, and the failure policy judged against the current world."""

from __future__ import annotations

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.coordinator._admission import Grow, Refuse, Terms, judge
from flodl_trio.coordinator._roster import Roster
from flodl_trio.wire import SaveReason

from helpers.board import FakeRelay


def elastic(least: int, most: int, *hosts: tuple[str, tuple[int, ...]],
            run: bool = True) -> Roster[FakeRelay]:
    roster: Roster[FakeRelay] = Roster(most, min_world=least)
    for host, ranks in hosts:
        relay = FakeRelay(host, ranks)
        roster.register(relay, 0.0)
        roster.confirm(relay)
    if run:
        roster.start_running(1.0)
    return roster


def test_the_status_document_tells_the_range_and_the_ranks_in_the_cohort_now() -> None:
    roster = elastic(2, 8, ("host-a", (0, 1)), ("host-b", (2, 3)))
    roster.mark_dead(3, "relay lost")
    fields = roster.state_fields()
    assert fields["world"] == {"min": 2, "max": 8, "current": 4}  # the dead one is awaited
    assert fields["world_size"] == 8 and fields["retired"] == []
    assert Roster(4).state_fields()["world"] == {"min": 4, "max": 4, "current": 0}


def test_a_share_of_the_world_is_a_share_of_the_current_world_not_of_its_maximum() -> None:
    half = ft.MaxFailure.percent(50)
    roster = elastic(2, 8, ("host-a", (0, 1)), ("host-b", (2, 3)))
    roster.mark_dead(2, "gone")
    assert roster.failure_reason(half) is None  # 1 of 4
    roster.mark_dead(3, "gone")
    # 2 of the 4 in the cohort: half of it, though only a quarter of the maximum.
    assert roster.failure_reason(half) is SaveReason.MAX_FAILURE_EXCEEDED
    assert half.describe(roster.current_world) == "percent(50) = 2 of 4"


def hello(host: str, ranks: tuple[int, ...], world: int) -> wire.HelloReceived:
    return wire.HelloReceived(wire.Hello(host=host, world_size=world, model_sigs={},
                                         ranks=ranks, nonce=bytes(16)))


def verdict(roster: Roster[FakeRelay], host: str, ranks: tuple[int, ...]) -> object:
    return judge(roster, hello(host, ranks, roster.world_size), "10.0.0.5:7000",
                 terms=Terms(), claims={})


def test_a_rank_left_out_of_the_formed_cohort_belongs_to_no_host_any_more() -> None:
    roster = elastic(2, 6, ("host-a", (0, 1)), ("host-b", (4, 5)), run=False)
    [_, b] = roster.relays
    roster.unregister(b)  # host-b's relay was lost while the world formed
    assert roster.announced_by(4) == "host-b"
    assert isinstance(verdict(roster, "host-c", (4, 5)), Refuse)  # host-b may still come back
    roster.start_running(2.0)  # formed with its minimum, without host-b
    assert roster.announced_by(4) is None
    assert verdict(roster, "host-c", (4, 5)) == Grow((4, 5))
    assert verdict(roster, "host-c", (2, 3, 4, 5)) == Grow((2, 3, 4, 5))
    # A fixed world covers every rank once formed: nothing for the row to take.
    fixed = elastic(4, 4, ("host-a", (0, 1)), ("host-b", (2, 3)))
    assert verdict(fixed, "host-c", (2, 3)) == Refuse(
        "authenticated Hello from relay 'host-c' at 10.0.0.5:7000: expected every rank it "
        "names to be dead, but rank 2 is alive on relay 'host-b' at 10.0.0.1:4000")
