"""Config objects and deadline scaling (SPEC §3, §4.1): ``FLODL_NET_TIMEOUT_SCALE`` multiplies the
deadline defaults, never cadences or explicit values; invalid values are ``ConfigError``."""

from __future__ import annotations

import math
from fractions import Fraction

import attrs
import pytest
from hypothesis import given, strategies as st

from flodl_trio._config import CoordinatorConfig, MaxFailure, RankConfig, RelayConfig
from flodl_trio._errors import ConfigError

ENV = "FLODL_NET_TIMEOUT_SCALE"

COORD_DEFAULTS = {
    "formation_timeout": 60.0, "handshake_timeout": 10.0, "heartbeat_timeout": 30.0,
    "write_stall_timeout": 30.0, "peek_timeout": 5.0, "shutdown_grace": 5.0,
}  # fmt: skip
RELAY_DEFAULTS = {
    "rank_accept_timeout": 60.0, "connect_timeout": 30.0, "handshake_timeout": 10.0,
    "write_stall_timeout": 30.0, "shutdown_grace": 5.0, "coord_liveness_timeout": 20.0,
}  # fmt: skip
RANK_DEFAULTS = {
    "connect_timeout": 30.0, "handshake_timeout": 10.0, "coord_liveness_timeout": 30.0,
    "write_stall_timeout": 30.0,
}  # fmt: skip
CONFIGS = [
    pytest.param(lambda **kw: CoordinatorConfig(world_size=4, **kw), COORD_DEFAULTS, id="coord"),
    pytest.param(lambda **kw: RelayConfig(**kw), RELAY_DEFAULTS, id="relay"),
    pytest.param(lambda **kw: RankConfig(**kw), RANK_DEFAULTS, id="rank"),
]


@pytest.fixture(autouse=True)
def _no_scale_from_the_outer_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)


@pytest.mark.parametrize(("make", "defaults"), CONFIGS)
def test_unscaled_defaults_are_the_spec_values(make: object, defaults: dict[str, float]) -> None:
    cfg = make()  # type: ignore[operator]
    assert {name: getattr(cfg, name) for name in defaults} == defaults


@pytest.mark.parametrize(("make", "defaults"), CONFIGS)
@pytest.mark.parametrize("scale", ["2", "0.1", " 3.5 "])
def test_timeout_scale_multiplies_every_deadline_default(
    monkeypatch: pytest.MonkeyPatch, make: object, defaults: dict[str, float], scale: str
) -> None:
    monkeypatch.setenv(ENV, scale)
    cfg = make()  # type: ignore[operator]
    factor = float(scale)
    for name, default in defaults.items():
        assert getattr(cfg, name) == pytest.approx(default * factor), name


@pytest.mark.parametrize(
    "make", [CONFIGS[0].values[0], CONFIGS[2].values[0]], ids=["coord", "rank"]
)
def test_timeout_scale_does_not_touch_the_heartbeat_cadence(
    monkeypatch: pytest.MonkeyPatch, make: object
) -> None:
    monkeypatch.setenv(ENV, "10")
    assert make().heartbeat_interval == 1.0  # type: ignore[operator]
    assert make(heartbeat_interval=0.25).heartbeat_interval == 0.25  # type: ignore[operator]


def test_explicit_deadlines_are_used_as_given_not_scaled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "4")
    cfg = CoordinatorConfig(world_size=2, heartbeat_timeout=3, formation_timeout=0.5)
    assert cfg.heartbeat_timeout == 3.0 and type(cfg.heartbeat_timeout) is float
    assert cfg.formation_timeout == 0.5
    assert cfg.handshake_timeout == 40.0  # the ones left out are still scaled
    assert RelayConfig(connect_timeout=7).connect_timeout == 7.0
    assert RankConfig(coord_liveness_timeout=2).coord_liveness_timeout == 2.0


def test_scale_is_read_when_the_config_is_created(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "2")
    cfg = RankConfig()
    monkeypatch.setenv(ENV, "5")
    assert cfg.handshake_timeout == 20.0
    assert RankConfig().handshake_timeout == 50.0


