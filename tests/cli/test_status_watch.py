"""``flodl-trio status --watch``: one screen refreshed in place (hosts with their ranks alive and
dead, the epoch, lost broadcasts), a bounded refresh interval, and a clean end on Ctrl-C and when
the coordinator goes away."""

from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import trio
from rich.console import Console

from flodl_trio.cli import main
from flodl_trio.cli._watch import changes, render
from flodl_trio.events import Note
from flodl_trio.local_cluster import layout
from flodl_trio.pytest_plugin import LocalClusterFactory

CLI = [sys.executable, "-m", "flodl_trio"]

STATE: dict[str, Any] = {
    "phase": "running", "world_size": 4, "covered": 4, "epoch": 2, "uptime_s": 12.5,
    "relays": [{"host": "host-a", "ranks": [0, 1], "peer": "127.0.0.1:5001", "connected": True},
               {"host": "host-b", "ranks": [2, 3], "peer": "127.0.0.1:5002", "connected": False}],
    "live": [0, 1], "dead": [{"rank": 2, "reason": "relay 'host-b' lost"},
                             {"rank": 3, "reason": "relay 'host-b' lost"}],
    "exited": [], "lost_broadcasts": 1,
}


def screen(state: dict[str, Any]) -> str:
    console = Console(record=True, width=100, file=io.StringIO())
    console.print(render(state, where="127.0.0.1:7000", interval=1.0))
    return console.export_text()


def test_the_view_shows_each_host_with_its_ranks_alive_and_dead_the_epoch_and_lost_broadcasts(
) -> None:
    text = screen(STATE)
    assert "coordinator 127.0.0.1:7000  phase running  epoch 2  covered 4/4" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines()
            if line.startswith("host-")}
    assert rows["host-a"][2:7] == ["connected", "2", "0", "0", "0,1"]
    assert rows["host-b"][2:7] == ["gone", "0", "2", "0", "2,3"]
    assert "ranks alive 2  dead 2  exited 0  lost broadcasts 1" in text
    assert "dead rank 2: relay 'host-b' lost" in text


def test_a_thousand_dead_ranks_still_fit_one_screen_and_a_strange_document_does_not_crash(
) -> None:
    many = dict(STATE, dead=[{"rank": r, "reason": "silent"} for r in range(1000)])
    assert len(screen(many).splitlines()) < 20
    assert "... and 995 more dead ranks" in screen(many)
    assert "phase ?  epoch -" in screen({"relays": "nonsense", "dead": [1, None], "live": 7})


async def test_the_status_document_says_which_epoch_an_orchestrator_started_from_1(
    autojump_clock: trio.abc.Clock, local_cluster_factory: LocalClusterFactory,
) -> None:
    async with local_cluster_factory(layout(1, 2)) as cluster:
        assert cluster.coord.state()["epoch"] is None  # before the first epoch
        cluster.coord.timeline.event(Note(what="epoch_started", fields={"epoch": 0}))
        assert cluster.coord.state()["epoch"] == 1
        cluster.coord.timeline.event(Note(what="epoch_started", fields={"epoch": 4}))
        assert cluster.coord.state()["epoch"] == 5


@pytest.mark.parametrize("interval", ["0.1", "61", "nan"])
def test_the_refresh_interval_is_bounded(interval: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--watch", "--interval", interval, "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err == (f"flodl-trio: error: --interval: expected seconds in "
                                       f"[0.2, 60], got {float(interval):g}\n")


def test_watch_and_json_together_are_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--watch", "--json", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err == ("flodl-trio: error: status: --watch shows a view, --json "
                                       "one document: choose one\n")


class _StatusServer:
    """A status page on loopback that answers STATE (or each of ``documents`` in turn, the last
    one from then on) and counts requests (a coordinator's view)."""

    def __init__(self, documents: tuple[dict[str, Any], ...] = (STATE,)) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.requests += 1
                body = json.dumps(documents[min(owner.requests, len(documents)) - 1]).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.requests = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def wait_for(self, requests: int) -> None:
        deadline = time.monotonic() + 30
        while self.requests < requests and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.requests >= requests

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def status_server() -> Iterator[_StatusServer]:
    server = _StatusServer()
    yield server
    server.stop()


