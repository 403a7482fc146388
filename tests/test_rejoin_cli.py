"""The command line of issue 26: ``demo --restart-relay`` restarts only a host that
``--kill-relay`` kills, and ``coordinator --allow-takeover`` reaches the config."""

from __future__ import annotations

import pytest

from flodl_trio._cli_parser import build_parser
from flodl_trio._cli_run import _coordinator_config
from flodl_trio.cli import main


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
