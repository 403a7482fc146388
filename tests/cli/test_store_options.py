"""``flodl-trio coordinator --store`` as real processes: a second coordinator on a led store
fails at once in one line unless it is a ``--standby`` (which waits, then leads); a store that is
not one, or an etcd nobody answers on, is one line naming it, exit 1, fast."""

from __future__ import annotations

import json
import re
import signal
import time
import urllib.request
from pathlib import Path

from helpers.cli_procs import Proc, coordinator, one_line
from helpers.scripts import load_script
from helpers.store import another_runs_session

PATIENCE = 20.0  # real seconds, only a bound



def leader_of(lock: Path) -> str:
    """The owner a leading coordinator wrote into the store's lock file (waits for it)."""
    deadline = time.monotonic() + PATIENCE
    while time.monotonic() < deadline:
        text = lock.read_text() if lock.exists() else ""
        if text.strip():
            return text.strip()
        time.sleep(0.05)
    raise AssertionError(f"nobody leads {lock}")


def test_a_second_coordinator_on_a_led_store_fails_at_once_unless_it_is_a_standby(
        tmp_path: Path, env: dict[str, str], procs: list[Proc]) -> None:
    store = f"sqlite:{tmp_path / 's.db'}"
    first = coordinator(env, procs, store)
    owner = leader_of(tmp_path / "s.db.lock")
    assert f"pid {first.popen.pid}" in owner

    started = time.monotonic()
    second = coordinator(env, procs, store)
    assert second.wait() == 1
    assert time.monotonic() - started < 10  # at once: it did not wait for the leadership
    line = one_line(second)
    assert line == (f"flodl-trio: coordinator: store {store} is led by {owner}; pass --standby "
                    "to wait for it"), line
    assert not any("listening" in out for out in second.out)  # refused before binding a port

    standby = coordinator(env, procs, store, "--standby")
    assert f"is led by {owner}; waiting" in standby.line_with("standby:")
    standby.line_with("relays can dial")  # its port is bound while it waits
    time.sleep(0.5)
    assert standby.popen.poll() is None and f"pid {first.popen.pid}" in leader_of(
        tmp_path / "s.db.lock")
    # A crash releases the lock at once and leaves the session to adopt (a graceful end would
    # record the end, and the standby would exit 0: the run it waited for ended).
    first.signal(signal.SIGKILL)
    assert first.wait() == -signal.SIGKILL
    deadline = time.monotonic() + PATIENCE
    while f"pid {standby.popen.pid}" not in leader_of(tmp_path / "s.db.lock"):
        assert time.monotonic() < deadline, "the standby never took the leadership"
        time.sleep(0.05)
    assert standby.popen.poll() is None  # it leads and forms, waiting for relays


def test_the_status_of_a_coordinator_with_a_store_shows_its_size_and_write_rate(
        tmp_path: Path, env: dict[str, str], procs: list[Proc]) -> None:
    first = coordinator(env, procs, f"sqlite:{tmp_path / 's.db'}", "--store-write-rate", "5",
                        "--port-file", str(tmp_path / "port"))
    first.line_with("relays can dial")
    deadline = time.monotonic() + PATIENCE
    store = None
    while not (store and store["size_bytes"]):  # None until it leads; then its size
        assert time.monotonic() < deadline, f"no store size in time: {store}"
        time.sleep(0.05)
        port = tmp_path / "port"  # written after that line
        address = port.read_text().strip() if port.exists() else ""
        if address:
            with urllib.request.urlopen(f"http://{address}/state.json", timeout=5) as answer:
                store = json.loads(answer.read())["store"]
    assert store["kind"] == "sqlite" and store["write_rate"] == 5.0
    assert store["description"] == f"sqlite:{tmp_path / 's.db'}"
    assert store["size_bytes"] == sum(store["detail"].values()) > 0
    assert store["writes"] >= 1 and store["generation"] == 1


