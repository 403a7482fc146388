"""Issue 38: the command line's long-lived components (``coordinator``, ``relay``, ``rank``)
move their start-up heap out of the garbage collector's reach before they run, when the command
line is the process's own; ``main(argv)`` inside another program leaves its collector alone."""

from __future__ import annotations

import gc
import sys

import pytest

from flodl_trio import SessionSalt
from flodl_trio._gc import freeze_setup
from flodl_trio.cli import _main


def test_freeze_setup_collects_then_freezes_what_the_process_holds() -> None:
    try:
        frozen = freeze_setup()
        assert frozen == gc.get_freeze_count() > 1000  # at least the imports
        assert not [o for o in gc.get_objects() if o is _main]  # modules are frozen too
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("command", ["rank", "status"])
def test_the_command_line_freezes_its_setup_only_as_the_process_own(
        monkeypatch: pytest.MonkeyPatch, command: str) -> None:
    calls: list[str] = []
    monkeypatch.setattr(_main, "freeze_setup", lambda: calls.append("frozen") or 0)
    monkeypatch.setattr(_main.trio, "run", lambda fn, args: calls.append("ran") or 0)
    argv = (["rank", "--relay", "127.0.0.1:9", "--rank", "0", "--world-size", "1",
             "--salt-hex", SessionSalt.generate().hex()] if command == "rank"
            else ["status", "127.0.0.1:9"])
    assert _main.main(argv) == 0  # inside a program: its collector is its own
    assert calls == ["ran"]
    monkeypatch.setattr(sys, "argv", ["flodl-trio", *argv])
    assert _main.main() == 0  # the process's own command line
    assert calls == ["ran", "frozen", "ran"] if command == "rank" else ["ran", "ran"]
