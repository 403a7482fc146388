"""The demo's elastic flags as a user runs them: ``--add-host`` starts a host the run did not
start with and it joins the running cohort; ``--drain-relay`` SIGTERMs a relay and its ranks
finish their sync, leave and are retired without a failure (real processes on loopback)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flodl_trio.cli import main


@pytest.mark.slow
def test_demo_adds_a_host_and_drains_one_and_every_epoch_is_covered_once(
        tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "flodl_trio", "demo", "--no-live", "--hosts", "2",
         "--ranks-per-host", "2", "--epochs", "8", "--total-samples", "320", "--batch-ms", "25",
         "--add-host", "0.1", "--drain-relay", "host-b@4"], capture_output=True, text=True,
        timeout=150, env=dict(os.environ, TMPDIR=str(tmp_path)))
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert re.search(r"started host host-c with ranks \[4, 5\] \d+\.\d\d s after formation: "
                     r"it joins the running cohort", out), out
    for rank in (4, 5):
        assert re.search(rf"rank {rank} \(host-c\) joined the running cohort: the world is "
                         r"\d ranks", out), out
    assert "relay host-b drains (SIGTERM): ranks [2, 3] finish their current sync" in out, out
    for rank in (2, 3):
        assert re.search(rf"rank {rank} \(host-b\) retired: its host 'host-b' left: SIGTERM",
                         out), out
    # Nobody died: a drained host is not a failure, and every rank process exited 0.
    assert "dead []" in out and "declared dead" not in out, out
    codes = re.search(r"rank process exit codes: (\{.*\})", out)
    assert codes and set(ast.literal_eval(codes[1]).values()) == {0}, out
    assert re.search(r"world 2:6: ranks \[4, 5\] joined \(host-c\); drained: host-b; "
                     r"retired \[2, 3\]", out), out
    assert "was started but the run ended before it joined" not in out, out
    assert "every epoch covered exactly once" in out and "run completed" in out, out


@pytest.mark.parametrize(("argv", "expected"), [
    (["--kill-relay", "host-a@1", "--drain-relay", "host-a@2"],
     "--drain-relay: expected a host --kill-relay does not kill, got host-a"),
    (["--add-host", "-1"], "--add-host: expected seconds >= 0, got [-1.0]"),
], ids=["killed-and-drained", "negative"])
def test_demo_elastic_flags_that_cannot_work_are_one_line_usage_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    assert main(["demo", "--no-live", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
