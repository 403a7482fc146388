"""The nemesis's checker: every rule of scripts/_nemesis_rules.py over the whole history of a run
(scripts/nemesis.py), and the figures the run reports (its ``--json`` targets).

It needs nothing but the history's entries, so tests feed it synthetic histories
(tests/test_nemesis_checker.py); docs/recovery.rst states each rule.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from _nemesis_deaths import deaths_by_leaders
from _nemesis_history import Entry, History, Violation
from _nemesis_rules import RULES, exactly_once_fraction

QUICK_LIMIT_MIN = 4.0  # --quick: the whole run, setup and teardown included


class Report:
    """The violations of a run and its figures."""

    def __init__(self, history: History, violations: Sequence[Violation]) -> None:
        self.history = history
        self.violations = sorted(violations, key=lambda v: v.t)
        self.faults = history.faults
        self.kinds = Counter(f["kind"] for f in self.faults)
        self.false_deaths = sum(1 for v in violations if v.rule == "false death")
        self.deposed_deaths = len(deaths_by_leaders(history)[1])
        # the elastic world: ranks that left it retired (a drain: never a death) and joined it
        self.retired = len(history.by_type["retired"])
        self.joined = len(history.by_type["joined"])
        self.exactly_once = exactly_once_fraction(history)
        ends = history.by_type["run_end"]
        exits = [e for e in history.by_type["run_exit"] if ends and e["name"] == ends[0]["name"]]
        code = exits[0].get("code") if exits else None
        # a signal (negative) reads as the shell's 128 + N; no end at all as 255
        self.exit_code = 255 if code is None else (128 - code if code < 0 else code)

    def rows(self) -> list[dict[str, Any]]:
        skipped = Counter(e["kind"] for e in self.history.by_type["fault_skipped"])
        return [{"kind": kind, "injected": self.kinds.get(kind, 0),
                 "skipped": skipped.get(kind, 0)}
                for kind in sorted(set(self.kinds) | set(skipped))]

    def summary(self) -> dict[str, Any]:
        """The round's figures, for the soak's table."""
        return {"faults": len(self.faults), "kinds": len(self.kinds),
                "violations": len(self.violations), "false_deaths": self.false_deaths,
                "exactly_once": self.exactly_once, "exit_code": self.exit_code,
                "retired": self.retired, "joined": self.joined}

    def text(self) -> str:
        h = self.history
        lines = [f"{len(self.faults)} faults of {len(self.kinds)} kinds: " + ", ".join(
            f"{k} {n}" for k, n in sorted(self.kinds.items())),
            f"epochs covered exactly once: {self.exactly_once:.2f} of {h.epochs}; run exit "
            f"code {self.exit_code}; deaths declared {len(h.by_type['dead'])} "
            f"({self.deposed_deaths} by a coordinator already superseded, which reach nobody); "
            f"ranks retired {self.retired}, joined {self.joined}",
            f"invariant violations: {len(self.violations)}"
            + (" (" + ", ".join(f"{r} {n}" for r, n in Counter(
                v.rule for v in self.violations).most_common()) + ")" if self.violations
               else "")]
        for v in self.violations:
            lines.append(f"\nVIOLATION [{v.rule}] at {v.t - h.t0:.3f} s: {v.message}")
            lines += [f"    {line}" for line in v.history]
        return "\n".join(lines)


def check(entries: Iterable[Entry]) -> Report:
    history = History(entries)
    violations: list[Violation] = []
    for rule in RULES:
        violations += rule(history)
    return Report(history, violations)
