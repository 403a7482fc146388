"""A mistyped option is named, with the flag it was most likely meant to be, whatever else is
wrong with the command line: one line, exit 2, for every command (real processes)."""

from __future__ import annotations

import os
import subprocess
import sys

from flodl_trio.cli._suggest import closest, unknown_text

CLI = [sys.executable, "-m", "flodl_trio"]

# command line -> the one stderr line expected
CASES = {
    ("coordinator", "--world-szie", "4"):
        "flodl-trio coordinator: error: unrecognized option --world-szie: did you mean "
        "--world-size? (see --help)",
    ("--debgu", "salt"):
        "flodl-trio: error: unrecognized option --debgu: did you mean --debug? (see --help)",
    ("salt", "--count", "2"): "flodl-trio salt: error: unrecognized option --count (see --help)",
    ("relay", "--coordinator", "127.0.0.1:1", "--hots", "h", "--ranks", "0",
     "--world-size", "1"):
        "flodl-trio relay: error: unrecognized option --hots: did you mean --host? (see --help)",
    ("rank", "--relay", "127.0.0.1:1", "--rnak=0", "--world-size", "1"):
        "flodl-trio rank: error: unrecognized option --rnak: did you mean --rank? (see --help)",
    ("status", "127.0.0.1:1", "--jsno"):
        "flodl-trio status: error: unrecognized option --jsno: did you mean --json? (see --help)",
    ("demo", "--kill-realy", "host-c@1", "--epocs", "2"):
        "flodl-trio demo: error: unrecognized options --kill-realy (did you mean --kill-relay?), "
        "--epocs (did you mean --epochs?) (see --help)",
    ("plot", "t.jsonl", "--ouput", "t.png"):
        "flodl-trio plot: error: unrecognized option --ouput: did you mean --output? "
        "(see --help)",
}


def test_every_command_names_a_mistyped_option_and_the_flag_it_meant() -> None:
    env = dict(os.environ, FLODL_SALT_HEX="ab" * 16)
    # All at once: each is a Python start-up, and none of them gets past its parser.
    children = {argv: subprocess.Popen([*CLI, *argv], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                       text=True, env=env)
                for argv in CASES}
    for argv, child in children.items():
        out, err = child.communicate(timeout=60)
        assert (child.returncode, err.splitlines(), out) == (2, [CASES[argv]], ""), argv


def test_options_it_knows_are_left_to_argparse() -> None:
    from flodl_trio.cli import build_parser

    parser = build_parser()
    # An unambiguous prefix, a value glued with "=", a negative number and "-o" with its value
    # attached are argparse's to take, not typos.
    args = parser.parse_args(["coordinator", "--world", "2", "--heartbeat-timeout", "-1",
                              "--listen=127.0.0.1:0"])
    assert (args.world_size, args.heartbeat_timeout, args.listen) == (2, -1.0, "127.0.0.1:0")
    assert parser.parse_args(["plot", "-ox.png", "t.jsonl"]).output == "x.png"


def test_no_suggestion_for_an_option_nothing_resembles() -> None:
    assert closest("--frobnicate", ["--world-size", "--epochs"]) is None
    assert closest("--epoch", ["--world-size", "--epochs"]) == "--epochs"
    assert unknown_text([("--frobnicate", None)]) == "unrecognized option --frobnicate"
