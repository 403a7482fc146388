"""The cluster a nemesis run (scripts/nemesis.py) attacks: real processes on loopback.

- a 3-member etcd cluster (scripts/_etcd.py ``EtcdCluster``), the session store;
- coordinator slots ``coord-a`` (the leader) and ``coord-b`` (its ``--standby``): ``flodl-trio
  coordinator --store etcd://... --epochs E`` (the reference SyncScheduler), each on a port of
  its own; one that exits before the run ended is started again there as the next standby;
- ``hosts`` relays (``flodl-trio relay --coordinator PA,PB``) of ``ranks_per_host`` simulated
  ranks each (scripts/_nemesis_rank.py); each relay dials the two coordinator ports through two
  chaos proxies of its own (:func:`flodl_trio.chaos.open_chaos_proxy`), its *link*. A host whose
  relay or rank exited before the run ended is started again whole, unless a fault holds it;
- the coordinator runs an elastic world (``--world-size MIN:MAX``, :class:`Layout`): a spare
  host (``host-4``) is started only by a ``host-join`` fault and drained when it heals, and a
  ``host-drain`` fault drains a host (SIGTERM to its relay) and starts it again to join anew.

Every child gets ``FLODL_NET_TIMEOUT_SCALE`` (:class:`Timings`) and a ``TMPDIR`` in the run
directory, which must be empty at the end (no temporary file leaked).
"""

from __future__ import annotations

import base64
import json
import os
import re
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
from _etcd import EtcdCluster
from _nemesis_layout import Layout, Timings
from _nemesis_procs import (
    Proc,
    Registry,
    distinct_ports,
    fd_count,
    generation_of,
    lines_of,
    read_summary,
    rss_mb,
    wait_for_line,
)

from flodl_trio import FlodlError, SessionSalt
from flodl_trio.chaos import ChaosProxy, open_chaos_proxy
from flodl_trio.status import fetch_state

HERE = Path(__file__).resolve().parent
CLI = [sys.executable, "-m", "flodl_trio", "--log-level", "INFO"]
PREFIX = "flodl/nemesis"
# A relay or rank that exits 0 heard the run's end (Shutdown, Goodbye) before the coordinator
# wrote its summary: its host is started again only if the end is not noticed within this.
CLEAN_EXIT_WAIT_S = 10.0

