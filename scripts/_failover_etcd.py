"""The production-etcd cases of scripts/bench_coordinator_failover.py (issue 34), one function
each, on that benchmark's ``Run`` (a session: coordinator and host processes):

- :func:`member_lost`: a 3-member etcd (scripts/_etcd.py ``EtcdCluster``, 500 ms election
  timeout); the coordinator's store lists the victim first (the endpoint it starts with); mid-epoch
  the etcd leader member is SIGKILLed (``pause``: the first-listed follower is SIGSTOPped
  instead), quorum intact. Kept = 1 when the coordinator led as generation 1 to the end of the
  run, never stepping down.
- :func:`tls_standby`: the ``etcd standby`` case on an etcd with client TLS, client certificates
  required and RBAC (user ``flodl`` limited to ``flodl/``): the leader is SIGKILLed, the standby
  takes over, relays re-resolve through ``etcds://``.
- :func:`tls_refused`: ``flodl-trio coordinator --store etcds://...`` without a client
  certificate: 1 when it exits 1 with one line naming the cause and no traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from _etcd import EtcdServer, EtcdTLS, free_port

MEMBER_LOST_TTL = 3  # the shortest TTL EtcdStore accepts for 3 members at 500 ms elections
ELECTION = 0.5  # scripts/_etcd.py members' --election-timeout
PASSWORD = "bench password"


def field(line: str, name: str) -> str:
    for word in line.split():
        if word.startswith(name + "="):
            return word[len(name) + 1:]
    raise ValueError(f"no {name}= in {line!r}")


class Secured:
    """A TLS etcd with authentication on, user ``flodl`` (readwrite on ``flodl/``)."""

    def __init__(self, server: EtcdServer, tls: EtcdTLS, password_file: Path) -> None:
        self.server, self.tls, self.password_file = server, tls, password_file

    def url(self, prefix: str, *, with_cert: bool = True) -> str:
        files = self.tls.query() if with_cert else f"ca={self.tls.ca_file}"
        return (f"etcds://{self.server.endpoint}/{prefix}?{files}&user=flodl&"
                f"password_file={self.password_file}")


@contextmanager
def secured_etcd(root: Path) -> Iterator[Secured]:
    tls = EtcdTLS(root / "pki")
    password_file = root / "flodl.password"
    password_file.write_text(PASSWORD + "\n")
    password_file.chmod(0o600)
    with EtcdServer(root, tls=tls) as server:
        server.enable_auth()
        server.add_user("flodl", PASSWORD, prefix="flodl/")
        yield Secured(server, tls, password_file)


def member_lost(run: Any, cluster: Any, *, pause: bool) -> dict[str, Any]:
    """One run of ``etcd member lost`` (``pause``: ``etcd member paused``)."""
    leader = cluster.leader()
    victim = (leader + 1) % len(cluster.members) if pause else leader
    order = [victim, *(i for i in range(len(cluster.members)) if i != victim)]
    endpoints = ",".join(cluster.members[i].endpoint for i in order)
    run.store = (f"etcd://{endpoints}/flodl/bench-{run.dir.name}?ttl={MEMBER_LOST_TTL}&"
                 f"election_timeout={ELECTION}")
    port = free_port()
    coord = run.coordinator(port)
    coord.wait_line(lambda s: " listening " in s, run.deadline)
    run.start_hosts(["--coordinator", f"127.0.0.1:{port}"])
    coord.wait_line(lambda s: " leader " in s, run.deadline)
    out: dict[str, Any] = {"case": "etcd member paused" if pause else "etcd member lost",
                           "epoch": run.mid_epoch(coord, after=time.monotonic())}
    hurt = time.monotonic()
    try:
        if pause:
            cluster.pause(victim)
        else:
            cluster.kill_member(victim)
            cluster.leader()  # waits (bounded) for the new etcd leader
            out["etcd_leader_again_s"] = time.monotonic() - hurt
        (end,) = coord.wait_line(lambda s: " done " in s or " deposed " in s, run.deadline)[:1]
    finally:
        if pause:
            cluster.resume(victim)
        else:
            cluster.start_member(victim)
    # led through the loss for at least a whole TTL: a step-down would have come by then
    out["led_after_s"] = float(field(end, "t")) - hurt
    out["kept"] = int(" done " in end and out["led_after_s"] >= MEMBER_LOST_TTL and
                      [field(s, "generation") for s in coord.lines() if " leader " in s] == ["1"])
    for child in run.hosts.values():
        if out["kept"]:
            child.proc.wait(timeout=max(1.0, run.deadline - time.monotonic()))
        else:
            child.stop()  # its relay would ride out the deposed coordinator for its grace
    if not out["kept"]:
        out["why"] = end
    out["dead"] = sorted(run.deaths())
    out.update(run.coverage())
    return out


def tls_standby(run: Any, secured: Secured) -> dict[str, Any]:
    """One run of ``etcd tls``: SIGKILL the leader, its standby takes over."""
    run.store = secured.url(f"flodl/bench-{run.dir.name}")
    leader = run.coordinator(free_port())
    leader.wait_line(lambda s: " listening " in s, run.deadline)
    run.start_hosts(["--etcd", run.store])
    leader.wait_line(lambda s: " leader " in s, run.deadline)
    standby = run.coordinator(free_port())
    standby.wait_line(lambda s: " listening " in s, run.deadline)
    time.sleep(0.2)  # from listening to waiting in store.acquire
    out: dict[str, Any] = {"case": "etcd tls", "epoch": run.mid_epoch(leader,
                                                                      after=time.monotonic())}
    killed = time.monotonic()
    leader.signal(signal.SIGKILL)
    (led,) = standby.wait_line(lambda s: " leader " in s, run.deadline)
    out["leader_s"] = float(field(led, "t")) - killed
    run.finish(standby)
    out["takeover_s"] = run.takeover(killed)
    out["dead"] = sorted(run.deaths())
    out["generations"] = [field(s, "generation") for c in run.coords for s in c.lines()
                          if " leader " in s]
    out.update(run.coverage())
    return out


def tls_refused(secured: Secured) -> dict[str, Any]:
    """``flodl-trio coordinator`` on the TLS etcd without a client certificate."""
    env = dict(os.environ, FLODL_SALT_HEX="ab" * 16)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "flodl_trio", "coordinator", "--world-size",
                           "2", "--store", secured.url("flodl/refused", with_cert=False)],
                          capture_output=True, text=True, timeout=60, env=env)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    clear = (done.returncode == 1 and len(lines) == 1 and "Traceback" not in done.stderr
             and lines[0].startswith("flodl-trio: StoreAuthError: ")
             and "client certificate" in lines[0])
    return {"case": "etcd tls refused", "refused": int(clear), "exit": done.returncode,
            "line": lines[-1] if lines else "", "s": time.monotonic() - started}
