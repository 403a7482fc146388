"""``wait_until``: poll a condition in Trio time, for tests and scripts (re-exported by
:mod:`flodl_trio.testing`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import trio

__all__ = ["wait_until"]


async def wait_until(
    predicate: Callable[[], object],
    *,
    limit: float = 60.0,
    step: float = 0.01,
    what: str | None = None,
) -> None:
    """Return once ``predicate()`` is true, checking every ``step`` seconds of Trio time.

    For conditions with no event to wait on (``coord.dead_ranks == {2, 3}``). Under
    ``MockClock(autojump_threshold=0)`` the polls take no real time. Always checkpoints.

    Args:
        predicate: the condition; called at once, then after each ``step``.
        limit: seconds of Trio time before giving up (``math.inf``: never).
        step: seconds between checks (> 0).
        what: the condition in words, for the error (default: ``repr(predicate)``).

    Raises:
        ValueError: ``step`` is not > 0 or ``limit`` is negative or NaN.
        trio.TooSlowError: still false after ``limit``; the message says what and how long.
    """
    if not step > 0 or math.isinf(step):
        raise ValueError(f"wait_until: expected step > 0 seconds, got {step!r}")
    if not limit >= 0:
        raise ValueError(f"wait_until: expected limit >= 0 seconds, got {limit!r}")
    deadline = trio.current_time() + limit
    await trio.lowlevel.checkpoint()
    while not predicate():
        now = trio.current_time()
        if now >= deadline:
            raise trio.TooSlowError(
                f"wait_until: expected {what or repr(predicate)} to become true within "
                f"{limit:g}s, still false"
            )
        await trio.sleep(min(step, deadline - now))
