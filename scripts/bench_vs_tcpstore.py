"""flodl-trio against torch.distributed.TCPStore (C++, libuv), 256 ranks, one run, loopback.

For TCPStore: a master plus 256 clients (threads in 2 load-generator processes); formation is the
master's ``wait_for_workers`` from the moment the clients are released, and "a value reaches every
rank" is master ``set`` -> the last client's blocked ``get`` returning. For flodl-trio (via
bench_cluster's load generators): formation from the relays' release to the coordinator's block,
and a ``broadcast_control`` -> the last rank's user code, with 1 and with 8 ranks per relay.

Issue 38's figures, per join at 1 rank per relay: ``coordinator CPU per join us`` (the
coordinator process's CPU in that formation / relays), ``relay CPU per join us`` (a library
relay's rank accept, rank handshake, upstream handshake and pump start, from
bench_relay_upstream.py: 64 relays in one process, their ranks and coordinator in another),
``handshake machine CPU per join us`` (the sans-IO FT/2 machines alone, bytes handed over in
memory: what no IO shape can go below) and ``floor CPU per join us`` (a ``selectors``
coordinator with no Trio and no roster driving the same machine over loopback, against the same
kind of load relays; its formation is a row of the table). See scripts/_join_floor.py.

TCPStore looks up the name of every client socket; on a machine whose DNS server is unreachable
each lookup stalls for the resolver timeout (5 s here), which would swamp the comparison. So when
run as root with ``unshare``, the TCPStore processes get a private mount namespace whose
/etc/resolv.conf points at 127.0.0.1 (refused at once); ``--machine-resolver`` measures them with
the machine's resolver as well.

PyTorch is optional and never installed into the project's .venv: ``--install-torch`` creates
``.venv-torch`` with torch==2.13.0 (about 1 GB) and says so; without it the TCPStore rows are
skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _join_floor as jf
import _report as rep
import trio
from bench_cluster import run_case

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TORCH_VENV = ROOT / ".venv-torch"
TORCH_PY = TORCH_VENV / "bin" / "python"
TORCH_PIN = "torch==2.13.0"


def ensure_torch(install: bool) -> bool:
    if TORCH_PY.exists() and subprocess.run([str(TORCH_PY), "-c", "import torch"],
                                            capture_output=True).returncode == 0:
        return True
    if not install:
        print(f"TCPStore rows skipped: no {TORCH_VENV}; rerun with --install-torch (installs "
              f"{TORCH_PIN} into {TORCH_VENV}, about 1 GB)")
        return False
    print(f"installing {TORCH_PIN} into {TORCH_VENV} (separate from .venv) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(TORCH_VENV)], check=True)
    subprocess.run([str(TORCH_PY), "-m", "pip", "install", "-q", TORCH_PIN], check=True)
    return True


def torch_cmd(args: list[str], fast_resolver: bool) -> list[str]:
    if not fast_resolver:
        return [str(TORCH_PY), *args]
    resolv = Path("/tmp/flodl-bench-resolv.conf")
    resolv.write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
    return ["unshare", "-m", "sh", "-c", f'mount --bind {resolv} /etc/resolv.conf && '
            'exec "$0" "$@"', str(TORCH_PY), *args]


def can_isolate_resolver() -> bool:
    return os.geteuid() == 0 and shutil.which("unshare") is not None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tcpstore_once(world: int, runs: int, procs: int, fast_resolver: bool
                  ) -> dict[str, list[float]]:
    port = free_port()
    script = str(HERE / "_tcpstore_bench.py")
    common = ["--world", str(world), "--port", str(port), "--runs", str(runs)]
    master = subprocess.Popen(torch_cmd([script, "master", *common], fast_resolver),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    counts = [world // procs + (1 if i < world % procs else 0) for i in range(procs)]
    clients = [subprocess.Popen(torch_cmd([script, "clients", *common, "--count", str(n)],
                                          fast_resolver),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                stderr=subprocess.DEVNULL)
               for n in counts]
    everyone = [master, *clients]
    try:
        for p in everyone:
            assert json.loads(p.stdout.readline())["ready"]  # type: ignore[union-attr]
        for p in everyone:  # release: master first (it only measures), then the clients
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        formed = json.loads(master.stdout.readline())["formed_ms"]  # type: ignore[union-attr]
        for c in clients:
            assert json.loads(c.stdout.readline())["connected"]  # type: ignore[union-attr]
        time.sleep(0.2)  # every client is blocked in get()
        sent = []
        for _ in range(runs):
            master.stdin.write("set\n")  # type: ignore[union-attr]
            master.stdin.flush()  # type: ignore[union-attr]
            sent.append(json.loads(master.stdout.readline())["sent"])  # type: ignore[union-attr]
            time.sleep(0.1)
        arrivals = [json.loads(c.stdout.readline())["arrivals"] for c in clients]  # type: ignore[union-attr]
        master.stdin.write("done\n")  # type: ignore[union-attr]
        master.stdin.flush()  # type: ignore[union-attr]
    finally:
        for p in everyone:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    values = []
    for run in range(runs):
        last = max(a[str(run)][0] for a in arrivals)
        assert sum(a[str(run)][1] for a in arrivals) == world
        values.append((last - sent[run]) * 1000)
    return {"formation_ms": [formed], "value_ms": values}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--install-torch", action="store_true", help=f"install {TORCH_PIN} into "
                   f"{TORCH_VENV} if missing")
    p.add_argument("--reps", type=int, default=3, help="repetitions of each formation")
    p.add_argument("--values", type=int, default=20, help="values/broadcasts per repetition")
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--machine-resolver", action="store_true",
                   help="also measure TCPStore with this machine's /etc/resolv.conf")
    p.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = p.parse_args()
    world = 256
    rows: dict[str, dict[str, float]] = {}
    if ensure_torch(args.install_torch):
        variants = []
        if can_isolate_resolver():
            variants.append(("TCPStore (libuv)", True))
        if args.machine_resolver or not can_isolate_resolver():
            variants.append(("TCPStore, machine DNS", False))
        for name, fast in variants:
            form, val = [], []
            reps = args.reps if fast else 1
            for _ in range(reps):
                r = tcpstore_once(world, args.values, args.procs, fast)
                form += r["formation_ms"]
                val += r["value_ms"]
            rows[name] = {"formation": statistics.median(form), "value": statistics.median(val)}
    cpu: dict[str, list[float]] = {"coord": [], "lg": []}
    for per in (1, 8):
        form, val = [], []
        for _ in range(args.reps):
            r = trio.run(run_case, world, per, args.values, args.procs)
            form.append(r["formation_ms"])
            val.append(r["p50_ms"])
            if per == 1:
                cpu["coord"].append(r["cpu_coord_formation_s"] * 1e6 / world)
        rows[f"flodl-trio, {per} rank/relay"] = {"formation": statistics.median(form),
                                                 "value": statistics.median(val)}
    joins = join_costs(world, args.reps, args.procs)
    joins["coordinator CPU per join us"] = statistics.median(cpu["coord"])
    rows["floor: selectors + FT/2 machines, 1 rank/relay"] = {
        "formation": joins.pop("floor formation ms"), "value": math.nan}
    rows["flodl-trio coordinator, floor's relays, 1 rank/relay"] = {
        "formation": joins.pop("library coordinator, floor relays ms"), "value": math.nan}
    base = rows.get("TCPStore (libuv)") or rows.get("TCPStore, machine DNS")
    print(f"\n{world} ranks, loopback, {rep.machine_note()}, {args.procs} load-generator "
          f"processes, medians of {args.reps} formations x {args.values} values")
    header = (f"{'system':<52} {'formation ms':>13} {'ratio':>7} {'value->all ms':>14} "
              f"{'ratio':>7}")
    print(header)
    print("-" * len(header))
    for name, r in rows.items():
        fr = f"{r['formation'] / base['formation']:.2f}" if base else "-"
        vr = f"{r['value'] / base['value']:.2f}" if base and r["value"] == r["value"] else "-"
        value = f"{r['value']:>14.2f}" if r["value"] == r["value"] else f"{'-':>14}"
        print(f"{name:<52} {r['formation']:>13.1f} {fr:>7} {value} {vr:>7}")
    print("\nCPU per join, 1 rank per relay (µs):")
    for name in JOIN_FIGURES:
        print(f"  {name:<44} {joins[name]:>7.0f}")
    print("coordinator: its process's CPU from the relays' release to formation, / relays; "
          "relay: a library relay's\nrank accept, rank handshake, upstream handshake and pump "
          "start (bench_relay_upstream.py, 64 relays, median of 3 joins in one process, its\n"
          "ranks and coordinator in another process); handshake machine: the sans-IO FT/2 "
          "machines alone, in memory;\nfloor: "
          "a selectors coordinator (no Trio, no roster) driving the same machines over "
          "loopback;\n'flodl-trio coordinator, floor's relays': the library's coordinator "
          "against those same selectors relays\n(the relays' side near its floor).")
    print("targets (issues 23 and 38, SPEC §13): formation 1 rank/relay <= 1.0x TCPStore, 8 "
          "ranks/relay <= 0.5x; value->all 1 rank/relay <= 1.5x, 8 ranks/relay <= 1.0x; "
          f"coordinator CPU per join <= {COORD_JOIN_US:g} us, relay <= {RELAY_JOIN_US:g} us")
    if args.json:
        targets = []
        if base:
            for what, key, limits in (("formation", "formation", ((1, 1.0), (8, 0.5))),
                                      ("value->all", "value", ((1, 1.5), (8, 1.0)))):
                for per, limit in limits:
                    mine = rows[f"flodl-trio, {per} rank/relay"][key]
                    targets.append(rep.target(f"{what}, {per} rank/relay / TCPStore",
                                              mine / base[key], "<=", limit))
        targets += [
            rep.target("coordinator CPU per join us", joins["coordinator CPU per join us"],
                       "<=", COORD_JOIN_US),
            rep.target("relay CPU per join us", joins["relay CPU per join us"], "<=",
                       RELAY_JOIN_US)]
        raw = [{"system": name, "formation_ms": r["formation"], "value_ms": r["value"]}
               for name, r in rows.items()]
        rep.finish("vs_tcpstore", raw, targets, True, joins=joins)


# Issue 38's figures, in the order printed; the first two are targets.
JOIN_FIGURES = ("coordinator CPU per join us", "relay CPU per join us",
                "handshake machine CPU per join us", "handshake machine, relay side us",
                "floor CPU per join us", "floor, relay side us")
COORD_JOIN_US, RELAY_JOIN_US = 200.0, 450.0


def join_costs(world: int, reps: int, procs: int) -> dict[str, float]:
    """Issue 38's per-join figures besides the coordinator's own (medians of ``reps``): a
    library relay's join (bench_relay_upstream.py's, 64 relays of 1 rank), the sans-IO
    machines alone, and the selectors floor's formation of ``world`` relays."""
    machine = jf.machine_cpu_us(2000, 1)
    floors = [trio.run(jf.selectors_formation, world, 1, procs) for _ in range(reps)]
    # The library's coordinator against the floor's relays: what formation is with the relays'
    # side near its floor (the coordinator's share of the gap to TCPStore).
    coords = [trio.run(jf.library_coordinator_formation, world, 1, procs) for _ in range(reps)]
    # One process, ``reps`` joins of 64 relays each (the first pays the process's first use
    # of every path: with --quick alone that one-off cost was most of the figure).
    done = subprocess.run([sys.executable, str(HERE / "bench_relay_upstream.py"), "--relays",
                           "64", "--per", "1", "--runs", str(max(reps, 3)), "--seconds", "1",
                           "--json"], capture_output=True, text=True, check=True, timeout=300)
    runs = json.loads(done.stdout.splitlines()[-1])["runs"]
    return {
        "relay CPU per join us": statistics.median(r["join_cpu_relay"] * 1000 for r in runs),
        "handshake machine CPU per join us": machine["coord_us"],
        "handshake machine, relay side us": machine["relay_us"],
        "floor CPU per join us": statistics.median(f["coord_us"] for f in floors),
        "floor, relay side us": statistics.median(f["relay_us"] for f in floors),
        "floor formation ms": statistics.median(f["ms"] for f in floors),
        "library coordinator, floor relays ms": statistics.median(c["ms"] for c in coords),
    }

if __name__ == "__main__":
    main()
