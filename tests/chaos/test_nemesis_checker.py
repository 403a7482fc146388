"""The nemesis's checker (scripts/_nemesis_checker.py) over synthetic histories: a clean run
passes, and each rule catches the violation it is for, printed with the slice of history that
shows it. No process runs here: the nemesis itself (scripts/nemesis.py) is not in the suite."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from helpers.scripts import SCRIPTS

if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

import _nemesis_checker as checker

T0 = 1_800_000_000.0
TIMINGS = {"heartbeat_timeout": 6.0, "resume_timeout": 10.0, "grace": 20.0, "lease_ttl": 2.0,
           "handshake": 2.0, "coord_liveness": 6.0, "scale": 0.2}


def e(t: float, entry_type: str, /, **fields: Any) -> dict[str, Any]:
    return {"t": T0 + t, "type": entry_type, **fields}


def clean() -> list[dict[str, Any]]:
    """Two epochs, two hosts of two ranks, generation 1 leads throughout, a clean end."""
    h = [e(0, "config", timings=TIMINGS), e(0, "layout", epochs=2, ranks_per_host=2, hosts=2),
         e(1, "elected", by="coord-a#0", pid=100, generation=1, adopted=False)]
    for host, ranks in (("host-0", (0, 1)), ("host-1", (2, 3))):
        h.append(e(2, "relay_joined", by="coord-a#0", generation=1, host=host, peer="p"))
        h.append(e(2.01, "relay_accept", host=host, incarnation=0, generation=1, how="join"))
        for rank in ranks:
            h += [e(3, "rank_msg", rank=rank, incarnation=0, label="StartEpoch", value="0"),
                  e(4, "rank_msg", rank=rank, incarnation=0, label="SyncNow", value="")]
    for epoch in (0, 1):
        h.append(e(5 + epoch, "epoch_covered", by="coord-a#0", generation=1, epoch=epoch,
                   exactly_once=True, samples=160, total=160, gaps=0, overlaps=0))
    h += [e(8, "run_end", name="coord-a", incarnation=0, failed=None, epochs=2),
          e(8.5, "run_exit", name="coord-a", code=0),
          e(9, "proc_exit", name="relay host-0", role="relay", incarnation=0, code=0),
          e(10, "sample", name="coord-a", pid=100, rss_mb=60.0, fds=30),
          e(11, "teardown", leftovers=[], tmp_files=[], driver_fds=[6, 6])]
    return h


def violations(history: list[dict[str, Any]]) -> list[Any]:
    return checker.check(history).violations


def only(history: list[dict[str, Any]], rule: str) -> Any:
    found = violations(history)
    assert [v.rule for v in found] == [rule], [(v.rule, v.message) for v in found]
    return found[0]


def fault(t: float, end: float, kind: str, index: int = 0,
          **fields: Any) -> list[dict[str, Any]]:
    kills = kind in ("relay-kill", "link-cut", "rank-kill", "link-stall-long")
    return [e(t, "fault", index=index, kind=kind, kills=kills, start=T0 + t, **fields),
            e(end, "heal", index=index, kind=kind, start=T0 + t, end=T0 + end,
              target=fields.get("target"), ranks=fields.get("ranks", []))]


def test_a_clean_history_passes_with_its_figures() -> None:
    report = checker.check(clean())
    assert report.violations == []
    assert report.exactly_once == 1.0 and report.exit_code == 0 and report.false_deaths == 0


def test_an_epoch_never_closed_and_one_counted_twice_are_caught() -> None:
    history = [x for x in clean() if not (x["type"] == "epoch_covered" and x["epoch"] == 1)]
    assert "1 epoch(s) never closed by any coordinator: 2" in only(history, "epochs").message
    history = [{**x, "exactly_once": False, "overlaps": 8} if x["type"] == "epoch_covered"
               and x["epoch"] == 1 else x for x in clean()]
    found = only(history, "epochs")
    assert "epoch 2 closed by coord-a#0 (generation 1) with 0 samples missed and 8 counted " \
        "twice" in found.message
    assert checker.check(history).exactly_once == 0.5


def test_a_death_with_no_fault_that_kills_is_false_and_printed_with_its_history() -> None:
    death = e(4.5, "dead", by="coord-a#0", generation=1, rank=2, host="host-1",
              reason="heartbeat stale (>6s)")
    found = only([*clean(), death], "false death")
    assert found.message.startswith("rank 2 (host-1) declared dead by coord-a#0 (generation 1) "
                                    "with no fault that kills it: heartbeat stale")
    assert any("dead" in line and "rank=2" in line for line in found.history)
    # a relay SIGSTOP shorter than heartbeat_timeout does not excuse it
    stop = fault(3.0, 4.0, "relay-stop", target="host-1", ranks=[2, 3])
    assert only([*clean(), *stop, death], "false death")
    # a relay killed on its host does
    kill = fault(4.0, 6.0, "relay-kill", target="host-1", ranks=[2, 3])
    assert violations([*clean(), *kill, death]) == []


def test_a_restart_excuses_only_the_deaths_after_it() -> None:
    death = e(4.5, "dead", by="coord-a#0", generation=1, rank=2, host="host-1", reason="x")
    caused = e(4.6, "restart", target="host-1", cause="rank 2 exit 1")
    assert only([*clean(), death, caused], "false death")
    assert violations([*clean(), caused, {**death, "t": T0 + 4.7}]) == []


def test_a_run_that_stopped_progressing_is_one_run_end_not_the_deaths_of_stopping_it() -> None:
    # The nemesis stops the cluster once no epoch closed for its tail: the relays' ends then
    # read as deaths, which are its doing; the run's end says what went wrong.
    history = [x for x in clean() if x["type"] not in ("run_end", "run_exit", "proc_exit")
               and not (x["type"] == "epoch_covered" and x["epoch"] == 1)]
    stopped = [e(7.0, "run_timeout", seconds=100.0, epochs_closed=1),
               e(7.01, "dead", by="coord-a#0", generation=1, rank=0, host="host-0",
                 reason="relay 'host-0' at p lost: connection closed by the relay (EOF)")]
    found = violations([*history, *stopped])
    assert sorted(v.rule for v in found) == ["epochs", "run end"], [v.message for v in found]
    # the same death before the nemesis stopped anything is a false one
    early = [{**x, "t": T0 + 6.9} if x["type"] == "dead" else x for x in stopped]
    assert "false death" in [v.rule for v in violations([*history, *early])]


def test_a_death_declared_by_a_superseded_coordinator_is_not_counted() -> None:
    history = [*clean(), e(6.5, "elected", by="coord-b#0", pid=200, generation=2,
                           adopted=True),
               e(7.0, "dead", by="coord-a#0", generation=1, rank=0, host="host-0", reason="x")]
    report = checker.check(history)
    assert report.violations == [] and report.deposed_deaths == 1


def test_a_relay_going_back_a_generation_is_caught() -> None:
    history = [*clean(), e(6.0, "elected", by="coord-b#0", pid=200, generation=2, adopted=True),
               e(6.1, "relay_accept", host="host-0", incarnation=0, generation=2, how="resume"),
               e(7.0, "relay_accept", host="host-0", incarnation=1, generation=1, how="join")]
    found = [v for v in violations(history) if v.rule == "generations"]
    assert [v.message for v in found] == ["relay host-0 went from generation 2 back to 1"]


def test_a_superseded_coordinator_accepting_a_relay_is_caught() -> None:
    history = [*clean(), e(6.0, "elected", by="coord-b#0", pid=200, generation=2, adopted=True),
               e(7.0, "relay_joined", by="coord-a#0", generation=1, host="host-1", peer="p")]
    found = only(history, "one coordinator")
    assert found.message == ("coord-a#0 (generation 1) accepted relay host-1 1.00 s after a "
                             "newer generation was elected")


def test_two_coordinators_elected_with_one_generation_are_caught() -> None:
    history = [*clean(), e(6.0, "elected", by="coord-b#0", pid=200, generation=1,
                           adopted=True)]
    found = only(history, "one coordinator")
    assert found.message == "coord-b#0 and coord-a#0 were both elected with generation 1"


def test_relays_accepting_an_older_generation_after_a_newer_one_is_caught() -> None:
    history = [*clean(), e(6.0, "elected", by="coord-b#0", pid=200, generation=2, adopted=True),
               e(6.5, "relay_accept", host="host-0", incarnation=0, generation=2, how="resume"),
               e(6.8, "relay_accept", host="host-1", incarnation=1, generation=1, how="join")]
    found = only(history, "one coordinator")
    assert found.message == ("relay host-1 accepted generation 1 after relay host-0 had "
                             "accepted generation 2")


def test_a_record_of_a_frozen_leader_delivered_after_it_woke_is_caught() -> None:
    frozen = fault(4.0, 9.0, "coord-stop", target="coord-a", pid=100)
    standby = e(7.0, "elected", by="coord-b#0", pid=200, generation=2, adopted=True)
    late = e(9.02, "rank_msg", rank=3, incarnation=0, label="SyncNow", value="")
    found = only([*clean(), *frozen, standby, late], "deposed records")
    assert found.message == ("ranks [3] were handed 1 record(s) (SyncNow) of generation 1 "
                             "from 9.020 s on; generation 1 was superseded at 7.000 s")
    assert any("SyncNow" in line for line in found.history)
    # the same record after the relay said it resumed with generation 2 is generation 2's
    resumed = e(9.01, "rank_msg", rank=3, incarnation=0, label="CoordinatorResumed", value="2")
    assert violations([*clean(), *frozen, standby, resumed, late]) == []


def test_a_step_down_without_a_fault_that_takes_the_lease_is_caught() -> None:
    down = e(5.5, "stepped_down", by="coord-a#0", generation=1, reason="stepping down: no "
             "renewal (etcd 127.0.0.1:1: no answer)")
    member = fault(4.0, 6.0, "etcd-kill", target="flodl-m0")
    found = only([*clean(), *member, down], "step-down")
    assert "coord-a#0 (generation 1) stepped down with no fault that takes its lease" in \
        found.message
    quorum = fault(4.0, 6.0, "etcd-quorum", target="flodl-m0,flodl-m1")
    assert violations([*clean(), *quorum, down]) == []


@pytest.mark.parametrize(("change", "message"), [
    (lambda h: [x for x in h if x["type"] not in ("run_end", "run_exit")],
     "the run did not end within the schedule and its tail"),
    (lambda h: [{**x, "failed": "ClusterFailure: ALL_RANKS_LOST", "epochs": None}
                if x["type"] == "run_end" else x for x in h],
     "coord-a ended the run after None/2 epochs: ClusterFailure: ALL_RANKS_LOST"),
    (lambda h: [{**x, "code": 1} if x["type"] == "run_exit" else x for x in h],
     "coord-a exited with 1 after it ended the run (expected 0)"),
])
def test_a_run_that_does_not_end_with_every_epoch_and_exit_0_is_caught(
        change: Any, message: str) -> None:
    found = [v for v in violations(change(clean())) if v.rule == "run end"]
    assert [v.message for v in found] == [message]


def every_rank_killed(failed: str, code: int, *, host_1_faulted: bool = True,
                      rejoined: bool = False) -> list[dict[str, Any]]:
    """clean() where relay-kills take both hosts at once in epoch 1 and the run fails."""
    h = [x for x in clean() if x["type"] not in ("run_end", "run_exit", "epoch_covered")
         or x.get("epoch") == 0]
    h += fault(5.2, 7.0, "relay-kill", 0, target="host-0", ranks=[0, 1])
    if host_1_faulted:
        h += fault(5.3, 7.0, "relay-kill", 1, target="host-1", ranks=[2, 3])
    for rank in (0, 1, 2, 3):
        h.append(e(5.25 + 0.1 * (rank // 2), "dead", rank=rank, host=f"host-{rank // 2}",
                   by="coord-a#0", generation=1, reason="relay lost"))
    if rejoined:
        h.append(e(5.32, "rejoined", rank=0, host="host-0", by="coord-a#0", generation=1))
    h += [e(5.4, "run_end", name="coord-a", incarnation=0, failed=failed, epochs=1),
          e(5.5, "run_exit", name="coord-a", code=code)]
    return sorted(h, key=lambda x: x["t"])


POLICY = "ClusterFailure: cluster failure: ALL_RANKS_LOST; dead ranks [0, 1, 2, 3] (no live " \
    "rank is left)"


def test_a_schedule_that_killed_every_rank_is_judged_by_the_failure_policys_end() -> None:
    # --max-hosts-down 2 of 2 hosts: every rank died of a fault; ALL_RANKS_LOST and exit 1
    # are the right end, the epochs after it are not missed
    assert violations(every_rank_killed(POLICY, 1)) == []
    # ... and nothing else: another reason, or another exit code, is still the run's failure
    found = sorted(violations(every_rank_killed("ReformationError: no live rank to ask", 1)),
                   key=lambda v: v.rule, reverse=True)
    assert [v.rule for v in found] == ["run end", "epochs"]
    assert found[0].message.startswith("coord-a ended the run after 1/2 epochs: Reformation")
    found = only(every_rank_killed(POLICY, 0), "run end")
    assert found.message == "coord-a exited with 0 after it ended the run (expected 1)"
    # a rank that died of no fault, or that was back, is no schedule's loss of every rank
    found = violations(every_rank_killed(POLICY, 1, host_1_faulted=False))
    assert sorted(v.rule for v in found) == ["epochs", "false death", "false death", "run end"]
    found = violations(every_rank_killed(POLICY, 1, rejoined=True))
    assert sorted(v.rule for v in found) == ["epochs", "run end"]


def test_after_the_run_a_failed_exit_an_adopted_finished_run_and_leaks_are_caught() -> None:
    history = [*clean(), e(9.1, "proc_exit", name="rank 3", role="rank", incarnation=0,
                           code=1),
               e(9.2, "elected", by="coord-b#0", pid=200, generation=2, adopted=True),
               e(9.3, "still_running", name="relay host-1", role="relay", pid=300)]
    history[-4] = {**history[-4], "leftovers": ["4242 (python)"], "tmp_files": ["x.tmp"],
                   "driver_fds": [6, 7]}  # the teardown
    messages = [v.message for v in violations(history)]
    assert messages[0].startswith("rank 3 exited with 1 after the run ended")
    assert "coord-b#0 was elected (generation 2) after the run ended and adopted the finished " \
        "session; it declared ranks [] dead" in messages
    assert any(m.startswith("relay host-1 still ran") for m in messages)
    assert "processes left in the children's sessions: ['4242 (python)']" in messages
    assert "temporary files left: ['x.tmp']" in messages
    assert "the driver holds 1 more file descriptor(s) than before the run" in messages


def test_a_coordinator_over_its_rss_or_descriptor_bound_is_caught() -> None:
    history = [*clean(), e(7, "sample", name="coord-a", pid=100, rss_mb=250.0, fds=30)]
    assert "coord-a (pid 100): RSS 250 MB" in only(history, "resources").message


def drained(*, dead: int | None = None, exit_code: int = 0,
            rejoined: bool = True) -> list[dict[str, Any]]:
    """clean() with host-1 (ranks 2, 3) drained from 4.0 s to 5.0 s (SIGTERM to its relay):
    the coordinator hears Draining and retires both ranks as they exit; the heal starts the
    host again and its ranks join anew. ``dead``: that rank is declared dead instead."""
    h = [*clean(), *fault(4.0, 5.0, "host-drain", target="host-1", ranks=[2, 3])]
    for name, t in (("relay host-1", 2.0), ("rank 2", 2.0), ("rank 3", 2.0)):
        h.append(e(t - 1.5, "proc_start", name=name, role=name.split()[0], incarnation=0))
    h.append(e(4.01, "draining", by="coord-a#0", generation=1, host="host-1", ranks=[2, 3],
               reason="SIGTERM"))
    for rank in (2, 3):
        if rank == dead:
            h.append(e(4.2, "dead", by="coord-a#0", generation=1, rank=rank, host="host-1",
                       reason="relay 'host-1' at p lost: connection closed by the relay (EOF)"))
        else:
            h.append(e(4.05, "retired", by="coord-a#0", generation=1, rank=rank,
                       host="host-1", reason="its host 'host-1' left: SIGTERM", world=2 + rank))
        h.append(e(4.1, "proc_exit", name=f"rank {rank}", role="rank", incarnation=0,
                   code=exit_code if rank == 3 else 0))
    h.append(e(4.2, "proc_exit", name="relay host-1", role="relay", incarnation=0, code=0))
    h.append(e(5.0, "host_start", target="host-1", cause="host-drain healed"))
    if rejoined:
        h += [e(5.6, "joined", by="coord-a#0", generation=1, rank=rank, host="host-1",
                world=3 + rank) for rank in (2, 3)]
    # the run goes on long enough after the heal that the host must have joined again
    return [x if x["type"] not in ("run_end", "run_exit", "teardown")
            else {**x, "t": x["t"] + 40} for x in h]


def test_a_drained_hosts_ranks_are_retired_not_dead_and_join_again() -> None:
    report = checker.check(drained())
    assert report.violations == [], [(v.rule, v.message) for v in report.violations]
    assert (report.retired, report.joined, report.false_deaths) == (2, 2, 0)
    assert "ranks retired 2, joined 2" in report.text()


def test_a_death_during_a_drain_is_still_a_false_death() -> None:
    # a drain kills nobody: a rank declared dead instead of retired has no fault to excuse it
    found = sorted(violations(drained(dead=2)), key=lambda v: v.rule)
    assert [v.rule for v in found] == ["false death", "membership"]
    assert found[0].message.startswith("rank 2 (host-1) declared dead by coord-a#0 "
                                       "(generation 1) with no fault that kills it")
    assert found[1].message == ("host-drain of host-1 (fault 0): rank(s) [2] were not retired "
                                "after their host drained (a drained rank leaves the world "
                                "retired, never dead)")
    assert checker.check(drained(dead=2)).false_deaths == 1


def test_a_drained_rank_that_fails_or_a_host_that_never_joins_again_is_caught() -> None:
    found = only(drained(exit_code=1), "membership")
    assert found.message == ("host-drain of host-1 (fault 0): rank 3 exited with 1 after its "
                             "host drained (expected 0)")
    found = only(drained(rejoined=False), "membership")
    assert found.message == ("host-drain of host-1 (fault 0) started again: rank(s) [2, 3] "
                             "never joined the running cohort within 30.5 s")


def spare_joined(*, joined: bool = True) -> list[dict[str, Any]]:
    """clean() with the spare host-4 (ranks 8, 9) started at 3.0 s: it joins the running
    cohort (a relay of generation 1 like the others), and is drained when the fault heals."""
    h = [*clean(), *fault(3.0, 6.0, "host-join", target="host-4", ranks=[8, 9])]
    h += [e(3.0, "proc_start", name=name, role=name.split()[0], incarnation=0)
          for name in ("relay host-4", "rank 8", "rank 9")]
    if joined:
        h += [e(3.5, "relay_joined", by="coord-a#0", generation=1, host="host-4", peer="p"),
              e(3.51, "relay_accept", host="host-4", incarnation=0, generation=1, how="join")]
        h += [e(3.5, "joined", by="coord-a#0", generation=1, rank=r, host="host-4",
                world=5 + r - 8) for r in (8, 9)]
    h.append(e(5.0, "drain", target="host-4", cause="host-join healed"))
    h += [e(5.1, "retired", by="coord-a#0", generation=1, rank=r, host="host-4",
            reason="its host 'host-4' left: SIGTERM", world=13 - r) for r in (8, 9)]
    h += [e(5.2, "proc_exit", name=name, role=name.split()[0], incarnation=0, code=0)
          for name in ("rank 8", "rank 9", "relay host-4")]
    return h


def test_a_spare_that_joins_and_drains_is_no_generation_rejoin_or_death_violation() -> None:
    report = checker.check(spare_joined())
    assert report.violations == [], [(v.rule, v.message) for v in report.violations]
    assert (report.joined, report.retired) == (2, 2)
    found = only(spare_joined(joined=False), "membership")
    assert found.message == ("host-join of host-4 (fault 0): rank(s) [8, 9] never joined the "
                             "running cohort within 3.0 s")


def test_a_drain_that_did_not_finish_is_caught() -> None:
    late = e(7.0, "drain_overdue", index=0, target="host-4", running=["rank 9"], seconds=30.0)
    found = only([*spare_joined(), late], "membership")
    assert found.message == ("host-4 had not finished draining 30.0 s after SIGTERM: "
                             "['rank 9'] still ran (killed)")
