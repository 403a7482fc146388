"""The checker's rules (scripts/_nemesis_checker.py runs them): each takes the
:class:`~_nemesis_history.History` of a run and returns its violations, each with the slice of
history that shows it. docs/recovery.rst states every rule and where in the docs it comes from.
"""

from __future__ import annotations

from _nemesis_deaths import FAILED_EXIT, deaths_by_leaders, justified, policy_end
from _nemesis_history import RELAY_LOCAL, Entry, History, Violation, about
from _nemesis_membership import rule_membership

RSS_LIMIT_MB = 200.0   # a coordinator of 8 ranks: ~60 MB; past this it grows with the faults
FD_LIMIT = 96          # a coordinator of 4 relays holds ~30 descriptors
LATE_S = 2.0           # a record delivered this long after its coordinator was superseded
PATH_KINDS = {"relay-stop", "link-stall", "link-stall-long", "link-stall-past-grace"}


def rule_epochs(h: History) -> list[Violation]:
    """Every epoch of the run closed, and covered exactly once by the last coordinator that
    closed it (an epoch a takeover re-ran is counted by the one that closed it last)."""
    latest: dict[int, Entry] = {}
    for note in h.by_type["epoch_covered"]:
        key = (note.get("generation") or 0, note["t"])
        old = latest.get(note["epoch"])
        if old is None or key >= (old.get("generation") or 0, old["t"]):
            latest[note["epoch"]] = note
    out = []
    missing = [epoch + 1 for epoch in range(h.epochs) if epoch not in latest]
    if missing and policy_end(h) is None:  # a run the schedule left with no rank stops there
        t = h.entries[-1]["t"] if h.entries else 0.0
        out.append(Violation("epochs", f"{len(missing)} epoch(s) never closed by any "
                             f"coordinator: {_ranges(missing)}", t, h.slice(
                                 t, before=60, keep=lambda e: e["type"] in (
                                     "epoch_covered", "run_end", "cluster_failed"))))
    for epoch in range(h.epochs):
        note = latest.get(epoch)
        if note is not None and not note.get("exactly_once"):
            out.append(Violation(
                "epochs", f"epoch {epoch + 1} closed by {note.get('by')} (generation "
                f"{note.get('generation')}) with {note.get('gaps')} samples missed and "
                f"{note.get('overlaps')} counted twice", note["t"],
                h.slice(note["t"], before=20, keep=lambda e: e["type"] in (
                    "epoch_covered", "epoch_started", "dead", "rejoined", "fault", "elected"))))
    return out


