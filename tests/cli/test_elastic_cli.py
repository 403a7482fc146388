"""Elastic membership on the command line (issue 37), as real processes on loopback: the
done-when scenario of the issue. A coordinator of ``--world-size 2:6 --retire-after 2`` forms
with one relay of ranks 0-1; a relay of ranks 2-5 started 3 s later joins the running cohort (its
ranks alive in state.json within 3 s, ``world.current`` 6); that relay SIGKILLed, its ranks are
retired within 5 s (``world.current`` 2), the run goes on, and the coordinator exits 0 saying
every epoch was covered exactly once."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from typing import Any

import pytest

from helpers.cli_procs import Proc

BATCH_MS = "40"
EPOCHS = 14  # with 2 ranks at 40 ms a batch, an epoch takes about 1.2 s: the run outlasts it all


def state_of(address: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{address}/state.json", timeout=5) as answer:
        doc = json.loads(answer.read())
    assert isinstance(doc, dict)
    return doc


def until(address: str, check: Any, *, within: float) -> tuple[dict[str, Any], float]:
    """The first state.json that passes ``check`` and the real seconds it took (polled)."""
    began = time.monotonic()
    state: dict[str, Any] = {}
    while time.monotonic() - began < within:
        state = state_of(address)
        if check(state):
            return state, time.monotonic() - began
        time.sleep(0.05)
    raise AssertionError(f"not within {within:g} s; last state: {state}")


def host(procs: list[Proc], env: dict[str, str], address: str, name: str,
         ranks: list[int], *, world: int = 6) -> Proc:
    relay = Proc("relay", "--coordinator", address, "--host", name, "--ranks",
                 f"{ranks[0]}-{ranks[-1]}", "--world-size", str(world), env=env)
    procs.append(relay)
    listening = relay.line_with("listening for ranks on").rsplit(" ", 1)[-1]
    for rank in ranks:
        procs.append(Proc("rank", "--relay", listening, "--rank", str(rank), "--world-size",
                          str(world), "--batch-ms", BATCH_MS, env=env))
    return relay


@pytest.mark.slow
def test_a_world_of_2_to_6_grows_with_a_host_and_retires_it_when_it_is_killed(
    env: dict[str, str], procs: list[Proc],
) -> None:
    coord = Proc("coordinator", "--listen", "127.0.0.1:0", "--world-size", "2:6",
                 "--retire-after", "2", "--epochs", str(EPOCHS), "--batch-size", "4", env=env)
    procs.append(coord)
    address = coord.line_with("coordinator listening on").rsplit(" ", 1)[-1]
    host(procs, env, address, "host-a", [0, 1])
    assert coord.line_with("formed: ") == "formed: 2 ranks over 1 relays (world 2:6)"
    formed = state_of(address)
    assert formed["world"] == {"min": 2, "max": 6, "current": 2}

    time.sleep(3)
    started = time.monotonic()
    grower = host(procs, env, address, "host-b", [2, 3, 4, 5])
    grown, _ = until(address, lambda s: set(range(6)) <= set(s["live"]), within=3)
    assert time.monotonic() - started < 3
    assert grown["world"] == {"min": 2, "max": 6, "current": 6}

    grower.signal(signal.SIGKILL)
    killed = time.monotonic()
    shrunk, _ = until(address, lambda s: s["retired"] == [2, 3, 4, 5], within=5)
    assert time.monotonic() - killed < 5
    assert shrunk["world"] == {"min": 2, "max": 6, "current": 2}
    assert shrunk["dead"] == [] and shrunk["live"] == [0, 1]
    epoch_then = shrunk["epoch"]

    assert coord.wait() == 0, (coord.out, coord.err)
    assert f"coordinator: {EPOCHS}/{EPOCHS} epochs, every epoch covered exactly once" in coord.out
    summary = json.loads(coord.line_with('"summary"'))["summary"]
    assert summary["coverage"]["exact"] is True and summary["dead_ranks"] == []
    # The run went on after the retirement, and the coordinator said each change.
    assert epoch_then is not None and epoch_then < EPOCHS - 1
    for rank in (2, 3, 4, 5):
        assert f"rank {rank} (host-b) joined: the world is 6 ranks" in coord.out
        assert any(line.startswith(f"rank {rank} (host-b) retired: dead for 2s (retire_after)")
                   for line in coord.out), coord.out


@pytest.mark.slow
def test_sigterm_drains_a_relay_its_ranks_leave_after_their_sync_and_everyone_exits_0(
    env: dict[str, str], procs: list[Proc],
) -> None:
    # A long join window: the world forms with both hosts (at once once it has its maximum).
    coord = Proc("coordinator", "--listen", "127.0.0.1:0", "--world-size", "2:4",
                 "--join-window", "20", "--epochs", "6", "--batch-size", "4", env=env)
    procs.append(coord)
    address = coord.line_with("coordinator listening on").rsplit(" ", 1)[-1]
    host(procs, env, address, "host-a", [0, 1], world=4)
    leaving = host(procs, env, address, "host-b", [2, 3], world=4)
    ranks_b = procs[-2:]
    assert coord.line_with("formed: ") == "formed: 4 ranks over 2 relays (world 2:4)"
    coord.line_with("epoch 1/6: ")
    leaving.signal(signal.SIGTERM)
    assert leaving.line_with("SIGTERM: draining") == (
        "relay host-b: SIGTERM: draining: ranks [2, 3] finish their current sync and exit "
        "(SIGTERM again stops the relay at once)")
    assert leaving.wait() == 0, (leaving.out, leaving.err)
    assert leaving.out[-1] == "relay host-b drained: its ranks left after their last sync"
    assert [rank.wait() for rank in ranks_b] == [0, 0]
    state, _ = until(address, lambda s: s["retired"] == [2, 3], within=5)
    assert state["world"]["current"] == 2 and state["dead"] == []
    assert coord.wait() == 0, (coord.out, coord.err)
    assert "coordinator: 6/6 epochs, every epoch covered exactly once" in coord.out
    summary = json.loads(coord.line_with('"summary"'))["summary"]
    assert summary["dead_ranks"] == [] and summary["deaths"] == {}
    for rank in (2, 3):
        assert f"rank {rank} (host-b) retired: its host 'host-b' left: SIGTERM; the world is" \
            in " ".join(coord.out)
