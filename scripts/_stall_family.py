"""The stall family of ``chaos_sweep.py`` (issue 13): the real-process scenarios of
``_chaos/stalls.py`` (a relay or a rank frozen with SIGSTOP while its sockets stay open; a
relay frozen past ``heartbeat_timeout`` and resumed), each run several times, judged as the tests
judge them, and counted."""

from __future__ import annotations

import time
from collections import Counter

import attrs
import trio
from _chaos.stalls import SCENARIOS, StallResult


def problems(r: StallResult) -> list[str]:
    """What the suite would reject in ``r`` (empty: as expected)."""
    out: list[str] = []
    if r.healthy_errors:
        out.append(f"healthy ranks ended: {r.healthy_errors}")
    if any(r.late.values()):
        out.append(f"late or missing broadcasts: {r.late}")
    if r.decided_after is None:
        out.append("no decision")
    if r.scenario == "relay stops reading":
        if set(r.dead) != {2} or "write stall" not in r.dead.get(2, ""):
            out.append(f"dead: {r.dead}")
    elif r.scenario == "rank stops reading":
        if set(r.dead) != {1} or "dropped rank 1" not in r.dead.get(1, ""):
            out.append(f"dead: {r.dead}")
    else:
        if set(r.evicted) != {1, 2}:
            out.append(f"not evicted: {sorted({1, 2} - set(r.evicted))}")
        if not r.connection_closed:
            out.append("coordinator kept the connection")
        if r.decided_after is not None and r.decided_after >= 5.0:
            out.append(f"evicted {r.decided_after:.2f} s after SIGCONT")
    return out


@attrs.define
class StallRow:
    scenario: str
    runs: int = 0
    decided: list[float] = attrs.Factory(list)
    late: int = 0
    healthy_lost: int = 0
    evicted: int = 0
    closed: int = 0
    counters: Counter[str] = attrs.Factory(Counter)
    unexpected: list[str] = attrs.Factory(list)


def run_stalls(rounds: int) -> list[StallRow]:
    rows: dict[str, StallRow] = {}
    for _ in range(rounds):
        for scenario in SCENARIOS:
            result = trio.run(scenario)
            row = rows.setdefault(result.scenario, StallRow(result.scenario))
            row.runs += 1
            if result.decided_after is not None:
                row.decided.append(result.decided_after)
            row.late += sum(len(v) for v in result.late.values())
            row.healthy_lost += len(result.healthy_errors)
            row.evicted += len(result.evicted)
            row.closed += int(bool(result.connection_closed))
            row.counters.update(result.counters)
            row.unexpected += [f"{result.scenario}: {p}" for p in problems(result)]
    return list(rows.values())


def print_stalls(rows: list[StallRow], elapsed: float) -> None:
    headers = ("stall scenario", "runs", "decided after (min-max s)", "late bcasts",
               "healthy lost", "evicted", "conn closed", "counters", "unexpected")
    table = []
    for r in rows:
        span = (f"{min(r.decided):.2f}-{max(r.decided):.2f}" if r.decided else "-")
        counters = ", ".join(f"{k} {v}" for k, v in sorted(r.counters.items()) if v) or "-"
        table.append((r.scenario, str(r.runs), span, str(r.late), str(r.healthy_lost),
                      str(r.evicted), str(r.closed), counters, str(len(r.unexpected))))
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(headers)]
    print(" | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for t in table:
        print(" | ".join(c.ljust(w) for c, w in zip(t, widths, strict=True)))
    bad = [u for r in rows for u in r.unexpected]
    print(f"\n{sum(r.runs for r in rows)} stall runs in {elapsed:.1f} s real; "
          f"{len(bad)} unexpected")
    for text in bad[:20]:
        print(f"  unexpected: {text}")


def main_stalls(rounds: int) -> int:
    started = time.monotonic()
    rows = run_stalls(rounds)
    print_stalls(rows, time.monotonic() - started)
    return 1 if any(r.unexpected for r in rows) else 0
