"""A run's life in its session store on the command line, as real processes (issues 34 and 39):
a standby whose leader ends gracefully exits 0 saying the run finished (it used to adopt the
finished session and fail 30 s later with ALL_RANKS_LOST), and says ``standby`` on its status
page meanwhile; a second run on the same SQLite file starts a new session; ``--fresh`` starts
one over an unfinished session of another run; a leader SIGSTOPped until a standby took over
says nothing but that it steps down when it wakes, and leaves at once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from helpers.cli_procs import Proc, coordinator, two_hosts
from helpers.store import another_runs_session

pytestmark = pytest.mark.slow

DEPOSED_EXIT_S = 2.0  # docs/failover.rst: within 1 s, plus a loaded 2-core machine's slack




def test_a_standby_exits_0_when_the_run_it_waits_for_ends_and_says_standby_meanwhile(
        tmp_path: Path, env: dict[str, str], procs: list[Proc]) -> None:
    store = f"sqlite:{tmp_path / 'run.db'}"
    summary = tmp_path / "summary.json"
    run = ("--total-samples", "80", "--epochs", "2", "--summary-file", str(summary))
    leader = coordinator(env, procs, store, *run)
    address = leader.line_with("coordinator listening on").rsplit(" ", 1)[-1]
    standby = coordinator(env, procs, store, *run, "--standby")
    waiting = standby.line_with("standby: ")
    assert waiting.endswith("waiting for the leadership (it would lead as generation 2)")
    standby_at = standby.line_with("coordinator listening on").rsplit(" ", 1)[-1]
    status = subprocess.run([sys.executable, "-m", "flodl_trio", "status", "--json",
                             standby_at], capture_output=True, text=True, env=env, timeout=30)
    state = json.loads(status.stdout)
    assert state["phase"] == "standby" and state["covered"] == 0, state  # not "forming"
    assert state["standby"]["store"] == store and state["standby"]["would_lead_as"] == 2
    assert state["standby"]["leader"].endswith(f"pid {leader.popen.pid}")
    relays, _ = two_hosts(env, procs, address)
    assert leader.wait() == 0, leader.err[-5:]
    ended = time.monotonic()
    assert standby.wait() == 0, standby.err  # not 30 s later with ALL_RANKS_LOST
    assert time.monotonic() - ended < 10
    assert standby.out[-1] == (f"standby: the run it waited for on {store} ended (generation "
                               "1: the block exited); nothing to adopt"), standby.out
    assert standby.err == []
    assert json.loads(summary.read_text())["epochs_completed"] == 2  # the leader's, untouched
    assert all(relay.wait() == 0 for relay in relays)


def test_a_second_run_on_the_same_store_starts_a_new_session_with_the_next_generation(
        tmp_path: Path, env: dict[str, str], procs: list[Proc]) -> None:
    """Issue 39 item 1: the same salt adopted the finished session and its relays were refused
    (``rank 0 exited cleanly and does not rejoin``); another salt was a StoreCorrupt."""
    store = f"sqlite:{tmp_path / 'run.db'}"
    for generation, salt in ((1, "ab" * 16), (2, "cd" * 16)):
        run_env = dict(env, FLODL_SALT_HEX=salt)
        leader = coordinator(run_env, procs, store, "--epochs", "1")
        address = leader.line_with("coordinator listening on").rsplit(" ", 1)[-1]
        relays, _ = two_hosts(run_env, procs, address)
        assert leader.line_with("formed: ") == (
            f"formed: 2 ranks over 2 relays (generation {generation} of {store}, a new "
            "session)")
        assert leader.wait() == 0, leader.err[-5:]
        assert all(relay.wait() == 0 for relay in relays), [r.err for r in relays]


def test_fresh_starts_a_new_session_over_another_runs_unfinished_one(
        tmp_path: Path, env: dict[str, str], procs: list[Proc]) -> None:
    path = tmp_path / "run.db"
    # Refused without --fresh: tests/cli/test_store_options.py.
    another_runs_session(path, owner="a coordinator that crashed",
                         roster=(("elsewhere", (0, 1)),), formed=True)
    store, summary = f"sqlite:{path}", tmp_path / "summary.json"
    fresh = coordinator(env, procs, store, "--total-samples", "80", "--epochs", "1", "--fresh",
                        "--summary-file", str(summary))
    address = fresh.line_with("coordinator listening on").rsplit(" ", 1)[-1]
    relays, _ = two_hosts(env, procs, address)
    assert fresh.line_with("formed: ").endswith(f"(generation 2 of {store}, a new session)")
    assert fresh.wait() == 0, fresh.err[-5:]
    assert all(relay.wait() == 0 for relay in relays)
    result = json.loads(summary.read_text())
    assert result["epochs_completed"] == 1 and result["first_epoch"] == 1  # counted from 1
    assert [m["epoch"] for m in result["epoch_metrics"]] == [1]


def test_a_leader_woken_after_a_standby_took_over_says_only_that_it_steps_down(
        tmp_path: Path, env: dict[str, str], procs: list[Proc], etcd: Any) -> None:
    """Issue 34 item 4: woken after a long SIGSTOP it logged each rank declared dead and
    ``ERROR cluster failure: ALL_RANKS_LOST`` before ``stepping down``, and wrote its summary.
    The relays here give up on a silent coordinator after 3 s (timeouts scaled by 0.1), so the
    old leader wakes to their closed connections."""
    store = f"etcd://{etcd.endpoint}/flodl/deposed"
    summary = tmp_path / "summary.json"
    run = ("--total-samples", "80", "--epochs", "40")
    leader = coordinator(env, procs, store, *run, "--summary-file", str(summary))
    leader.line_with("relays can dial")
    relays, _ = two_hosts(env, procs, store, batch_ms=25,
                          relay_env=dict(env, FLODL_NET_TIMEOUT_SCALE="0.1"))
    leader.line_with("epoch 1/40:")
    standby = coordinator(env, procs, store, *run, "--standby")
    standby.line_with("standby: ")
    leader.popen.send_signal(signal.SIGSTOP)
    try:
        standby.line_with("adopted the running session")
        for n, relay in enumerate(relays):
            relay.line_with(f"relay h{n}: resumed with the coordinator")
        time.sleep(1)  # the relays closed their connections to the stopped leader
        said_out, said_err = len(leader.out), len(leader.err)
    finally:
        leader.popen.send_signal(signal.SIGCONT)
    woken = time.monotonic()
    assert leader.wait() == 1
    took = time.monotonic() - woken
    assert took < DEPOSED_EXIT_S, took
    assert leader.out[said_out:] == []  # no death, no epoch, no summary
    (line,) = leader.err[said_err:]
    assert line.startswith(f"flodl-trio: stepping down: store {store}: expected to lead as "
                           "generation 1, but"), line
    assert not any("declared dead" in x or "cluster failure" in x for x in leader.err)
    assert not summary.exists()
    standby.popen.send_signal(signal.SIGTERM)  # its own run is not this test's
    assert standby.wait() == 143