@pytest.mark.parametrize(
    "raw", ["abc", "0.05", "nan", "inf", "-inf", "-1", "0", "1e400", "2x", "", "  "]
)
@pytest.mark.parametrize("make", [c.values[0] for c in CONFIGS], ids=["coord", "relay", "rank"])
def test_invalid_timeout_scale_is_config_error_quoting_raw_value_and_rule(
    monkeypatch: pytest.MonkeyPatch, raw: str, make: object
) -> None:
    monkeypatch.setenv(ENV, raw)
    with pytest.raises(ConfigError) as err:
        make()  # type: ignore[operator]
    msg = str(err.value)
    assert ENV in msg and repr(raw) in msg and "finite number >= 0.1" in msg, msg


@pytest.mark.parametrize("make", [c.values[0] for c in CONFIGS], ids=["coord", "relay", "rank"])
def test_math_inf_disables_a_deadline(make: object) -> None:
    cfg = make(handshake_timeout=math.inf)  # type: ignore[operator]
    assert cfg.handshake_timeout == math.inf


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"world_size": 0}, ["CoordinatorConfig.world_size", "integer > 0", "got 0"]),
        ({"world_size": -3}, ["CoordinatorConfig.world_size", "got -3"]),
        ({"world_size": 2.0}, ["CoordinatorConfig.world_size", "got 2.0"]),
        ({"world_size": True}, ["CoordinatorConfig.world_size", "got True"]),
        ({"world_size": 2, "heartbeat_timeout": -1}, ["heartbeat_timeout", "> 0", "-1.0"]),
        ({"world_size": 2, "formation_timeout": 0}, ["formation_timeout", "> 0", "0.0"]),
        ({"world_size": 2, "peek_timeout": math.nan}, ["peek_timeout", "nan"]),
        ({"world_size": 2, "shutdown_grace": "soon"}, ["shutdown_grace", "'soon'"]),
        ({"world_size": 2, "handshake_timeout": None}, ["handshake_timeout", "None"]),
        ({"world_size": 2, "heartbeat_interval": 0}, ["heartbeat_interval", "finite", "> 0"]),
        ({"world_size": 2, "heartbeat_interval": math.inf}, ["heartbeat_interval", "finite"]),
        ({"world_size": 2, "max_failure": 3}, ["max_failure", "MaxFailure or None"]),
        ({"world_size": 2, "timing_buffer": 0}, ["timing_buffer", "integer > 0"]),
        ({"world_size": 2, "max_rejected_handshakes": -1}, ["max_rejected_handshakes", ">= 0"]),
        ({"world_size": 2, "max_pending_handshakes": 0}, ["max_pending_handshakes", "> 0"]),
        ({"world_size": 2, "max_pending_handshakes": 2.5}, ["max_pending_handshakes", "2.5"]),
    ],
    ids=lambda v: "-".join(f"{k}={v[k]}" for k in v if k != "world_size" or len(v) == 1)
    if isinstance(v, dict) else None,
)  # fmt: skip
def test_invalid_coordinator_fields_are_config_error_naming_field(
    kwargs: dict[str, object], words: list[str]
) -> None:
    with pytest.raises(ConfigError) as err:
        CoordinatorConfig(**kwargs)  # type: ignore[arg-type]
    for word in words:
        assert word in str(err.value), str(err.value)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: RelayConfig(rank_accept_timeout=-5), ["RelayConfig.rank_accept_timeout", "-5.0"]),
        (lambda: RelayConfig(queue_size=0), ["RelayConfig.queue_size", "integer > 0"]),
        (lambda: RankConfig(connect_timeout="x"), ["RankConfig.connect_timeout", "'x'"]),
        (lambda: RankConfig(heartbeat_interval=-1), ["RankConfig.heartbeat_interval"]),
    ],
    ids=["relay-timeout", "relay-queue", "rank-timeout", "rank-interval"],
)
def test_invalid_relay_and_rank_fields_are_config_error_naming_field(
    make: object, words: list[str]
) -> None:
    with pytest.raises(ConfigError) as err:
        make()  # type: ignore[operator]
    for word in words:
        assert word in str(err.value), str(err.value)


def test_configs_are_frozen() -> None:
    cfg = CoordinatorConfig(world_size=1)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        cfg.world_size = 2  # type: ignore[misc]
    assert attrs.evolve(cfg, heartbeat_timeout=5).heartbeat_timeout == 5.0


# ---------------------------------------------------------------- MaxFailure


