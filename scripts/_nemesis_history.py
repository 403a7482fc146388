"""The history of a nemesis run as the checker's rules read it (scripts/_nemesis_checker.py).

The history is a list of entries (dicts with ``t``, wall-clock seconds, and ``type``): what the
nemesis did (``fault``, ``heal``, ``restart``, ``proc_start``, ``proc_exit``, ``run_end``,
``teardown``, ``sample``, ``store_leader``) and what the processes logged
(scripts/_nemesis_logs.py: ``elected``, ``stepped_down``, ``dead``, ``rejoined``,
``relay_joined``, ``relay_lost``, ``epoch_covered``, ``relay_accept``, ``rank_msg``, ...).
:class:`History` indexes them once (by type, the elections, the faults with their ends) and
cuts the slice of history a violation is printed with.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import attrs

Entry = dict[str, Any]
# Relay-local messages a rank is handed: not records of any coordinator.
RELAY_LOCAL = frozenset({"CoordinatorReconnecting", "CoordinatorResumed"})


@attrs.define
class Violation:
    rule: str
    message: str
    t: float
    history: list[str] = attrs.Factory(list)


class History:
    """The entries and what the rules derive from them once (elections, faults, timings)."""

    def __init__(self, entries: Iterable[Entry]) -> None:
        self.entries = sorted(entries, key=lambda e: e["t"])
        self.t0 = self.entries[0]["t"] if self.entries else 0.0
        self.by_type: dict[str, list[Entry]] = defaultdict(list)
        for entry in self.entries:
            self.by_type[entry["type"]].append(entry)
        config = (self.by_type.get("config") or [{}])[0]
        self.timings: dict[str, float] = config.get("timings", {})
        layout = (self.by_type.get("layout") or [{}])[0]
        self.epochs = int(layout.get("epochs", 0))
        self.layout_ranks = int(layout.get("ranks_per_host", 0))  # ranks per host
        self.world = int(layout.get("world", self.layout_ranks * int(layout.get("hosts", 0))))
        self.faults = self._faults()
        # generation -> when it was elected (the first time), from the coordinators' logs
        self.elected: dict[int, float] = {}
        for e in self.by_type["elected"]:
            self.elected.setdefault(e["generation"], e["t"])

    def _faults(self) -> list[Entry]:
        ends = {h["index"]: h["end"] for h in self.by_type.get("heal", [])}
        last = self.entries[-1]["t"] if self.entries else 0.0
        return [{**f, "end": ends.get(f["index"], last)} for f in self.by_type.get("fault", [])]

    def timing(self, name: str, default: float) -> float:
        return float(self.timings.get(name, default))

    def superseded(self, generation: int) -> float | None:
        """When a generation newer than ``generation`` was first elected (None: never)."""
        later = [t for g, t in self.elected.items() if g > generation]
        return min(later) if later else None

    def slice(self, t: float, *, before: float = 6.0, after: float = 2.0,
              keep: Callable[[Entry], bool] = lambda e: True, limit: int = 14) -> list[str]:
        """The entries around ``t`` that ``keep`` selects, one line each (relative times)."""
        times = [e["t"] for e in self.entries]
        lo, hi = bisect.bisect_left(times, t - before), bisect.bisect_right(times, t + after)
        chosen = [e for e in self.entries[lo:hi] if keep(e) and e["type"] != "sample"]
        if len(chosen) > limit:  # keep the entries nearest to t
            chosen = sorted(sorted(chosen, key=lambda e: abs(e["t"] - t))[:limit],
                            key=lambda e: e["t"])
        return [self.line(e) for e in chosen]

    def line(self, entry: Entry) -> str:
        skip = {"t", "type", "files", "schedule"}
        fields = " ".join(f"{k}={self._value(v)}" for k, v in entry.items() if k not in skip)
        return f"{entry['t'] - self.t0:9.3f}s {entry['type']:<14} {fields}"

    def _value(self, value: Any) -> str:
        """A field for one line: a wall-clock time as seconds since the start, text cut."""
        if isinstance(value, float) and value > 1e9:
            return f"{value - self.t0:.3f}s"
        text = str(value)
        return text if len(text) <= 90 else text[:87] + "..."


def about(*, rank: int | None = None, host: str | None = None,
          generation: int | None = None) -> Callable[[Entry], bool]:
    """A slice filter: faults and restarts, elections, and entries naming the rank or host."""
    def keep(e: Entry) -> bool:
        if e["type"] in ("fault", "heal", "restart", "elected", "stepped_down", "run_end"):
            return True
        if rank is not None and (e.get("rank") == rank or rank in (e.get("ranks") or [])):
            return e["type"] != "rank_msg"
        if host is not None and e.get("host") == host:
            return True
        return generation is not None and e.get("generation") == generation \
            and e["type"] != "rank_msg"
    return keep
