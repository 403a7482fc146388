"""The nemesis's elastic actions (scripts/_nemesis_actions.py) against a cluster stand-in: who
may restart a part while a fault is on it. No process runs here."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import trio

from helpers.scripts import SCRIPTS

if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

import _nemesis_actions as actions


class Relay:
    def __init__(self) -> None:
        self.signals: list[int] = []

    def signal(self, sig: int) -> None:
        self.signals.append(sig)


class SpareCluster:
    """The parts of ``Cluster`` a ``host-join`` uses: a spare whose first relay gives up."""

    def __init__(self) -> None:
        self.held = {"host-4"}
        self.finished = trio.Event()
        self.records: list[tuple[str, dict[str, Any]]] = []
        self.relays = {"host-4": Relay()}
        self.joined = False
        self.stopped = False
        self.layout = SimpleNamespace(ranks_of=lambda host: [8, 9])
        self.leader_generation: int | None = 28

    def record(self, what: str, **fields: Any) -> None:
        self.records.append((what, fields))

    def hold(self, part: str) -> None:
        self.held.add(part)

    def release(self, part: str) -> None:
        self.held.discard(part)

    def start_host(self, host: str) -> None:
        self.stopped = False

    def host_recovered(self, host: str) -> bool:
        return self.joined

    def host_gone(self, host: str) -> bool:
        return self.stopped

    def host_procs(self, host: str) -> list[Any]:
        return []


async def test_a_joining_spare_is_the_supervisors_until_it_joined(autojump_clock: Any) -> None:
    # Seed 2: the spare's first relay gave up at connect_timeout (its join fell in a
    # coordinator failover); held from the heal's start, it was never started again.
    cluster = SpareCluster()
    heal = await actions.ACTIONS["host-join"](cluster, {"kind": "host-join", "index": 3},
                                              "host-4", 0.0)  # type: ignore[arg-type]
    assert "host-4" not in cluster.held
    async with trio.open_nursery() as nursery:
        nursery.start_soon(heal)
        await trio.sleep(10.0)  # its relay exited 1 meanwhile: the supervisor may restart it
        assert "host-4" not in cluster.held
        assert cluster.relays["host-4"].signals == []
        cluster.joined = True  # the restarted host joined
        await trio.sleep(1.0)
        assert "host-4" in cluster.held  # now drained by the heal, not restarted under it
        assert cluster.relays["host-4"].signals != []
        cluster.stopped = True
    assert [what for what, _ in cluster.records] == ["host_start", "drain"]


class DrainingCluster(SpareCluster):
    """A host sent SIGTERM whose processes exit at ``exits_at`` (Trio time)."""

    def __init__(self, exits_at: float) -> None:
        super().__init__()
        self.exits_at = exits_at
        self.killed = False

    def host_gone(self, host: str) -> bool:
        return trio.current_time() >= self.exits_at

    def kill_host(self, host: str) -> None:
        self.killed = True


async def take_over(cluster: DrainingCluster, at: float) -> None:
    await trio.sleep_until(at)
    assert cluster.leader_generation is not None
    cluster.leader_generation += 1


async def test_a_drain_is_given_its_time_again_after_each_change_of_leader(
        autojump_clock: Any) -> None:
    # Seed 14's soak: a drained host's ranks leave after their next sync, and none came while
    # three leaders followed each other; killed as overdue 30 s after SIGTERM, its ranks were
    # then counted as falsely declared dead.
    start = trio.current_time()
    cluster = DrainingCluster(exits_at=start + 45.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(take_over, cluster, start + 8.0)
        nursery.start_soon(take_over, cluster, start + 20.0)
        await actions.drained(cluster, "host-4", {"index": 7})  # type: ignore[arg-type]
    assert not cluster.killed
    assert trio.current_time() - start < 46.0
    assert [what for what, _ in cluster.records] == []


async def test_a_drain_with_a_steady_leader_is_overdue_after_its_time(
        autojump_clock: Any) -> None:
    start = trio.current_time()
    cluster = DrainingCluster(exits_at=start + 45.0)
    await actions.drained(cluster, "host-4", {"index": 7})  # type: ignore[arg-type]
    assert cluster.killed
    assert 30.0 <= trio.current_time() - start < 31.0
    assert [what for what, _ in cluster.records] == ["drain_overdue"]


async def test_leaders_that_keep_changing_do_not_hold_a_drain_forever(
        autojump_clock: Any) -> None:
    start = trio.current_time()
    cluster = DrainingCluster(exits_at=start + 1000.0)
    async with trio.open_nursery() as nursery:
        for at in range(5, 200, 10):
            nursery.start_soon(take_over, cluster, start + at)
        await actions.drained(cluster, "host-4", {"index": 7})  # type: ignore[arg-type]
        nursery.cancel_scope.cancel()
    assert cluster.killed
    assert trio.current_time() - start <= actions.DRAIN_WAIT_MAX_S + 0.2