@pytest.mark.parametrize(
    ("policy", "world", "limit"),
    [
        (MaxFailure.absolute(2), 8, 2),
        (MaxFailure.absolute(0), 8, 1),  # 0 means: the first death
        (MaxFailure.absolute(50), 8, 50),
        (MaxFailure.fraction(0.5), 3, 2),  # ceil(1.5)
        (MaxFailure.percent(50), 4, 2),
        (MaxFailure.fraction(0.25), 10, 3),  # ceil(2.5)
        (MaxFailure.percent(25), 10, 3),
        (MaxFailure.percent(7), 100, 7),  # 0.07 * 100 is 7.000000000000001 in floats
        (MaxFailure.fraction(0.14), 50, 7),
        (MaxFailure.fraction(1.0), 7, 7),
        (MaxFailure.percent(100), 7, 7),
        (MaxFailure.fraction(0), 7, 1),  # limit 1: any death
        (MaxFailure.percent(0.25), 8, 1),  # a quarter of one percent, not a quarter
    ],
    ids=["abs2", "abs0", "abs-over-world", "half-of-3", "50pct-of-4", "quarter-of-10",
         "25pct-of-10", "7pct-of-100", "0.14-of-50", "all", "100pct", "zero", "0.25pct"],
)  # fmt: skip
def test_max_failure_limit_is_ceil_of_the_share_and_at_least_one(
    policy: MaxFailure, world: int, limit: int
) -> None:
    assert policy.limit(world) == limit


@given(percent=st.integers(0, 100), world=st.integers(1, 4096))
def test_max_failure_percent_matches_exact_decimal_arithmetic(percent: int, world: int) -> None:
    exact = math.ceil(Fraction(percent, 100) * world)
    assert MaxFailure.percent(percent).limit(world) == max(1, exact)
    assert MaxFailure.fraction(percent / 100).limit(world) == max(1, exact)


def test_percent_and_fraction_name_the_same_policy() -> None:
    assert MaxFailure.percent(25) == MaxFailure.fraction(0.25)
    assert MaxFailure.percent(25).describe(8) == "percent(25) = 2 of 8"


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: MaxFailure.absolute(-1), ["MaxFailure.absolute", ">= 0", "-1"]),
        (lambda: MaxFailure.absolute(1.5), ["MaxFailure.absolute", "1.5"]),
        (lambda: MaxFailure.absolute(True), ["MaxFailure.absolute", "True"]),
        (lambda: MaxFailure.percent(math.nan), ["MaxFailure.percent", "nan"]),
        (lambda: MaxFailure.percent("50%"), ["MaxFailure.percent", "'50%'"]),
        (lambda: MaxFailure.percent(101), ["MaxFailure.percent", "[0, 100]", "101"]),
        (lambda: MaxFailure.percent(-1), ["MaxFailure.percent", "[0, 100]", "-1"]),
        (lambda: MaxFailure.fraction(25), ["MaxFailure.fraction", "[0, 1]", "25"]),
        (lambda: MaxFailure.fraction(-0.1), ["MaxFailure.fraction", "[0, 1]", "-0.1"]),
        (lambda: MaxFailure.fraction(True), ["MaxFailure.fraction", "True"]),
    ],
    ids=["abs-negative", "abs-float", "abs-bool", "pct-nan", "pct-str", "pct-over-100",
         "pct-negative", "frac-over-1", "frac-negative", "frac-bool"],
)  # fmt: skip
def test_invalid_max_failure_is_config_error(make: object, words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        make()  # type: ignore[operator]
    for word in words:
        assert word in str(err.value), str(err.value)


def test_coordinator_config_accepts_a_max_failure_policy() -> None:
    cfg = CoordinatorConfig(world_size=3, max_failure=MaxFailure.percent(50))
    assert cfg.max_failure is not None and cfg.max_failure.limit(cfg.world_size) == 2


def test_max_rejected_handshakes_is_accepted_but_deprecated_and_pending_has_a_default() -> None:
    assert CoordinatorConfig(world_size=2).max_pending_handshakes == 1024
    with pytest.warns(DeprecationWarning, match="max_rejected_handshakes is deprecated"):
        cfg = CoordinatorConfig(world_size=2, max_rejected_handshakes=5)
    assert cfg.max_rejected_handshakes == 5
