"""Every failing ``flodl-trio`` command prints one line under 200 characters with the cause a person
can act on first (a refused connection names the peer that should be running), exits with its
code, and shows the whole message and a traceback only with ``--debug``."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from flodl_trio import FlodlError, FormationTimeout, HandshakeError
from flodl_trio.cli import main
from flodl_trio.cli._errors import MAX_LINE, error_line, network_cause

CLI = [sys.executable, "-m", "flodl_trio"]


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def only_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("flodl-trio")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert len(lines[0]) < MAX_LINE, lines[0]
    return lines[0]


def test_status_on_a_closed_port_asks_whether_a_coordinator_runs_there(
    capsys: pytest.CaptureFixture[str],
) -> None:
    port = closed_port()
    assert main(["status", f"127.0.0.1:{port}", "--timeout", "5"]) == 1
    assert only_line(capsys.readouterr().err) == (
        f"flodl-trio: status: connection refused: is a coordinator running at 127.0.0.1:{port}?")


def test_status_with_debug_shows_the_whole_error_as_a_traceback() -> None:
    port = closed_port()
    with pytest.raises(BaseExceptionGroup) as info:  # the nursery's group, as it happened
        main(["--debug", "status", f"127.0.0.1:{port}", "--timeout", "5"])
    assert info.group_contains(FlodlError, match="connection refused: is a coordinator running")
    [refused] = [e for e in info.value.exceptions if isinstance(e, FlodlError)]
    assert isinstance(refused.__cause__, OSError)  # the OS's own error stays attached


@pytest.mark.slow
def test_a_rank_whose_relay_port_is_closed_asks_whether_a_relay_runs_there(
    tmp_path: Path,
) -> None:
    port = closed_port()
    env = dict(os.environ, FLODL_SALT_HEX="ab" * 16, FLODL_NET_TIMEOUT_SCALE="0.1")
    done = subprocess.run([*CLI, "rank", "--relay", f"127.0.0.1:{port}", "--rank", "3",
                           "--world-size", "4"], capture_output=True, text=True, timeout=60,
                          env=env)
    assert done.returncode == 1
    assert only_line(done.stderr) == (
        f"flodl-trio: rank 3: connection refused: is a relay running at 127.0.0.1:{port}?")


@pytest.mark.parametrize(("argv", "code", "line"), [
    (["demo", "--hosts", "0"], 2,
     "flodl-trio: error: demo: expected --hosts, --ranks-per-host and --epochs >= 1"),
    (["coordinator", "--world-size", "1", "--listen", "127.0.0.1:99999"], 2,
     "flodl-trio: error: --listen: expected HOST:PORT, got '127.0.0.1:99999'"),
    (["relay", "--coordinator", "127.0.0.1:1", "--host", "h", "--ranks", "0", "--world-size",
      "1", "--salt-file", "/no-such-dir/salt"], 2,
     "flodl-trio: error: --salt-file '/no-such-dir/salt': No such file or directory"),
], ids=["demo-hosts", "coordinator-listen", "relay-salt-file"])
def test_each_usage_error_is_its_one_short_line(
    argv: list[str], code: int, line: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLODL_SALT_HEX", "ab" * 16)
    assert main(argv) == code
    assert only_line(capsys.readouterr().err) == line


def test_a_coordinator_no_relay_ever_reached_says_how_far_it_got_and_what_to_start(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLODL_SALT_HEX", "ab" * 16)
    assert main(["coordinator", "--world-size", "2", "--formation-timeout", "0.2"]) == 1
    assert only_line(capsys.readouterr().err) == (
        "flodl-trio: FormationTimeout: formation timed out after 0.2s: 0/2 ranks covered: no "
        "relay dialed in; start each relay with --coordinator set to an address of 'relays can "
        "dial'")


def test_a_formation_timeout_with_rejected_relays_keeps_the_rejections_first() -> None:
    timeout = FormationTimeout("formation timed out after 60s: 0/2 ranks covered; hosts joined: "
                               "none; rejected connections: bad mac x3 (last from 127.0.0.1:5)")
    assert error_line(timeout, command="coordinator", who="coordinator", address=None) == (
        f"flodl-trio: FormationTimeout: {timeout}")


def test_a_long_library_message_is_cut_at_a_clause_and_points_at_debug() -> None:
    detail = "; ".join(f"rejected connection {i} from 127.0.0.{i}:5000 (bad mac)"
                       for i in range(20))
    line = error_line(FlodlError(f"formation timed out after 60s: 3/8 ranks covered; {detail}"),
                      command="coordinator", who="coordinator", address=None)
    assert len(line) < MAX_LINE
    assert line.startswith("flodl-trio: FlodlError: formation timed out after 60s: 3/8 ranks "
                           "covered; rejected connection 0 from 127.0.0.0:5000 (bad mac)")
    assert line.endswith("(bad mac) ... (--debug for the full message)")


def test_a_rank_whose_relay_gave_up_quotes_the_relay_first() -> None:
    lost = FlodlError("rank 0 (via relay 127.0.0.1:4000): link to relay 127.0.0.1:4000 lost "
                      "(BrokenResourceError); the relay said: relay 'h' gave up: no coordinator")
    assert error_line(lost, command="rank", who="rank 0", address="127.0.0.1:4000") == (
        "flodl-trio: FlodlError: rank 0: the relay said: relay 'h' gave up: no coordinator")


def test_unknown_names_and_unreachable_networks_say_to_check_the_address() -> None:
    unknown = HandshakeError("relay 'h': expected a connection")
    unknown.__cause__ = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    assert network_cause(unknown, peer="coordinator", address="coord.example:7000") == (
        "cannot resolve 'coord.example' (Name or service not known): check the coordinator "
        "address")
    unreachable = OSError("all attempts to connect failed")
    unreachable.__cause__ = ExceptionGroup("x", [OSError(errno.ENETUNREACH, "Network is "
                                                         "unreachable")])
    assert network_cause(unreachable, peer="relay", address="10.0.0.1:7000") == (
        "no route to 10.0.0.1:7000 (Network is unreachable): check the relay address")
    assert network_cause(FlodlError("bad mac"), peer="relay", address="x:1") is None


def test_an_unknown_name_behind_a_store_or_a_list_is_not_read_from_the_option() -> None:
    published = HandshakeError("relay 'h': ...")
    published.__cause__ = socket.gaierror(
        socket.EAI_NONAME, "cannot resolve 'box-9' (Name or service not known), the address the "
        "coordinator published at etcd://10.0.0.5:2379/r")
    assert network_cause(published, peer="coordinator",
                         address="etcd://10.0.0.5:2379/r") == (
        "cannot resolve 'box-9' (Name or service not known), the address the coordinator "
        "published at etcd://10.0.0.5:2379/r: check the coordinator address")
    listed = HandshakeError("relay 'h': ...")
    listed.__cause__ = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    assert network_cause(listed, peer="coordinator", address="a:1,b:2") == (
        "cannot resolve a name of a:1,b:2 (Name or service not known): check the coordinator "
        "address")


def test_a_rank_its_relay_rejects_is_told_what_to_check() -> None:
    rejected = HandshakeError(
        "rank 3: expected a handshake ack (a relay closes connections whose salt, world_size or "
        "rank it rejects: check its log) from relay 127.0.0.1:4000 within connect_timeout=3s; "
        "last attempt failed: WireError('ack from relay 127.0.0.1:4000: peer closed the "
        "connection before sending anything')")
    line = error_line(rejected, command="rank", who="rank 3", address="127.0.0.1:4000")
    assert line == ("flodl-trio: HandshakeError: rank 3: the relay at 127.0.0.1:4000 closed every "
                    "handshake: is this rank one of its --ranks, and do --world-size and the salt "
                    "match its own? (its log says which)")
    assert len(line) < MAX_LINE
