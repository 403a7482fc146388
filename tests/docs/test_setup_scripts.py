"""What ``./scripts/demo`` and ``./scripts/test`` install into a clone's ``.venv`` (dry runs in a
copy of the clone): the demo only flodl-trio and its dependencies, never the test extra nor a
Debian package; the test extra and the Debian packages only for the tests; and the stamp files
let either run after the other in one ``.venv`` without installing what is already there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEMO_DEFAULTS = "--kill-relay host-c@1.5 --timeline demo-timeline.jsonl"
VENV_PIP = ".venv/bin/python -m pip install --quiet"


def clone(tmp_path: Path) -> Path:
    """The files the scripts read: scripts/ and pyproject.toml (nothing installed)."""
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    shutil.copy2(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def venv_with(root: Path, stamps: dict[str, float]) -> None:
    """A ``.venv`` whose python is there, with stamps ``seconds`` newer (or older, < 0) than
    pyproject.toml."""
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "bin" / "python").symlink_to(sys.executable)
    base = (root / "pyproject.toml").stat().st_mtime
    for name, seconds in stamps.items():
        stamp = root / ".venv" / f".flodl-installed-{name}"
        stamp.touch()
        os.utime(stamp, (base + seconds, base + seconds))


def dry_run(root: Path, script: str, *args: str) -> list[str]:
    env = dict(os.environ, FLODL_SETUP_DRY_RUN="1", PYTHON=sys.executable,
               PIP_NO_INDEX="1")  # a script that ignored the dry run would fail fast, offline
    done = subprocess.run([str(root / "scripts" / script), *args], capture_output=True,
                          text=True, timeout=120, env=env, cwd=root)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Debian" not in done.stderr or script == "test", done.stderr
    return done.stdout.splitlines()


def test_the_demo_in_a_fresh_clone_installs_only_flodl_trio_and_runs_the_demo(
        tmp_path: Path) -> None:
    root = clone(tmp_path)
    started = time.monotonic()
    assert dry_run(root, "demo") == [
        f"would run: {sys.executable} -m venv .venv",
        f"would run: {VENV_PIP} --upgrade pip",
        f"would run: {VENV_PIP} -e .",  # no extra: not the test extra's mypy, ruff, Sphinx...
        "would run: touch .venv/.flodl-installed-base",
        f"would run: .venv/bin/python -m flodl_trio demo {DEMO_DEFAULTS}",
    ]
    assert time.monotonic() - started < 30
    assert not (root / ".venv").exists()  # a dry run changes nothing


def test_the_demo_after_the_tests_installs_nothing_more(tmp_path: Path) -> None:
    root = clone(tmp_path)
    venv_with(root, {"test": 5.0})
    assert dry_run(root, "demo", "--linger", "60") == [
        "would run: .venv/bin/python -m flodl_trio demo --linger 60"]


def test_the_tests_after_the_demo_add_the_test_extra_to_the_same_venv(tmp_path: Path) -> None:
    root = clone(tmp_path)
    venv_with(root, {"base": 5.0})
    lines = dry_run(root, "test", "-q")
    assert lines[:3] == [f"would run: {VENV_PIP} --upgrade pip",
                         f"would run: {VENV_PIP} -e .[test]",
                         "would run: touch .venv/.flodl-installed-test"]
    assert lines[-1] == "would run: .venv/bin/python -m pytest -n 3 --dist loadfile -q"
    # As root, the Debian packages the tests drive, if they are missing; nothing else.
    assert set(lines[3:-1]) <= {"would run: apt-get install -y -qq chromium",
                                "would run: apt-get install -y -qq etcd-server"}, lines


def test_a_stamp_older_than_pyproject_installs_again(tmp_path: Path) -> None:
    root = clone(tmp_path)
    venv_with(root, {"test": -5.0, "base": -5.0})  # pyproject.toml changed since
    assert dry_run(root, "demo")[:2] == [f"would run: {VENV_PIP} --upgrade pip",
                                         f"would run: {VENV_PIP} -e ."]
