"""Waking up on the command line (issue 37), as real processes on loopback: a coordinator of a
world of 4 (``--heartbeat-timeout 2``), two relays of two ranks each; one relay and its ranks
are SIGSTOPped past the heartbeat timeout (declared dead, fenced), then SIGCONTed. The relay
joins again with the same rank processes (``rejoin_when_fenced`` is on by default in the CLI),
the ranks are alive again in state.json, the run completes with every epoch covered exactly
once and every process exits 0."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from typing import Any

import pytest

from helpers.cli_procs import Proc

FROZEN_S = 3.5  # past --heartbeat-timeout 2


def state_of(address: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{address}/state.json", timeout=5) as answer:
        doc = json.loads(answer.read())
    assert isinstance(doc, dict)
    return doc


def until(address: str, check: Any, *, within: float) -> dict[str, Any]:
    """The first state.json that passes ``check`` (polled every 50 ms, for ``within`` s)."""
    deadline = time.monotonic() + within
    state: dict[str, Any] = {}
    while time.monotonic() < deadline:
        state = state_of(address)
        if check(state):
            return state
        time.sleep(0.05)
    raise AssertionError(f"not within {within:g} s; last state: {state}")


def host(procs: list[Proc], env: dict[str, str], address: str, name: str,
         ranks: list[int]) -> tuple[Proc, list[Proc]]:
    relay = Proc("relay", "--coordinator", address, "--host", name, "--ranks",
                 ",".join(map(str, ranks)), "--world-size", "4", env=env)
    procs.append(relay)
    listening = relay.line_with("listening for ranks on").rsplit(" ", 1)[-1]
    started = [Proc("rank", "--relay", listening, "--rank", str(rank), "--world-size", "4",
                    "--batch-ms", "20", env=env) for rank in ranks]
    procs.extend(started)
    return relay, started


@pytest.mark.slow
def test_a_sigstopped_host_declared_dead_comes_back_on_sigcont_without_a_restart(
    env: dict[str, str], procs: list[Proc],
) -> None:
    coord = Proc("coordinator", "--listen", "127.0.0.1:0", "--world-size", "4",
                 "--heartbeat-timeout", "2", "--epochs", "3", "--total-samples", "1024",
                 env=env)
    procs.append(coord)
    address = coord.line_with("coordinator listening on").rsplit(" ", 1)[-1]
    _, survivors = host(procs, env, address, "h0", [0, 1])
    relay, frozen = host(procs, env, address, "h1", [2, 3])
    assert coord.line_with("formed: ") == "formed: 4 ranks over 2 relays"

    time.sleep(0.5)
    for proc in (relay, *frozen):
        proc.signal(signal.SIGSTOP)
    dead = until(address, lambda s: [d["rank"] for d in s["dead"]] == [2, 3], within=10)
    assert {d["reason"] for d in dead["dead"]} == {"heartbeat stale (>2s)"}
    time.sleep(max(0.0, FROZEN_S - 2.0))
    for proc in (relay, *frozen):
        proc.signal(signal.SIGCONT)
    back = until(address, lambda s: s["live"] == [0, 1, 2, 3], within=5)
    assert back["dead"] == []

    assert coord.wait() == 0, (coord.out, coord.err)
    assert "coordinator: 3/3 epochs, every epoch covered exactly once" in coord.out
    assert relay.line_with("relay h1: the coordinator fenced every rank it carries") == (
        "relay h1: the coordinator fenced every rank it carries (heartbeat stale (>2s)); "
        "joining again with ranks [2, 3]")
    assert relay.line_with("back in the run") == "relay h1: back in the run with its ranks " \
        "(wake-up 1)"
    assert relay.wait() == 0, (relay.out, relay.err)
    for rank, proc in zip((2, 3), frozen, strict=True):
        assert proc.wait() == 0, (proc.out, proc.err)
        assert proc.line_with("brought back") == (
            f"rank {rank}: fenced and brought back by its relay 1 time(s)")
    for proc in survivors:
        assert proc.wait() == 0, (proc.out, proc.err)
