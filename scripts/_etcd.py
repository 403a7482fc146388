"""A real etcd (Debian's ``etcd-server``, /usr/bin/etcd) for the tests and the benchmarks: one
member on free loopback ports (client and peer), its data in a given directory, stopped by PID.

    with EtcdServer(tmp_path) as etcd:
        store = EtcdStore(etcd.endpoint, "flodl/run1", ttl=1)

The member runs with a 100 ms heartbeat and a 500 ms election timeout, so that etcd's minimum
lease TTL (1.5 election timeouts, rounded up to whole seconds) is 1 s instead of 2 s.

A production-like member (client TLS, client certificates required, RBAC users):

    tls = EtcdTLS(tmp_path / "pki")            # a CA, the member's and a client's certificates
    with EtcdServer(tmp_path, tls=tls) as etcd:
        etcd.enable_auth()                      # a root user, then authentication on
        etcd.add_user("flodl", "s3cret", prefix="flodl/")   # readwrite on that prefix only
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
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


class EtcdTLS:
    """Certificates made with trustme in ``directory`` for a TLS etcd on 127.0.0.1: a CA
    (``ca_file``), the members' server certificate, a client certificate and key
    (``cert_file``, ``key_file``), and a client certificate of another CA (``rogue_cert_file``,
    ``rogue_key_file``) that the members refuse.

    The client certificates have no Common Name: etcd 3.4 refuses every JSON-gateway request
    made with one whose subject has a CN (with --client-cert-auth the CN would be the user).
    """

    def __init__(self, directory: Path) -> None:
        import trustme  # a test dependency: only this helper needs it

        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        ca, rogue = trustme.CA(), trustme.CA()
        server = ca.issue_cert("127.0.0.1", "localhost", common_name="flodl etcd member")
        client, stranger = ca.issue_cert("flodl-client"), rogue.issue_cert("flodl-client")
        self.ca_file = self._write("ca.pem", ca.cert_pem.bytes())
        self.server_cert = self._write("server.pem", server.cert_chain_pems[0].bytes())
        self.server_key = self._write("server-key.pem", server.private_key_pem.bytes())
        self.cert_file = self._write("client.pem", client.cert_chain_pems[0].bytes())
        self.key_file = self._write("client-key.pem", client.private_key_pem.bytes())
        self.rogue_cert_file = self._write("rogue.pem", stranger.cert_chain_pems[0].bytes())
        self.rogue_key_file = self._write("rogue-key.pem", stranger.private_key_pem.bytes())

    def _write(self, name: str, data: bytes) -> str:
        path = self.directory / name
        path.write_bytes(data)
        path.chmod(0o600)
        return str(path)

    def client_context(self) -> ssl.SSLContext:
        """What the helper itself dials the members with (the client certificate)."""
        context = ssl.create_default_context(cafile=self.ca_file)
        context.load_cert_chain(self.cert_file, self.key_file)
        return context

    def query(self) -> str:
        """The ``?ca=&cert=&key=`` part of an ``etcds://`` store URL."""
        return f"ca={self.ca_file}&cert={self.cert_file}&key={self.key_file}"


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
                 without_quorum: bool = False, tls: EtcdTLS | None = None,
                 auth_token_ttl: int | None = None) -> None:
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
        # client TLS with client certificates required (--client-cert-auth); peers stay plain
        self.tls = tls
        self.auth_token_ttl = auth_token_ttl  # etcd's --auth-token-ttl (simple tokens, 300 s)
        self.root_password: str | None = None  # once enable_auth() ran
        self._root_token: str | None = None
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

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    def _tls_flags(self) -> list[str]:
        flags = [] if self.auth_token_ttl is None else ["--auth-token-ttl",
                                                        str(self.auth_token_ttl)]
        if self.tls is None:
            return flags
        return [*flags, "--cert-file", self.tls.server_cert, "--key-file", self.tls.server_key,
                "--trusted-ca-file", self.tls.ca_file, "--client-cert-auth"]

    def _spawn(self) -> None:
        client = self.client_url
        argv = [self.binary, "--name", self.name, "--data-dir", str(self.data_dir),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", self.peer_url,
                "--initial-advertise-peer-urls", self.peer_url,
                "--initial-cluster", self._initial_cluster(),
                "--initial-cluster-state", "new",
                "--heartbeat-interval", "100", "--election-timeout", "500",
                "--logger", "zap", "--log-level", "warn", *self._tls_flags()]
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

    def _context(self) -> ssl.SSLContext | None:
        return None if self.tls is None else self.tls.client_context()

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=0.5,
                                        context=self._context()) as r:
                return bool(json.loads(r.read()).get("health") == "true")
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def gateway(self, path: str, body: dict[str, Any], *, as_root: bool = True,
                renew: bool = True) -> dict[str, Any]:
        """POST ``body`` to the JSON gateway, as root once :meth:`enable_auth` ran (root's
        token renewed once if it expired); RuntimeError with etcd's answer on an error."""
        request = urllib.request.Request(f"{self.client_url}{path}",
                                         data=json.dumps(body).encode(), method="POST")
        if as_root and self._root_token is not None:
            request.add_header("Authorization", self._root_token)
        try:
            with urllib.request.urlopen(request, timeout=5, context=self._context()) as answer:
                doc = json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            text = exc.read()[:200]
            if exc.code == 401 and as_root and renew and self.root_password is not None:
                self._root_token = str(self.gateway("/v3/auth/authenticate", {
                    "name": "root", "password": self.root_password}, as_root=False)["token"])
                return self.gateway(path, body, renew=False)
            raise RuntimeError(f"etcd {self.endpoint} {path}: HTTP {exc.code}: {text!r}") from None
        return doc if isinstance(doc, dict) else {}

    def enable_auth(self) -> None:
        """Create the root user (a random password, :attr:`root_password`) and turn
        authentication on; later :meth:`gateway` calls authenticate as root."""
        self.root_password = secrets.token_hex(8)
        self.gateway("/v3/auth/role/add", {"name": "root"})
        self.gateway("/v3/auth/user/add", {"name": "root", "password": self.root_password})
        self.gateway("/v3/auth/user/grant", {"user": "root", "role": "root"})
        self.gateway("/v3/auth/enable", {})
        self._root_token = "none yet"  # the first call authenticates (a 401 renews it)

    def add_user(self, name: str, password: str, *, prefix: str) -> None:
        """A user whose role (of the same name) may read and write the keys under ``prefix``
        and nothing else."""
        def b64(text: str) -> str:
            return base64.b64encode(text.encode()).decode()

        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)  # the range [prefix, end) is the prefix
        self.gateway("/v3/auth/role/add", {"name": name})
        self.gateway("/v3/auth/role/grant", {"name": name, "perm": {
            "permType": "READWRITE", "key": b64(prefix), "range_end": b64(end)}})
        self.gateway("/v3/auth/user/add", {"name": name, "password": password})
        self.gateway("/v3/auth/user/grant", {"user": name, "role": name})

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

    def kill_member(self, index: int) -> None:
        """SIGKILL one member, as a crash (a SIGTERMed leader would hand its leadership over
        first); :meth:`start_member` brings it back."""
        member = self.members[index]
        assert member.pid is not None
        os.kill(member.pid, signal.SIGKILL)
        member.stop()  # reaps it

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
        request = urllib.request.Request(f"{member.client_url}/v3/maintenance/status",
                                         data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=0.5,
                                        context=member._context()) as answer:
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
