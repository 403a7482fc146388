"""Fixtures shared by the tests that run ``flodl-trio`` as real processes
(tests/helpers/cli_procs.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from helpers.cli_procs import Proc


@pytest.fixture
def env() -> dict[str, str]:
    """The children's environment: one session salt, the default deadlines."""
    out = dict(os.environ, FLODL_SALT_HEX="ab" * 16)
    out.pop("FLODL_NET_TIMEOUT_SCALE", None)
    return out


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Children a test starts; each is killed (if still running) and reaped at teardown."""
    started: list[Proc] = []
    yield started
    for proc in started:
        proc.stop()
