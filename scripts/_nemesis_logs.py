"""Turn the logs of a nemesis run into history entries the checker reads (scripts/nemesis.py).

Sources, per process incarnation (the files :mod:`_nemesis_cluster` gave it):

- a coordinator's stderr (``--log-level INFO``, wall-clock stamps): when it bound its port, when
  it was elected and with which generation, when it stepped down;
- its ``--timeline`` (JSONL, milliseconds since the timeline started, turned into wall clock with
  the ``Listening`` event, logged at the same moment): deaths, rejoins, relays joined and lost,
  the elastic world's changes (``joined``, ``draining``, ``retired``), each epoch's coverage
  (``epoch_covered``), a cluster failure; its ``--summary-file``;
- a relay's stderr: each generation it accepted (``durable (generation G)``, ``resumed ...
  (generation G``), each coordinator it lost, its end;
- a rank's log (scripts/_nemesis_rank.py): every control message handed to it, its end.

Every entry has ``t`` (wall clock seconds) and ``type``; coordinator entries say which
incarnation recorded them (``by``) and its generation at the time (None while a standby).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _nemesis_cluster import Cluster
    from _nemesis_procs import Proc

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) (\S+) (\w+) (.*)$")
_ELECTED = re.compile(r"leading session store \S+ as generation (\d+) \((.*)\)")
_DURABLE = re.compile(r"relay '[^']+': the coordinator is durable \(generation (\d+)\)")
_RESUMED = re.compile(r"relay '[^']+' resumed with the coordinator \(generation (\d+)")
_LOST = re.compile(r"relay '[^']+': lost the coordinator \((.*)\); re-dialing")
_ENDING = re.compile(r"relay '[^']+' ending: (.*)")


def log_lines(path: Path) -> Iterator[tuple[float, str, str]]:
    """(wall clock, level, message) of each stamped line of a ``flodl-trio`` stderr log."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return
    for line in text.splitlines():
        match = _STAMP.match(line)
        if match:
            stamp = time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S"))
            yield stamp + int(match.group(2)) / 1000, match.group(4), match.group(5)


def collect(cluster: Cluster) -> list[dict[str, Any]]:
    """Every entry the logs of the run's processes give."""
    out: list[dict[str, Any]] = []
    for proc in cluster.procs:
        if proc.role == "coordinator":
            out += coordinator_entries(proc)
        elif proc.role == "relay":
            out += relay_entries(proc)
        else:
            out += rank_entries(proc)
    return out


def coordinator_entries(proc: Proc) -> list[dict[str, Any]]:
    by = f"{proc.name}#{proc.incarnation}"
    out: list[dict[str, Any]] = []
    listening: float | None = None
    elected: list[tuple[float, int]] = []
    for t, _level, message in log_lines(proc.files["err"]):
        if message.startswith("coordinator listening on") and listening is None:
            listening = t
        if (match := _ELECTED.search(message)) is not None:
            generation = int(match.group(1))
            elected.append((t, generation))
            out.append({"t": t, "type": "elected", "by": by, "pid": proc.pid,
                        "generation": generation, "adopted": "adopted" in match.group(2)})
        elif message.startswith("stepping down"):
            out.append({"t": t, "type": "stepped_down", "by": by, "reason": message,
                        "generation": elected[-1][1] if elected else None})
    if listening is not None:
        out += timeline_entries(proc.files["timeline"], listening, by, elected)
    try:
        summary = json.loads(proc.files["summary"].read_text())
    except (OSError, ValueError):
        summary = None
    out.append({"t": proc.exited or time.time(), "type": "summary", "by": by,
                "code": proc.code, "summary": summary})
    return out


