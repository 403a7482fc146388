"""A nemesis for flodl-trio (issue 35): a real cluster of processes on loopback, a seeded schedule
of faults of many kinds injected while the reference scheduler runs, and a checker over the
whole history of the run.

The cluster (scripts/_nemesis_cluster.py): a 3-member etcd, a leading coordinator and a standby
on it (``flodl-trio coordinator --store etcd://...``), 4 relays (``flodl-trio relay``) of 2
simulated ranks each, every relay's upstream through chaos proxies. The faults
(scripts/_nemesis_faults.py, ``--list-kinds``): coordinators SIGKILLed and SIGSTOPped, etcd
members killed and the quorum lost, relays killed and stopped, links stalled and cut, ranks
killed. The checker (scripts/_nemesis_checker.py) reads the coordinators' timelines and
summaries, the relays' and ranks' logs and the store, and prints every violation with the slice
of history that shows it. docs/recovery.rst says what each rule is and why.

    .venv/bin/python scripts/nemesis.py --quick --json          # <= 4 minutes, >= 20 faults
    .venv/bin/python scripts/nemesis.py --minutes 30 --seed 7   # a soak
    .venv/bin/python scripts/nemesis.py --quick --kinds coord-kill,link-cut --plot run.png
    .venv/bin/python scripts/nemesis.py --quick --exclude coord-stop-long,etcd-kill

Exit status: 0 when every target was met, 1 otherwise, 2 on a usage error, 130 on Ctrl-C (every
process is stopped by its PID and the temporary directory removed on every way out).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _nemesis_checker as checker
import _nemesis_faults as faults
import _nemesis_logs as logs
import _report as rep
from _etcd import etcd_binary
from _nemesis_cluster import Cluster, Layout, Timings
from _nemesis_procs import fd_count, session_leftovers

QUICK_MINUTES = 1.7        # the fault window of --quick: the whole run stays under 4 minutes
SAMPLES_PER_S = 220.0      # the cluster's throughput with faults, to size the run's epochs
TAIL_S = 75.0              # after the window: the run's last epochs, then everyone's exit
EXIT_WAIT_S = 20.0         # after the run ended: relays and ranks exit on their own
CLEAN_EPOCHS = 2           # the run's last epochs: no fault starts once they began


class History:
    """What the run recorded, in order; every entry has ``t`` (wall clock) and ``type``."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def record(self, entry_type: str, /, **fields: Any) -> None:
        self.events.append({"t": round(time.time(), 6), "type": entry_type, **fields})


def layout_for(minutes: float) -> Layout:
    """Enough epochs that the run outlasts the fault window (at a pessimistic throughput)."""
    base = Layout()
    epochs = max(4, math.ceil(minutes * 60 * SAMPLES_PER_S / base.total_samples))
    return Layout(epochs=epochs)


async def drive(cluster: Cluster, nemesis: faults.Nemesis, window: float) -> None:
    """Start the cluster, run the schedule, wait (bounded) for the run's end and exits."""
    async with trio.open_nursery() as nursery:
        await cluster.start(nursery)
        nursery.start_soon(cluster.supervise)
        nursery.start_soon(cluster.observe)
        stop = trio.Event()
        nursery.start_soon(quiet_near_the_end, cluster, stop)
        with trio.move_on_after(window + 60.0):
            await nemesis.run(stop)
        cluster.record("schedule_end", injected=len(nemesis.injected),
                       skipped=len(nemesis.skipped))
        with trio.move_on_after(TAIL_S) as waiting:
            await cluster.finished.wait()
        if waiting.cancelled_caught:
            cluster.record("run_timeout", seconds=TAIL_S)
        else:
            await settle(cluster)
        nursery.cancel_scope.cancel()


async def quiet_near_the_end(cluster: Cluster, stop: trio.Event) -> None:
    """Set ``stop`` once the run ended or its last ``CLEAN_EPOCHS`` epochs began: they run
    without faults, so that the run's end is not one more fault's recovery."""
    last = cluster.layout.epochs - CLEAN_EPOCHS
    while not cluster.finished.is_set() and cluster.epochs_closed < last:  # noqa: ASYNC110 - read from a child's output
        await trio.sleep(0.2)
    cluster.record("quiet", epochs_closed=cluster.epochs_closed)
    stop.set()


