"""The demo's child processes: the coordinator, one relay per host and one rank per rank, each
a ``flodl-trio`` command with its stderr in a log file of its own; a killed coordinator or host
can be started again (``--kill-coordinator``, ``--restart-relay``)."""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from ..cli._common import CommandFailed


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "flodl_trio", *args]


def _log(folder: Path, name: str) -> IO[str]:
    # Children's stderr goes to a file each: a killed relay's ranks report CoordinatorLost, which
    # is the point of the demo, not noise for the terminal.
    return (folder / f"{name}.log").open("w", encoding="utf-8")


# The kept directory's path is printed on stdout ("process logs kept in ..."): a temporary path
# would take most of the one error line.
LOG_HINT = " (see coordinator.log in the process logs kept)"


def _read_line(proc: subprocess.Popen[str], what: str, logs: Path) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the child prints it right after binding
    if not line:
        raise CommandFailed(f"demo: the {what} process exited with code {proc.wait()} before "
                            f"printing its address (see {what}.log in the process logs kept)")
    return line


class Cluster:
    """The child processes, started in order; ``stop()`` ends every one still running."""

    def __init__(self, args: argparse.Namespace, env: dict[str, str], logs: Path,
                 timeline: Path, summary: Path, *, store: str | None = None) -> None:
        self.args, self.env, self.logs = args, env, logs
        self.timeline, self.summary = timeline, summary
        self.store = store  # the coordinator's --store (``--kill-coordinator``)
        self.coordinators = 0  # coordinator processes started
        self.coord: subprocess.Popen[str] | None = None
        self.relays: dict[str, subprocess.Popen[str]] = {}
        self.ranks: dict[int, subprocess.Popen[str]] = {}
        self.replaced: list[subprocess.Popen[str]] = []  # killed hosts' processes, restarted
        self.restarted: set[str] = set()
        self.address = ""
        # time.monotonic() when each coordinator printed its address: the moment of its
        # Listening event, which puts every coordinator's timeline on the demo's clock.
        self.listening_at: list[float] = []
        self.layout: dict[str, list[int]] = {}
        self.world = 0
        # An elastic world (--add-host, --drain-relay): (MIN, MAX) of the coordinator's
        # --world-size; relays and ranks are started with MAX, the id space.
        self.world_range: tuple[int, int] | None = None
        self.files: list[IO[str]] = []

    def elastic(self, least: int, most: int) -> None:
        """Run an elastic world of ``least`` to ``most`` ranks (before :meth:`start`)."""
        self.world_range = (least, most)

    @property
    def id_space(self) -> int:
        """The ``--world-size`` of relays and ranks: the world's maximum."""
        return self.world if self.world_range is None else self.world_range[1]

    def _start(self, argv: list[str], log: str, *, stdout: Any) -> subprocess.Popen[str]:
        err = _log(self.logs, log)
        self.files.append(err)
        return subprocess.Popen(argv, env=self.env, stdout=stdout, stderr=err,
                                stdin=subprocess.DEVNULL, text=True)

    def start(self, layout: dict[str, list[int]], world: int) -> str:
        self.layout, self.world = dict(layout), world  # --add-host adds to it
        self.start_coordinator("127.0.0.1:0")
        for host in layout:
            self.start_host(host)
        return self.address

    def start_coordinator(self, listen: str) -> None:
        """Start a coordinator process listening on ``listen`` (the first one, or one that
        takes over the session of a killed one: same port, same store, same timeline)."""
        a = self.args
        self.coordinators += 1
        log = "coordinator" if self.coordinators == 1 else f"coordinator-{self.coordinators}"
        store = ["--store", self.store] if self.store else []
        world = [str(self.world)]
        if self.world_range is not None:
            # Every first host joins within the window (each relay once its ranks are in).
            world = [f"{self.world_range[0]}:{self.world_range[1]}", "--join-window", "3"]
        self.coord = self._start(_cli(
            "--log-level", "INFO", "coordinator", "--listen", listen, "--world-size",
            *world, "--epochs", str(a.epochs), "--total-samples",
            str(a.total_samples), "--batch-size", str(a.batch_size), "--timeline",
            str(self.timeline), "--summary-file", str(self.summary), "--heartbeat-timeout", "5",
            "--linger", str(a.linger), *store), log, stdout=subprocess.PIPE)
        self.address = _read_line(self.coord, log, self.logs).strip().rsplit(" ", 1)[-1]
        self.listening_at.append(time.monotonic())

    def kill_coordinator(self) -> int:
        """SIGKILL the coordinator (no goodbye: the OS closes its sockets); return its pid.
        :meth:`start_coordinator` on :attr:`address` starts the one that takes over."""
        old = self.coord
        assert old is not None
        old.kill()
        old.wait()
        self.replaced.append(old)
        # The killed process may have died in the middle of a timeline line: end it, so that
        # the next coordinator's first event starts a line of its own.
        with self.timeline.open("rb+") as f:
            if f.seek(0, 2) > 0 and (f.seek(-1, 2), f.read(1))[1] != b"\n":
                f.write(b"\n")
        return old.pid

    def start_host(self, host: str, *, again: bool = False) -> None:
        """Start ``host``'s relay, then its rank processes (``again``: after a kill)."""
        a, ranks = self.args, self.layout[host]
        slower = 1 + list(self.layout).index(host)
        log = f"{host}-restarted" if again else host
        if again:
            self.replaced += [self.relays[host], *(self.ranks[r] for r in ranks)]
        relay = self._start(_cli(
            "relay", "--coordinator", self.address, "--host", host, "--ranks",
            ",".join(map(str, ranks)), "--world-size", str(self.id_space)), log,
            stdout=subprocess.PIPE)
        self.relays[host] = relay
        rank_address = _read_line(relay, log, self.logs).split()[-1]
        for r in ranks:
            self.ranks[r] = self._start(_cli(
                "rank", "--relay", rank_address, "--rank", str(r), "--world-size",
                str(self.id_space), "--batch-size", str(a.batch_size), "--batch-ms",
                str(a.batch_ms * slower)), f"rank-{r}-restarted" if again else f"rank-{r}",
                stdout=subprocess.DEVNULL)

    def add_host(self, host: str) -> list[int]:
        """Start one more host with the next ``--ranks-per-host`` rank ids: it joins the
        running cohort (an elastic world). Returns its ranks."""
        per = self.args.ranks_per_host
        first = max(r for ranks in self.layout.values() for r in ranks) + 1
        self.layout[host] = list(range(first, first + per))
        self.start_host(host)
        return self.layout[host]

    def children(self) -> list[subprocess.Popen[str]]:
        return [*self.relays.values(), *self.ranks.values()]

    def stop(self) -> int:
        procs = [p for p in [self.coord, *self.children(), *self.replaced] if p is not None]
        running = [p for p in procs if p.poll() is None]
        for p in running:
            p.terminate()  # SIGTERM: each stops gracefully and exits 143
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
            if p.poll() is None:
                p.kill()
                p.wait()
            if p.stdout is not None:
                p.stdout.close()
        for f in self.files:
            f.close()
        return len(running)
