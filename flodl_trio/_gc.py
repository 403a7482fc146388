"""The cyclic garbage collector paused while a cohort forms (issue 38).

A coordinator admitting thousands of relays allocates the objects each one keeps for the whole
run (its connection, sealer and opener, its reader task) and little garbage. CPython's
collector scans the whole heap each time it grew by a quarter, so a formation of 8,192 relays
ran about seven full collections over the relays it had just admitted: a fifth of its CPU
(about 60 µs of 270 per relay, ``scripts/bench_scale.py``). Reference counting frees what
formation discards either way; only cycles wait, and formation is bounded by its timeout.

The pause is process-wide, as the collector is. It is counted, so components forming at once
in one process (tests run several coordinators) resume it only when the last one formed; it is
resumed as it was found (a process that had disabled the collector keeps it disabled), and
nothing is collected on resuming (the collector's next turn comes as it would have).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

_pausers = 0
_resume_to = False  # whether the collector was enabled when the first pauser paused it


@contextmanager
def gc_paused(pause: bool = True) -> Iterator[None]:
    """Pause the cyclic garbage collector for the block (``pause=False``: leave it alone)."""
    global _pausers, _resume_to
    if not pause:
        yield
        return
    if _pausers == 0:
        _resume_to = gc.isenabled()
        gc.disable()
    _pausers += 1
    try:
        yield
    finally:
        _pausers -= 1
        if _pausers == 0 and _resume_to:
            gc.enable()


def gc_pausers() -> int:
    """How many blocks pause the collector now (for tests and the status page)."""
    return _pausers


def freeze_setup() -> int:
    """Move everything the process allocated so far out of the collector's reach, after one
    collection (``gc.collect``, then ``gc.freeze``); the number of objects frozen.

    For a process that runs one component for its whole life (the command line's
    ``coordinator``, ``relay`` and ``rank``): its imports and set-up are never garbage, yet every
    full collection scanned them again. One fell inside a relay's join in most runs, about
    15 ms of CPU (``scripts/bench_relay_upstream.py``, issue 38). An embedding program decides
    for itself (docs/performance.rst, "The garbage collector").
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
