"""The live page's document for an elastic world (issue 37): its range and size now, and the ranks
that joined, drain or were retired told apart from the alive and the dead (a retired rank is out
of the world, not dead), in a small world rank by rank and in a large one as counts per relay."""

from __future__ import annotations

import functools
from typing import Any

import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.cli._watch import changes
from flodl_trio.coordinator._board import Board
from flodl_trio.coordinator._boardview import RELAY_COLUMNS, board_document
from flodl_trio.coordinator._roster import Roster
from flodl_trio.scheduler import SyncScheduler
from flodl_trio.testing import MemoryNetwork

from helpers import COORD, wait_until
from helpers.board import FakeRelay
from helpers.sims import start_sim_host


def running(least: int, most: int, *hosts: tuple[str, tuple[int, ...]]) -> Roster[Any]:
    roster: Roster[Any] = Roster(most, min_world=least)
    for host, ranks in hosts:
        relay = FakeRelay(host, ranks)
        roster.register(relay, 0.0)
        roster.confirm(relay)
    roster.start_running(1.0)
    return roster


def states(document: dict[str, Any]) -> dict[str | None, list[tuple[int, str]]]:
    """Each relay's (or group's) ranks with their state, as the page lists them."""
    return {relay["host"] or relay["group"]: [(row[0], row[1]) for row in relay["ranks"]]
            for relay in document["relays"]}


def test_the_page_says_world_4_of_2_to_6_and_shows_joined_draining_and_retired_ranks_apart(
) -> None:
    roster = running(2, 6, ("host-a", (0, 1)), ("host-b", (2, 3)))
    roster.rejoin(FakeRelay("host-c", (4,)), 2.0)  # the world grows while it runs
    roster.mark_dead(2, "relay 'host-b' lost")
    roster.retire(2, "retired by the orchestrator")
    document = board_document(roster, Board(6), now=3.0, failed=False, extras={},
                              draining=frozenset({3}))
    assert document["world"] == {"min": 2, "max": 6, "current": 4}
    assert states(document) == {
        "host-a": [(0, "alive"), (1, "alive")],
        "host-b": [(2, "retired"), (3, "draining")],  # retired: not "dead"
        "host-c": [(4, "joined")],
        "waiting": [(5, "waiting")],  # room the world may grow into
    }
    assert [relay.get("draining") for relay in document["relays"]] == [False, True, False, None]
    assert document["counts"] == {"alive": 4, "joined": 1, "draining": 1, "dead": 0,
                                  "exited": 0, "retired": 1, "waiting": 1}
    assert document["deaths"] == [] and document["deaths_total"] == 0
    assert document["retired"] == [
        {"rank": 2, "host": "host-b", "reason": "retired by the orchestrator"}]

    # host-b's last rank exits and is retired: the relay leaves, its ranks are a group of
    # their own, not "no relay yet".
    roster.mark_exited(3)
    roster.retire(3, "its host 'host-b' left: SIGTERM")
    document = board_document(roster, Board(6), now=4.0, failed=False, extras={})
    assert document["world"] == {"min": 2, "max": 6, "current": 3}
    assert states(document) == {
        "host-a": [(0, "alive"), (1, "alive")], "host-c": [(4, "joined")],
        "retired": [(2, "retired"), (3, "retired")], "waiting": [(5, "waiting")]}
    assert [d["reason"] for d in document["retired"]] == [
        "retired by the orchestrator", "its host 'host-b' left: SIGTERM"]

    # A retired id that joins again is in the world again, and says it joined.
    roster.rejoin(FakeRelay("host-d", (2,)), 5.0)
    document = board_document(roster, Board(6), now=5.0, failed=False, extras={})
    assert states(document)["host-d"] == [(2, "joined")]
    assert document["retired"] == [{"rank": 3, "host": "host-b",
                                    "reason": "its host 'host-b' left: SIGTERM"}]


