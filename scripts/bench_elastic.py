"""Elastic membership benchmark (issue 37, docs/elastic.rst): a host joining and a host draining a
running world, on real processes.

The coordinator and its SyncScheduler run in this process (world ``2:6``); every relay is a
``flodl-trio relay`` process and every rank a ``flodl-trio rank`` process (a simulated rank) on
loopback, as an operator would start them. A new cluster is formed for every run:

1. host-a (ranks 0, 1) forms the world with its minimum and the run starts;
2. once epoch 1 is under way, host-b (ranks 2, 3) is started: its relay process, then its ranks.
   Measured from the relay's start to its ranks joining the cohort (``RankJoined``) and to the
   scheduler sending them their first ``StartEpoch`` (the next epoch: ``epoch_started`` naming
   them), and that no survivor was restarted: host-a's rank processes keep their PIDs and run to
   the end, exit 0, and the coordinator declared no rank dead and counted no rejoin;
3. once host-b's ranks worked an epoch, its relay gets SIGTERM: it drains. Measured from the
   signal to both its ranks retired (``RankRetired``), with no death; the run goes on to its
   end with host-a, every epoch covered exactly once.

    .venv/bin/python scripts/bench_elastic.py            # 5 runs
    .venv/bin/python scripts/bench_elastic.py --quick    # 2 runs
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import _report as rep
import trio
from _relay_proc import RelayProcess

import flodl_trio as ft
from flodl_trio.events import Note, RankDeclaredDead, RankJoined, RankRetired
from flodl_trio.scheduler import SyncScheduler, exactly_once_fraction

RUN_LIMIT = 90.0  # seconds; a run that takes longer is a failure, not a hang
WORLD = 6
BATCH_MS = 20.0
BATCH_SIZE = 4
SAMPLES = 480  # 2 ranks: 60 batches of 20 ms each per epoch, about 1.3 s with the syncs
EPOCHS = 6
# Targets (medians): a joining host has work within 2 epochs of its relay's start (process
# start-up included); a drain ends within a second of SIGTERM (one sync, one exit).
JOIN_TARGET_S = 4.0
DRAIN_TARGET_S = 1.0


class Child(RelayProcess):
    """One ``flodl-trio`` process and the lines it printed so far (``_relay_proc``'s line
    collection and stop, for any command)."""

    @classmethod
    async def command(cls, nursery: trio.Nursery, name: str, *argv: str) -> Child:
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "flodl_trio", *argv], stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env={**os.environ})
        child = cls(proc, name)
        nursery.start_soon(child.collect)
        return child

    async def line_with(self, text: str) -> str:
        """The first printed line holding ``text`` (the run's fail_after bounds the wait)."""
        return (await self.wait_lines(lambda line: text in line))[0]


async def start_host(nursery: trio.Nursery, address: tuple[str, int], salt: ft.SessionSalt,
                     host: str, ranks: list[int]) -> tuple[Child, list[Child]]:
    """A relay process, then one rank process per rank once it printed its rank port."""
    relay = await Child.command(nursery, host, "relay", "--coordinator",
                              f"{address[0]}:{address[1]}", "--host", host, "--ranks",
                              ",".join(map(str, ranks)), "--world-size", str(WORLD),
                              "--salt-hex", salt.hex())
    listening = (await relay.line_with("listening for ranks on")).rsplit(" ", 1)[-1]
    children = [await Child.command(nursery, f"rank {r}", "rank", "--relay", listening, "--rank",
                                  str(r), "--world-size", str(WORLD), "--batch-ms",
                                  str(BATCH_MS), "--batch-size", str(BATCH_SIZE), "--salt-hex",
                                  salt.hex()) for r in ranks]
    return relay, children


def stamps(timeline: ft.Timeline, match: Callable[[Any], bool]) -> list[float]:
    return [s.t_ms for s in timeline.stamped() if match(s.event)]


def note(timeline: ft.Timeline, what: str) -> float:
    timeline.event(Note(what, {}))
    return stamps(timeline, lambda e: isinstance(e, Note) and e.what == what)[-1]


async def until(predicate: Callable[[], bool]) -> None:
    """Poll every 2 ms (the times measured come from the timeline's stamps, not this loop)."""
    while not predicate():  # noqa: ASYNC110 - no event for "the scheduler started epoch n"
        await trio.sleep(0.002)


def first_work_ms(timeline: ft.Timeline, ranks: set[int]) -> float:
    return stamps(timeline, lambda e: isinstance(e, Note) and e.what == "epoch_started"
                  and ranks <= set(e.fields.get("ranks", ())))[0]


async def one_run() -> dict[str, Any]:
    salt = ft.SessionSalt.generate()
    timeline = ft.Timeline()
    cfg = ft.CoordinatorConfig(world_size=WORLD, min_world_size=2, join_window=0.2,
                               formation_timeout=60)
    procs: list[Child] = []
    try:
        with trio.fail_after(RUN_LIMIT):
            async with trio.open_nursery() as nursery:
                bound = await ft.bind_coordinator(("127.0.0.1", 0))
                relay_a, ranks_a = await start_host(nursery, bound.address, salt, "host-a",
                                                    [0, 1])
                procs += [relay_a, *ranks_a]
                pids = [c.proc.pid for c in ranks_a]
                async with ft.open_coordinator(bound, salt=salt, config=cfg,
                                               timeline=timeline) as coord:
                    scheduler = SyncScheduler(coord, total_samples=SAMPLES,
                                              batch_size=BATCH_SIZE, num_epochs=EPOCHS)
                    result: dict[str, Any] = {}

                    async def run() -> None:
                        result["summary"] = await scheduler.run()

                    nursery.start_soon(run)
                    row = await grow_and_drain(nursery, coord, timeline, bound.address, salt,
                                               procs)
                    await until(lambda: "summary" in result)
                survivors = [await c.proc.wait() for c in ranks_a]
                nursery.cancel_scope.cancel()
    finally:
        for child in procs:
            await child.stop()
    deaths = stamps(timeline, lambda e: isinstance(e, RankDeclaredDead))
    summary = result["summary"]
    row.update(pids_unchanged=[c.proc.pid for c in ranks_a] == pids and survivors == [0, 0],
               deaths=len(deaths), rejoins=sum(coord.rejoins.values()),
               epochs=summary.epochs_completed,
               exactly_once=exactly_once_fraction(scheduler.coverage) == 1.0)
    return row


async def grow_and_drain(nursery: trio.Nursery, coord: ft.Coordinator, timeline: ft.Timeline,
                         address: tuple[str, int], salt: ft.SessionSalt,
                         procs: list[Child]) -> dict[str, Any]:
    """Steps 2 and 3 of the module doc; returns their times (ms)."""
    epochs = lambda: stamps(timeline, lambda e: isinstance(e, Note)  # noqa: E731
                            and e.what == "epoch_started")
    await until(lambda: len(epochs()) >= 1)
    await trio.sleep(0.3)  # into epoch 1
    began = note(timeline, "host_b_started")
    relay_b, ranks_b = await start_host(nursery, address, salt, "host-b", [2, 3])
    procs += [relay_b, *ranks_b]
    await until(lambda: coord.current_world == 4 and {2, 3} <= coord.live_ranks)
    joined = max(stamps(timeline, lambda e: isinstance(e, RankJoined)))
    await until(lambda: any({2, 3} <= set(e.fields.get("ranks", ()))
                            for s in timeline.stamped() if isinstance(e := s.event, Note)
                            and e.what == "epoch_started"))
    work = first_work_ms(timeline, {2, 3})
    await trio.sleep(0.5)  # host-b works in its first epoch
    signalled = note(timeline, "sigterm_host_b")
    relay_b.proc.send_signal(signal.SIGTERM)
    await until(lambda: {2, 3} <= coord.retired_ranks)
    retired = max(stamps(timeline, lambda e: isinstance(e, RankRetired)))
    epoch_ms = statistics.median(b - a for a, b in zip(epochs(), epochs()[1:], strict=False))
    relay_code = await relay_b.proc.wait()
    return {"join_ms": joined - began, "work_ms": work - began,
            "join_to_work_ms": work - joined, "drain_ms": retired - signalled,
            "epoch_ms": epoch_ms, "drained_relay_exit": relay_code}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 runs")
    parser.add_argument("--runs", type=int, default=None, help="runs (default 5)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every run")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # a join and a drain log warnings by design
    runs = args.runs or (2 if args.quick else 5)
    rows = []
    for i in range(runs):
        rows.append(await one_run())
        if args.verbose:
            print(f"  run {i + 1}: " + ", ".join(
                f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in rows[-1].items()))
    med = rep.medians(rows)
    restarted = sum(not r["pids_unchanged"] for r in rows)
    deaths = sum(r["deaths"] + r["rejoins"] for r in rows)
    exact = sum(r["epochs"] == EPOCHS and r["exactly_once"] for r in rows)
    print(f"{rep.machine_note()}; {runs} runs of a 2:6 world: host-a (ranks 0-1) forms it, "
          f"host-b (ranks 2-3) joins in epoch 1, then drains (SIGTERM); every relay and rank "
          f"its own process, loopback")
    print(rep.table([("case", "case", ""), ("median", "value", "")], [
        {"case": "joining host: relay start -> its ranks joined (RankJoined)",
         "value": f"{med['join_ms']:.0f} ms"},
        {"case": "joining host: relay start -> first StartEpoch (has work)",
         "value": f"{med['work_ms']:.0f} ms"},
        {"case": "  of which joined -> the next epoch began",
         "value": f"{med['join_to_work_ms']:.0f} ms"},
        {"case": "  (one epoch took)", "value": f"{med['epoch_ms']:.0f} ms"},
        {"case": "survivors restarted (a PID changed, or exit != 0)",
         "value": f"{restarted} of {runs} runs"},
        {"case": "ranks declared dead or rejoined", "value": str(deaths)},
        {"case": "drain: SIGTERM -> both ranks retired (RankRetired)",
         "value": f"{med['drain_ms']:.0f} ms"},
        {"case": "drained relay's exit code", "value": str(sorted(
            {r["drained_relay_exit"] for r in rows}))},
        {"case": f"{EPOCHS} epochs completed, each covered exactly once",
         "value": f"{exact} of {runs} runs"},
    ]))
    targets = [
        rep.target("relay start -> first StartEpoch, median s", med["work_ms"] / 1000, "<",
                   JOIN_TARGET_S),
        rep.target("survivors restarted", restarted, "<=", 0),
        rep.target("ranks declared dead or rejoined", deaths, "<=", 0),
        rep.target("SIGTERM -> ranks retired, median s", med["drain_ms"] / 1000, "<",
                   DRAIN_TARGET_S),
        rep.target("runs covering every epoch exactly once", exact, ">=", runs),
    ]
    rep.finish("elastic", rows, targets, args.json)


if __name__ == "__main__":
    trio.run(main)
