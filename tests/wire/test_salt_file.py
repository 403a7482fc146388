"""The session salt in a file (issue 39): ``SessionSalt.save`` / ``from_file`` keep it in a file
only its owner may read, a file others may read is refused naming the fix, a salt is never
overwritten, ``create=True`` lets a restarted program find its own salt again, and the command
line's ``salt FILE`` and ``--salt-file`` use the same rules."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import flodl_trio as ft


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_saved_salt_is_read_back_from_a_file_only_its_owner_may_read(tmp_path: Path) -> None:
    path = tmp_path / "salt"
    salt = ft.SessionSalt.generate()
    old = os.umask(0)  # whatever the umask would let through, the file is 0600
    try:
        salt.save(path)
    finally:
        os.umask(old)
    assert mode(path) == 0o600 and path.read_text() == salt.hex() + "\n"
    assert ft.SessionSalt.from_file(path) == salt
    assert [p.name for p in tmp_path.iterdir()] == ["salt"]  # no temporary file left


@pytest.mark.parametrize("bits", [0o644, 0o640, 0o604, 0o620])
def test_a_salt_file_others_may_read_or_write_is_refused_naming_the_fix(
        tmp_path: Path, bits: int) -> None:
    path = tmp_path / "salt"
    path.write_text("ab" * 16 + "\n")
    path.chmod(bits)
    with pytest.raises(ft.ConfigError) as refused:
        ft.SessionSalt.from_file(path)
    assert str(refused.value) == (f"salt file {str(path)!r}: expected mode 0600 (chmod 600 "
                                  f"it: only its owner may read the run's secret), got "
                                  f"{bits:04o}")


def test_a_salt_is_never_saved_over_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "salt"
    first = ft.SessionSalt.generate()
    first.save(path)
    with pytest.raises(ft.ConfigError, match="expected no file there, got an existing one"):
        ft.SessionSalt.generate().save(path)
    assert ft.SessionSalt.from_file(path) == first


def test_create_makes_the_salt_once_and_a_restart_finds_the_same_one(tmp_path: Path) -> None:
    path = tmp_path / "salt"
    with pytest.raises(ft.ConfigError, match="expected a salt file, found none"):
        ft.SessionSalt.from_file(path)
    made = ft.SessionSalt.from_file(path, create=True)
    assert ft.SessionSalt.from_file(path, create=True) == made  # the program restarted
    assert mode(path) == 0o600


@pytest.mark.parametrize(("content", "problem"), [
    (b"not a salt\n", "expected 32 hex characters, got 10"),
    (b"\xff\xfe" * 16, "expected 32 hex characters as text, got bytes that are not UTF-8"),
])
def test_a_salt_file_that_is_not_a_salt_is_refused_naming_the_file(
        tmp_path: Path, content: bytes, problem: str) -> None:
    path = tmp_path / "salt"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(ft.ConfigError, match=f"^salt file '{path}': .*{problem}"):
        ft.SessionSalt.from_file(path)


def test_a_directory_is_not_a_salt_file(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir(mode=0o700)
    with pytest.raises(ft.ConfigError, match="expected a regular file holding the salt, got a "
                       "directory"):
        ft.SessionSalt.from_file(tmp_path / "d")


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flodl_trio", *args], capture_output=True,
                          text=True, env=env, timeout=60)


def test_the_command_line_writes_a_salt_file_and_refuses_one_others_may_read(
        tmp_path: Path, env: dict[str, str]) -> None:
    path = tmp_path / "salt"
    made = run("salt", str(path), env=env)
    assert made.returncode == 0 and made.stdout == f"wrote a fresh session salt to {path} " \
        "(mode 0600)\n"
    assert mode(path) == 0o600 and ft.SessionSalt.from_file(path)
    again = run("salt", str(path), env=env)
    assert again.returncode == 2 and "got an existing one" in again.stderr
    path.chmod(0o644)  # what `flodl-trio salt > FILE` leaves with the usual umask
    relay = run("relay", "--coordinator", "127.0.0.1:1", "--host", "h", "--ranks", "0",
                "--world-size", "1", "--salt-file", str(path), env=env)
    assert relay.returncode == 2
    assert relay.stderr.splitlines() == [
        f"flodl-trio: error: --salt-file {str(path)!r}: expected mode 0600 (chmod 600 it: only "
        "its owner may read the run's secret), got 0644"]
