"""Exit codes of every long-running command, as real processes with real signals: 0 only for a run
that completed as asked, 1 with one line for a failed run, 2 for usage, 130 / 143 after a graceful
stop on SIGINT / SIGTERM; operating-system errors are one line naming the address or the file."""

from __future__ import annotations

import json
import signal
import socket
from pathlib import Path

import pytest

from helpers.cli_procs import PATIENCE, Proc, failure_line, one_line


def one_host(env: dict[str, str], procs: list[Proc], world: int, *coordinator: str,
             rank_args: tuple[str, ...] = ()) -> tuple[Proc, Proc, list[Proc]]:
    """A coordinator of ``world`` ranks (its other arguments ``coordinator``), one relay (host
    ``h``, every rank) and a rank process per rank: ``(coordinator, relay, ranks)``."""
    coord = Proc("coordinator", "--world-size", str(world), *coordinator, env=env)
    procs.append(coord)
    address = coord.line_with("coordinator listening on").split()[-1]
    every = f"0-{world - 1}" if world > 1 else "0"
    relay = Proc("relay", "--coordinator", address, "--host", "h", "--ranks", every,
                 "--world-size", str(world), env=env)
    procs.append(relay)
    rank_address = relay.line_with("listening for ranks on").split()[-1]
    ranks = [Proc("rank", "--relay", rank_address, "--rank", str(r), "--world-size", str(world),
                  *rank_args, env=env) for r in range(world)]
    procs.extend(ranks)
    return coord, relay, ranks


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["SIGINT", "SIGTERM"])
def test_coordinator_stopped_by_a_signal_exits_128_plus_signum_with_its_summary(
    env: dict[str, str], procs: list[Proc], signum: int, code: int
) -> None:
    coord = Proc("coordinator", "--world-size", "2", "--epochs", "1", env=env)
    procs.append(coord)
    coord.line_with("coordinator listening on")
    coord.signal(signum)
    assert coord.wait() == code
    name = signal.Signals(signum).name
    assert one_line(coord) == f"flodl-trio: coordinator stopped by {name} (graceful shutdown done)"
    assert f'"stopped": "{name}"' in coord.line_with('"summary"')


@pytest.mark.slow
def test_a_completed_run_exits_0_everywhere_and_a_lost_coordinator_is_1_for_its_rank(
    env: dict[str, str], procs: list[Proc]
) -> None:
    coord, relay, ranks = one_host(env, procs, 2, "--epochs", "1", "--total-samples", "16",
                                   rank_args=("--batch-ms", "5"))
    assert coord.wait() == 0, coord.err
    assert [rank.wait() for rank in ranks] == [0, 0], [rank.err for rank in ranks]
    assert relay.wait() == 0, relay.err
    assert '"epochs_completed": 1' in coord.line_with('"summary"')
    assert '"epoch_metrics": [{"epoch": 1,' in coord.line_with('"summary"')  # as the line below
    progress = coord.line_with("epoch 1/1: ")
    assert progress.startswith("epoch 1/1: 16/16 samples covered (exactly once), ")
    assert progress.endswith(" 0 deaths (0 dead in all)") and "samples/s" in progress


@pytest.mark.slow
def test_signalled_ranks_exit_143_and_130_and_a_lost_coordinator_is_1_for_rank_and_relay(
    env: dict[str, str], procs: list[Proc]
) -> None:
    coord, relay, ranks = one_host(env, procs, 3)  # the coordinator holds the cohort, no epochs
    coord.line_with("formed: 3 ranks")
    ranks[1].signal(signal.SIGTERM)
    ranks[2].signal(signal.SIGINT)
    assert (ranks[1].wait(), ranks[2].wait()) == (143, 130)
    assert one_line(ranks[1]) == "flodl-trio: rank 1 stopped by SIGTERM (graceful shutdown done)"
    assert one_line(ranks[2]) == "flodl-trio: rank 2 stopped by SIGINT (graceful shutdown done)"
    coord.popen.kill()  # no Shutdown: the rank's link ends and its coordinator is lost
    assert ranks[0].wait() == 1
    assert "CoordinatorLost: rank 0" in one_line(ranks[0])
    assert relay.wait() == 1  # no Goodbye came (FT/2): the coordinator died


