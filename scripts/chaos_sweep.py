"""Run the fault scenarios of ``scripts/_chaos`` (those of ``tests/chaos``) with more iterations
and print a table.

    .venv/bin/python scripts/chaos_sweep.py            # every offset x 3 rounds, 20 SIGKILLs
    .venv/bin/python scripts/chaos_sweep.py --quick    # every offset once, 6 SIGKILLs
    .venv/bin/python scripts/chaos_sweep.py --family flood   # only the junk floods (issue 12)
    .venv/bin/python scripts/chaos_sweep.py --family stall   # only the stalls (issue 13)

In-memory scenarios run under ``MockClock`` (one ``trio.run`` each), so their decision times are
mock seconds; the process and namespace scenarios run on the real clock. Each row checks every
outcome against what the suite expects and counts the ones that are not (``unexpected``, must be
0), and counts what was still open afterwards (``leaks``, must be 0). Exit status 1 if either is
not 0.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import attrs
import trio
import trio.testing
from _chaos import handshake_faults as hs, procs as _procs, run_faults as rf
from _chaos.util import EventLog, Outcome, rank_heartbeat_len

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.chaos import FaultPlan
from flodl_trio.testing import MemoryNetwork

UP = hs.UPSTREAM


@attrs.define
class Row:
    scenario: str
    clock: str
    runs: int = 0
    outcomes: Counter[str] = attrs.Factory(Counter)
    decisions: Counter[str] = attrs.Factory(Counter)
    unexpected: list[str] = attrs.Factory(list)
    leaks: int = 0
    max_decision: float | None = None

    def add(self, out: Outcome, ok: bool) -> None:
        self.runs += 1
        self.outcomes[out.label] += 1
        self.decisions[short(out.decision)] += 1
        self.leaks += len(out.leaks)
        if not ok:
            self.unexpected.append(f"{out.scenario}: {out.label}; {out.decision}; {out.error}")
        if out.decision_time is not None:
            self.max_decision = max(self.max_decision or 0.0, out.decision_time)


def short(decision: str) -> str:
    """A decision without peer addresses and details, so equal outcomes count together."""
    text = re.sub(r"relay '[^']+' at \S+ lost: ", "", decision)
    text = re.sub(r"relay '([^']+)' reported that rank \d+'s", r"relay reported rank's", text)
    text = re.sub(r"\(wrong session salt.*\)", "", text)
    text = re.sub(r"record #\d+ .*: tag", "record tag", text)
    return text.strip()[:60]


def mock_run(fn: Callable[[], Awaitable[Outcome]]) -> Outcome:
    return trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


def sweep(row: Row, cases: Iterable[Any], run: Callable[[Any], Outcome],
          check: Callable[[Any, Outcome], bool]) -> Row:
    for case in cases:
        out = run(case)
        try:
            ok = check(case, out)
        except (KeyError, TypeError, AttributeError):
            ok = False
        row.add(out, ok)
    return row


def clean_formation(out: Outcome) -> bool:
    return out.formed and out.error is None and not out.dead and not out.leaks


def memory_rows(rounds: int, rng: random.Random) -> list[Row]:
    rows: list[Row] = []
    repeat = range(rounds)

    def cut_ok(case: tuple[str, int], out: Outcome) -> bool:
        # FT/2: a cut attempt is never counted as a join (no RelayLost), whatever the byte.
        return (clean_formation(out) and out.decision.startswith("rejected: ")
                and out.details["attempts"] == 2 and not out.dead)

    for last in (False, True):
        which = "last" if last else "first"
        for direction, length in (("up", UP.up), ("down", UP.down)):
            cases = [(direction, k) for _ in repeat for k in range(length)]
            rows.append(sweep(
                Row(f"upstream cut {direction}, {which} relay (every byte)", "mock"), cases,
                lambda c, last=last: mock_run(
                    lambda c=c: hs.upstream_cut(MemoryNetwork(), *c, last=last)),
                cut_ok))
        rank_up = wire.RANK_HELLO_LEN + rank_heartbeat_len(1)
        for direction, length in (("up", rank_up), ("down", wire.RANK_ACK_LEN)):
            cases = [(direction, k) for _ in repeat for k in range(length)]
            rows.append(sweep(
                Row(f"rank cut {direction}, {which} rank (every byte)", "mock"), cases,
                lambda c, last=last: mock_run(
                    lambda c=c: hs.rank_cut(MemoryNetwork(), *c, last=last)),
                lambda c, o: clean_formation(o) and o.decision == "rank re-dialed"
                and not o.dead))
    rows.append(sweep(
        Row("corrupt magic+Hello+Ready (every byte)", "mock"),
        [k for _ in repeat for k in range(UP.up)],
        lambda k: mock_run(lambda k=k: hs.corrupt_upstream(MemoryNetwork(), "up", k)),
        lambda k, o: clean_formation(o) and o.decision.removeprefix("rejected: ")
        in hs.corrupt_hello_categories(k)))

    rows.append(sweep(
        Row("corrupt Challenge (every byte)", "mock"),
        [k for _ in repeat for k in range(UP.challenge)],
        lambda k: mock_run(lambda k=k: hs.corrupt_upstream(MemoryNetwork(), "down", k)),
        # FT/2: any failed attempt before the welcome re-dials, a forged Challenge included.
        lambda k, o: clean_formation(o) and o.details["attempts"] == 2))
    rows.append(sweep(
        Row("corrupt HelloAck (every byte)", "mock"),
        [k for _ in repeat for k in range(UP.challenge, UP.challenge + UP.hello_ack)],
        lambda k: mock_run(lambda k=k: hs.corrupt_upstream(MemoryNetwork(), "down", k)),
        lambda k, o: clean_formation(o) and o.details["attempts"] == 2
        and o.decision == "rejected: no ready"))
    slow = [(f"stall up@{k}", FaultPlan().stall(k, "up")) for k in range(UP.up)]
    slow += [(f"stall down@{k}", FaultPlan().stall(k, "down")) for k in range(UP.challenge)]
    slow += [(f"drip {d} {r}B/s", FaultPlan().drip(r, d)) for d in ("up", "down")  # type: ignore[arg-type]
             for r in (0.5, 1, 2, 5)]
    rows.append(sweep(
        Row("stall / drip in the handshake", "mock"), [s for _ in repeat for s in slow],
        lambda s: mock_run(lambda s=s: hs.slow_upstream(MemoryNetwork(), s[1], name=s[0])),
        lambda s, o: clean_formation(o) and o.decision in ("rejected: timeout",
                                                           "rejected: no ready")
        and o.decision_time == 5.0))
    rows.append(sweep(
        Row("silent dialer", "mock"), list(repeat),
        lambda _: mock_run(lambda: hs.silent_dialer(MemoryNetwork())),
        lambda _, o: clean_formation(o) and o.decision == "rejected: timeout"))
    rows.append(sweep(
        Row("world-size disagreement (both directions)", "mock"),
        [w for _ in repeat for w in (2, 4)],
        lambda w: mock_run(lambda w=w: hs.world_mismatch(MemoryNetwork(), relay_world=w)),
        lambda w, o: isinstance(o.error, ft.FormationError) and "world_size mismatch"
        in str(o.error) and f"is {w}" in str(o.error) and not o.leaks
        and o.decision_time is not None and o.decision_time <= 5.0))
    for fault in rf.FAULTS:
        cases = [rng.randint(2, 45) for _ in range(3 * rounds)]

        def mid_ok(at: int, out: Outcome) -> bool:
            survivors = [h.steps(r) == list(range(1, 51)) for h in out.hosts.values()
                         for r in h.ranks if r in rf.SURVIVOR_RANKS]
            return (out.formed and out.error is None and set(out.dead) == rf.VICTIM_RANKS
                    and all(survivors) and not out.leaks)

        rows.append(sweep(
            Row(f"mid-run {fault} (random step)", "mock"), cases,
            lambda at, f=fault: mock_run(lambda: rf.mid_run(rf.network_for(f), f, fault_at=at)),
            mid_ok))
    rows.append(sweep(
        Row("replayed upstream session", "mock"), list(repeat),
        lambda _: mock_run(lambda: rf.replayed_session(MemoryNetwork())),
        lambda _, o: clean_formation(o) and o.decision == "rejected: bad mac"))
    rows.append(sweep(
        Row("duplicated record in a live link", "mock"), list(repeat),
        lambda _: mock_run(lambda: rf.duplicated_record(MemoryNetwork())),
        lambda _, o: set(o.dead) == rf.VICTIM_RANKS and "authentication" in o.decision
        and not o.leaks))
    return rows


def process_rows(kills: int, seed: int, *, netns: bool) -> list[Row]:
    plans = _procs.kill_plans(kills, seed=seed)
    outcomes = trio.run(lambda: _procs.kill_scenarios(plans, concurrency=2))
    row = Row(f"SIGKILL relay/rank process (seed {seed})", "real")
    for plan, out in zip(plans, outcomes, strict=True):
        row.add(out, not _procs.explained(out, plan))
    rows = [row]
    if netns:
        from _chaos import netns as _netns

        reason = _netns.unavailable()
        netns_row = Row("relay in a 2nd network namespace", "real")
        if reason is None:
            with _netns.netns_pair() as pair, tempfile.TemporaryDirectory() as tmp:
                run = trio.run(_netns.multi_host_run, pair, Path(tmp))
            ok = (all(code == 0 for code, _ in run.status.values())
                  and run.summary.get("epochs_completed") == 1
                  and run.joined[0]["peer"].startswith(pair.address2))
            out = Outcome("netns", EventLog(), formed=ok, decision="epoch run across veth",
                          decision_time=run.seconds)
            out.leaks = _netns.leftover(pair)
            netns_row.add(out, ok)
        else:
            netns_row.scenario += f" (skipped: {reason})"
        rows.append(netns_row)
    return rows


def counts(counter: Counter[str]) -> str:
    return ", ".join(f"{k} {n}" for k, n in counter.most_common()) or "-"


def print_table(rows: list[Row]) -> None:
    headers = ("scenario", "runs", "outcomes", "decisions", "max decision", "unexpected",
               "leaks")
    table = [(r.scenario, str(r.runs), counts(r.outcomes), counts(r.decisions),
              "-" if r.max_decision is None else f"{r.max_decision:.3f} s {r.clock}",
              str(len(r.unexpected)), str(r.leaks)) for r in rows]
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(headers)]
    line = " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    print(line)
    print("-+-".join("-" * w for w in widths))
    for t in table:
        print(" | ".join(c.ljust(w) for c, w in zip(t, widths, strict=True)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round, 6 process kills")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of every offset")
    parser.add_argument("--kills", type=int, default=None, help="process SIGKILL scenarios")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--no-processes", action="store_true")
    parser.add_argument("--family", choices=("all", "faults", "flood", "stall"), default="all",
                        help="faults: the fault scenarios; flood: junk against a coordinator "
                        "process (counts, log lines, RSS); stall: frozen relay and rank "
                        "processes (issue 13)")
    parser.add_argument("--flood-scale", type=float, default=1.0,
                        help="multiply the flood sizes (1.0: 1,100 / 5,000 / 1,000 / 20,000)")
    args = parser.parse_args(argv)
    flood_bad = 0
    if args.family in ("all", "flood"):
        import _flood

        floods = trio.run(lambda: _flood.run_floods(scale=args.flood_scale))
        _flood.print_floods(floods)
        flood_bad = sum(1 for f in floods if not f.ok)
        print()
        if args.family == "flood":
            return 1 if flood_bad else 0
    rounds = args.rounds or (1 if args.quick else 3)
    stall_bad = 0
    if args.family in ("all", "stall") and not args.no_processes:
        from _stall_family import main_stalls

        stall_bad = main_stalls(rounds)
        print()
        if args.family == "stall":
            return stall_bad
    kills = args.kills or (6 if args.quick else 20)
    started = time.monotonic()
    rows = memory_rows(rounds, random.Random(args.seed))
    if not args.no_processes:
        rows += process_rows(kills, args.seed, netns=True)
    print_table(rows)
    elapsed = time.monotonic() - started
    bad = [u for r in rows for u in r.unexpected]
    leaks = sum(r.leaks for r in rows)
    print(f"\n{sum(r.runs for r in rows)} runs in {elapsed:.1f} s real; "
          f"{len(bad)} unexpected, {leaks} leaks")
    for text in bad[:20]:
        print(f"  unexpected: {text}")
    return 1 if bad or leaks or flood_bad or stall_bad else 0


if __name__ == "__main__":
    sys.exit(main())
