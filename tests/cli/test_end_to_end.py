"""The CLI end to end, as subprocesses: the demo with a fault, status, usage errors, plot."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import trio

CLI = [sys.executable, "-m", "flodl_trio"]


def run_cli(*args: str, timeout: float = 60, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def test_demo_with_a_killed_relay_tells_the_story_and_cleans_up(tmp_path: Path) -> None:
    timeline = tmp_path / "t.jsonl"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = dict(os.environ, TMPDIR=str(scratch))
    done = run_cli("demo", "--kill-relay", "host-c@0.5", "--timeline", str(timeline),
                   "--no-live", "--epochs", "3", timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert re.search(r"formed in \d+ ms: 3 relays, 6 ranks", out), out
    assert "epoch 1/" not in out.split("formed in")[0]  # no epoch talk during formation
    for rank in (4, 5):  # host-c carries ranks 4 and 5
        assert re.search(rf"rank {rank} \(host-c\) declared dead: relay 'host-c'", out), out
        assert re.search(rf"rank {rank}'s \d+ unprocessed samples of epoch \d redistributed: "
                         r"rank 0 takes samples \d+\u2013\d+", out), out
    assert "3/3 epochs" in out and "dead [4, 5]" in out and out.rstrip().endswith("run completed")
    assert re.search(r"^live page: http://127\.0\.0\.1:\d+/ \(open it in a browser", out, re.M)
    # The kill line is stamped on the story's clock and says the delay it really had.
    formed = float(re.search(r"^ *(\d+\.\d\d)s  formed in", out, re.M)[1])  # type: ignore[index]
    killed = re.search(r"^ *(\d+\.\d\d)s  SIGKILLed relay host-c \(ranks \[4, 5\]\) "
                       r"(\d+\.\d\d) s after formation$", out, re.M)
    assert killed and float(killed[2]) >= 0.5, out
    assert abs(float(killed[1]) - formed - float(killed[2])) <= 0.011, out
    assert list(scratch.iterdir()) == []  # the temporary directory of logs is gone
    events = [json.loads(line) for line in timeline.read_text().splitlines()]
    dead = {e["rank"] for e in events if e["kind"] == "RankDeclaredDead"}
    assert dead == {4, 5}
    assert any(e["kind"] == "FormationComplete" for e in events)
    assert events[-1]["kind"] == "ShutdownComplete"


def test_plot_writes_a_png(tmp_path: Path) -> None:
    timeline = tmp_path / "t.jsonl"
    lines = [
        {"t_ms": 0.0, "kind": "Listening", "address": "127.0.0.1:1"},
        {"t_ms": 10.0, "kind": "RelayJoined", "host": "a", "ranks": [0, 1], "peer": "x"},
        {"t_ms": 11.0, "kind": "FormationComplete", "relays": 1, "world_size": 2,
         "elapsed_ms": 11.0},
        {"t_ms": 20.0, "kind": "Note", "what": "epoch_started", "fields": {"epoch": 0}},
        {"t_ms": 30.0, "kind": "Note", "what": "sync", "fields": {"global_step": 1}},
        {"t_ms": 40.0, "kind": "RankDeclaredDead", "rank": 1, "host": "a", "reason": "test"},
        {"t_ms": 50.0, "kind": "RankExited", "rank": 0},
    ]
    timeline.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "t.png"
    done = run_cli("plot", str(timeline), "-o", str(out))
    assert done.returncode == 0, done.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000


@pytest.mark.parametrize("argv", [
    ["relay", "--coordinator", "nonsense", "--host", "h", "--ranks", "0", "--world-size", "1"],
    ["relay", "--coordinator", "127.0.0.1:1", "--host", "h", "--ranks", "3-1",
     "--world-size", "4"],
    ["coordinator"],
    ["frobnicate"],
    ["status", "127.0.0.1"],
    ["rank", "--relay", "nonsense", "--rank", "0", "--world-size", "1"],
    ["rank", "--relay", "127.0.0.1:1", "--rank", "5", "--world-size", "2"],
    ["demo", "--kill-relay", "host-z@1"],
    ["demo", "--hosts", "0"],
    ["coordinator", "--world-size", "1", "--port-file", "/no-such-dir/port"],
])
def test_usage_errors_exit_2_with_one_line(argv: list[str]) -> None:
    env = dict(os.environ, FLODL_SALT_HEX="00" * 16)
    done = run_cli(*argv, env=env, timeout=30)
    assert done.returncode == 2, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("flodl-trio") and len(lines[0]) < 200, lines[0]
    assert "Traceback" not in done.stderr


def test_a_bad_salt_is_a_usage_error_naming_the_problem() -> None:
    env = dict(os.environ, FLODL_SALT_HEX="xyz")
    done = run_cli("relay", "--coordinator", "127.0.0.1:1", "--host", "h", "--ranks", "0",
                   "--world-size", "1", env=env, timeout=30)
    assert done.returncode == 2
    assert "expected 32 hex characters" in done.stderr


def test_salt_prints_32_lowercase_hex_chars() -> None:
    done = run_cli("salt")
    assert done.returncode == 0
    text = done.stdout.strip()
    assert len(text) == 32 and text == text.lower() and int(text, 16) >= 0


async def test_status_against_a_running_coordinator() -> None:
    import flodl_trio as ft

    bound = await ft.bind_coordinator(("127.0.0.1", 0))
    address = f"127.0.0.1:{bound.address[1]}"
    salt = ft.SessionSalt.generate()

    async def coordinator() -> None:
        with trio.move_on_after(20):
            async with ft.open_coordinator(bound, salt=salt,
                                           config=ft.CoordinatorConfig(world_size=2)):
                pass  # pragma: no cover - never formed in this test

    async with trio.open_nursery() as nursery:
        nursery.start_soon(coordinator)
        await trio.sleep(0.1)
        done = await trio.run_process([*CLI, "status", address], capture_stdout=True,
                                      capture_stderr=True, check=False)
        pretty = done.stdout.decode()
        raw = await trio.run_process([*CLI, "status", address, "--json"], capture_stdout=True,
                                     check=False)
        nursery.cancel_scope.cancel()
    assert done.returncode == 0, done.stderr
    assert "phase forming" in pretty and "world 2" in pretty and "covered 0" in pretty
    state = json.loads(raw.stdout)
    assert state["phase"] == "forming" and state["world_size"] == 2


def test_status_of_an_unreachable_coordinator_exits_1_with_one_line() -> None:
    done = run_cli("status", "127.0.0.1:1", "--timeout", "2", timeout=30)
    assert done.returncode == 1
    assert len(done.stderr.strip().splitlines()) == 1


def test_salt_on_the_command_line_of_a_long_running_process_warns() -> None:
    import argparse

    from flodl_trio.cli import load_salt

    args = argparse.Namespace(salt_file=None, salt_hex="ab" * 16)
    with pytest.warns(UserWarning, match="ps"):
        salt = load_salt(args, long_running=True)
    assert salt.hex() == "ab" * 16


def test_salt_file_is_read_and_trimmed(tmp_path: Path) -> None:
    import argparse

    from flodl_trio.cli import load_salt

    f = tmp_path / "salt"
    f.write_text("  " + "CD" * 16 + "\n")
    f.chmod(0o600)
    args = argparse.Namespace(salt_file=str(f), salt_hex=None)
    assert load_salt(args, long_running=True).hex() == "cd" * 16


def test_every_option_of_every_command_has_help_text_and_shows_its_default() -> None:
    import argparse

    from flodl_trio.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == {"salt", "coordinator", "relay", "rank", "status", "demo", "plot"}
    for name, command in sub.choices.items():
        text = command.format_help()
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{name} {action.option_strings or action.dest}: no help text"
            if action.default not in (None, False, [], argparse.SUPPRESS) and not action.required:
                assert f"(default: {action.default})" in " ".join(text.split()), (
                    f"{name} {action.option_strings}: default {action.default!r} not shown")
    rank_help = " ".join(sub.choices["rank"].format_help().split())
    assert "--jitter FRACTION random spread of each batch time" in rank_help
    assert "--batch-ms MS simulated milliseconds per batch (default: 20.0)" in rank_help