def test_a_large_elastic_world_counts_retired_and_draining_ranks_per_relay() -> None:
    per = 8
    roster = running(1024, 2048, *((f"host-{i}", tuple(range(i * per, (i + 1) * per)))
                                   for i in range(2048 // per)))
    board = Board(2048)
    for r in range(2048):
        board.on_message(wire.Heartbeat(rank=r, step_count=3))
    for r in (8, 9):  # two of host-1's ranks died and were retired
        roster.mark_dead(r, "silent")
    for r in (8, 9):
        roster.retire(r, "dead for 5s (retire_after): silent")
    document = board_document(roster, board, now=2.0, failed=False, extras={},
                              draining=frozenset(range(16, 24)))  # host-2 leaves
    rows = {row[0]: dict(zip(RELAY_COLUMNS, row, strict=True)) for row in document["relays"]}
    assert (rows["host-1"]["alive"], rows["host-1"]["retired"], rows["host-1"]["waiting"]) == (
        6, 2, 0)
    assert (rows["host-2"]["alive"], rows["host-2"]["draining"]) == (8, 8)
    assert document["counts"]["retired"] == 2 and document["counts"]["dead"] == 0
    assert document["world"] == {"min": 1024, "max": 2048, "current": 2046}


async def test_a_real_elastic_run_shows_the_join_the_drain_and_the_retirements_as_they_happen(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    """A coordinator's own documents, read every 5 ms as the page and ``status --watch`` read
    them: host-c joins a running world of 2..6, then host-b drains."""
    salt = ft.SessionSalt.generate()
    start = functools.partial(start_sim_host, net=memory_network, salt=salt, world=6,
                              sim_args=lambda rank: {"batch_size": 2, "seed": rank,
                                                     "batch_ms": 10.0})
    cfg = ft.CoordinatorConfig(world_size=6, min_world_size=2, join_window=0.01,
                               formation_timeout=60, heartbeat_timeout=30)
    lines: list[str] = []
    seen: dict[int, list[str]] = {}  # each rank's states on the page, in order, once each

    async def look(coord: ft.Coordinator) -> None:
        before = coord.state()
        while True:  # until the run's block ends (cancelled)
            await trio.sleep(0.005)
            now = coord.state()
            lines.extend(changes(before, now))
            before = now
            for relay in coord.board()["relays"]:
                for rank, state, *_ in relay["ranks"]:
                    if seen.setdefault(rank, [state])[-1] != state:
                        seen[rank].append(state)

    async with trio.open_nursery() as nursery:
        hosts = [start(nursery, host="host-a", ranks=[0, 1]),
                 start(nursery, host="host-b", ranks=[2, 3])]
        async with ft.open_coordinator(memory_network.listener(COORD), salt=salt,
                                       config=cfg) as coord:
            nursery.start_soon(look, coord)
            scheduler = SyncScheduler(coord, total_samples=96, batch_size=2, num_epochs=3)

            async def change() -> None:
                await wait_until(lambda: hosts[1].worked_in(0), limit=5)
                hosts.append(start(nursery, host="host-c", ranks=[4, 5]))
                await wait_until(lambda: hosts[2].worked_in(1), limit=10)
                assert hosts[1].relay is not None
                await hosts[1].relay.drain("maintenance")

            nursery.start_soon(change)
            await scheduler.run()
            assert coord.retired_ranks == {2, 3}
            await trio.sleep(0.05)  # one more look
        nursery.cancel_scope.cancel()
    assert lines == [
        "host-c joined: rank(s) 4,5 in the cohort; world 6 of 2..6",
        "host-b draining (maintenance): rank(s) 2,3 finish their current sync and exit",
        "host-b: rank(s) 2,3 retired (its host 'host-b' left: maintenance); world 4 of 2..6"]
    # Never "dead"; the drain itself may end between two looks (a sync was due). After the
    # run the others exit.
    assert seen[2] in (["alive", "draining", "retired"], ["alive", "retired"])
    assert seen[3] == seen[2]
    assert seen[4] == seen[5] == ["waiting", "joined", "exited"]
    assert seen[0] == seen[1] == ["alive", "exited"]
