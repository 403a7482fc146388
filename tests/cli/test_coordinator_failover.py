"""Coordinator failover on the command line, as real processes: ``coordinator --store sqlite:``
SIGKILLed mid-run and started again on the same port with the same store adopts the running
session, the relays (``relay`` commands) say they lost it and resumed, no rank is declared dead
and the run completes; ``demo --kill-coordinator`` shows the same story end to end; an etcd
standby takes over a leader that was killed, or frozen (``SIGSTOP``), and the relays find it
through the store."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from helpers.cli_procs import Proc, coordinator, two_hosts

pytestmark = pytest.mark.slow


def test_a_coordinator_killed_and_restarted_on_its_store_continues_the_run(
        tmp_path: Path, env: dict[str, str], procs: list[Proc]) -> None:
    store = f"sqlite:{tmp_path / 'session.db'}"
    summary = tmp_path / "summary.json"
    run = ("--epochs", "4", "--total-samples", "160", "--summary-file", str(summary))
    first = coordinator(env, procs, store, *run)
    address = first.line_with("coordinator listening on").rsplit(" ", 1)[-1]
    relays, _ = two_hosts(env, procs, address, batch_ms=25)
    first.line_with("epoch 1/4:")  # the first epoch is done: kill it in the second
    first.popen.kill()
    killed = time.monotonic()
    assert first.wait() == -9
    assert not summary.exists()  # issue 34: a 0-byte file (it is now written whole, at the end)

    second = coordinator(env, procs, store, *run, listen=address)
    adopted = second.line_with("adopted the running session")
    took_over = time.monotonic() - killed
    assert re.search(rf"of {re.escape(store)} as generation 2: 2 live ranks, 0 dead; resuming "
                     r"at epoch [2-4]/4", adopted), adopted
    assert second.wait() == 0, second.err[-5:]
    for n, relay in enumerate(relays):
        lost = relay.line_with(f"relay h{n}: lost the coordinator")
        assert "riding it out for up to 30 s" in lost, lost
        assert "(generation 2;" in relay.line_with(f"relay h{n}: resumed with the coordinator")
    print(f"sqlite restart: adopted {took_over:.2f} s after the SIGKILL (a new process), both "
          f"relays resumed after {time.monotonic() - killed:.2f} s")
    assert all(relay.wait() == 0 for relay in relays)
    for relay in relays:  # told once, on stdout (the library's warning said it again)
        assert not [line for line in relay.err if "lost the coordinator" in line], relay.err
    result = json.loads(summary.read_text())
    assert result["epochs_completed"] == 4 and result["resumed"] is True
    assert result["dead_ranks"] == [] and result["coverage"]["exact"], result
    # The whole run's, numbered from 1: the first coordinator's epoch too (issue 34 item 7).
    assert [m["epoch"] for m in result["epoch_metrics"]] == [1, 2, 3, 4]
    assert all(isinstance(m["avg_loss"], float) for m in result["epoch_metrics"][:1])
    assert 2 <= result["first_epoch"] <= 4
    taken_over = second.line_with(f"epoch {result['first_epoch']}/4:")
    assert "begun before the takeover" in taken_over and "over 0.00 s" not in taken_over


def test_demo_kill_coordinator_adopts_and_finishes_with_every_epoch_covered_once(
        tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "flodl_trio", "demo", "--no-live", "--hosts", "2",
         "--ranks-per-host", "1", "--epochs", "3", "--total-samples", "160", "--batch-ms",
         "20", "--kill-coordinator", "0.5"], capture_output=True, text=True, timeout=150,
        env=dict(os.environ, TMPDIR=str(tmp_path)))
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    # Every time it prints is on one clock: the kill's stamp minus formation's is the
    # "after formation" it states, at least the 0.5 s asked for (it notices formation up to a
    # poll late), and the new coordinator's lines come after the kill.
    formed = float(re.search(r"^ *(\d+\.\d\d)s  formed in", out, re.M)[1])  # type: ignore[index]
    killed = re.search(r"^ *(\d+\.\d\d)s  SIGKILLed the coordinator \(pid \d+\) "
                       r"(\d+\.\d\d) s after formation, in epoch \d/3$", out, re.M)
    assert killed, out
    at, after = float(killed[1]), float(killed[2])
    assert 0.5 <= after < 2.5 and abs(at - formed - after) <= 0.011, (formed, at, after)
    restarted = re.search(r"^ *(\d+\.\d\d)s  started a coordinator again on 127\.0\.0\.1:\d+ "
                          r"\(pid \d+\) with sqlite:", out, re.M)
    adopted_at = re.search(r"^ *(\d+\.\d\d)s  adopted the running session", out, re.M)
    assert restarted and adopted_at, out
    assert at <= float(restarted[1]) <= float(adopted_at[1]), out
    # The summary's time spans both coordinators and says which epochs the second ran; every
    # epoch's loss is listed, whichever coordinator aggregated it.
    assert re.search(r"summary: 3/3 epochs in \d+\.\d s from formation to the last epoch "
                     r"\(epochs? [1-3](-3)? run by the adopting coordinator, in \d+\.\d s\)",
                     out), out
    assert [int(e) for e in re.findall(r"^  epoch (\d): avg loss", out, re.M)] == [1, 2, 3], out
    assert re.search(r"adopted the running session as generation 2: 2 live ranks, 0 dead", out)
    for host in ("host-a", "host-b"):
        assert re.search(rf"relay {host} resumed with ranks \[\d\]\n", out), out
    assert not re.search(r"rank \d+ \(host-.\) declared dead", out), out
    assert ("coordinator SIGKILLed and restarted: adopted as generation 2; relays resumed: "
            "host-a, host-b; no rank declared dead") in out
    assert "every epoch covered exactly once" in out and out.rstrip().endswith("run completed")
    assert list(tmp_path.iterdir()) == []  # its temporary directory (the store too) is gone


def with_a_standby(env: dict[str, str], procs: list[Proc], store: str, *run: str,
                   batch_ms: int) -> tuple[Proc, Proc, list[Proc], list[Proc]]:
    """A leader on ``store`` (its arguments ``run``) whose cohort formed over two hosts, then a
    standby on the same store: ``(leader, standby, relays, ranks)``."""
    leader = coordinator(env, procs, store, *run)
    leader.line_with("relays can dial")
    relays, ranks = two_hosts(env, procs, store, batch_ms=batch_ms)
    leader.line_with("formed: 2 ranks over 2 relays (generation 1 of ")
    return leader, coordinator(env, procs, store, *run, "--standby"), relays, ranks


def test_an_etcd_standby_takes_over_and_relays_find_it_through_the_store(
        tmp_path: Path, env: dict[str, str], procs: list[Proc], etcd: Any) -> None:
    store = f"etcd://{etcd.endpoint}/flodl/cli-standby"
    summary = tmp_path / "summary.json"
    leader, standby, relays, _ = with_a_standby(env, procs, store, "--epochs", "8",
                                                "--total-samples", "160", "--summary-file",
                                                str(summary), batch_ms=40)
    waiting = standby.line_with("standby: ")
    assert "is led by coordinator on " in waiting and f"pid {leader.popen.pid};" in waiting
    leader.line_with("epoch 1/8:")
    leader.popen.kill()
    killed = time.monotonic()
    assert leader.wait() == -9
    adopted = standby.line_with("adopted the running session")
    took_over = time.monotonic() - killed
    assert f"of {store} as generation 2: 2 live ranks, 0 dead" in adopted, adopted
    for n, relay in enumerate(relays):
        assert "(generation 2;" in relay.line_with(f"relay h{n}: resumed with the coordinator")
    resumed = time.monotonic() - killed
    print(f"etcd standby (ttl 2 s): adopted {took_over:.2f} s after the leader's SIGKILL, "
          f"both relays resumed after {resumed:.2f} s")
    assert standby.wait() == 0, standby.err[-5:]
    assert all(relay.wait() == 0 for relay in relays)
    result = json.loads(summary.read_text())
    assert result["epochs_completed"] == 8 and result["dead_ranks"] == []
    assert result["coverage"]["exact"], result


def test_a_frozen_etcd_leader_is_left_for_its_standby_in_seconds_and_no_rank_dies(
        tmp_path: Path, env: dict[str, str], procs: list[Proc], etcd: Any) -> None:
    # Issue 34: the leader is SIGSTOPped (a GC pause, a hung VM). Its lease runs out (2 s), the
    # standby leads; the relays, reading the store, move to it within seconds: not after their
    # coord_liveness_timeout (20 s), nor the ranks' (30 s), whose expiry killed every rank.
    store = f"etcd://{etcd.endpoint}/flodl/cli-frozen"
    summary = tmp_path / "summary.json"
    leader, standby, relays, ranks = with_a_standby(env, procs, store, "--epochs", "4",
                                                    "--total-samples", "320", "--summary-file",
                                                    str(summary), batch_ms=25)
    standby.line_with("standby: ")  # mid-run: an epoch is 1 s, the run 4 s
    leader.signal(signal.SIGSTOP)
    frozen = time.monotonic()
    standby.line_with("adopted the running session")
    for n, relay in enumerate(relays):
        lost = relay.line_with(f"relay h{n}: lost the coordinator")
        assert "(a newer coordinator leads: generation 2 at 127.0.0.1:" in lost, lost
        assert f"published at {store})" in lost, lost
        assert "(generation 2;" in relay.line_with(f"relay h{n}: resumed with the coordinator")
    resumed = time.monotonic() - frozen
    print(f"frozen etcd leader (ttl 2 s): both relays resumed {resumed:.2f} s after the SIGSTOP")
    assert resumed < 8, resumed  # lease 2 s + a read per second; never the 20 s deadline
    assert standby.wait() == 0, standby.err[-5:]
    assert all(relay.wait() == 0 for relay in relays)
    assert all(rank.wait() == 0 for rank in ranks), [rank.err[-2:] for rank in ranks]
    result = json.loads(summary.read_text())
    assert result["epochs_completed"] == 4 and result["dead_ranks"] == [], result
    leader.popen.kill()  # still stopped: SIGKILL ends it anyway
