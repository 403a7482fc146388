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

    def _launch(self) -> bool:
        """True once the member is up, False if it exited at once."""
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [self.binary, "--name", "flodl-test", "--data-dir", str(self.data_dir),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"flodl-test={peer}" + (
                    f",phantom=http://127.0.0.1:{free_port()}" if self.without_quorum else ""),
                "--initial-cluster-state", "new",
                "--heartbeat-interval", "100", "--election-timeout", "500",
                "--logger", "zap", "--log-level", "warn"]
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT)
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

    def status(self) -> dict[str, int]:
        """The member's ``/v3/maintenance/status``: ``revision`` (the cluster's), ``db_size``
        and ``db_size_in_use`` in bytes (what etcd's quota counts)."""
        request = urllib.request.Request(f"http://{self.endpoint}/v3/maintenance/status",
                                         data=b"{}")
        with urllib.request.urlopen(request, timeout=5) as answer:
            doc = json.loads(answer.read())
        return {"revision": int(doc["header"]["revision"]), "db_size": int(doc["dbSize"]),
                "db_size_in_use": int(doc.get("dbSizeInUse", doc["dbSize"]))}

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
