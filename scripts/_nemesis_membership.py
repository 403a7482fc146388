"""The checker's rule for the elastic fault kinds (scripts/_nemesis_rules.py runs it with the
others): a host that drains leaves the world its ranks retired and its processes exited 0, and
joins again once started; the spare host that a ``host-join`` starts joins the running cohort and
leaves it the same way. Deaths are not judged here: a drain kills nobody, so a death during one is
the ``false death`` rule's (docs/recovery.rst).
"""

from __future__ import annotations

from _nemesis_history import Entry, History, Violation, about

SLACK_S = 5.0      # a retirement or an exit logged this long after the heal saw the host gone
REJOIN_S = 30.0    # a host started again after its drain joins within this (or the run ended)


def rule_membership(h: History) -> list[Violation]:
    """Each ``host-drain`` fault: its ranks retired, their processes and relay exited 0, and
    its ranks joined again once the heal started the host; each ``host-join``: the spare's
    ranks joined, and once drained at the heal, retired and exited 0. A drain that did not end
    within the nemesis's bound (``drain_overdue``) is one too."""
    ends = h.by_type["run_end"]
    over = ends[0]["t"] if ends else float("inf")
    out: list[Violation] = []
    for f in h.faults:
        if f["kind"] not in ("host-drain", "host-join") or f["end"] > over:
            continue  # the run's end (Shutdown) ended what the fault began
        ranks, host = list(f.get("ranks") or []), f.get("target")
        what = f"{f['kind']} of {host} (fault {f['index']})"
        if f["kind"] == "host-join":
            out += _joined(h, f, what, ranks, f["start"], f["end"])
            drains = [d for d in h.by_type["drain"] if d.get("target") == host
                      and f["start"] <= d["t"] <= f["end"]]
            if drains:
                out += _left(h, f, what, host, ranks, drains[0]["t"])
        else:
            out += _left(h, f, what, host, ranks, f["start"])
            if over > f["end"] + REJOIN_S:
                out += _joined(h, f, what + " started again", ranks, f["end"] - 0.5,
                               f["end"] + REJOIN_S)
    for late in h.by_type["drain_overdue"]:
        out.append(Violation(
            "membership", f"{late.get('target')} had not finished draining "
            f"{late.get('seconds')} s after SIGTERM: {late.get('running')} still ran (killed)",
            late["t"], h.slice(late["t"], before=late.get("seconds", 30) + 2,
                               keep=about(host=late.get("target")))))
    return out


def _joined(h: History, f: Entry, what: str, ranks: list[int], start: float,
            end: float) -> list[Violation]:
    """Each of ``ranks`` joined (or rejoined) the running cohort between ``start`` and
    ``end``."""
    back = {e["rank"] for e in h.by_type["joined"] + h.by_type["rejoined"]
            if start <= e["t"] <= end}
    missing = [r for r in ranks if r not in back]
    if not missing:
        return []
    return [Violation("membership", f"{what}: rank(s) {missing} never joined the running "
                      f"cohort within {end - start:.1f} s", end,
                      h.slice(end, before=end - start, keep=about(host=f.get("target"))))]


def _left(h: History, f: Entry, what: str, host: str | None, ranks: list[int],
          sent: float) -> list[Violation]:
    """The host's ranks, sent SIGTERM at ``sent``, were retired (not dead) and every process
    of it then running exited 0."""
    end = f["end"] + SLACK_S
    retired = {e["rank"] for e in h.by_type["retired"] if sent - 0.5 <= e["t"] <= end}
    out = []
    missing = [r for r in ranks if r not in retired]
    if missing:
        out.append(Violation(
            "membership", f"{what}: rank(s) {missing} were not retired after their host "
            "drained (a drained rank leaves the world retired, never dead)", end,
            h.slice(end, before=end - sent + 1, keep=about(host=host))))
    names = {f"relay {host}"} | {f"rank {r}" for r in ranks}
    # the incarnations that ran when it was sent SIGTERM (not those the heal started again)
    running = {(e["name"], e.get("incarnation")) for e in h.by_type["proc_start"]
               if e["name"] in names and e["t"] <= sent}
    for e in h.by_type["proc_exit"]:
        if (e["name"], e.get("incarnation")) in running and sent <= e["t"] <= end \
                and e.get("code") != 0:
            out.append(Violation(
                "membership", f"{what}: {e['name']} exited with {e.get('code')} after its "
                "host drained (expected 0)", e["t"],
                h.slice(e["t"], before=e["t"] - sent + 1, keep=about(host=host))))
    return out
