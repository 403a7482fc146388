"""Draw a nemesis run (scripts/nemesis.py ``--plot PATH``): what an operator looks at first.

Top: one lane per rank (alive, declared dead by the leading coordinator, back after a rejoin;
blank while retired, out of the elastic world, until it joins again)
and one per coordinator slot (down, standby, leading with its generation); bottom: the epochs
closed so far. Every fault is a band across both, coloured by kind and numbered as in the
history; each violation is a red mark at its time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from _nemesis_checker import Report
from _nemesis_deaths import deaths_by_leaders
from _nemesis_history import Entry, History

ALIVE, DEAD, LEADER, STANDBY = "#4caf50", "#e53935", "#1e88e5", "#bbdefb"


def draw(entries: Sequence[Entry], report: Report, path: str) -> None:
    """Write the picture of the run to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = History(entries)
    end = (h.entries[-1]["t"] - h.t0) if h.entries else 1.0
    ranks = sorted({e["rank"] for e in h.by_type["rank_msg"]} | {
        d["rank"] for d in h.by_type["dead"]})
    slots = sorted({e["name"] for e in h.by_type["proc_start"] if e["role"] == "coordinator"})
    lanes = [f"rank {r}" for r in ranks] + slots + ["etcd"]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(14, 7.5),
                                      gridspec_kw={"height_ratios": [4, 1]})
    for i, r in enumerate(ranks):
        for start, stop, color in rank_spans(h, r, end):
            top.broken_barh([(start, stop - start)], (i - 0.3, 0.45), color=color)
    for j, slot in enumerate(slots):
        y = len(ranks) + j
        for start, stop, color, label in coordinator_spans(h, slot, end):
            top.broken_barh([(start, stop - start)], (y - 0.3, 0.45), color=color)
            if label:
                top.text(start + 0.2, y - 0.08, label, va="center", fontsize=7)
    colors = draw_faults(top, h, lanes, plt.get_cmap("tab20"))
    times, closed = epochs_closed(h)
    bottom.step(times, closed, where="post", color="black")
    bottom.set_ylabel("epochs closed")
    bottom.set_ylim(0, max(h.epochs, 1) + 0.5)
    for v in report.violations:
        for ax in (top, bottom):
            ax.axvline(v.t - h.t0, color="red", lw=0.8, ls="--")
    top.set_yticks(range(len(lanes)), lanes, fontsize=8)
    top.set_ylim(-0.6, len(lanes) - 0.2)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    handles += [plt.Rectangle((0, 0), 1, 1, color=c) for c in (ALIVE, DEAD, LEADER, STANDBY)]
    top.legend(handles, [*colors, "rank alive", "rank dead", "leading (gN)", "standby"],
               loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7,
               title="faults (bars above their target)")
    bottom.set_xlabel("seconds since the nemesis started (red dashes: violations)")
    top.set_title(f"{len(h.faults)} faults of {len(colors)} kinds, {len(report.violations)} "
                  f"violations, epochs exactly once {report.exactly_once:.2f}, run exit "
                  f"{report.exit_code}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_faults(ax: Any, h: History, lanes: list[str], cmap: Any) -> dict[str, Any]:
    """Each fault as a thin bar just above the lanes of its target (a host's: its ranks'),
    numbered as in the history; returns the colour of each kind."""
    kinds = sorted({f["kind"] for f in h.faults})
    colors = {k: cmap(i % 20) for i, k in enumerate(kinds)}
    for f in h.faults:
        target = str(f.get("target", ""))
        if f["kind"].startswith("etcd"):
            rows = [lanes.index("etcd")]
        elif target in lanes:
            rows = [lanes.index(target)]
        else:
            rows = [lanes.index(f"rank {r}") for r in f.get("ranks") or []
                    if f"rank {r}" in lanes]
        for row in rows:
            ax.broken_barh([(f["start"] - h.t0, f["end"] - f["start"])], (row + 0.2, 0.22),
                           color=colors[f["kind"]])
        if rows:
            ax.text(f["start"] - h.t0, max(rows) + 0.47, str(f["index"]), fontsize=6)
    return colors


def rank_spans(h: History, rank: int, end: float) -> list[tuple[float, float, str]]:
    """(start, stop, colour) of a rank's lane: alive from its first message, dead from each
    death a leading coordinator declared until it rejoined, nothing drawn from a retirement
    until it joined again."""
    msgs = [e["t"] - h.t0 for e in h.by_type["rank_msg"] if e["rank"] == rank]
    if not msgs:
        return []
    changes: list[tuple[float, str]] = [(msgs[0], ALIVE)]
    led = deaths_by_leaders(h)[0]
    colour = {"dead": DEAD, "retired": ""}
    for e in sorted(led + h.by_type["rejoined"] + h.by_type["retired"] + h.by_type["joined"],
                    key=lambda e: e["t"]):
        if e["rank"] == rank:
            changes.append((e["t"] - h.t0, colour.get(e["type"], ALIVE)))
    last = msgs[-1]  # its last message: what comes later (a finished run adopted) is not drawn
    changes = [c for c in changes if c[0] <= last]
    spans = []
    for (start, color), nxt in zip(changes, [*changes[1:], (min(last, end), "")], strict=True):
        if nxt[0] > start and color:
            spans.append((start, nxt[0], color))
    return spans


def coordinator_spans(h: History, slot: str, end: float
                      ) -> list[tuple[float, float, str, str]]:
    """(start, stop, colour, label) of a coordinator slot: standby from each start, leading
    (with its generation) from its election, until it exited or stepped down."""
    spans = []
    for start in (e for e in h.by_type["proc_start"] if e["name"] == slot):
        by = f"{slot}#{start['incarnation']}"
        exits = [e["t"] for e in h.by_type["proc_exit"] if e["name"] == slot
                 and e["incarnation"] == start["incarnation"]]
        stop = (exits[0] if exits else h.t0 + end) - h.t0
        downs = [e["t"] - h.t0 for e in h.by_type["stepped_down"] if e["by"] == by]
        elected = [e for e in h.by_type["elected"] if e["by"] == by]
        begin = start["t"] - h.t0
        if elected:
            lead = elected[0]["t"] - h.t0
            spans.append((begin, lead, STANDBY, ""))
            spans.append((lead, min([stop, *downs]), LEADER, f"g{elected[0]['generation']}"))
        else:
            spans.append((begin, stop, STANDBY, ""))
    return spans


def epochs_closed(h: History) -> tuple[list[float], list[Any]]:
    times, counts, seen = [0.0], [0], set()
    for e in h.by_type["epoch_covered"]:
        seen.add(e["epoch"])
        times.append(e["t"] - h.t0)
        counts.append(len(seen))
    return times, counts
