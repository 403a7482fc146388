"""Fixtures of more than one folder: the library's log records; the environment and the
children of the tests that run ``flodl-trio`` as real processes (tests/helpers/cli_procs.py);
real etcd members (scripts/_etcd.py: free loopback ports, a temporary data directory, stopped by
PID), for the tests of the stores, the command line and the relays."""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers.cli_procs import Proc
from helpers.scripts import load_script


@pytest.fixture
def flodl_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """``caplog``, capturing the library's log records from INFO up."""
    caplog.set_level(logging.INFO, logger="flodl_trio")
    return caplog


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


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[Any]:
    """A one-member etcd of this test's own (skipped where etcd is not installed)."""
    yield from etcd_member(tmp_path)


@pytest.fixture(scope="module")
def shared_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One member for every test of a file that asks (each uses a key prefix of its own)."""
    yield from etcd_member(tmp_path_factory.mktemp("etcd"))


def etcd_member(root: Path) -> Iterator[Any]:
    helper = load_script("_etcd")
    if helper.etcd_binary() is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    with helper.EtcdServer(root) as server:
        yield server


@pytest.fixture
def gc_restored() -> Iterator[None]:
    """Python's cyclic collector is enabled for the test, and as it was afterwards (the
    coordinator's and the relay's pause tests, issue 38)."""
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()
