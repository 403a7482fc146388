"""A real etcd (Debian's ``etcd-server``, /usr/bin/etcd) for the tests and the benchmarks: one
member on free loopback ports (client and peer), its data in a given directory, stopped by PID.

    with EtcdServer(tmp_path) as etcd:
        store = EtcdStore(etcd.endpoint, "flodl/run1", ttl=1)

The member runs with a 100 ms heartbeat and a 500 ms election timeout, so that etcd's minimum
lease TTL (1.5 election timeouts, rounded up to whole seconds) is 1 s instead of 2 s.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

ETCD = os.environ.get("FLODL_ETCD", "/usr/bin/etcd")


def etcd_binary() -> str | None:
    """The etcd binary's path, or None when it is not installed."""
    return ETCD if os.access(ETCD, os.X_OK) else shutil.which("etcd")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EtcdServer:
    """One etcd member on 127.0.0.1. ``start()`` waits (bounded) until ``/health`` says true.

    Attributes:
        endpoint: ``"127.0.0.1:PORT"``, its client endpoint.
        pid: the running process's PID (None when stopped).
    """

    def __init__(self, data_dir: Path, *, start_timeout: float = 15.0,
                 without_quorum: bool = False) -> None:
        binary = etcd_binary()
        if binary is None:
            raise FileNotFoundError("etcd is not installed (Debian: apt-get install etcd-server)")
        self.binary = binary
        self.data_dir = Path(data_dir) / "etcd-data"
        self.log_path = Path(data_dir) / "etcd.log"
        self.client_port = free_port()
        self.peer_port = free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self.start_timeout = start_timeout
        # a member of a two-member cluster whose other member never starts: it listens and
        # accepts, but has no leader, so it never answers (what users see of a cluster that
        # lost its quorum)
        self.without_quorum = without_quorum
        self.name = "flodl-test"
        self._proc: subprocess.Popen[bytes] | None = None
        self._started = False  # once up, a restart keeps its ports and data

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> EtcdServer:
        """Start the member (again, on the same ports and data, after :meth:`stop`)."""
        for attempt in range(3):
            if self._launch():
                self._started = True
                return self
            if self._started or attempt == 2:
                break
            # a port taken between free_port() and etcd's bind (another test): fresh ports
            self.client_port, self.peer_port = free_port(), free_port()
            self.endpoint = f"127.0.0.1:{self.client_port}"
            shutil.rmtree(self.data_dir, ignore_errors=True)
        raise RuntimeError(f"etcd on {self.endpoint} exited at start; its log "
                           f"{self.log_path}:\n{self.log_tail()}")

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def _initial_cluster(self) -> str:
        """The ``--initial-cluster`` flag's value (a cluster member overrides it)."""
        return f"{self.name}={self.peer_url}" + (
            f",phantom=http://127.0.0.1:{free_port()}" if self.without_quorum else "")

    def _spawn(self) -> None:
        client = f"http://127.0.0.1:{self.client_port}"
        argv = [self.binary, "--name", self.name, "--data-dir", str(self.data_dir),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", self.peer_url,
                "--initial-advertise-peer-urls", self.peer_url,
                "--initial-cluster", self._initial_cluster(),
                "--initial-cluster-state", "new",
                "--heartbeat-interval", "100", "--election-timeout", "500",
                "--logger", "zap", "--log-level", "warn"]
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT)

    def _launch(self) -> bool:
        """True once the member is up, False if it exited at once."""
        self._spawn()
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._proc = None
                return False
            if self.listening() if self.without_quorum else self.healthy():
                return True
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd on {self.endpoint} not up within {self.start_timeout} s; "
                           f"its log {self.log_path}:\n{self.log_tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=0.5) as r:
                return bool(json.loads(r.read()).get("health") == "true")
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def listening(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.client_port), timeout=0.5).close()
            return True
        except OSError:
            return False

    def pause(self) -> None:
        """SIGSTOP: the member stops answering; connections still open (the kernel accepts)."""
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; waits for the process (by its PID)."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signal.SIGCONT)  # a paused member cannot handle SIGTERM
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class _Member(EtcdServer):
    """One member of an :class:`EtcdCluster` (its own ports, data and log)."""

    def __init__(self, cluster: EtcdCluster, index: int, data_dir: Path) -> None:
        super().__init__(data_dir, start_timeout=cluster.start_timeout)
        self.name = f"flodl-m{index}"
        self._cluster = cluster

    def _initial_cluster(self) -> str:
        return ",".join(f"{m.name}={m.peer_url}" for m in self._cluster.members)


