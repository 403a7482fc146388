"""``flodl-trio plot``: one picture of a run from its timeline JSONL (needs matplotlib).

One labelled lane per rank (``rank 4 · host-c``), coloured by state (alive, dead, exited) with a
marker at each death and each exit; a labelled formation line and epoch lines; a labelled row of
syncs, drawn as ticks while they are few and as a rate histogram when a long run would merge them
into a solid bar; lost broadcasts in the same row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .._errors import ConfigError

_COLORS = {"alive": "#3a9d5d", "dead": "#d64545", "exited": "#4a78c2"}
_SYNC_COLOR, _LOST_COLOR, _FORMED_COLOR, _EPOCH_COLOR = "#8a5cc2", "#d68a00", "#1f6f3f", "#555555"
_MAX_SYNC_TICKS = 120  # more than this and ticks merge into a bar: draw a rate histogram
_SYNC_BINS = 120
_SYNC_ROW = -1.0
_LEGEND_INCHES = 0.5  # two rows of legend entries at fontsize 8


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


def rank_hosts(events: list[dict[str, Any]]) -> dict[int, str]:
    """Rank → the host of the relay that announced it."""
    return {int(r): str(ev.get("host", "?")) for ev in events if ev.get("kind") == "RelayJoined"
            for r in ev.get("ranks", [])}


def plot_timeline(path: str | Path, output: str | Path) -> None:
    """Draw ``path`` (timeline JSONL) into the PNG ``output``.

    Raises:
        ConfigError: the file is not a timeline, or matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("plot needs matplotlib: install flodl-trio with its plot extra "
                          "(from a clone: python -m pip install -e '.[plot]')") from None
    events = load_events(path)
    if not events:
        raise ConfigError(f"{path}: the timeline is empty")
    lanes = rank_lanes(events)
    end = max(ev.get("t_ms", 0.0) for ev in events) / 1000.0
    span = end * 1.04 if end > 0 else 1.0
    height = 2.4 + 0.42 * max(1, len(lanes))
    fig, ax = plt.subplots(figsize=(12, height))
    _draw_lanes(ax, lanes, end, span)
    top = max(1, len(lanes)) - 0.4
    syncs, lost = _draw_markers(ax, events, top, span)
    hosts = rank_hosts(events)
    ticks = [_SYNC_ROW, *sorted(lanes)]
    ax.set_yticks(ticks)
    sync_label = f"syncs ({syncs})" + (f"\nlost broadcasts ({lost})" if lost else "")
    ax.set_yticklabels([sync_label, *(f"rank {r} · {hosts.get(r, '?')}" for r in sorted(lanes))])
    ax.set_ylim(_SYNC_ROW - 0.6, top + 1.3)
    ax.set_xlim(0, span)
    ax.set_xlabel("seconds since the coordinator started")
    ax.set_title(f"flodl-trio run: {Path(path).name}")
    # The legend in a strip of its own at the bottom of the figure: placed under the axes (an
    # offset in axes units) it ran into the x-axis label whenever there were few lanes.
    fig.legend(handles=_legend(), loc="lower center", fontsize=8, ncol=5, frameon=False)
    fig.tight_layout(rect=(0, _LEGEND_INCHES / height, 1, 1))
    try:
        fig.savefig(output, dpi=110)
    except OSError as exc:
        raise ConfigError(f"-o {str(output)!r}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)


def _draw_lanes(ax: Any, lanes: dict[int, list[tuple[float, str]]], end: float,
                span: float) -> None:
    for rank, changes in sorted(lanes.items()):
        for i, (t, state) in enumerate(changes):
            stop = changes[i + 1][0] if i + 1 < len(changes) else end
            ax.broken_barh([(t, max(stop - t, span / 400))], (rank - 0.35, 0.7),
                           facecolors=_COLORS.get(state, "grey"))
            if state == "dead":
                ax.plot([t], [rank], marker="X", color="black", markersize=9)
            elif state == "exited":  # exits cluster at the very end: a marker keeps them visible
                ax.plot([t], [rank], marker=">", color=_COLORS["exited"], markersize=8,
                        markeredgecolor="black", markeredgewidth=0.6)


def _draw_markers(ax: Any, events: list[dict[str, Any]], top: float,
                  span: float) -> tuple[int, int]:
    """Formation, epochs, syncs and lost broadcasts; returns how many syncs and lost ones."""
    sync_times: list[float] = []
    lost = 0
    last_label = -span
    for ev in events:
        t = ev.get("t_ms", 0.0) / 1000.0
        kind, what = ev.get("kind"), ev.get("what")
        if kind == "FormationComplete":
            ax.axvline(t, color=_FORMED_COLOR, linewidth=1.6)
            ax.text(t, top + 0.9, f" formed ({float(ev.get('elapsed_ms', 0.0)):.0f} ms)",
                    fontsize=8, color=_FORMED_COLOR, va="top", ha="left")
        elif kind == "Note" and what == "epoch_started":
            ax.axvline(t, color=_EPOCH_COLOR, linestyle="--", linewidth=0.8)
            if t - last_label > span / 40:  # labels closer than that would overlap
                epoch = int(ev.get("fields", {}).get("epoch", 0)) + 1
                ax.text(t, top + 0.2, f" e{epoch}", fontsize=7, color=_EPOCH_COLOR, va="bottom")
                last_label = t
        elif kind == "Note" and what == "sync":
            sync_times.append(t)
        elif kind == "LostBroadcast":
            ax.plot([t], [_SYNC_ROW], marker="v", color=_LOST_COLOR, markersize=9)
            lost += 1
    if len(sync_times) <= _MAX_SYNC_TICKS:
        for t in sync_times:
            ax.plot([t, t], [_SYNC_ROW - 0.3, _SYNC_ROW + 0.3], color=_SYNC_COLOR, linewidth=1)
    else:  # the sync rate as a step curve: its height is the bin's share of the busiest bin
        width = span / _SYNC_BINS
        counts = [0] * _SYNC_BINS
        for t in sync_times:
            counts[min(int(t / width), _SYNC_BINS - 1)] += 1
        peak = max(counts)
        xs = [i * width for i in range(_SYNC_BINS + 1)]
        ys = [_SYNC_ROW - 0.35 + 0.7 * n / peak for n in [*counts, counts[-1]]]
        ax.step(xs, ys, where="post", color=_SYNC_COLOR, linewidth=1.2)
        ax.fill_between(xs, _SYNC_ROW - 0.35, ys, step="post", color=_SYNC_COLOR, alpha=0.2)
        ax.text(span, _SYNC_ROW + 0.4, f"sync rate per {width:.3g} s; top of row = "
                f"{peak / width:.2g} syncs/s ", fontsize=7, color=_SYNC_COLOR, ha="right",
                va="bottom")
    return len(sync_times), lost


def _legend() -> list[Any]:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles: list[Any] = [Patch(color=c, label=s) for s, c in _COLORS.items()]
    handles += [
        Line2D([], [], marker="X", linestyle="", color="black", label="declared dead"),
        Line2D([], [], marker=">", linestyle="", color=_COLORS["exited"], label="exit"),
        Line2D([], [], color=_FORMED_COLOR, linewidth=1.6, label="formation complete"),
        Line2D([], [], color=_EPOCH_COLOR, linestyle="--", label="epoch start (e1, e2, ...)"),
        Line2D([], [], marker="|", linestyle="", color=_SYNC_COLOR, label="sync"),
        Line2D([], [], marker="v", linestyle="", color=_LOST_COLOR, label="lost broadcast"),
    ]
    return handles
