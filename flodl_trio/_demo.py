"""``flodl-trio demo``: a whole local cluster as separate OS processes on loopback.

One coordinator process (driving the SyncScheduler), one relay process per host and one
simulated-rank process per rank. Progress comes from the coordinator's status page and its
timeline file; ``--kill-relay HOST@SECONDS`` SIGKILLs a relay process mid-run to show the
failure path (its ranks are declared dead, the survivors take over their samples).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from ._errors import FlodlError, UsageError
from .wire import SessionSalt

START_DEADLINE_S = 30.0
RUN_DEADLINE_S = 120.0


class DemoError(FlodlError):
    """The demo could not run its cluster (a process did not start, or the run hung)."""


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "flodl_trio", *args]


def _parse_kills(specs: list[str], hosts: list[str]) -> dict[str, float]:
    kills: dict[str, float] = {}
    for spec in specs:
        host, sep, seconds = spec.partition("@")
        try:
            when = float(seconds)
        except ValueError:
            when = -1.0
        if not sep or host not in hosts or when < 0:
            raise UsageError(f"--kill-relay: expected HOST@SECONDS with HOST one of {hosts}, "
                             f"got {spec!r}")
        kills[host] = when
    return kills


def _get_state(address: str) -> dict[str, Any] | None:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=1.0)
    try:
        conn.request("GET", "/state.json")
        resp = conn.getresponse()
        if resp.status != 200:
            return None
        state: dict[str, Any] = json.loads(resp.read())
        return state
    except (OSError, ValueError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def _log(folder: Path, name: str) -> IO[str]:
    # Children's stderr goes to a file each: a killed relay's ranks report CoordinatorLost, which
    # is the point of the demo, not noise for the terminal.
    return (folder / f"{name}.log").open("w", encoding="utf-8")


def _read_line(stream: IO[str] | None, deadline: float, what: str) -> str:
    assert stream is not None
    line = stream.readline()  # the child prints it right after binding
    if not line or time.monotonic() > deadline:
        raise DemoError(f"{what} did not start (no address line)")
    return line


class _Progress:
    """Counts what the timeline file says: syncs, epochs, deaths."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.syncs = 0
        self.epoch = 0
        self.deaths: list[str] = []
        self.events = 0

    def poll(self) -> None:
        if not self.path.exists():
            return
        with self.path.open(encoding="utf-8") as f:
            f.seek(self.offset)
            for line in f:
                if not line.endswith("\n"):
                    break
                self.offset += len(line.encode("utf-8"))
                self.events += 1
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if ev.get("kind") == "RankDeclaredDead":
                    self.deaths.append(f"rank {ev['rank']} ({ev['host']}): {ev['reason']}")
                if ev.get("kind") == "Note":
                    what = ev.get("what")
                    if what == "sync":
                        self.syncs += 1
                    elif what == "epoch_started":
                        self.epoch = int(ev.get("fields", {}).get("epoch", self.epoch))


def _render(state: dict[str, Any] | None, prog: _Progress, layout: dict[str, list[int]],
            epochs: int, killed: set[str]) -> Any:
    from rich.table import Table

    phase = (state or {}).get("phase", "starting")
    table = Table(title="flodl-trio demo", min_width=64,
                  caption=f"{phase}: epoch {prog.epoch + 1 if state else 0}/{epochs}, "
                  f"{prog.syncs} syncs, {len(prog.deaths)} deaths")
    table.add_column("host")
    table.add_column("rank", justify="right")
    table.add_column("status")
    dead = {d["rank"]: d["reason"] for d in (state or {}).get("dead", [])}
    exited = set((state or {}).get("exited", []))
    live = set((state or {}).get("live", []))
    for host, ranks in layout.items():
        for r in ranks:
            if r in dead:
                status = "[red]dead[/red]"
            elif r in exited:
                status = "[blue]exited[/blue]"
            elif r in live:
                status = "[green]alive[/green]"
            else:
                status = "[yellow]starting[/yellow]"
            label = host + (" (killed)" if host in killed else "")
            table.add_row(label, str(r), status)
    return table


