"""Which deaths the nemesis's schedule explains (scripts/_nemesis_rules.py judges them): a death
is justified by a fault that may kill its rank, or by a restart of its host; a death declared by
a coordinator already superseded reaches nobody; and a run that the schedule left with no rank
at all ends as the failure policy says (``ClusterFailure(ALL_RANKS_LOST)``), not as a bug.
"""

from __future__ import annotations

from _nemesis_history import Entry, History

POLICY_FAILURE = "ALL_RANKS_LOST"  # the failure policy's reason when no live rank is left
FAILED_EXIT = 1                    # flodl-trio's exit code for a failed run (docs/cli.rst)


def death_window(h: History) -> float:
    """How long after a fault healed a death may still be its doing: the staleness deadline,
    a takeover's resume deadline and a handshake, plus 5 s of slack for a loaded machine."""
    return (h.timing("heartbeat_timeout", 30) + h.timing("resume_timeout", 30)
            + h.timing("handshake", 10) + 5.0)


def justified(h: History, death: Entry) -> bool:
    """A fault the docs say may kill ``death``'s rank (on it, its host or its link), or a
    restart of its host, around the death; or the nemesis stopping the cluster after a run
    that stopped progressing (judged by the ``run end`` rule instead)."""
    after = death_window(h)
    rank, host = death["rank"], death.get("host")
    if any(stop["t"] <= death["t"] for stop in h.by_type["run_timeout"]):
        return True  # the nemesis stopped a run that no longer progressed: the "run end" rule's
    for f in h.faults:
        if f.get("kills") and rank in (f.get("ranks") or []) and \
                f["start"] - 0.5 <= death["t"] <= f["end"] + after:
            return True
    for r in h.by_type["restart"]:
        # only deaths after it: a restart the death itself caused (its rank exited) is no cause
        if r.get("target") in (host, f"rank {rank}") and r["t"] <= death["t"] <= \
                r["t"] + after:
            return True
    return False


def deaths_by_leaders(h: History) -> tuple[list[Entry], list[Entry]]:
    """Deaths declared by a coordinator while it led, and those declared by one that had
    already been superseded (they reach nobody: relays follow the newer generation)."""
    led, deposed = [], []
    for death in h.by_type["dead"]:
        generation = death.get("generation")
        later = h.superseded(generation) if generation is not None else None
        (deposed if later is not None and death["t"] > later else led).append(death)
    return led, deposed


def policy_end(h: History) -> Entry | None:
    """The run's end when it is the failure policy's, and the schedule's doing: the run failed
    with ``ClusterFailure(ALL_RANKS_LOST)`` while every rank of the world was dead (its last
    death before the end not followed by its rejoin), each of those deaths justified
    (``--max-hosts-down`` as large as the number of hosts lets the schedule lose every rank).
    None otherwise: then the run must complete."""
    ends = h.by_type["run_end"]
    if not ends or POLICY_FAILURE not in str(ends[0].get("failed") or ""):
        return None
    end = ends[0]
    last: dict[int, Entry] = {}
    for death in deaths_by_leaders(h)[0]:
        if death["t"] <= end["t"]:
            last[death["rank"]] = death
    for back in h.by_type["rejoined"] + h.by_type["joined"]:
        if back["t"] <= end["t"] and back["rank"] in last and back["t"] > last[back["rank"]]["t"]:
            del last[back["rank"]]
    world = h.world
    if world <= 0 or set(last) != set(range(world)):
        return None
    return end if all(justified(h, death) for death in last.values()) else None
