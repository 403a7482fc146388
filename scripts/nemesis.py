"""A nemesis for flodl-trio (issue 35): a real cluster of processes on loopback, a seeded schedule
of faults of many kinds injected while the reference scheduler runs, and a checker over the
whole history of the run.

The cluster (scripts/_nemesis_cluster.py): a 3-member etcd, a leading coordinator and a standby
on it (``flodl-trio coordinator --store etcd://... --world-size 4:10``, an elastic world), 4
relays (``flodl-trio relay``) of 2 simulated ranks each and a spare host not started, every
relay's upstream through chaos proxies. The faults (scripts/_nemesis_faults.py,
``--list-kinds``): coordinators SIGKILLed and SIGSTOPped, etcd members killed and the quorum
lost, relays killed and stopped, links stalled and cut, ranks killed, hosts drained and started
again, the spare host joining and drained. The checker (scripts/_nemesis_checker.py) reads the
coordinators' timelines and summaries, the relays' and ranks' logs and the store, and prints
every violation with the slice of history that shows it. docs/recovery.rst says what each rule
is and why.

    .venv/bin/python scripts/nemesis.py --quick --json          # <= 4 minutes, >= 20 faults
    .venv/bin/python scripts/nemesis.py --minutes 30 --seed 7   # a soak: rounds back to back
    .venv/bin/python scripts/nemesis.py --quick --kinds coord-kill,link-cut --plot run.png
    .venv/bin/python scripts/nemesis.py --quick --exclude coord-stop-long,etcd-kill

A soak is a sequence of rounds (``--round-minutes`` of faults each, a new cluster and session
per round, seeds SEED, SEED+1, ...) until ``--minutes`` have passed: a run that a fault ended
early is reported, and the soak goes on with the next round. ``--quick`` is one round.

Exit status: 0 when every target was met, 1 otherwise, 2 on a usage error, 130 on Ctrl-C (every
process is stopped by its PID and the temporary directory removed on every way out).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _nemesis_checker as checker
import _nemesis_faults as faults
import _report as rep
from _etcd import etcd_binary
from _nemesis_layout import Timings
from _nemesis_run import Round, run_round

QUICK_MINUTES = 1.5  # the fault window of --quick: the whole run stays under 4 minutes
MIN_ROUND = 1.0      # a soak does not start a round of fewer minutes of faults than this


def main(argv: list[str] | None = None) -> int:
    # Started in the background by a shell without job control, a process inherits SIGINT
    # ignored, and Ctrl-C (or `kill -INT`) would never stop the cluster; Trio turns this handler
    # into a KeyboardInterrupt, after which every child is stopped by its PID.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    args = parse(argv)
    if args.list_kinds:
        for kind in faults.KINDS:
            low, high = kind.seconds(Timings())
            print(f"{kind.name:22} {low:5.1f}-{high:4.1f} s  {kind.what}")
        return 0
    try:
        kinds = tuple(faults.select(args.kinds, args.exclude))
    except ValueError as exc:
        print(f"nemesis: error: {exc}", file=sys.stderr)
        return 2
    if etcd_binary() is None:
        print("nemesis: etcd is not installed (Debian: apt-get install etcd-server)",
              file=sys.stderr)
        return 2
    started = time.monotonic()
    total = QUICK_MINUTES if args.quick else args.minutes
    rounds: list[tuple[Round, checker.Report, float]] = []
    if args.history:
        Path(args.history).write_text("")
    while True:
        spent = (time.monotonic() - started) / 60
        window = total if args.quick else min(args.round_minutes, total - spent)
        if rounds and (args.quick or window < MIN_ROUND):
            break
        spec = Round(index=len(rounds), seed=args.seed + len(rounds), minutes=window,
                     kinds=kinds, hosts_down=args.max_hosts_down, keep_logs=args.keep_logs)
        began = time.monotonic()
        try:
            history, report, interrupted = run_round(spec)
        except KeyboardInterrupt:  # between two rounds' processes: nothing runs any more
            print("nemesis: interrupted", file=sys.stderr)
            return 130
        rounds.append((spec, report, (time.monotonic() - began) / 60))
        save(args, spec, history.events, report)
        print(f"\n=== round {spec.index} (seed {spec.seed}): " + report.text(), flush=True)
        if interrupted:
            return 130
    minutes_run = (time.monotonic() - started) / 60
    targets = combined_targets([r for _, r, _ in rounds], minutes_run, quick=args.quick)
    rows = [{"round": spec.index, "seed": spec.seed, "minutes": mins, **report.summary()}
            for spec, report, mins in rounds]
    print()
    print(rep.table([("round", "round", "d"), ("seed", "seed", "d"),
                     ("minutes", "minutes", ".1f"), ("faults", "faults", "d"),
                     ("kinds", "kinds", "d"), ("violations", "violations", "d"),
                     ("false deaths", "false_deaths", "d"),
                     ("exactly once", "exactly_once", ".2f"), ("exit", "exit_code", "d")],
                    rows))
    rep.finish("nemesis", rows, targets, args.json, seed=args.seed)
    return 0 if all(t["met"] for t in targets) else 1


def save(args: argparse.Namespace, spec: Round, events: list[dict[str, Any]],
         report: checker.Report) -> None:
    """Append the round's history to ``--history``; draw it to ``--plot`` (round 0) or to
    ``PLOT-rN.png`` (round N)."""
    if args.history:
        with open(args.history, "a", encoding="utf-8") as out:
            for event in events:
                out.write(json.dumps(event, default=str) + "\n")
    if args.plot:
        import _nemesis_plot

        path = Path(args.plot)
        if spec.index:
            path = path.with_name(f"{path.stem}-r{spec.index}{path.suffix or '.png'}")
        _nemesis_plot.draw(events, report, str(path))


def combined_targets(reports: list[checker.Report], minutes: float, *,
                     quick: bool) -> list[dict[str, Any]]:
    """The targets over every round: sums of faults, violations and false deaths, the kinds
    of all rounds, the worst exactly-once fraction and exit code, the minutes of the whole."""
    kinds = set().union(*(set(r.kinds) for r in reports))
    return [
        rep.target("faults injected", sum(len(r.faults) for r in reports), ">=", 20),
        rep.target("fault kinds", len(kinds), ">=", 6),
        rep.target("invariant violations", sum(len(r.violations) for r in reports), "<=", 0),
        rep.target("ranks falsely declared dead", sum(r.false_deaths for r in reports),
                   "<=", 0),
        rep.target("epochs covered exactly once", min(r.exactly_once for r in reports),
                   ">=", 1),
        rep.target("run exit code", max(r.exit_code for r in reports), "<=", 0),
        rep.target("minutes", minutes, "<=", checker.QUICK_LIMIT_MIN) if quick
        else rep.target("minutes", minutes, ">", 0),
    ]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"one round of {QUICK_MINUTES:g} minutes of faults (the whole "
                        "run: < 4 minutes)")
    parser.add_argument("--minutes", type=float, default=10.0,
                        help="minutes of the soak (rounds back to back)")
    parser.add_argument("--round-minutes", type=float, default=10.0,
                        help="minutes of faults per round of a soak")
    parser.add_argument("--seed", type=int, default=1, help="the first round's seed")
    parser.add_argument("--kinds", help="comma-separated fault kinds (default: all; "
                        "--list-kinds)")
    parser.add_argument("--exclude", help="comma-separated fault kinds to leave out")
    parser.add_argument("--list-kinds", action="store_true", help="print the kinds and exit")
    parser.add_argument("--max-hosts-down", type=int, default=2, metavar="N",
                        help="hosts under a fault at once (of 4; a drained host counts "
                        "until it joined again; the elastic world's MIN is 8 - 2 N ranks)")
    parser.add_argument("--history", metavar="PATH", help="write the history here (JSONL)")
    parser.add_argument("--plot", metavar="PATH", help="draw each round as a PNG (matplotlib)")
    parser.add_argument("--keep-logs", action="store_true",
                        help="keep each round's directory (every process's logs)")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