def timeline_entries(path: Path, listening: float, by: str,
                     elected: list[tuple[float, int]]) -> list[dict[str, Any]]:
    rows = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a SIGKILL
    bound = [r for r in rows if r.get("kind") == "Listening"]
    if not bound:
        return []
    t0 = listening - float(bound[0]["t_ms"]) / 1000
    out = []
    for row in rows:
        t = t0 + float(row["t_ms"]) / 1000
        entry = timeline_entry(row, t)
        if entry is None:
            continue
        generations = [g for at, g in elected if at <= t + 0.05]
        entry.update(by=by, generation=generations[-1] if generations else None)
        out.append(entry)
    return out


def timeline_entry(row: dict[str, Any], t: float) -> dict[str, Any] | None:
    """The history entry of one timeline event (None for the events the checker ignores)."""
    kind = row.get("kind")
    if kind == "RankDeclaredDead":
        return {"t": t, "type": "dead", "rank": row["rank"], "host": row["host"],
                "reason": row["reason"]}
    if kind == "RankRejoined":
        return {"t": t, "type": "rejoined", "rank": row["rank"], "host": row["host"]}
    if kind == "RankJoined":
        return {"t": t, "type": "joined", "rank": row["rank"], "host": row["host"],
                "world": row.get("world")}
    if kind == "RankRetired":
        return {"t": t, "type": "retired", "rank": row["rank"], "host": row.get("host"),
                "reason": row.get("reason"), "world": row.get("world")}
    if kind == "RelayDraining":
        return {"t": t, "type": "draining", "host": row["host"],
                "ranks": list(row.get("ranks") or []), "reason": row.get("reason")}
    if kind == "RelayJoined":
        return {"t": t, "type": "relay_joined", "host": row["host"], "peer": row["peer"]}
    if kind == "RelayLost":
        return {"t": t, "type": "relay_lost", "host": row["host"], "reason": row["reason"]}
    if kind == "ClusterFailed":
        return {"t": t, "type": "cluster_failed", "reason": row["reason"],
                "dead": row.get("dead")}
    if kind == "Note" and row.get("what") == "epoch_covered":
        fields = row.get("fields", {})
        return {"t": t, "type": "epoch_covered", **{k: fields.get(k) for k in (
            "epoch", "exactly_once", "samples", "total", "gaps", "overlaps")}}
    if kind == "Note" and row.get("what") == "epoch_started":
        return {"t": t, "type": "epoch_started", "epoch": row.get("fields", {}).get("epoch")}
    return None


def relay_entries(proc: Proc) -> list[dict[str, Any]]:
    host = proc.name.split()[1]
    out: list[dict[str, Any]] = []
    for t, _level, message in log_lines(proc.files["err"]):
        base = {"t": t, "host": host, "incarnation": proc.incarnation}
        if (match := _DURABLE.search(message)) is not None:
            out.append({**base, "type": "relay_accept", "generation": int(match.group(1)),
                        "how": "join"})
        elif (match := _RESUMED.search(message)) is not None:
            out.append({**base, "type": "relay_accept", "generation": int(match.group(1)),
                        "how": "resume"})
        elif (match := _LOST.search(message)) is not None:
            out.append({**base, "type": "relay_away", "reason": match.group(1)})
        elif (match := _ENDING.search(message)) is not None:
            out.append({**base, "type": "relay_end", "reason": match.group(1)})
    return out


def rank_entries(proc: Proc) -> list[dict[str, Any]]:
    rank = int(proc.name.split()[1])
    out: list[dict[str, Any]] = []
    try:
        text = proc.files["log"].read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        words = line.split(maxsplit=3)
        if len(words) < 2:
            continue
        try:
            t = float(words[0])
        except ValueError:
            continue
        base = {"t": t, "rank": rank, "incarnation": proc.incarnation}
        if words[1] == "msg" and len(words) >= 3:
            out.append({**base, "type": "rank_msg", "label": words[2],
                        "value": words[3] if len(words) > 3 else ""})
        elif words[1] == "end":
            out.append({**base, "type": "rank_end", "how": words[2] if len(words) > 2 else "",
                        "detail": words[3] if len(words) > 3 else ""})
        elif words[1] == "connected":
            out.append({**base, "type": "rank_connected"})
    return out
