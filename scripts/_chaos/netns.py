"""Two Linux network namespaces joined by a veth pair: a second "host" on one machine.

Everything is created inside namespaces of our own (the veth pair is born inside them, the
addresses exist only there); nothing touches the machine's own interfaces or routes. Needs root
and iproute2; :func:`unavailable` says why not otherwise.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

import flodl_trio as ft

from .procs import Child, child_env, cli, rank_address

SUBNET_PREFIX = 24
ADDRESS_1 = "10.213.7.1"  # inside NS1 only
ADDRESS_2 = "10.213.7.2"  # inside NS2 only
COMMAND_TIMEOUT = 10


@attrs.frozen
class NetnsPair:
    ns1: str
    ns2: str
    address1: str = ADDRESS_1
    address2: str = ADDRESS_2

    def exec_prefix(self, ns: str) -> list[str]:
        """The argv prefix that runs a command inside namespace ``ns``."""
        return ["ip", "netns", "exec", ns]


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT, check=False)


def unavailable() -> str | None:
    """Why namespaces cannot be used here, or None if they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip`"
    probe = f"flcp{os.getpid() % 100000}{secrets.token_hex(2)}"
    added = _ip("netns", "add", probe)
    if added.returncode != 0:
        return f"`ip netns add` does not work here: {added.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


@contextmanager
def netns_pair() -> Iterator[NetnsPair]:
    """Create NS1 and NS2 (unique names), a veth pair between them, addresses and lo; always
    delete both namespaces (which destroys the veth pair) on the way out."""
    tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
    pair = NetnsPair(ns1=f"flc1{tag}", ns2=f"flc2{tag}")
    veth1, veth2 = f"fv1{tag}", f"fv2{tag}"  # < 16 chars: IFNAMSIZ
    created: list[str] = []
    try:
        for ns in (pair.ns1, pair.ns2):
            _check(_ip("netns", "add", ns))
            created.append(ns)
        _check(_ip("link", "add", veth1, "netns", pair.ns1, "type", "veth",
                   "peer", "name", veth2, "netns", pair.ns2))
        for ns, dev, address in ((pair.ns1, veth1, pair.address1),
                                 (pair.ns2, veth2, pair.address2)):
            _check(_ip("-n", ns, "addr", "add", f"{address}/{SUBNET_PREFIX}", "dev", dev))
            _check(_ip("-n", ns, "link", "set", dev, "up"))
            _check(_ip("-n", ns, "link", "set", "lo", "up"))
        yield pair
    finally:
        for ns in created:
            _ip("netns", "del", ns)


def _check(done: subprocess.CompletedProcess[str]) -> None:
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, done.args))}: {done.stderr.strip()}")


def leftover(pair: NetnsPair) -> list[str]:
    """Namespaces of ``pair`` that still exist (must be none after teardown)."""
    listed = _ip("netns", "list").stdout.split()
    return [ns for ns in (pair.ns1, pair.ns2) if ns in listed]


# ------------------------------------------------------------------ the two-host run

RUN_PATIENCE = 30.0  # real seconds for the whole run; it takes about one


@attrs.define
class MultiHostRun:
    """What :func:`multi_host_run` saw: exit status and last lines of every process, the
    coordinator's summary and timeline, and the relay's peer address as the coordinator saw it."""

    status: dict[str, tuple[int | None, list[str]]]
    summary: dict[str, Any]
    events: list[dict[str, Any]]
    seconds: float
    rank_leg: tuple[str, int] | None = None  # where the ranks dialed their relay, in NS2

    @property
    def joined(self) -> list[dict[str, Any]]:
        return [ev for ev in self.events if ev["kind"] == "RelayJoined"]


async def multi_host_run(pair: NetnsPair, workdir: Path) -> MultiHostRun:
    """Coordinator CLI (``--epochs 1``) in NS1 on ``address1``; relay ``ns2-host`` and two
    simulated ranks in NS2, the ranks on NS2's loopback. Every process is reaped on the way out.
    """
    salt = ft.SessionSalt.generate()
    env = child_env(salt)
    port_file, summary_file = workdir / "port", workdir / "summary.json"
    timeline_file = workdir / "timeline.jsonl"
    children: list[Child] = []
    rank_leg: tuple[str, int] | None = None
    started = trio.current_time()
    try:
        with trio.fail_after(RUN_PATIENCE):
            async with trio.open_nursery() as nursery:
                rank_leg = await _start_hosts(
                    nursery, pair, children, env=env, env1=env, ranks=(0, 1), port_file=port_file,
                    coordinator_args=("--epochs", "1", "--total-samples", "16", "--batch-size",
                                      "4", "--formation-timeout", "15", "--summary-file",
                                      str(summary_file), "--timeline", str(timeline_file)),
                    rank_args=("--batch-ms", "5"))
                for child in children:
                    await child.proc.wait()
                nursery.cancel_scope.cancel()
    finally:
        for child in children:
            await child.stop()
    summary_path, timeline_path = trio.Path(summary_file), trio.Path(timeline_file)
    summary = json.loads(await summary_path.read_text()) if await summary_path.exists() else {}
    lines = (await timeline_path.read_text()).splitlines() if await timeline_path.exists() else []
    return MultiHostRun(
        status={c.name: (c.proc.returncode, c.lines[-3:]) for c in children},
        summary=summary, events=[json.loads(line) for line in lines],
        seconds=trio.current_time() - started, rank_leg=rank_leg)


async def _start_hosts(nursery: trio.Nursery, pair: NetnsPair, children: list[Child], *,
                       env: dict[str, str], env1: dict[str, str], ranks: tuple[int, ...],
                       port_file: Path, coordinator_args: tuple[str, ...],
                       rank_args: tuple[str, ...] = ()) -> tuple[str, int]:
    """The coordinator CLI (world 2, environment ``env1``) in NS1 on ``address1``, relay
    ``ns2-host`` with ``ranks`` and one simulated rank process each in NS2 (their loopback);
    every child is appended to ``children``. Returns where the ranks dialed their relay."""
    coord = await Child.start(nursery, "coordinator", cli(
        "coordinator", "--listen", f"{pair.address1}:0", "--world-size", "2",
        "--port-file", str(port_file), *coordinator_args),
        env=env1, prefix=pair.exec_prefix(pair.ns1))
    children.append(coord)
    await coord.wait_line(lambda s: s.startswith("coordinator listening on"))
    listen = await _read_port_file(trio.Path(port_file))
    relay = await Child.start(nursery, "relay", cli(
        "relay", "--coordinator", listen, "--host", "ns2-host", "--ranks",
        ",".join(map(str, ranks)), "--world-size", "2"), env=env,
        prefix=pair.exec_prefix(pair.ns2))
    children.append(relay)
    host, port = rank_address(await relay.wait_line(lambda s: "listening for ranks on" in s))
    for rank in ranks:
        children.append(await Child.start(nursery, f"rank {rank}", cli(
            "rank", "--relay", f"{host}:{port}", "--rank", str(rank), "--world-size", "2",
            *rank_args), env=env, prefix=pair.exec_prefix(pair.ns2)))
    return host, port


async def _read_port_file(path: trio.Path) -> str:
    """HOST:PORT once the coordinator wrote it (it prints its address first, then writes)."""
    for _ in range(500):  # 5 s at most, inside the caller's deadline
        if await path.exists():
            text = (await path.read_text()).strip()
            if text[-1:].isdigit():
                return text
        await trio.sleep(0.01)
    raise AssertionError(f"{path} was never written")


def veth_of(pair: NetnsPair, ns: str) -> str:
    """The name of ``pair``'s veth end inside namespace ``ns``."""
    listed = _ip("-n", ns, "-o", "link", "show", "type", "veth")
    _check(listed)
    # "<index>: <name>@<peer>: <flags> ..."
    return listed.stdout.split(":", 2)[1].strip().split("@", 1)[0]


def cut_link(pair: NetnsPair, ns: str) -> None:
    """Take ``ns``'s veth end down: from then on nothing crosses, not even a FIN or an RST
    (what a pulled cable or a frozen host looks like to the other end)."""
    _check(_ip("-n", ns, "link", "set", veth_of(pair, ns), "down"))


async def silent_link_during_formation(pair: NetnsPair, workdir: Path, *,
                                       heartbeat_timeout: float) -> tuple[float, dict[str, Any]]:
    """Coordinator CLI in NS1 (world 2, so formation waits), relay ``ns2-host`` with rank 0 in
    NS2. Once the relay joined, NS2's link is cut. Returns how long after the cut the
    coordinator's ``RelayLost`` came, and that event. The coordinator's deadlines are scaled by
    0.1 (``write_stall_timeout`` 3 s) and ``heartbeat_timeout`` is given: nothing but the
    kernel's keepalive and ``TCP_USER_TIMEOUT`` can find a peer that went silent during
    formation (no staleness watch runs yet, and its heartbeats fit in the socket buffer)."""
    salt = ft.SessionSalt.generate()
    env = child_env(salt)
    coord_env = {**env, "FLODL_NET_TIMEOUT_SCALE": "0.1"}
    port_file, timeline_file = workdir / "port", workdir / "timeline.jsonl"
    children: list[Child] = []
    try:
        with trio.fail_after(RUN_PATIENCE):
            async with trio.open_nursery() as nursery:
                await _start_hosts(
                    nursery, pair, children, env=env, env1=coord_env, ranks=(0,),
                    port_file=port_file,
                    coordinator_args=("--formation-timeout", str(RUN_PATIENCE),
                                      "--heartbeat-timeout", str(heartbeat_timeout),
                                      "--timeline", str(timeline_file)))
                await _wait_event(trio.Path(timeline_file), "RelayJoined")
                cut_link(pair, pair.ns2)
                cut_at = trio.current_time()
                lost = await _wait_event(trio.Path(timeline_file), "RelayLost")
                nursery.cancel_scope.cancel()
                return trio.current_time() - cut_at, lost
    finally:
        for child in children:
            await child.stop()
    raise AssertionError("not reached")


async def _wait_event(path: trio.Path, kind: str) -> dict[str, Any]:
    """The first timeline event of ``kind`` (polled; the caller's deadline bounds it)."""
    for _ in range(100_000):
        if await path.exists():
            for line in (await path.read_text()).splitlines():
                event = json.loads(line)
                if event["kind"] == kind:
                    return dict(event)
        await trio.sleep(0.05)
    raise AssertionError(f"no {kind} event in {path}")
