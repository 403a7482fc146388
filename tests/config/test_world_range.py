"""Elastic membership's world range (issue 37): ``CoordinatorConfig(min_world_size=...)`` and the
coordinator's ``--world-size MIN:MAX``. A fixed world (``world_size=N``, ``--world-size N``) is
N:N, as before; bad ranges are one clear line and nothing runs."""

from __future__ import annotations

import math

import pytest

from flodl_trio import ConfigError, CoordinatorConfig
from flodl_trio.cli import main
from flodl_trio.cli._common import parse_world_range
from flodl_trio.cli._parser import build_parser
from flodl_trio.cli._run import _coordinator_config


def test_world_size_alone_is_a_fixed_world_and_a_minimum_makes_it_elastic() -> None:
    fixed = CoordinatorConfig(world_size=4)
    assert (fixed.min_world, fixed.elastic, fixed.retire_after) == (4, False, math.inf)
    assert fixed.join_window == 1.0
    elastic = CoordinatorConfig(world_size=6, min_world_size=2, join_window=0,
                                retire_after=2.5)
    assert (elastic.min_world, elastic.elastic, elastic.join_window, elastic.retire_after) == (
        2, True, 0.0, 2.5)
    assert not CoordinatorConfig(world_size=3, min_world_size=3).elastic


@pytest.mark.parametrize("least", [0, 7, -1, 2.0, True, "2"])
def test_a_minimum_outside_one_to_the_maximum_is_a_config_error_naming_both(
    least: object,
) -> None:
    with pytest.raises(ConfigError) as info:
        CoordinatorConfig(world_size=6, min_world_size=least)  # type: ignore[arg-type]
    assert str(info.value) == (
        "CoordinatorConfig.min_world_size: expected an integer in [1, world_size=6] (the "
        f"world's minimum, at most its maximum), got {least!r}")


@pytest.mark.parametrize(("field", "value"), [("join_window", -1), ("retire_after", 0),
                                              ("retire_after", math.nan)])
def test_windows_and_retirement_delays_refuse_what_cannot_be_waited(field: str,
                                                                     value: float) -> None:
    with pytest.raises(ConfigError, match=f"CoordinatorConfig.{field}: expected seconds"):
        CoordinatorConfig(world_size=4, **{field: value})


def config_of(*argv: str) -> CoordinatorConfig:
    args = build_parser().parse_args(["coordinator", *argv])
    return _coordinator_config(args)


def test_the_command_line_takes_n_or_min_max_and_the_elastic_settings() -> None:
    assert config_of("--world-size", "4") == CoordinatorConfig(world_size=4)
    cfg = config_of("--world-size", "2:6", "--join-window", "0.5", "--retire-after", "2")
    assert (cfg.world_size, cfg.min_world, cfg.join_window, cfg.retire_after) == (6, 2, 0.5, 2)
    assert config_of("--world-size", "3:3").elastic is False
    assert parse_world_range(" 2:6 ") == (2, 6)


@pytest.mark.parametrize(("argv", "line"), [
    (["--world-size", "5:3"], "--world-size: expected N or MIN:MAX with 1 <= MIN <= MAX, got "
     "'5:3' (MIN 5 is above MAX 3)"),
    (["--world-size", "0:4"], "--world-size: expected N or MIN:MAX with 1 <= MIN <= MAX, got "
     "'0:4' (a world of 0 ranks cannot run)"),
    (["--world-size", "0"], "--world-size: expected N or MIN:MAX with 1 <= MIN <= MAX, got "
     "'0' (a world of 0 ranks cannot run)"),
    (["--world-size", "2-6"], "--world-size: expected N or MIN:MAX with 1 <= MIN <= MAX, got "
     "'2-6'"),
    (["--world-size", "2:6", "--retire-after", "0"],
     "--retire-after: expected seconds > 0, got 0.0"),
    (["--world-size", "2:6", "--join-window", "-1"],
     "--join-window: expected seconds >= 0, got -1.0"),
], ids=["min-above-max", "min-zero", "zero", "not-a-range", "retire-zero", "window-negative"])
def test_a_bad_range_or_setting_is_one_usage_line_and_nothing_listens(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLODL_SALT_HEX", "ab" * 16)
    assert main(["coordinator", *argv]) == 2
    err = capsys.readouterr()
    assert err.err.strip() == f"flodl-trio: error: {line}"
    assert "listening" not in err.out