async def settle(cluster: Cluster) -> None:
    """After the run ended, its relays and ranks and the coordinator that ended it should exit
    on their own (bounded), and the standby exit or go on waiting for a leadership (bounded by
    its ``resume_timeout`` and more: a standby that adopted the finished run fails after it);
    whatever still runs then is recorded and stopped with SIGTERM."""
    limit = trio.current_time() + EXIT_WAIT_S + cluster.timings.resume_timeout
    while trio.current_time() < limit and cluster.procs.running():  # noqa: ASYNC110 - child processes
        await trio.sleep(0.2)
    late = cluster.procs.running()
    for proc in late:
        cluster.record("still_running", name=proc.name, role=proc.role, pid=proc.pid)
        proc.signal(signal.SIGTERM)
    with trio.move_on_after(5.0):
        while cluster.procs.running():  # noqa: ASYNC110 - child processes
            await trio.sleep(0.1)
    await trio.sleep(0.3)  # the supervisor records the last exits


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.list_kinds:
        for kind in faults.KINDS:
            low, high = kind.seconds(Timings())
            print(f"{kind.name:22} {low:5.1f}-{high:4.1f} s  {kind.what}")
        return 0
    try:
        kinds = faults.select(args.kinds, args.exclude)
    except ValueError as exc:
        print(f"nemesis: error: {exc}", file=sys.stderr)
        return 2
    if etcd_binary() is None:
        print("nemesis: etcd is not installed (Debian: apt-get install etcd-server)",
              file=sys.stderr)
        return 2
    minutes = QUICK_MINUTES if args.quick else args.minutes
    timings = Timings()
    schedule = faults.plan(args.seed, minutes * 60, kinds, timings)
    history = History()
    history.record("config", seed=args.seed, minutes=minutes, kinds=[k.name for k in kinds],
                   max_hosts_down=args.max_hosts_down,
                   timings={"scale": timings.scale, "heartbeat_timeout": timings.heartbeat_timeout,
                            "resume_timeout": timings.resume_timeout, "grace": timings.grace,
                            "lease_ttl": timings.lease_ttl,
                            "coord_liveness": timings.coord_liveness,
                            "handshake": timings.handshake},
                   schedule=[vars_of(p) for p in schedule])
    started = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="flodl-nemesis-"))
    try:
        report, interrupted = run(args, root, history, schedule, minutes)
    finally:
        if args.keep_logs:
            print(f"logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    minutes_run = (time.monotonic() - started) / 60
    print_report(report, minutes_run, args)
    if interrupted:
        return 130
    return 0 if all(t["met"] for t in report.targets(minutes_run, quick=args.quick)) else 1


def run(args: argparse.Namespace, root: Path, history: History,
        schedule: list[faults.Planned], minutes: float) -> tuple[checker.Report, bool]:
    """Run the cluster and the schedule, stop everything, check the history."""
    driver_fds = fd_count()
    timings = Timings()
    cluster = Cluster(root, timings, layout_for(minutes), history.record)
    history.record("layout", **vars_of(cluster.layout), world=cluster.layout.world)
    nemesis = faults.Nemesis(cluster, schedule, history.record,
                             hosts_down=args.max_hosts_down)
    interrupted = False
    try:
        trio.run(drive, cluster, nemesis, minutes * 60)
    except KeyboardInterrupt:
        interrupted = True
        print("nemesis: interrupted; stopping every process", file=sys.stderr)
    finally:
        sessions = [p.pid for p in cluster.procs]
        cluster.stop_everything()
    history.record("teardown", leftovers=session_leftovers(sessions),
                   tmp_files=sorted(str(p.relative_to(cluster.tmp))
                                    for p in cluster.tmp.rglob("*")),
                   driver_fds=[driver_fds, fd_count()])
    history.events.extend(logs.collect(cluster, history.events))
    history.events.sort(key=lambda e: e["t"])
    report = checker.check(history.events)
    if args.history:
        with open(args.history, "w", encoding="utf-8") as out:
            for event in history.events:
                out.write(json.dumps(event, default=str) + "\n")
    if args.plot:
        import _nemesis_plot

        _nemesis_plot.draw(history.events, report, args.plot)
    return report, interrupted


def vars_of(obj: Any) -> dict[str, Any]:
    import attrs

    return attrs.asdict(obj)


def print_report(report: checker.Report, minutes_run: float, args: argparse.Namespace) -> None:
    print(report.text())
    targets = report.targets(minutes_run, quick=args.quick)
    rep.finish("nemesis", report.rows(), targets, args.json, seed=args.seed)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"a {QUICK_MINUTES:g}-minute fault window (the run: < 4 minutes)")
    parser.add_argument("--minutes", type=float, default=10.0,
                        help="minutes of faults (a soak); the run lasts a little longer")
    parser.add_argument("--seed", type=int, default=1, help="the schedule's seed")
    parser.add_argument("--kinds", help="comma-separated fault kinds (default: all; "
                        "--list-kinds)")
    parser.add_argument("--exclude", help="comma-separated fault kinds to leave out")
    parser.add_argument("--list-kinds", action="store_true", help="print the kinds and exit")
    parser.add_argument("--max-hosts-down", type=int, default=2, metavar="N",
                        help="hosts under a fault at once (of 4)")
    parser.add_argument("--history", metavar="PATH", help="write the history here (JSONL)")
    parser.add_argument("--plot", metavar="PATH", help="draw the run as a PNG (matplotlib)")
    parser.add_argument("--keep-logs", action="store_true",
                        help="keep the run directory (every process's logs)")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
