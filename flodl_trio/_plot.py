"""``flodl-trio plot``: one picture of a run from its timeline JSONL (needs matplotlib).

One lane per rank, coloured by state (alive, dead, exited), with markers for syncs, epoch
starts, lost broadcasts and deaths.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ._errors import ConfigError

_COLORS = {"alive": "#3a9d5d", "dead": "#d64545", "exited": "#4a78c2"}


def load_events(path: str | Path) -> list[dict[str, Any]]:
    """Read a timeline JSONL file.

    Raises:
        ConfigError: the file cannot be read, is not UTF-8 text or has a line that is not JSON;
            the message names the file (and the line).
    """
    events = []
    try:
        with Path(path).open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    events.append(json.loads(line))
                except ValueError as exc:
                    raise ConfigError(
                        f"{path}:{n}: expected one JSON object per line ({exc})"
                    ) from None
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: expected a timeline (JSONL), got bytes that are not UTF-8 "
                          "text") from None
    return events


def rank_lanes(events: list[dict[str, Any]]) -> dict[int, list[tuple[float, str]]]:
    """Per rank, the (time s, state) changes in order."""
    lanes: dict[int, list[tuple[float, str]]] = {}
    for ev in events:
        t = ev.get("t_ms", 0.0) / 1000.0
        kind = ev.get("kind")
        if kind == "RelayJoined":
            for r in ev.get("ranks", []):
                lanes.setdefault(int(r), []).append((t, "alive"))
        elif kind == "RankDeclaredDead":
            lanes.setdefault(int(ev["rank"]), []).append((t, "dead"))
        elif kind == "RankExited":
            lanes.setdefault(int(ev["rank"]), []).append((t, "exited"))
    return lanes


def plot_timeline(path: str | Path, output: str | Path) -> None:
    """Draw ``path`` (timeline JSONL) into the PNG ``output``.

    Raises:
        ConfigError: the file is not a timeline, or matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError:
        raise ConfigError("plot needs matplotlib: pip install 'flodl-trio[plot]'") from None
    events = load_events(path)
    if not events:
        raise ConfigError(f"{path}: the timeline is empty")
    lanes = rank_lanes(events)
    end = max(ev.get("t_ms", 0.0) for ev in events) / 1000.0
    fig, ax = plt.subplots(figsize=(11, 1.8 + 0.45 * max(1, len(lanes))))
    for rank, changes in sorted(lanes.items()):
        for i, (t, state) in enumerate(changes):
            stop = changes[i + 1][0] if i + 1 < len(changes) else end
            ax.broken_barh([(t, max(stop - t, 1e-3))], (rank - 0.35, 0.7),
                           facecolors=_COLORS.get(state, "grey"))
        for t, state in changes:
            if state == "dead":
                ax.plot([t], [rank], marker="X", color="black", markersize=9)
    for ev in events:
        t = ev.get("t_ms", 0.0) / 1000.0
        kind = ev.get("kind")
        if kind == "Note" and ev.get("what") == "epoch_started":
            ax.axvline(t, color="#555555", linestyle="--", linewidth=0.9)
            ax.text(t, len(lanes) - 0.4, f" epoch {ev.get('fields', {}).get('epoch', '?')}",
                    fontsize=8, va="bottom")
        elif kind == "Note" and ev.get("what") == "sync":
            ax.plot([t], [-0.75], marker="|", color="#8a5cc2", markersize=8)
        elif kind == "LostBroadcast":
            ax.plot([t], [-0.75], marker="v", color="#d68a00", markersize=8)
        elif kind == "FormationComplete":
            ax.axvline(t, color="#3a9d5d", linewidth=1.2)
    ax.set_yticks(sorted(lanes))
    ax.set_yticklabels([f"rank {r}" for r in sorted(lanes)])
    ax.set_ylim(-1.2, max(1, len(lanes)) + 0.3)
    ax.set_xlim(0, end * 1.02 if end > 0 else 1)
    ax.set_xlabel("seconds since the coordinator started")
    ax.set_title(f"flodl-trio run: {Path(path).name}")
    handles: list[Any] = [Patch(color=c, label=s) for s, c in _COLORS.items()]
    handles.append(Line2D([], [], marker="|", linestyle="", color="#8a5cc2", label="sync"))
    handles.append(Line2D([], [], marker="v", linestyle="", color="#d68a00",
                              label="lost broadcast"))
    handles.append(Line2D([], [], marker="X", linestyle="", color="black", label="death"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.22), fontsize=8,
              ncol=len(handles), frameon=False)
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)