class Cluster:
    """The parts of the run, their processes and the proxies; ``record`` writes the history."""

    def __init__(self, root: Path, timings: Timings, layout: Layout,
                 record: Callable[..., None]) -> None:
        self.root = root
        self.timings = timings
        self.layout = layout
        self.record = record
        self.tmp = root / "tmp"
        self.tmp.mkdir()
        self.salt_file = root / "salt"
        SessionSalt.generate().save(self.salt_file)  # mode 0600, as --salt-file requires
        env = dict(os.environ, FLODL_NET_TIMEOUT_SCALE=f"{timings.scale:g}",
                   TMPDIR=str(self.tmp), PYTHONUNBUFFERED="1")
        self.procs = Registry(root, env)
        self.etcd = EtcdCluster(root / "etcd", size=3)
        every_host = layout.host_names + layout.spare_names
        ports = distinct_ports(2 + len(every_host))
        self.coord_ports = {"coord-a": ports[0], "coord-b": ports[1]}
        self.coords: dict[str, Proc] = {}
        self.relays: dict[str, Proc] = {}
        self.ranks: dict[int, Proc] = {}
        self.rank_ports = dict(zip(every_host, ports[2:], strict=True))
        self.proxies: dict[str, list[ChaosProxy]] = {}
        # parts a fault holds: the supervisor leaves them alone (a spare host is held while
        # it is out of the run)
        self.held: set[str] = set(layout.spare_names)
        self.finished = trio.Event()  # a coordinator ended the run (exit 0 or a failure)
        self.final: Proc | None = None  # the coordinator that ended it
        self.leader_generation: int | None = None  # the store's, as last read
        self.last_owner: str | None = None
        self.epochs_closed = 0  # the highest "epoch N/E:" line any coordinator printed
        # the ranks the leader says are live, and the hosts whose relay it says is connected
        # (its /state.json), as last read
        self.live_ranks: frozenset[int] = frozenset(range(layout.world))
        self.connected: frozenset[str] = frozenset(layout.host_names)
        self.recovering: set[str] = set()  # hosts a fault killed, until seen live again
        self._generations: dict[int, int] = {}  # coordinator PID -> the generation it led
        self._deferred: dict[str, float] = {}  # host -> when to restart it (trio clock)

    def hold(self, part: str) -> None:
        """A fault holds ``part`` (a host, a coordinator slot): the supervisor does not restart
        it until :meth:`release`."""
        self.held.add(part)

    def release(self, part: str) -> None:
        self.held.discard(part)

    @property
    def store_url(self) -> str:
        t = self.timings
        return (f"etcd://{self.etcd.endpoints}/{PREFIX}?ttl={t.lease_ttl:g}"
                f"&election_timeout={t.election_timeout:g}")

    # ------------------------------------------------------------------ starting parts

    def start_coordinator(self, slot: str, *, standby: bool) -> Proc:
        t, lay = self.timings, self.layout

        def argv(files: dict[str, Path]) -> list[str]:
            return [*CLI, "coordinator", "--listen", f"127.0.0.1:{self.coord_ports[slot]}",
                    "--world-size", f"{lay.min_world}:{lay.max_world}", "--join-window",
                    f"{t.join_window:g}", "--salt-file", str(self.salt_file),
                    "--store", self.store_url, "--epochs", str(lay.epochs),
                    "--total-samples", str(lay.total_samples), "--batch-size",
                    str(lay.batch_size), "--heartbeat-timeout", f"{t.heartbeat_timeout:g}",
                    "--resume-timeout", f"{t.resume_timeout:g}", "--formation-timeout",
                    f"{t.formation_timeout:g}", "--timeline", str(files["timeline"]),
                    "--summary-file", str(files["summary"]), *(["--standby"] if standby else [])]

        proc = self.procs.start(slot, "coordinator", argv, extra=("timeline", "summary"))
        self.coords[slot] = proc
        self._started(proc, standby=standby)
        return proc

    def start_host(self, host: str) -> None:
        """Start ``host``'s relay and its ranks (any process of it still running is killed)."""
        self.kill_host(host)
        t = self.timings
        links = ",".join(f"127.0.0.1:{p.address[1]}" for p in self.proxies[host])
        ranks = self.layout.ranks_of(host)

        def argv(files: dict[str, Path]) -> list[str]:
            return [*CLI, "relay", "--coordinator", links, "--host", host, "--ranks",
                    ",".join(map(str, ranks)), "--world-size", str(self.layout.max_world),
                    "--salt-file", str(self.salt_file), "--rank-port",
                    str(self.rank_ports[host]), "--coordinator-grace", f"{t.grace:g}",
                    "--coord-liveness-timeout", f"{t.relay_liveness:g}"]

        self.relays[host] = relay = self.procs.start(f"relay {host}", "relay", argv)
        self._started(relay, host=host)
        for rank in ranks:
            self.start_rank(rank)

    def start_rank(self, rank: int) -> Proc:
        host = self.host_of(rank)
        lay = self.layout

        def argv(files: dict[str, Path]) -> list[str]:
            return [sys.executable, str(HERE / "_nemesis_rank.py"), "--relay",
                    f"127.0.0.1:{self.rank_ports[host]}", "--rank", str(rank), "--world-size",
                    str(lay.max_world), "--salt-file", str(self.salt_file), "--batch-ms",
                    f"{lay.batch_ms:g}", "--batch-size", str(lay.batch_size), "--log",
                    str(files["log"]), "--coord-liveness-timeout",
                    f"{self.timings.rank_liveness:g}"]

        self.ranks[rank] = proc = self.procs.start(f"rank {rank}", "rank", argv, extra=("log",))
        self._started(proc, host=host, rank=rank)
        return proc

    def _started(self, proc: Proc, **fields: Any) -> None:
        self.record("proc_start", name=proc.name, role=proc.role, pid=proc.pid,
                    incarnation=proc.incarnation,
                    files={k: str(v) for k, v in proc.files.items()}, **fields)

    def host_of(self, rank: int) -> str:
        return f"host-{rank // self.layout.ranks_per_host}"

    def host_procs(self, host: str) -> list[Proc]:
        procs = [self.relays[host]] if host in self.relays else []
        return procs + [self.ranks[r] for r in self.layout.ranks_of(host) if r in self.ranks]

    def kill_host(self, host: str) -> None:
        for proc in self.host_procs(host):
            proc.kill()

    def host_gone(self, host: str) -> bool:
        """No process of ``host`` runs (a spare before it joins, a drained host)."""
        return not any(p.running for p in self.host_procs(host))

    def host_whole(self, host: str) -> bool:
        procs = self.host_procs(host)
        return len(procs) == 1 + self.layout.ranks_per_host and all(p.running for p in procs)

    # ------------------------------------------------------------------ startup

    async def start(self, nursery: trio.Nursery) -> None:
        """etcd, the proxies, the leader, the hosts, then (once formed) the standby."""
        await trio.to_thread.run_sync(self.etcd.start)
        self.record("etcd_start", endpoints=self.etcd.endpoints,
                    pids=[m.pid for m in self.etcd.members])
        for host in self.layout.host_names + self.layout.spare_names:
            self.proxies[host] = [await nursery.start(_serve_proxy, ("127.0.0.1", port))
                                  for port in self.coord_ports.values()]
        first = self.start_coordinator("coord-a", standby=False)
        await wait_for_line(first, "err", "leading session store", 60.0)
        for host in self.layout.host_names:
            self.start_host(host)
        await wait_for_line(first, "out", "formed:", self.timings.formation_timeout + 10)
        self.start_coordinator("coord-b", standby=True)
        self.record("formed")

    # ------------------------------------------------------------------ supervision

    async def supervise(self) -> None:
        """Notice every exit; restart what exited before the run ended (not what a fault
        holds); notice the end of the run (a coordinator wrote its summary)."""
        while True:
            for proc in self.procs:
                if proc.take_exit():
                    self._exited(proc)
                    self._react(proc)
            if not self.finished.is_set():
                self._notice_end()
                self._notice_progress()
            self._restart_deferred()
            await trio.sleep(0.1)

    def _restart_deferred(self) -> None:
        """Start again the hosts whose clean exit was not the run's end after all."""
        for host, at in list(self._deferred.items()):
            if self.finished.is_set() or host in self.held or self.host_whole(host):
                del self._deferred[host]
            elif trio.current_time() >= at:
                del self._deferred[host]
                self.record("restart", target=host, cause=f"exited 0 {CLEAN_EXIT_WAIT_S:g} s "
                            "before, and the run did not end")
                self.start_host(host)

    def _notice_end(self) -> None:
        """A coordinator that wrote its summary ended the run, unless it was deposed: it says
        so (``LeadershipLost``), or a newer generation was elected meanwhile (one woken after
        its lease ran out may fail the run in its summary before it notices) and the run goes
        on under its successor."""
        generations = {slot: self._generation(proc) for slot, proc in self.coords.items()}
        newest = max([g for g in generations.values() if g is not None]
                     + [self.leader_generation or 0])
        for slot, proc in self.coords.items():
            summary = read_summary(proc)
            if summary is None or "LeadershipLost" in str(summary.get("failed", "")) or \
                    generations[slot] != newest:
                continue
            self.final = proc
            self.finished.set()
            self.record("run_end", name=proc.name, incarnation=proc.incarnation,
                        failed=summary.get("failed"),
                        epochs=summary.get("epochs_completed"))
            if not proc.running:  # it exited before this pass read its summary
                self.record("run_exit", name=proc.name, code=proc.code)
            return

    def _exited(self, proc: Proc) -> None:
        self.record("proc_exit", name=proc.name, role=proc.role, pid=proc.pid,
                    incarnation=proc.incarnation, code=proc.code)

    def _generation(self, proc: Proc) -> int | None:
        """``proc``'s generation once it logged one (kept: it never changes)."""
        if proc.pid not in self._generations:
            found = generation_of(proc)
            if found is None:
                return None
            self._generations[proc.pid] = found
        return self._generations[proc.pid]

    def _notice_progress(self) -> None:
        for proc in self.coords.values():
            for line in lines_of(proc.files["out"])[-5:]:
                match = re.match(r"epoch (\d+)/\d+:", line)
                if match:
                    self.epochs_closed = max(self.epochs_closed, int(match.group(1)))

    def _react(self, proc: Proc) -> None:
        if proc.role == "coordinator" and not self.finished.is_set():
            # It may have written its summary and exited since the last pass: read it while
            # the process is still its slot's (a restart would replace it and hide the end).
            self._notice_end()
            if proc is self.final:
                return  # its exit is recorded with the run's end
        if proc.role == "coordinator" and proc is self.final:
            self.record("run_exit", name=proc.name, code=proc.code)
        if self.finished.is_set():
            return
        if proc.role == "coordinator":
            if proc.name not in self.held and self.coords.get(proc.name) is proc:
                self.record("restart", target=proc.name, cause=f"exit {proc.code}")
                self.start_coordinator(proc.name, standby=True)
            return
        host = proc.name.split()[1] if proc.role == "relay" else self.host_of(
            int(proc.name.split()[1]))
        if proc not in self.host_procs(host):
            return  # an older incarnation, killed when its host was started again
        if host not in self.held and not self.host_whole(host):
            if proc.code == 0:  # it heard the run's end; the summary may not be written yet
                # (restarting at once killed a finishing host's other rank: soak seed 5)
                self._deferred.setdefault(host, trio.current_time() + CLEAN_EXIT_WAIT_S)
                return
            self.record("restart", target=host, cause=f"{proc.name} exit {proc.code}")
            self.start_host(host)

    async def observe(self) -> None:
        """Every second: each coordinator's RSS and open fds; every 0.25 s: the store's leader
        (its generation), recorded when it changes."""
        last: Any = "unset"
        tick = 0
        while True:
            leader = await trio.to_thread.run_sync(self.read_leader)
            if leader != last:
                self.record("store_leader", **(leader or {"generation": None}))
                last = leader
                if leader is not None and leader.get("generation") is not None:
                    self.leader_generation = leader["generation"]
                    self.last_owner = leader["owner"]
                elif leader is None:
                    self.last_owner = None
            if tick % 2 == 0:
                await self._read_live()
            if tick % 4 == 0:
                for slot, proc in self.coords.items():
                    if proc.running:
                        self.record("sample", name=slot, pid=proc.pid, rss_mb=rss_mb(proc.pid),
                                    fds=fd_count(proc.pid))
            tick += 1
            await trio.sleep(0.25)

    def leader_slot(self) -> str | None:
        """The slot whose running process leads, by the PID in the store's leader key."""
        match = re.search(r"pid (\d+)", self.last_owner or "")
        for slot, proc in self.coords.items():
            if match and proc.running and proc.pid == int(match.group(1)):
                return slot
        return None

    async def _read_live(self) -> None:
        """The leader's live ranks and connected relays from its status page (kept as they
        were when it does not answer: a takeover, a stopped leader). A leader that adopted the
        session counts the ranks of a relay that has not resumed yet as live until its
        ``resume_timeout``: only a connected relay says its host is back."""
        slot = self.leader_slot()
        if slot is None:
            return
        with trio.move_on_after(1.0):
            try:
                state = await fetch_state(("127.0.0.1", self.coord_ports[slot]), timeout=1.0)
            except (OSError, FlodlError):
                return
            live, relays = state.get("live"), state.get("relays")
            if isinstance(live, list) and isinstance(relays, list):
                self.live_ranks = frozenset(int(r) for r in live)
                self.connected = frozenset(str(r.get("host")) for r in relays
                                           if isinstance(r, dict) and r.get("connected"))
                self.recovering = {h for h in self.recovering if not self._seen_back(h)}

    def _seen_back(self, host: str) -> bool:
        """The leader, as last read, has ``host``'s relay connected and its ranks live."""
        return host in self.connected and set(self.layout.ranks_of(host)) <= self.live_ranks

    def mark_recovering(self, host: str) -> None:
        """A fault killed ``host``'s ranks: it is not recovered before the leader's status page,
        read from now on, counts them live again."""
        self.recovering.add(host)

    def host_recovered(self, host: str) -> bool:
        """Its processes run and the leader has its relay connected and its ranks live."""
        return self.host_whole(host) and host not in self.recovering and self._seen_back(host)

    def read_leader(self) -> dict[str, Any] | None:
        """The leader key (owner, generation) from the first member that answers, or None."""
        key = base64.b64encode(f"{PREFIX}/leader".encode()).decode()
        for member in self.etcd.members:
            request = urllib.request.Request(f"http://{member.endpoint}/v3/kv/range",
                                             data=json.dumps({"key": key}).encode(),
                                             method="POST")
            try:
                with urllib.request.urlopen(request, timeout=0.3) as answer:
                    doc = json.loads(answer.read())
            except (OSError, ValueError, urllib.error.URLError):
                continue
            kvs = doc.get("kvs") or []
            if not kvs:
                return None
            value = json.loads(base64.b64decode(kvs[0]["value"]))
            return {"generation": int(value["generation"]), "owner": str(value["owner"])}
        return {"generation": None, "owner": "unreachable"}

    # ------------------------------------------------------------------ the end

    def stop_everything(self) -> None:
        """Kill every child by PID and stop etcd (idempotent; runs on every way out)."""
        self.procs.kill_all()
        self.etcd.stop()


async def _serve_proxy(target: tuple[str, int], *,
                       task_status: trio.TaskStatus[ChaosProxy] = trio.TASK_STATUS_IGNORED
                       ) -> None:
    async with open_chaos_proxy(target) as proxy:
        task_status.started(proxy)
        await trio.sleep_forever()


__all__ = ["Cluster", "Layout", "Timings"]
