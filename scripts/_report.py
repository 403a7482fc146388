"""What every benchmark prints: a table of medians, the targets, and with ``--json`` one JSON
object as the last line: ``{"rows": [...], "targets": [{"name", "value", "op", "limit"}]}``."""

from __future__ import annotations

import json
import math
import operator
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_OPS: dict[str, Callable[[float, float], bool]] = {
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
}


def target(name: str, value: float, op: str, limit: float) -> dict[str, Any]:
    """One checkable target; ``value`` is rounded for reading, never for the comparison."""
    if op not in _OPS:
        raise ValueError(f"target op must be one of {sorted(_OPS)}, got {op!r}")
    return {"name": name, "value": round(float(value), 4), "op": op, "limit": limit,
            "met": bool(_OPS[op](float(value), limit))}


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of ``values``."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def medians(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per key, the median over runs of every numeric value (other values from the first run)."""
    out: dict[str, Any] = {}
    for key, first in runs[0].items():
        if isinstance(first, int | float) and not isinstance(first, bool):
            out[key] = median([float(r[key]) for r in runs])
        else:
            out[key] = first
    return out


def table(columns: Sequence[tuple[str, str, str]], rows: Sequence[dict[str, Any]]) -> str:
    """``columns``: (header, row key, format spec)."""
    cells = [[_cell(row.get(key), spec) for _, key, spec in columns] for row in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (h, _, _) in enumerate(columns)]
    lines = ["  ".join(h.rjust(w) for (h, _, _), w in zip(columns, widths, strict=True))]
    lines.append("-" * len(lines[0]))
    lines += ["  ".join(c.rjust(w) for c, w in zip(cell, widths, strict=True)) for cell in cells]
    return "\n".join(lines)


def _cell(value: Any, spec: str) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "" if value is None else str(value)
    if spec.endswith("d"):
        value = round(value)
    return format(value, spec)


def targets_text(targets: Sequence[dict[str, Any]]) -> str:
    return "\n".join(f"  [{'met' if t['met'] else 'MISSED'}] {t['name']}: {t['value']:g} "
                     f"{t['op']} {t['limit']:g}" for t in targets)


def machine_note() -> str:
    """Cores and load average, so a reader can judge the noise."""
    try:
        load = os.getloadavg()
        text = f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    except OSError:
        text = "load average unknown"
    now = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    return f"cores: {os.cpu_count()}, {text}, {now} UTC"


def finish(bench: str, rows: Sequence[dict[str, Any]], targets: Sequence[dict[str, Any]],
           as_json: bool, **extra: Any) -> None:
    """Print the targets and, when asked, the JSON object as the very last line."""
    print("targets:")
    print(targets_text(targets))
    if as_json:
        print(json.dumps({"bench": bench, "machine": machine_note(), "rows": list(rows),
                          "targets": list(targets), **extra}, default=str))


def rss_mb(pid: int | str = "self") -> tuple[float, float]:
    """(current RSS, peak RSS) in MB of a process (Linux /proc)."""
    cur = peak = math.nan
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            cur = int(line.split()[1]) / 1024
        elif line.startswith("VmHWM:"):
            peak = int(line.split()[1]) / 1024
    return cur, peak