def test_a_file_that_is_not_a_store_is_one_line_naming_it(
        tmp_path: Path, env: dict[str, str], procs: list[Proc]) -> None:
    path = tmp_path / "state.db"
    path.write_bytes(b"not a database at all " * 200)
    proc = coordinator(env, procs, f"sqlite:{path}")
    assert proc.wait() == 1
    line = one_line(proc)
    assert line.startswith("flodl-trio: StoreCorrupt: ") and str(path) in line, line


def test_an_etcd_nobody_answers_on_is_one_line_naming_it_fast(
        env: dict[str, str], procs: list[Proc]) -> None:
    port = load_script("_etcd").free_port()  # nothing listens there
    started = time.monotonic()
    proc = coordinator(env, procs, f"etcd://127.0.0.1:{port}/x")
    assert proc.wait() == 1
    assert time.monotonic() - started < 8
    line = one_line(proc)
    assert re.match(rf"flodl-trio: StoreUnavailable: store etcd://127\.0\.0\.1:{port}/x: ", line)
    assert "refused" in line, line


def test_a_store_url_of_no_known_form_and_standby_without_store_are_usage_errors(
        env: dict[str, str], procs: list[Proc]) -> None:
    bad = coordinator(env, procs, "postgres://db/x")
    standby = Proc("coordinator", "--world-size", "2", "--standby", env=env)
    relay = ["relay", "--host", "h", "--ranks", "0", "--world-size", "1"]
    store_target = Proc(*relay, "--coordinator", "sqlite:/tmp/x.db", env=env)
    negative_grace = Proc(*relay, "--coordinator", "127.0.0.1:7000", "--coordinator-grace",
                          "-1", env=env)
    no_rate = coordinator(env, procs, "memory:", "--store-write-rate", "0")
    procs += [bad, standby, store_target, negative_grace, no_rate]
    assert all(p.wait() == 2 for p in (bad, standby, store_target, negative_grace, no_rate))
    assert ("CoordinatorConfig.store_write_rate: expected a rate > 0 per second (math.inf: no "
            "pacing), got 0.0") in one_line(no_rate)
    assert "--store: store 'postgres://db/x': unknown scheme 'postgres'" in one_line(bad)
    assert "--standby waits for the leadership of a --store" in one_line(standby)
    assert ("--coordinator: expected HOST:PORT[,HOST:PORT...] or etcd://HOST:PORT/PREFIX, got "
            "'sqlite:/tmp/x.db'") in one_line(store_target)
    assert "--coordinator-grace: expected seconds >= 0, got -1.0" in one_line(negative_grace)


def test_a_store_holding_another_runs_session_is_one_line_naming_it(
        tmp_path: Path, env: dict[str, str], procs: list[Proc]) -> None:
    path = tmp_path / "other.db"
    another_runs_session(path, owner="a coordinator of another run", model_sigs={}, roster=(),
                         dead={}, failures=0, formed=False, checkpoint=None)
    proc = coordinator(env, procs, f"sqlite:{path}")
    assert proc.wait() == 1
    line = one_line(proc)
    assert line.startswith(f"flodl-trio: coordinator: sqlite:{path} holds another run's "
                           "unfinished session: --fresh discards it, or use another store"), line
    assert proc.out[-1].startswith("relays can dial")  # no summary: it never led a run


def test_a_coordinator_that_loses_its_leadership_exits_1_with_one_line(
        tmp_path: Path, env: dict[str, str], procs: list[Proc]) -> None:
    path = tmp_path / "lost.db"
    proc = coordinator(env, procs, f"sqlite:{path}")
    leader_of(tmp_path / "lost.db.lock")
    proc.line_with("relays can dial")
    path.unlink()  # the store is gone under it: it can no longer lead (checked every second)
    assert proc.wait() == 1
    line = one_line(proc)
    assert line.startswith(f"flodl-trio: stepping down: store sqlite:{path}: expected to lead "
                           "as generation 1"), line