def watch(address: str) -> subprocess.Popen[str]:
    return subprocess.Popen([*CLI, "status", "--watch", "--interval", "0.2", address],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_watch_ends_with_one_line_and_exit_0_when_the_coordinator_goes_away(
    status_server: _StatusServer,
) -> None:
    proc = watch(status_server.address)
    status_server.wait_for(3)  # the view refreshed
    status_server.stop()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert err == ""
    last = out.splitlines()[-1]
    # Refused, or cut mid-answer when the server stopped during a refresh.
    assert last.startswith(f"coordinator {status_server.address} went away (")
    assert last.endswith("last seen: phase running, epoch 2, 2 alive, 2 dead")
    assert "host-b" in out and "lost broadcasts 1" in out  # the last view stays on screen


@pytest.mark.slow
def test_watch_stopped_by_ctrl_c_exits_130_with_one_line(status_server: _StatusServer) -> None:
    proc = watch(status_server.address)
    status_server.wait_for(2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert err == f"flodl-trio: status --watch {status_server.address} stopped by SIGINT\n"


# An elastic world (2..6) as a coordinator's /state.json tells it: host-c joins, host-b drains,
# its ranks are retired as they exit.
ELASTIC: dict[str, Any] = dict(
    STATE, world_size=6, covered=4, live=[0, 1, 2, 3], dead=[], lost_broadcasts=0,
    relays=[{"host": "host-a", "ranks": [0, 1], "peer": "127.0.0.1:5001", "connected": True},
            {"host": "host-b", "ranks": [2, 3], "peer": "127.0.0.1:5002", "connected": True}],
    world={"min": 2, "max": 6, "current": 4}, retired=[], retirements=[], joins={},
    draining=[])
HOST_C = {"host": "host-c", "ranks": [4, 5], "peer": "127.0.0.1:5003", "connected": True}
GROWN = dict(ELASTIC, relays=[*ELASTIC["relays"], HOST_C], live=[0, 1, 2, 3, 4, 5],
             covered=6, world={"min": 2, "max": 6, "current": 6}, joins={"4": 1, "5": 1})
DRAINING = dict(GROWN, draining=[2, 3], drains_total=1, drains=[
    {"host": "host-b", "ranks": [2, 3], "reason": "SIGTERM"}])
DRAINED = dict(DRAINING, draining=[], relays=[ELASTIC["relays"][0], HOST_C],
               live=[0, 1, 4, 5], covered=4, world={"min": 2, "max": 6, "current": 4},
               retired=[2, 3], retirements=[
                   {"rank": r, "host": "host-b", "reason": "its host 'host-b' left: SIGTERM"}
                   for r in (2, 3)])


def test_each_join_drain_and_retirement_is_one_line_and_a_steady_world_none() -> None:
    assert changes(ELASTIC, GROWN) == ["host-c joined: rank(s) 4,5 in the cohort; world 6 of 2..6"]
    assert changes(GROWN, DRAINING) == [
        "host-b draining (SIGTERM): rank(s) 2,3 finish their current sync and exit"]
    # A drain that began and ended between two refreshes is said all the same.
    assert changes(GROWN, DRAINED) == [
        "host-b draining (SIGTERM): rank(s) 2,3 finish their current sync and exit",
        "host-b: rank(s) 2,3 retired (its host 'host-b' left: SIGTERM); world 4 of 2..6"]
    assert changes(DRAINING, DRAINED) == [
        "host-b: rank(s) 2,3 retired (its host 'host-b' left: SIGTERM); world 4 of 2..6"]
    assert changes(DRAINED, DRAINED) == [] and changes(STATE, STATE) == []
    # Retired again after joining again between two refreshes: both said.
    back = dict(DRAINED, joins={"2": 1, "3": 1, "4": 1, "5": 1})
    assert changes(DRAINED, back) == [
        "? joined: rank(s) 2,3 in the cohort; world 4 of 2..6",
        "host-b: rank(s) 2,3 retired (its host 'host-b' left: SIGTERM); world 4 of 2..6"]
    assert "world 4 of 2..6, retired 2,3" in screen(DRAINED)
    assert "host-b  127.0.0.1:5002  draining" in screen(DRAINING)


@pytest.mark.slow
def test_watch_prints_a_line_for_each_join_drain_and_retirement_as_it_sees_them() -> None:
    server = _StatusServer((ELASTIC, ELASTIC, GROWN, GROWN, DRAINING, DRAINED))
    try:
        proc = watch(server.address)
        server.wait_for(8)
    finally:
        server.stop()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    said = [line[9:] for line in out.splitlines() if re.match(r"\d\d:\d\d:\d\d ", line)]
    assert said == [
        "host-c joined: rank(s) 4,5 in the cohort; world 6 of 2..6",
        "host-b draining (SIGTERM): rank(s) 2,3 finish their current sync and exit",
        "host-b: rank(s) 2,3 retired (its host 'host-b' left: SIGTERM); world 4 of 2..6"]
