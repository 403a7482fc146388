"""The processes of a nemesis run (scripts/nemesis.py): each child is started in a session of its
own, its output goes to files in the run directory, and it is stopped by its PID -- on a normal
end, on Ctrl-C and on a crash of the driver alike (:meth:`Registry.kill_all`).

A :class:`Proc` is one incarnation of one part (``coord-a``, ``relay host-2``, ``rank 5``): a part
that is restarted gets a new Proc, with its own log files (``NAME.N.out`` / ``.err``).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import trio

# How long a child gets to exit after SIGKILL before the driver gives up waiting (bounded).
REAP_S = 5.0


class Proc:
    """One child process (one incarnation of a part of the cluster).

    Attributes:
        name: the part (``coord-a``, ``relay host-0``, ``rank 3``).
        role: ``coordinator``, ``relay`` or ``rank``.
        incarnation: 0 for the first start of the part, then 1, 2, ...
        files: the paths of its logs, by kind (``out``, ``err``, ``log``, ``timeline``, ...).
        started: wall clock of the start.
        exited: wall clock when the driver saw it exit (None while running).
        code: its exit status (negative: killed by that signal), None while running.
        stopped: SIGSTOPped by the nemesis and not yet continued.
    """

    def __init__(self, name: str, role: str, incarnation: int, argv: Sequence[str],
                 files: dict[str, Path], env: dict[str, str]) -> None:
        self.name = name
        self.role = role
        self.incarnation = incarnation
        self.files = files
        self.started = time.time()
        self.exited: float | None = None
        self.code: int | None = None
        self.stopped = False
        self._exit_taken = False
        with open(files["out"], "ab") as out, open(files["err"], "ab") as err:
            self._popen = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out,
                                           stderr=err, env=env, start_new_session=True)

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def running(self) -> bool:
        return self.code is None

    def poll(self) -> None:
        """Update ``code`` and ``exited`` if the process has exited."""
        if self.code is not None:
            return
        code = self._popen.poll()
        if code is not None:
            self.code, self.exited, self.stopped = code, time.time(), False

    def take_exit(self) -> bool:
        """True exactly once: the first call after the process exited (the supervisor's)."""
        self.poll()
        if self.code is None or self._exit_taken:
            return False
        self._exit_taken = True
        return True

    def signal(self, sig: int) -> bool:
        """Send ``sig`` if it still runs; False if it had exited."""
        if self._popen.poll() is not None:
            return False
        os.kill(self._popen.pid, sig)
        if sig == signal.SIGSTOP:
            self.stopped = True
        elif sig == signal.SIGCONT:
            self.stopped = False
        return True

    def kill(self) -> None:
        """SIGCONT (a stopped process cannot die of anything else), SIGKILL, then reap."""
        if self._popen.poll() is None:
            os.kill(self._popen.pid, signal.SIGCONT)
            os.kill(self._popen.pid, signal.SIGKILL)
        try:
            self._popen.wait(timeout=REAP_S)
        except subprocess.TimeoutExpired:
            pass
        self.poll()

    def tail(self, kind: str = "err", lines: int = 8) -> list[str]:
        try:
            return self.files[kind].read_text(errors="replace").splitlines()[-lines:]
        except (OSError, KeyError):
            return []

    def __repr__(self) -> str:
        state = "running" if self.running else f"exit {self.code}"
        return f"<Proc {self.name}#{self.incarnation} pid {self.pid} {state}>"


class Registry:
    """Every Proc the run started, in start order (the driver's one list of children)."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root = root
        self.env = env
        self._procs: list[Proc] = []
        self._count: dict[str, int] = {}

    def start(self, name: str, role: str, build: Callable[[dict[str, Path]], list[str]], *,
              extra: Sequence[str] = ()) -> Proc:
        """Start a new incarnation of ``name``: ``build`` makes its argv from its files (``out``,
        ``err`` and the ``extra`` kinds its argv names: ``timeline``, ``summary``, ``log``),
        which are paths in the run directory named after the part and its incarnation."""
        n = self._count.get(name, 0)
        self._count[name] = n + 1
        stem = name.replace(" ", "-")
        files = {kind: self.root / f"{stem}.{n}.{kind}" for kind in ("out", "err", *extra)}
        proc = Proc(name, role, n, build(files), files, self.env)
        self._procs.append(proc)
        return proc

    def __iter__(self) -> Iterator[Proc]:
        return iter(list(self._procs))

    def running(self) -> list[Proc]:
        return [p for p in self._procs if p.running]

    def kill_all(self) -> None:
        """Stop every child still running, by PID (SIGCONT, SIGKILL, reap)."""
        for proc in reversed(self._procs):
            if proc.running:
                proc.kill()


def session_leftovers(sessions: Sequence[int]) -> list[str]:
    """Processes still alive in any of ``sessions`` (the children's own sessions: a child that
    started a grandchild and died would leave it here), as ``pid (comm)``."""
    wanted = set(sessions)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        state, session = fields[0], int(fields[3])
        if session in wanted and state != "Z":
            found.append(f"{entry.name} ({comm})")
    return found


def fd_count(pid: int | str = "self") -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


def generation_of(proc: Proc) -> int | None:
    """The generation a coordinator logged it leads with (None: it never led)."""
    for line in reversed(lines_of(proc.files["err"])):
        match = re.search(r"leading session store \S+ as generation (\d+)", line)
        if match:
            return int(match.group(1))
    return None


def read_summary(proc: Proc) -> dict[str, Any] | None:
    """The coordinator's ``--summary-file`` once it is written whole (None before)."""
    try:
        summary = json.loads(proc.files["summary"].read_text())
    except (OSError, ValueError, KeyError):
        return None
    return summary if isinstance(summary, dict) else None


async def wait_for_line(proc: Proc, kind: str, text: str, limit: float) -> str:
    """The first line of ``proc``'s ``kind`` file containing ``text`` (bounded by ``limit``)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        for line in lines_of(proc.files[kind]):
            if text in line:
                return line
        proc.poll()
        if not proc.running:
            break
        await trio.sleep(0.05)
    raise RuntimeError(f"{proc.name}: no line with {text!r} within {limit:g} s (exit "
                       f"{proc.code}); last lines:\n" + "\n".join(proc.tail(kind, 15)))


def lines_of(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def stable_port() -> int:
    """A free loopback port below the kernel's ephemeral range: a part restarted on its port
    (a coordinator slot, a relay's rank port) must find it free, and a port from the ephemeral
    range can meanwhile be taken as the local end of any outgoing connection (one the proxies
    or the relays dial, or another program's)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):  # bounded: a port taken between this check and its bind is retried
        port = rng.randrange(10000, max(10001, low))
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in 10000..{low - 1} after 200 tries")


def distinct_ports(n: int) -> list[int]:
    """``n`` different :func:`stable_port` ports."""
    ports: list[int] = []
    while len(ports) < n:  # bounded: stable_port raises after its tries
        port = stable_port()
        if port not in ports:
            ports.append(port)
    return ports
