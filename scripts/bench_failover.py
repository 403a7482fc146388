"""Failure-detection benchmark (SPEC §13): how fast a dead host is noticed, on real processes.

The coordinator runs in this process; every relay and its ranks run in their own process
(scripts/_relay_proc.py) on loopback. A new cluster is formed for every run.

- SIGKILL: 4 relay processes x 8 ranks; one is SIGKILLed after formation. Measured from the
  kill to the coordinator's ``RankDeclaredDead`` for all 8 of its ranks (its timeline), and to
  the last ``DeclareDead`` arrival at a surviving rank (the survivors print ``time.time()``;
  same machine clock). Target < 100 ms (flodl waited for the 30 s heartbeat timeout).
- SIGSTOP: a process hosting one relay and one rank is frozen (its socket stays open, so only
  heartbeat staleness can tell) with ``heartbeat_timeout=2``; measured from the SIGSTOP to
  ``RankDeclaredDead``. The rank's last heartbeat left up to one ``heartbeat_interval`` (1 s)
  before the freeze, so expect 1-2 s; target 2 s +- 1 s.

    .venv/bin/python scripts/bench_failover.py            # 10 SIGKILL runs, 3 SIGSTOP runs
    .venv/bin/python scripts/bench_failover.py --quick    # 3 and 1
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import statistics
import time
from collections.abc import Callable

import _report as rep
import trio
from _relay_proc import RelayProcess, arrival_time

import flodl_trio as ft
from flodl_trio.events import Note, RankDeclaredDead

RUN_LIMIT = 60.0  # seconds; one run that takes longer than this is a failure, not a hang


def event_ms(timeline: ft.Timeline, predicate: Callable[[object], bool]) -> list[float]:
    return [s.t_ms for s in timeline.stamped() if predicate(s.event)]


def is_connected(line: str) -> bool:
    return line.startswith("relay ") and " connected " in line


async def wait_until(predicate: Callable[[], bool]) -> None:
    """Poll every millisecond (the measured times come from timestamps, not from this loop)."""
    while not predicate():  # noqa: ASYNC110 - the coordinator has no event for "n ranks dead"
        await trio.sleep(0.001)


async def sigkill_run(hosts: int, per_host: int) -> tuple[float, float, float]:
    """One cluster; SIGKILL one relay process. Returns, in ms after the kill: every rank
    declared dead, every survivor told of a first death, every survivor told of every death."""
    world = hosts * per_host
    salt = ft.SessionSalt.generate()
    timeline = ft.Timeline()
    cfg = ft.CoordinatorConfig(world_size=world, formation_timeout=30)
    children: list[RelayProcess] = []
    try:
        with trio.fail_after(RUN_LIMIT):
            async with trio.open_nursery() as nursery:
                bound = await ft.bind_coordinator(("127.0.0.1", 0))
                for h in range(hosts):
                    children.append(await RelayProcess.start(
                        nursery, coordinator=bound.address, salt=salt, host=f"host-{h}",
                        ranks=range(h * per_host, (h + 1) * per_host), world_size=world))
                victim, survivors = children[0], children[1:]
                doomed = frozenset(range(per_host))
                async with ft.open_coordinator(bound, salt=salt, config=cfg,
                                               timeline=timeline) as coord:
                    for child in children:
                        await child.wait_lines(is_connected)
                    await trio.sleep(0.3)  # heartbeats flowing, nothing in flight
                    killed_wall = time.time()
                    timeline.event(Note("sigkill", {"host": victim.host}))
                    victim.proc.kill()
                    await wait_until(lambda: coord.dead_ranks >= doomed)
                    told: list[str] = []
                    for child in survivors:
                        told += await child.wait_lines(lambda s: " got DeclareDead " in s,
                                                       per_host * per_host)
                    first_by_rank: dict[str, float] = {}
                    for line in told:  # "rank R got DeclareDead D t=..."
                        rank = line.split()[1]
                        first_by_rank[rank] = min(first_by_rank.get(rank, math.inf),
                                                  arrival_time(line))
                    (kill_ms,) = event_ms(timeline, lambda e: isinstance(e, Note))
                    dead_ms = event_ms(timeline, lambda e: isinstance(e, RankDeclaredDead)
                                       and e.rank in doomed)
                    assert len(dead_ms) == per_host, dead_ms
                    declared = max(dead_ms) - kill_ms
                    told_first = (max(first_by_rank.values()) - killed_wall) * 1000
                    told_all = (max(arrival_time(s) for s in told) - killed_wall) * 1000
                nursery.cancel_scope.cancel()
    finally:
        for child in children:
            await child.stop()
    return declared, told_first, told_all


async def sigstop_run(heartbeat_timeout: float) -> float:
    """One cluster; SIGSTOP the process of a 1-rank relay. Returns ms to RankDeclaredDead."""
    salt = ft.SessionSalt.generate()
    timeline = ft.Timeline()
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=30,
                               heartbeat_timeout=heartbeat_timeout)
    children: list[RelayProcess] = []
    try:
        with trio.fail_after(RUN_LIMIT):
            async with trio.open_nursery() as nursery:
                bound = await ft.bind_coordinator(("127.0.0.1", 0))
                for host, ranks in (("frozen", [0]), ("host-b", [1, 2, 3])):
                    children.append(await RelayProcess.start(
                        nursery, coordinator=bound.address, salt=salt, host=host, ranks=ranks,
                        world_size=4))
                frozen = children[0]
                async with ft.open_coordinator(bound, salt=salt, config=cfg,
                                               timeline=timeline) as coord:
                    for child in children:
                        await child.wait_lines(is_connected)
                    await trio.sleep(1.3)  # a few heartbeats in: the freeze lands mid-interval
                    timeline.event(Note("sigstop", {"host": frozen.host}))
                    frozen.proc.send_signal(signal.SIGSTOP)
                    await wait_until(lambda: 0 in coord.dead_ranks)
                    assert coord.dead_reason(0) == f"heartbeat stale (>{heartbeat_timeout:g}s)"
                    (stop_ms,) = event_ms(timeline, lambda e: isinstance(e, Note))
                    (dead_ms,) = event_ms(timeline, lambda e: isinstance(e, RankDeclaredDead))
                    frozen.proc.send_signal(signal.SIGCONT)
                nursery.cancel_scope.cancel()
    finally:
        for child in children:
            await child.stop()
    return dead_ms - stop_ms


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 SIGKILL runs and 1 SIGSTOP run")
    parser.add_argument("--runs", type=int, default=None, help="SIGKILL runs (default 10)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every run")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_args()
    kill_runs = args.runs or (3 if args.quick else 10)
    stop_runs = 1 if args.quick else 3
    hosts, per_host, stale_after = 4, 8, 2.0

    logging.basicConfig(level=logging.ERROR)  # the deaths are the point: no warning per rank
    declared: list[float] = []
    told_first: list[float] = []
    told_all: list[float] = []
    for i in range(kill_runs):
        d, f, a = await sigkill_run(hosts, per_host)
        declared.append(d)
        told_first.append(f)
        told_all.append(a)
        if args.verbose:
            print(f"  sigkill run {i + 1}: declared {d:.1f} ms, every survivor told of a death "
                  f"{f:.1f} ms, of all {per_host} {a:.1f} ms")
    frozen: list[float] = []
    for i in range(stop_runs):
        frozen.append(await sigstop_run(stale_after))
        if args.verbose:
            print(f"  sigstop run {i + 1}: declared {frozen[-1]:.1f} ms")

    window = (stale_after - 1) * 1000, (stale_after + 1) * 1000
    targets = [
        rep.target("SIGKILL relay -> all RankDeclaredDead, median ms",
                   statistics.median(declared), "<", 100),
        rep.target("SIGKILL relay -> survivors told of all deaths, median ms",
                   statistics.median(told_all), "<", 100),
        rep.target("SIGSTOP rank -> declared, median ms (>= timeout - 1 s)",
                   statistics.median(frozen), ">=", window[0]),
        rep.target("SIGSTOP rank -> declared, median ms (<= timeout + 1 s)",
                   statistics.median(frozen), "<=", window[1]),
    ]
    rows = [
        (f"SIGKILL relay ({per_host} ranks) -> all RankDeclaredDead", declared, "< 100 ms",
         statistics.median(declared) < 100),
        (f"SIGKILL relay -> all {per_host * (hosts - 1)} survivors got a DeclareDead",
         told_first, "< 100 ms", statistics.median(told_first) < 100),
        (f"SIGKILL relay -> all {per_host * (hosts - 1)} survivors got all {per_host} DeclareDead",
         told_all, "< 100 ms", statistics.median(told_all) < 100),
        (f"SIGSTOP rank, link open -> declared (timeout {stale_after:g} s)", frozen,
         f"{stale_after * 1000:.0f} +- 1000 ms",
         window[0] <= statistics.median(frozen) <= window[1]),
    ]
    print(f"cores: {os.cpu_count()}  relay processes: {hosts} x {per_host} ranks (SIGKILL), "
          f"2 (SIGSTOP); a new cluster per run; loopback TCP")
    header = f"{'case':<62} {'runs':>4} {'median ms':>10} {'p90 ms':>9}  {'target':<16} pass"
    print(header)
    print("-" * len(header))
    for name, values, target, ok in rows:
        print(f"{name:<62} {len(values):>4} {statistics.median(values):>10.1f} "
              f"{p90(values):>9.1f}  {target:<16} {'yes' if ok else 'NO'}")
    if args.json:
        raw = [{"case": name, "runs_ms": values, "median_ms": statistics.median(values),
                "p90_ms": p90(values)} for name, values, _, _ in rows]
        rep.finish("failover", raw, targets, True)


if __name__ == "__main__":
    trio.run(main)
