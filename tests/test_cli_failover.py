"""Coordinator failover on the command line, as real processes: ``coordinator --store sqlite:``
SIGKILLed mid-run and started again on the same port with the same store adopts the running
session, the relays (``relay`` commands) say they lost it and resumed, no rank is declared dead
and the run completes; and ``demo --kill-coordinator`` shows the same story end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cli_procs import Proc

from helpers import load_script

pytestmark = pytest.mark.slow


def test_a_coordinator_killed_and_restarted_on_its_store_continues_the_run(
        tmp_path: Path, env: dict[str, str], procs: list[Proc]) -> None:
    store = f"sqlite:{tmp_path / 'session.db'}"
    summary = tmp_path / "summary.json"

    def coordinator(listen: str) -> Proc:
        proc = Proc("coordinator", "--listen", listen, "--world-size", "2", "--epochs", "4",
                    "--total-samples", "160", "--store", store, "--summary-file", str(summary),
                    env=env)
        procs.append(proc)
        return proc

    first = coordinator("127.0.0.1:0")
    address = first.line_with("coordinator listening on").rsplit(" ", 1)[-1]
    relays = []
    for rank in (0, 1):
        relay = Proc("relay", "--coordinator", address, "--host", f"h{rank}", "--ranks",
                     str(rank), "--world-size", "2", env=env)
        procs.append(relay)
        relays.append(relay)
    for rank, relay in enumerate(relays):
        rank_address = relay.line_with("listening for ranks on").rsplit(" ", 1)[-1]
        procs.append(Proc("rank", "--relay", rank_address, "--rank", str(rank), "--world-size",
                          "2", "--batch-ms", "25", env=env))
    first.line_with("epoch 1/4:")  # the first epoch is done: kill it in the second
    first.popen.kill()
    killed = time.monotonic()
    assert first.wait() == -9
    assert not summary.exists()  # issue 34: a 0-byte file (it is now written whole, at the end)

    second = coordinator(address)
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
    assert re.search(r"SIGKILLed the coordinator \(pid \d+\) 0\.5s after formation", out), out
    assert re.search(r"adopted the running session as generation 2: 2 live ranks, 0 dead", out)
    for host in ("host-a", "host-b"):
        assert re.search(rf"relay {host} resumed with ranks \[\d\]\n", out), out
    assert not re.search(r"rank \d+ \(host-.\) declared dead", out), out
    assert ("coordinator SIGKILLed and restarted: adopted as generation 2; relays resumed: "
            "host-a, host-b; no rank declared dead") in out
    assert "every epoch covered exactly once" in out and out.rstrip().endswith("run completed")
    assert list(tmp_path.iterdir()) == []  # its temporary directory (the store too) is gone


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[Any]:
    helper = load_script("_etcd")
    if helper.etcd_binary() is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    with helper.EtcdServer(tmp_path) as server:
        yield server


def test_an_etcd_standby_takes_over_and_relays_find_it_through_the_store(
        tmp_path: Path, env: dict[str, str], procs: list[Proc], etcd: Any) -> None:
    store = f"etcd://{etcd.endpoint}/flodl/cli-standby"
    summary = tmp_path / "summary.json"

    def coordinator(*extra: str) -> Proc:
        proc = Proc("coordinator", "--listen", "127.0.0.1:0", "--world-size", "2", "--epochs",
                    "8", "--total-samples", "160", "--store", store, "--summary-file",
                    str(summary), *extra, env=env)
        procs.append(proc)
        return proc

    leader = coordinator()
    leader.line_with("relays can dial")
    relays = []
    for rank in (0, 1):
        relay = Proc("relay", "--coordinator", store, "--host", f"h{rank}", "--ranks",
                     str(rank), "--world-size", "2", env=env)
        procs.append(relay)
        relays.append(relay)
    for rank, relay in enumerate(relays):
        rank_address = relay.line_with("listening for ranks on").rsplit(" ", 1)[-1]
        procs.append(Proc("rank", "--relay", rank_address, "--rank", str(rank), "--world-size",
                          "2", "--batch-ms", "40", env=env))
    leader.line_with("formed: 2 ranks over 2 relays (generation 1 of ")
    standby = coordinator("--standby")
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