@pytest.mark.slow
def test_a_coordinator_whose_every_rank_died_exits_1_with_the_cluster_failure(
    env: dict[str, str], procs: list[Proc], tmp_path: Path
) -> None:
    summary_file = tmp_path / "summary.json"
    coord, relay, (rank,) = one_host(env, procs, 1, "--summary-file", str(summary_file))
    coord.line_with("formed: 1 ranks")
    rank.popen.kill()  # a crash: the relay reports RankExit, the coordinator declares it dead
    assert coord.wait() == 1
    assert one_line(coord).startswith("flodl-trio: ClusterFailure: cluster failure: "
                                      "ALL_RANKS_LOST; dead ranks [0]")
    summary = json.loads(summary_file.read_text())  # written, not left empty
    assert summary["failed"].startswith("ClusterFailure: cluster failure: ALL_RANKS_LOST")
    assert summary["dead_ranks"] == [0]
    assert relay.wait() == 0  # its rank is gone and the coordinator shut it down: a clean end


@pytest.mark.slow
def test_a_port_in_use_is_one_line_naming_the_address(
    env: dict[str, str], procs: list[Proc]
) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert failure_line(procs, "coordinator", "--listen", f"127.0.0.1:{port}",
                            "--world-size", "1", env=env, code=1) == (
            f"flodl-trio: coordinator: cannot listen on 127.0.0.1:{port}: Address already in use")
        assert failure_line(procs, "relay", "--coordinator", "127.0.0.1:1", "--host", "h",
                            "--ranks", "0", "--world-size", "1", "--rank-port", str(port),
                            env=env, code=1) == (
            f"flodl-trio: relay h: cannot listen for ranks on 127.0.0.1:{port}: Address already "
            "in use")


def test_a_binary_salt_file_is_a_usage_error_naming_the_file(
    env: dict[str, str], procs: list[Proc], tmp_path: Path
) -> None:
    salt = tmp_path / "salt.bin"
    salt.write_bytes(b"\xff\xfe\x00\x81" * 8)
    salt.chmod(0o600)
    assert failure_line(procs, "relay", "--coordinator", "127.0.0.1:1", "--host", "h", "--ranks",
                        "0", "--world-size", "1", "--salt-file", str(salt), env=env, code=2) == (
        f"flodl-trio: error: --salt-file {str(salt)!r}: expected 32 hex characters as text, got "
        "bytes that are not UTF-8")


def test_an_unwritable_timeline_is_one_line_naming_the_file(
    env: dict[str, str], procs: list[Proc], tmp_path: Path
) -> None:
    target = tmp_path / "no-such-dir" / "t.jsonl"
    assert failure_line(procs, "coordinator", "--world-size", "1", "--timeline", str(target),
                        env=env, code=2) == (
        f"flodl-trio: error: --timeline {str(target)!r}: No such file or directory")


def test_plot_of_a_missing_or_binary_file_or_to_an_unwritable_one_is_one_line_naming_it(
    env: dict[str, str], procs: list[Proc], tmp_path: Path
) -> None:
    missing = tmp_path / "missing.jsonl"
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xff")
    timeline = tmp_path / "t.jsonl"
    timeline.write_text('{"t_ms": 0.0, "kind": "Listening", "address": "127.0.0.1:1"}\n')
    unwritable = tmp_path / "no-such-dir" / "t.png"
    for path, output, words in (
        (missing, tmp_path / "t.png", f"{missing}: No such file or directory"),
        (binary, tmp_path / "t.png", f"{binary}: expected a timeline (JSONL), got bytes that are "
         "not UTF-8 text"),
        (timeline, unwritable, f"-o {str(unwritable)!r}: No such file or directory"),
    ):
        assert failure_line(procs, "plot", str(path), "-o", str(output), env=env,
                            code=2) == f"flodl-trio: error: {words}"


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["SIGINT", "SIGTERM"])
def test_demo_stopped_by_a_signal_says_so_stops_its_children_and_cleans_up(
    env: dict[str, str], procs: list[Proc], tmp_path: Path, signum: int, code: int
) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    # Slow batches: the run outlasts any delay of this (loaded) test process before the signal.
    demo = Proc("demo", "--no-live", "--hosts", "1", "--batch-ms", "1000",
                env=dict(env, TMPDIR=str(scratch)))
    procs.append(demo)
    demo.line_with("coordinator on")
    demo.signal(signum)
    assert demo.wait() == code
    name = signal.Signals(signum).name
    verb = "interrupted by" if signum == signal.SIGINT else "stopped by"
    assert one_line(demo) == f"flodl-trio: demo {verb} {name}"
    assert demo.line_with("interrupted: stopping the coordinator, 1 relays and 2 ranks")
    assert list(scratch.iterdir()) == []