def run_demo(args: argparse.Namespace) -> int:
    hosts = [f"host-{chr(ord('a') + i)}" if i < 26 else f"host-{i}" for i in range(args.hosts)]
    per = args.ranks_per_host
    layout = {h: list(range(i * per, (i + 1) * per)) for i, h in enumerate(hosts)}
    world = args.hosts * per
    kills = _parse_kills(args.kill_relay, hosts)
    salt = SessionSalt.generate()
    env = dict(os.environ, FLODL_SALT_HEX=salt.hex())
    work = Path(tempfile.mkdtemp(prefix="flodl-demo-"))
    timeline = Path(args.timeline) if args.timeline else work / "timeline.jsonl"
    if timeline.exists():
        timeline.unlink()
    summary_file = work / "summary.json"
    logs = work / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen[str]] = []
    rank_procs: list[subprocess.Popen[str]] = []
    relay_procs: dict[str, subprocess.Popen[str]] = {}
    killed: set[str] = set()
    start_deadline = time.monotonic() + START_DEADLINE_S
    try:
        coord = subprocess.Popen(
            _cli("--log-level", "ERROR", "coordinator", "--listen", "127.0.0.1:0",
                 "--world-size", str(world), "--epochs", str(args.epochs), "--total-samples",
                 str(args.total_samples), "--batch-size", str(args.batch_size), "--timeline",
                 str(timeline), "--summary-file", str(summary_file), "--heartbeat-timeout",
                 "5"),
            env=env, stdout=subprocess.PIPE, text=True)
        procs.append(coord)
        line = _read_line(coord.stdout, start_deadline, "coordinator")
        address = line.strip().rsplit(" ", 1)[-1]
        print(f"coordinator on {address} (status: http://{address}/state.json); world {world} "
              f"= {args.hosts} hosts x {per} ranks; timeline {timeline}")
        for i, host in enumerate(hosts):
            relay = subprocess.Popen(
                _cli("--log-level", "ERROR", "relay", "--coordinator", address, "--host", host,
                     "--ranks", ",".join(map(str, layout[host])), "--world-size", str(world)),
                env=env, stdout=subprocess.PIPE, stderr=_log(logs, host), text=True)
            procs.append(relay)
            relay_procs[host] = relay
            rank_addr = _read_line(relay.stdout, start_deadline, f"relay {host}").split()[-1]
            for r in layout[host]:
                rank_procs.append(subprocess.Popen(
                    _cli("--log-level", "CRITICAL", "rank", "--relay", rank_addr, "--rank",
                         str(r), "--world-size", str(world), "--batch-size",
                         str(args.batch_size), "--batch-ms", str(args.batch_ms * (1 + i))),
                    env=env, stdout=subprocess.DEVNULL, stderr=_log(logs, f"rank-{r}"),
                    text=True))
        procs.extend(rank_procs)
        print(f"process logs: {logs}")
        return _watch(args, coord, address, timeline, summary_file, layout, relay_procs, kills,
                      killed, [*relay_procs.values(), *rank_procs])
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
            if p.poll() is None:
                p.kill()
                p.wait()
            if p.stdout is not None:
                p.stdout.close()


def _watch(args: argparse.Namespace, coord: subprocess.Popen[str], address: str,
           timeline: Path, summary_file: Path, layout: dict[str, list[int]],
           relay_procs: dict[str, subprocess.Popen[str]], kills: dict[str, float],
           killed: set[str], children: list[subprocess.Popen[str]]) -> int:
    prog = _Progress(timeline)
    live_ui = not args.no_live and sys.stdout.isatty()
    started: float | None = None
    deadline = time.monotonic() + RUN_DEADLINE_S
    state: dict[str, Any] | None = None
    live_cm: Any = contextlib.nullcontext()
    if live_ui:
        from rich.live import Live

        live_cm = Live(_render(None, prog, layout, args.epochs, killed), refresh_per_second=8)
    last_line = ""
    with live_cm as live:
        while coord.poll() is None:
            if time.monotonic() > deadline:
                raise DemoError(f"the run did not finish within {RUN_DEADLINE_S:g}s")
            if any(p.poll() == 2 for p in children):  # a usage error: waiting cannot help
                raise DemoError("a relay or rank process rejected its command line (exit 2)")
            polled = _get_state(address)
            state = polled or state
            prog.poll()
            if started is None and state and state.get("phase") == "running":
                started = time.monotonic()
            if started is not None:
                for host, when in kills.items():
                    if host not in killed and time.monotonic() - started >= when:
                        relay_procs[host].kill()  # SIGKILL: no goodbye, the OS closes its sockets
                        killed.add(host)
                        msg = f"SIGKILLed relay {host} (ranks {layout[host]})"
                        if not live_ui:
                            print(msg, flush=True)
            if live_ui:
                live.update(_render(state, prog, layout, args.epochs, killed))
            else:
                line = (f"epoch {prog.epoch + 1}/{args.epochs} syncs {prog.syncs} "
                        f"deaths {len(prog.deaths)} live {len((state or {}).get('live', []))}")
                if line != last_line:
                    print(line, flush=True)
                    last_line = line
            time.sleep(0.2)
        prog.poll()
    code = coord.wait()
    for death in prog.deaths:
        print(f"  declared dead: {death}")
    if not summary_file.exists():
        print(f"run FAILED: coordinator exited with code {code} and no summary")
        return 1
    summary = json.loads(summary_file.read_text(encoding="utf-8"))
    done = summary.get("epochs_completed")
    print(f"summary: {done}/{args.epochs} epochs, {summary.get('syncs')} syncs, global step "
          f"{summary.get('global_step')}, dead ranks {summary.get('dead_ranks')}, lost "
          f"broadcasts {summary.get('lost_broadcasts')}")
    for m in summary.get("epoch_metrics", []):
        print(f"  epoch {m['epoch']}: avg loss {m['avg_loss']:.4f}")
    print(f"timeline: {timeline} ({prog.events} events)")
    if code != 0 or done != args.epochs:
        print("run FAILED")
        return 1
    print("run completed")
    return 0
