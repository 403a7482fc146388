"""The demo's live page, as a new user meets it: the demo prints its address at the start, and
``--linger`` keeps it up after the run with the finished run on it, until the time it said or
Ctrl-C (real processes on loopback)."""

from __future__ import annotations

import json
import re
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from helpers.cli_procs import Proc


@pytest.mark.slow
def test_demo_linger_keeps_the_finished_runs_page_up_until_ctrl_c(
        tmp_path: Path, env: dict[str, str], procs: list[Proc]) -> None:
    demo = Proc("demo", "--no-live", "--hosts", "1", "--ranks-per-host", "2", "--epochs", "1",
                "--total-samples", "32", "--batch-ms", "5", "--linger", "60",
                env=dict(env, TMPDIR=str(tmp_path)))
    procs.append(demo)
    page = demo.line_with("live page: http://")
    found = re.match(r"live page: (http://127\.0\.0\.1:\d+/) \(open it in a browser; kept up "
                     r"60 s after the run; /state\.json for scripts\)$", page)
    assert found, page
    url = found[1]
    demo.line_with("run completed")
    staying = demo.line_with("stays up until")
    assert staying.startswith(f"live page: {url} stays up until ") and staying.endswith(
        "(--linger 60; Ctrl-C ends it sooner)"), staying
    with urllib.request.urlopen(url + "board.json", timeout=10) as answer:
        board = json.loads(answer.read())
    with urllib.request.urlopen(url, timeout=10) as answer:
        html = answer.read().decode()
    assert board["phase"] == "finished" and board["counts"]["exited"] == 2, board
    [epoch] = board["epochs"]
    assert (epoch["samples_covered"], epoch["samples_total"], epoch["exactly_once"]) == (
        32, 32, True), epoch
    assert "<title>flodl-trio status</title>" in html
    stopped = time.monotonic()
    demo.signal(signal.SIGINT)  # the run is over and told: Ctrl-C only ends the wait
    assert demo.wait() == 0, demo.err
    assert time.monotonic() - stopped < 10
    assert not any("interrupted" in line for line in demo.out), demo.out
    assert list(tmp_path.iterdir()) == []  # its temporary directory is gone
