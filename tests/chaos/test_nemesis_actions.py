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
