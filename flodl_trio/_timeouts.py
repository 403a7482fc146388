"""Deadline defaults and ``FLODL_NET_TIMEOUT_SCALE``.

Every deadline is a float number of seconds. Defaults are multiplied by the scale read from the
environment when a config object is created; a value passed explicitly is used as given. Cadences
(heartbeat intervals) are never scaled: they are rates, not patience.
"""

from __future__ import annotations

import math
import os
import time

from ._errors import ConfigError

SCALE_ENV = "FLODL_NET_TIMEOUT_SCALE"
MIN_SCALE = 0.1

# Unscaled defaults, seconds (SPEC §3).
FORMATION_TIMEOUT = 60.0
HANDSHAKE_TIMEOUT = 10.0
HEARTBEAT_TIMEOUT = 30.0
COORD_LIVENESS_TIMEOUT = 30.0
# A relay must give up on a silent durable coordinator (and start feeding its ranks) before the
# ranks' watchdogs fire: at most RELAY_LIVENESS_SHARE of theirs (docs/deadlines.rst).
RELAY_LIVENESS_SHARE = 2 / 3
RELAY_COORD_LIVENESS_TIMEOUT = COORD_LIVENESS_TIMEOUT * RELAY_LIVENESS_SHARE  # 20 s
WRITE_STALL_TIMEOUT = 30.0
RANK_ACCEPT_TIMEOUT = 60.0
CONNECT_TIMEOUT = 30.0
PEEK_TIMEOUT = 5.0
SHUTDOWN_GRACE = 5.0
RESUME_TIMEOUT = 30.0  # an adopting coordinator waits this long for each known relay
COORDINATOR_GRACE = 30.0  # a relay rides out a lost durable coordinator this long
# An elastic world (issue 37) forms once its minimum is covered and no relay joined for this long
# (torchrun's last-call wait).
JOIN_WINDOW = 1.0
HEARTBEAT_INTERVAL = 1.0  # a cadence: never scaled
CONNECT_RETRY_INTERVAL = 0.5  # a cadence: never scaled


def timeout_scale(environ: dict[str, str] | None = None) -> float:
    """Return ``FLODL_NET_TIMEOUT_SCALE`` (default 1.0).

    Raises:
        ConfigError: the variable is set but is not a finite number >= 0.1 (an empty value
            included: ``FLODL_NET_TIMEOUT_SCALE= cmd`` is more likely a script bug than a wish
            for the default); the message quotes the raw value and the rule.
    """
    env = os.environ if environ is None else environ
    raw = env.get(SCALE_ENV)
    if raw is None:
        return 1.0
    if raw.strip() == "":
        raise ConfigError(
            f"{SCALE_ENV}={raw!r}: expected a finite number >= {MIN_SCALE}, got an empty value "
            "(unset the variable for the default 1.0)"
        )
    try:
        value = float(raw.strip())
    except ValueError:
        raise ConfigError(
            f"{SCALE_ENV}={raw!r}: expected a finite number >= {MIN_SCALE}, got text that is not "
            "a number"
        ) from None
    if not math.isfinite(value) or value < MIN_SCALE:
        raise ConfigError(f"{SCALE_ENV}={raw!r}: expected a finite number >= {MIN_SCALE}")
    return value


def scaled(seconds: float) -> float:
    """``seconds`` multiplied by the current :func:`timeout_scale`."""
    return seconds * timeout_scale()


def clock_time_in(seconds: float) -> str:
    """The local wall-clock time ``seconds`` from now, ``HH:MM:SS``: what a person reads in a
    line that says how long something waits (``until 12:00:31``)."""
    return time.strftime("%H:%M:%S", time.localtime(time.time() + max(0.0, seconds)))