class EtcdCluster:
    """A cluster of ``size`` etcd members on 127.0.0.1 (each with its own free ports and data
    directory under ``root/mN``), for the tests and benchmarks that lose one member of several.

    ``start()`` launches every member, then waits (bounded) until each says it is healthy;
    ``stop_member(i)`` / ``start_member(i)`` restart one on its ports and data (it rejoins),
    ``pause(i)`` / ``resume(i)`` SIGSTOP / SIGCONT it, ``leader()`` is the member etcd elected.

    Attributes:
        members: the members, in ``--initial-cluster`` order.
        endpoints: ``"127.0.0.1:P1,127.0.0.1:P2,..."`` for ``EtcdStore`` or ``etcd://``.
    """

    def __init__(self, root: Path, *, size: int = 3, start_timeout: float = 30.0) -> None:
        self.start_timeout = start_timeout
        self.members: list[_Member] = []
        for i in range(size):
            where = Path(root) / f"m{i}"
            where.mkdir(parents=True, exist_ok=True)
            self.members.append(_Member(self, i, where))

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def start(self) -> EtcdCluster:
        for member in self.members:
            member._spawn()
        deadline = time.monotonic() + self.start_timeout
        waiting = list(self.members)
        while waiting and time.monotonic() < deadline:
            for member in list(waiting):
                proc = member._proc
                if proc is None or proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"etcd member {member.name} on {member.endpoint} exited "
                                       f"at start; its log:\n{member.log_tail()}")
                if member.healthy():
                    waiting.remove(member)
            time.sleep(0.05)
        if waiting:
            tails = "".join(f"\n--- {m.name}:\n{m.log_tail()}" for m in waiting)
            self.stop()
            raise RuntimeError(f"etcd cluster not healthy within {self.start_timeout} s{tails}")
        for member in self.members:
            member._started = True
        return self

    def stop_member(self, index: int) -> None:
        self.members[index].stop()

    def start_member(self, index: int, *, wait: bool = True) -> None:
        """Start a stopped member again (same ports and data: it rejoins the cluster)."""
        member = self.members[index]
        member._spawn()
        deadline = time.monotonic() + self.start_timeout
        while wait and not member.healthy():
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd member {member.name} not healthy again within "
                                   f"{self.start_timeout} s; its log:\n{member.log_tail()}")
            time.sleep(0.05)

    def pause(self, index: int) -> None:
        self.members[index].pause()

    def resume(self, index: int) -> None:
        self.members[index].resume()

    def status(self, index: int) -> dict[str, Any] | None:
        """A member's ``/v3/maintenance/status`` answer, or None when it does not answer."""
        member = self.members[index]
        request = urllib.request.Request(f"http://{member.endpoint}/v3/maintenance/status",
                                         data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=0.5) as answer:
                doc = json.loads(answer.read())
        except (OSError, ValueError, urllib.error.URLError):
            return None
        return doc if isinstance(doc, dict) else None

    def leader(self, *, timeout: float = 10.0) -> int:
        """The index of the member etcd elected leader (waits, bounded, while there is none)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i in range(len(self.members)):
                doc = self.status(i)
                if doc is None:
                    continue
                me = str(doc.get("header", {}).get("member_id", ""))
                if me and me == str(doc.get("leader", "")):
                    return i
            time.sleep(0.05)
        raise RuntimeError(f"no etcd leader among {self.endpoints} within {timeout} s")

    def stop(self) -> None:
        for member in self.members:
            member.stop()

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