@pytest.mark.slow
def test_relays_stopped_by_sigterm_and_sigint_exit_143_and_130_one_whose_ranks_never_came_1(
    env: dict[str, str], procs: list[Proc]
) -> None:
    waiting = [Proc("relay", "--coordinator", "127.0.0.1:1", "--host", host, "--ranks", "0",
                    "--world-size", "1", env=env) for host in ("h", "i")]
    # The shortest deadlines the scale allows: rank_accept_timeout is 6 s instead of 60 s.
    alone = Proc("relay", "--coordinator", "127.0.0.1:1", "--host", "lonely", "--ranks", "0",
                 "--world-size", "1", env=dict(env, FLODL_NET_TIMEOUT_SCALE="0.1"))
    procs.extend([*waiting, alone])
    for relay, signum in zip(waiting, (signal.SIGTERM, signal.SIGINT), strict=True):
        relay.line_with("listening for ranks on")
        relay.signal(signum)
    assert [relay.wait() for relay in waiting] == [143, 130]
    assert one_line(waiting[0]) == "flodl-trio: relay h stopped by SIGTERM (graceful shutdown done)"
    assert one_line(waiting[1]) == "flodl-trio: relay i stopped by SIGINT (graceful shutdown done)"
    assert alone.wait() == 1
    line = one_line(alone)
    assert line.startswith("flodl-trio: FormationTimeout: relay 'lonely'"), line


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["SIGINT", "SIGTERM"])
def test_status_stopped_by_a_signal_while_waiting_exits_128_plus_signum(
    env: dict[str, str], procs: list[Proc], signum: int, code: int
) -> None:
    with socket.socket() as silent:  # accepts, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(PATIENCE)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        status = Proc("status", address, "--timeout", "60", env=env)
        procs.append(status)
        connection, _ = silent.accept()  # it is waiting for the answer now
        with connection:
            status.signal(signum)
            assert status.wait() == code
    name = signal.Signals(signum).name
    assert one_line(status) == f"flodl-trio: status {address} stopped by {name}"


@pytest.mark.slow
def test_a_demo_whose_run_fails_exits_1_with_one_line_and_keeps_its_logs(
    env: dict[str, str], procs: list[Proc], tmp_path: Path
) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    # Its only relay SIGKILLed: every rank is lost, the coordinator fails with ClusterFailure.
    demo = Proc("demo", "--no-live", "--hosts", "1", "--kill-relay", "host-a@0.2",
                env=dict(env, TMPDIR=str(scratch)))
    procs.append(demo)
    assert demo.wait() == 1
    line = one_line(demo)
    assert line.startswith("flodl-trio: demo: the run failed: ClusterFailure: cluster failure: "
                           "ALL_RANKS_LOST; dead ranks [0, 1]"), line
    assert demo.line_with("cluster FAILED: ALL_RANKS_LOST")
    [kept] = scratch.iterdir()  # the logs are what one wants to read after a failure
    assert line.endswith("(see coordinator.log in the process logs kept)") and len(line) < 200
    assert demo.line_with(f"process logs kept in {kept / 'logs'}")
    assert (kept / "logs" / "coordinator.log").is_file()


@pytest.mark.slow
def test_a_relay_and_its_rank_whose_coordinator_never_answers_exit_1(
    env: dict[str, str], procs: list[Proc]
) -> None:
    scaled = dict(env, FLODL_NET_TIMEOUT_SCALE="0.1")  # connect_timeout 3 s instead of 30 s
    relay = Proc("relay", "--coordinator", "127.0.0.1:1", "--host", "h", "--ranks", "0",
                 "--world-size", "1", env=scaled)
    procs.append(relay)
    rank = Proc("rank", "--relay", relay.line_with("listening for ranks on").split()[-1],
                "--rank", "0", "--world-size", "1", env=scaled)
    procs.append(rank)
    assert (relay.wait(), rank.wait()) == (1, 1)
    assert one_line(relay) == ("flodl-trio: relay h: connection refused: is a coordinator "
                               "running at 127.0.0.1:1?")
    assert one_line(rank).startswith("flodl-trio: CoordinatorLost: rank 0: ")
    assert "the relay said: relay 'h' gave up" in one_line(rank)