def _ranges(numbers: list[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``1-3, 5``."""
    out: list[str] = []
    for n in numbers:
        if out and out[-1].split("-")[-1] == str(n - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{n}"
        else:
            out.append(str(n))
    return ", ".join(out)


def exactly_once_fraction(h: History) -> float:
    """The fraction of the run's epochs whose last closing coordinator counted every sample
    exactly once (an epoch never closed counts as not)."""
    if h.epochs <= 0:
        return 0.0
    exact: dict[int, tuple[tuple[int, float], bool]] = {}
    for note in h.by_type["epoch_covered"]:
        key = (note.get("generation") or 0, note["t"])
        if note["epoch"] not in exact or key >= exact[note["epoch"]][0]:
            exact[note["epoch"]] = (key, bool(note.get("exactly_once")))
    return sum(1 for e in range(h.epochs) if exact.get(e, ((0, 0.0), False))[1]) / h.epochs


def rule_false_deaths(h: History) -> list[Violation]:
    """No rank declared dead unless the schedule did something to it, its host or its link
    that the docs say kills it (docs/recovery.rst lists the kinds)."""
    ends = h.by_type["run_end"]
    over = ends[0]["t"] if ends else float("inf")
    out = []
    for death in deaths_by_leaders(h)[0]:
        if justified(h, death) or death["t"] > over:
            continue  # after the end: the rule "after the run" reports the adoption
        out.append(Violation(
            "false death", f"rank {death['rank']} ({death.get('host')}) declared dead by "
            f"{death.get('by')} (generation {death.get('generation')}) with no fault that "
            f"kills it: {death.get('reason')}", death["t"],
            h.slice(death["t"], before=15, keep=about(rank=death["rank"],
                                                      host=death.get("host")))))
    return out


def rule_generations_grow(h: History) -> list[Violation]:
    """Every relay (host, across its restarts) saw the coordinator generation only grow: in
    what it logged accepting, and in which coordinator accepted it (their timelines)."""
    out = []
    seen: dict[str, Entry] = {}
    accepts = sorted(h.by_type["relay_accept"], key=lambda e: e["t"])
    joins = sorted((j for j in h.by_type["relay_joined"] if j.get("generation") is not None),
                   key=lambda e: e["t"])
    for source in (accepts, joins):
        seen.clear()
        for e in source:
            before = seen.get(e["host"])
            if before is not None and e["generation"] < before["generation"]:
                out.append(Violation(
                    "generations", f"relay {e['host']} went from generation "
                    f"{before['generation']} back to {e['generation']}", e["t"],
                    h.slice(e["t"], before=10, keep=about(host=e["host"]))))
            seen[e["host"]] = e
    return out


def rule_one_coordinator(h: History) -> list[Violation]:
    """At most one coordinator accepted by relays at any instant: no coordinator accepts a
    relay once a newer generation was elected, and the generations the relays accept, taken
    all together in time order, never go back."""
    out = []
    for join in h.by_type["relay_joined"]:
        generation = join.get("generation")
        later = h.superseded(generation) if generation is not None else None
        if later is not None and join["t"] > later:
            out.append(Violation(
                "one coordinator", f"{join.get('by')} (generation {generation}) accepted relay "
                f"{join['host']} {join['t'] - later:.2f} s after a newer generation was "
                "elected", join["t"], h.slice(join["t"], keep=about(host=join["host"],
                                                                     generation=generation))))
    by_generation: dict[int, Entry] = {}
    for e in h.by_type["elected"]:
        first = by_generation.setdefault(e["generation"], e)
        if first is not e and first.get("by") != e.get("by"):
            out.append(Violation(
                "one coordinator", f"{e.get('by')} and {first.get('by')} were both elected "
                f"with generation {e['generation']}", e["t"], h.slice(e["t"], keep=lambda x: (
                    x["type"] in ("elected", "stepped_down", "store_leader")))))
    top: Entry | None = None
    for e in sorted(h.by_type["relay_accept"], key=lambda e: e["t"]):
        if top is not None and e["generation"] < top["generation"]:
            out.append(Violation(
                "one coordinator", f"relay {e['host']} accepted generation {e['generation']} "
                f"after relay {top['host']} had accepted generation {top['generation']}",
                e["t"], h.slice(e["t"], keep=lambda x: x["type"] in (
                    "relay_accept", "elected", "stepped_down", "fault", "heal"))))
        if top is None or e["generation"] >= top["generation"]:
            top = e
    return out


def attributed(h: History) -> list[Entry]:
    """Every coordinator record a rank was handed, with the generation it came from: the one
    its relay last said it resumed with (``CoordinatorResumed``), else the one the relay joined."""
    joins: dict[str, list[Entry]] = {}
    for e in sorted(h.by_type["relay_accept"], key=lambda e: e["t"]):
        joins.setdefault(e["host"], []).append(e)
    per_host = h.layout_ranks
    out = []
    current: dict[tuple[int, int], int] = {}
    for msg in h.by_type["rank_msg"]:
        key = (msg["rank"], msg["incarnation"])
        if msg["label"] == "CoordinatorResumed" and msg.get("value", "").isdigit():
            current[key] = int(msg["value"])
            continue
        if msg["label"] in RELAY_LOCAL:
            continue
        generation = current.get(key)
        if generation is None:
            host = f"host-{msg['rank'] // per_host}" if per_host else ""
            before = [e for e in joins.get(host, []) if e["t"] <= msg["t"]]
            generation = before[-1]["generation"] if before else None
        if generation is not None:
            out.append({**msg, "generation": generation})
    return out


def _path_delayed(h: History, host: str, t_from: float, t_to: float) -> bool:
    """A fault that delays what reaches ``host``'s ranks (a stopped relay, a stalled link)."""
    return any(f["kind"] in PATH_KINDS and f.get("target") == host
               and f["start"] <= t_to and f["end"] >= t_from for f in h.faults)


def _frozen_over(h: History, generation: int, when: float) -> Entry | None:
    """The SIGSTOP of generation ``generation``'s coordinator that covered ``when``."""
    pids = {e["pid"] for e in h.by_type["elected"] if e["generation"] == generation}
    for f in h.faults:
        if f["kind"].startswith("coord-stop") and f.get("pid") in pids \
                and f["start"] <= when <= f["end"]:
            return f
    return None


def rule_deposed_records(h: History) -> list[Violation]:
    """No rank was handed a record of a deposed coordinator: one sent after a newer generation
    was elected (a coordinator frozen over that election and woken up: anything received after
    its SIGCONT; otherwise anything received ``LATE_S`` after the election, unless a fault
    delayed that rank's path)."""
    groups: dict[int, list[Entry]] = {}
    per_host = h.layout_ranks
    for msg in attributed(h):
        later = h.superseded(msg["generation"])
        if later is None or msg["t"] <= later:
            continue
        host = f"host-{msg['rank'] // per_host}" if per_host else ""
        frozen = _frozen_over(h, msg["generation"], later)
        if frozen is not None:
            deposed = msg["t"] > frozen["end"]
        else:
            deposed = msg["t"] > later + LATE_S and not _path_delayed(h, host, later - 30,
                                                                      msg["t"])
        if deposed:
            groups.setdefault(msg["generation"], []).append(msg)
    out = []
    for generation, msgs in sorted(groups.items()):
        first = msgs[0]
        ranks = sorted({m["rank"] for m in msgs})
        labels = ", ".join(sorted({m["label"] for m in msgs}))
        later = h.superseded(generation) or first["t"]
        out.append(Violation(
            "deposed records", f"ranks {ranks} were handed {len(msgs)} record(s) ({labels}) "
            f"of generation {generation} from {first['t'] - h.t0:.3f} s on; generation "
            f"{generation} was superseded at {later - h.t0:.3f} s", first["t"],
            h.slice(first["t"], before=10, keep=lambda e, r=first["rank"]: (
                e["type"] in ("fault", "heal", "elected", "stepped_down")
                or (e["type"] == "rank_msg" and e["rank"] == r)))))
    return out


def rule_step_down(h: History) -> list[Violation]:
    """A leader steps down only when a fault took its lease (it was stopped past its lease,
    or etcd lost its quorum): losing one etcd member of three must not depose it."""
    ttl = h.timing("lease_ttl", 2.0)
    out = []
    for e in h.by_type["stepped_down"]:
        pids = {x["pid"] for x in h.by_type["elected"] if x.get("by") == e.get("by")}
        cause = [f for f in h.faults if (
            (f["kind"].startswith("coord-stop") and f.get("pid") in pids)
            or f["kind"] == "etcd-quorum") and f["start"] <= e["t"] <= f["end"] + ttl + 5.0]
        if not cause:
            out.append(Violation(
                "step-down", f"{e.get('by')} (generation {e.get('generation')}) stepped down "
                f"with no fault that takes its lease: {e.get('reason')}", e["t"],
                h.slice(e["t"], before=10, keep=lambda x: x["type"] in (
                    "fault", "heal", "elected", "stepped_down", "store_leader"))))
    return out


def rule_run_end(h: History) -> list[Violation]:
    """The run ends with every epoch done and exit 0 (the schedule never exceeds the failure
    policy: at most two hosts are under a fault at once); or, when the schedule left no rank
    alive (:func:`policy_end`), with the failure policy's ``ALL_RANKS_LOST`` and exit 1."""
    last = h.entries[-1]["t"] if h.entries else 0.0
    ends = h.by_type["run_end"]
    if not ends:
        return [Violation("run end", "the run did not end within the schedule and its tail",
                          last, h.slice(last, before=30, keep=lambda e: e["type"] in (
                              "epoch_covered", "fault", "heal", "elected", "run_timeout")))]
    end = ends[0]
    around = h.slice(end["t"], before=20, keep=lambda e: e["type"] in (
        "dead", "cluster_failed", "fault", "heal", "elected", "stepped_down", "run_exit"))
    expected = FAILED_EXIT if policy_end(h) is not None else 0
    out = []
    if not expected and (end.get("failed") or end.get("epochs") != h.epochs):
        out.append(Violation("run end", f"{end['name']} ended the run after {end.get('epochs')}"
                             f"/{h.epochs} epochs: {end.get('failed')}", end["t"], around))
    exits = [e for e in h.by_type["run_exit"] if e["name"] == end["name"]]
    if not out and (not exits or exits[0].get("code") != expected):
        code = exits[0].get("code") if exits else "none (it did not exit)"
        out.append(Violation("run end", f"{end['name']} exited with {code} after it ended the "
                             f"run (expected {expected})", exits[0]["t"] if exits else last,
                             around))
    return out


def rule_after_run(h: History) -> list[Violation]:
    """After the run ended every relay and rank exits 0 on its own, the standby exits 0 or
    keeps waiting (the nemesis then stops it); nothing is left: no process in the children's
    sessions, no file in their TMPDIR, no descriptor of the driver's."""
    ends = h.by_type["run_end"]
    if not ends:
        return []
    end = ends[0]["t"]
    stopped = {e["name"] for e in h.by_type["still_running"]}
    if ends[0].get("failed"):  # the relays and ranks of a failed run fail with it
        stopped |= {e["name"] for e in h.by_type["proc_exit"] if e["role"] != "coordinator"}
    # the coordinator that ended the run is judged by "run end"; one elected after it by this
    # rule's first part (its failure then is part of that story)
    judged = {f"{ends[0]['name']}#{ends[0].get('incarnation')}"}
    out = []
    for e in h.by_type["elected"]:
        if e["t"] > end:
            judged.add(e["by"])
            dead = sorted({d["rank"] for d in h.by_type["dead"] if d.get("by") == e["by"]})
            out.append(Violation(
                "after the run", f"{e['by']} was elected (generation {e['generation']}) after "
                f"the run ended and adopted the finished session; it declared ranks {dead} "
                "dead", e["t"], h.slice(e["t"], before=3, after=15,
                                        keep=lambda x, by=e["by"]: x.get("by") == by
                                        or x["type"] in ("run_end", "run_exit"))))
    for e in h.by_type["proc_exit"]:
        if e["t"] < end or e.get("code") == 0 or e["name"] in stopped or \
                f"{e['name']}#{e.get('incarnation')}" in judged:
            continue
        out.append(Violation("after the run", f"{e['name']} exited with {e.get('code')} after "
                             "the run ended", e["t"], h.slice(e["t"], before=20, after=1,
                                                              keep=lambda x: x["type"] in (
                                                                  "run_end", "proc_exit",
                                                                  "elected", "summary"))))
    for e in h.by_type["still_running"]:
        if e.get("role") != "coordinator":
            out.append(Violation("after the run", f"{e['name']} still ran "
                                 f"{e['t'] - end:.0f} s after the run ended", e["t"], []))
    for e in h.by_type["teardown"]:
        if e.get("leftovers"):
            out.append(Violation("leaks", f"processes left in the children's sessions: "
                                 f"{e['leftovers']}", e["t"], []))
        if e.get("tmp_files"):
            out.append(Violation("leaks", f"temporary files left: {e['tmp_files'][:5]}",
                                 e["t"], []))
        before, after = e.get("driver_fds") or [None, None]
        if before is not None and after is not None and after > before:
            out.append(Violation("leaks", f"the driver holds {after - before} more file "
                                 "descriptor(s) than before the run", e["t"], []))
    return out


def rule_resources(h: History) -> list[Violation]:
    """Each coordinator's RSS stays under ``RSS_LIMIT_MB`` and its descriptors under
    ``FD_LIMIT`` whatever the faults did (relay connections come and go)."""
    out = []
    worst: dict[str, Entry] = {}
    for s in h.by_type["sample"]:
        name = s["name"]
        if (s.get("rss_mb") or 0) > RSS_LIMIT_MB or (s.get("fds") or 0) > FD_LIMIT:
            if name not in worst:
                worst[name] = s
    for name, s in worst.items():
        out.append(Violation("resources", f"{name} (pid {s['pid']}): RSS {s.get('rss_mb'):.0f} "
                             f"MB, {s.get('fds')} descriptors (limits {RSS_LIMIT_MB:g} MB, "
                             f"{FD_LIMIT})", s["t"], []))
    return out


RULES = (rule_epochs, rule_false_deaths, rule_generations_grow, rule_one_coordinator,
         rule_deposed_records, rule_step_down, rule_run_end, rule_after_run, rule_resources,
         rule_membership)
