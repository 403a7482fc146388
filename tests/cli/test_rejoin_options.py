"""The command line of issue 26: ``demo --restart-relay`` restarts only a host that
``--kill-relay`` kills, and ``coordinator --allow-takeover`` reaches the config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flodl_trio.cli import main
from flodl_trio.cli._parser import build_parser
from flodl_trio.cli._run import _coordinator_config
from flodl_trio.demo._story import Story


@pytest.mark.parametrize(("argv", "expected"), [
    (["--restart-relay", "host-c@1"],
     "--restart-relay: expected a host that --kill-relay kills, got host-c (killed: none)"),
    (["--kill-relay", "host-a@1", "--restart-relay", "host-z@1"],
     "--restart-relay: expected HOST@SECONDS with HOST one of ['host-a', 'host-b', 'host-c'], "
     "got 'host-z@1'"),
    (["--kill-relay", "host-a@1", "--restart-relay", "host-a@soon"],
     "--restart-relay: expected HOST@SECONDS"),
], ids=["not-killed", "unknown-host", "not-seconds"])
def test_demo_restart_of_a_host_it_does_not_kill_is_a_usage_error_naming_it(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    assert main(["demo", "--no-live", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


def test_coordinator_allow_takeover_flag_sets_the_config_and_is_off_by_default() -> None:
    parser = build_parser()
    base = ["coordinator", "--world-size", "4"]
    assert _coordinator_config(parser.parse_args(base)).allow_rank_takeover is False
    on = parser.parse_args([*base, "--allow-takeover"])
    assert _coordinator_config(on).allow_rank_takeover is True


@pytest.mark.parametrize(("argv", "expected"), [
    (["--kill-relay", "host-c@1", "--kill-relay", "host-c@5"],
     "--kill-relay: expected each host at most once, got host-c twice"),
    (["--kill-relay", "host-c@1", "--restart-relay", "host-c@1", "--restart-relay", "host-c@2"],
     "--restart-relay: expected each host at most once, got host-c twice"),
], ids=["kill-twice", "restart-twice"])
def test_demo_same_host_twice_is_a_usage_error_not_a_silently_dropped_kill(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    # A user asking the demo for a host that flaps twice got one kill: the first was dropped.
    assert main(["demo", "--no-live", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


def _timeline(path: Path, events: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(ev) + "\n" for ev in events), encoding="utf-8")
    return path


def test_demo_summary_says_rejoined_only_of_restarted_hosts_whose_ranks_came_back(
    tmp_path: Path
) -> None:
    # host-c was restarted and came back; host-b was restarted but the run ended first. The
    # summary said "restarted and rejoined: host-b, host-c, rejoins {...}" of both.
    story = Story(_timeline(tmp_path / "t.jsonl", [
        {"t_ms": 1.0, "kind": "RankDeclaredDead", "rank": r, "host": h, "reason": "EOF"}
        for r, h in ((2, "host-b"), (3, "host-b"), (4, "host-c"), (5, "host-c"))
    ] + [{"t_ms": 2.0, "kind": "RankRejoined", "rank": r, "host": "host-c"} for r in (4, 5)]),
        epochs=3)
    story.poll()
    layout = {"host-a": [0, 1], "host-b": [2, 3], "host-c": [4, 5]}
    text = story.restarts_text(layout, {"host-b", "host-c"})
    assert text == ("restarted and rejoined: host-c; restarted but not back before the run "
                    "ended: host-b")
    assert story.restarts_text(layout, {"host-b"}) == (
        "restarted but not back before the run ended: host-b")


def test_demo_restart_not_due_before_the_run_ended_is_said_and_coverage_is_told() -> None:
    # The restart is due 60 s after the kill; the one-epoch run ends long before.
    proc = subprocess.run(
        [sys.executable, "-m", "flodl_trio", "demo", "--no-live", "--hosts", "2",
         "--ranks-per-host", "1", "--epochs", "1", "--total-samples", "16",
         "--kill-relay", "host-b@0", "--restart-relay", "host-b@60"],
        capture_output=True, text=True, timeout=90, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "host-b was not restarted: the run ended before its restart was due (60s after " \
        "the kill)" in proc.stdout, proc.stdout
    assert "rejoined" not in proc.stdout, proc.stdout
    # The coordinator's summary carries the scheduler's coverage, and the demo says it.
    assert "  every epoch covered exactly once\n" in proc.stdout, proc.stdout
