"""Cluster benchmark (SPEC §13): formation, broadcast latency to the last rank, coordinator RSS.

The coordinator runs in this process; relays and ranks run in 2-4 load-generator processes
(scripts/_loadgen.py), each hosting many relays and their ranks in one Trio run, on loopback.

    .venv/bin/python scripts/bench_cluster.py            # 64, 256, 1024 x8 and 256 x1
    .venv/bin/python scripts/bench_cluster.py --quick
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import trio

import flodl_trio as ft
from flodl_trio.wire import SetGlobalStep

HERE = Path(__file__).resolve().parent


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def spawn_load_generators(addr: str, salt: ft.SessionSalt, world: int, per_relay: int,
                          relays: int, procs: int, profile: str | None = None,
                          ) -> list[subprocess.Popen[str]]:
    per_proc = [relays // procs + (1 if i < relays % procs else 0) for i in range(procs)]
    children: list[subprocess.Popen[str]] = []
    first_relay = 0
    for i, n in enumerate(per_proc):
        if n == 0:
            continue
        cmd = [sys.executable, str(HERE / "_loadgen.py"), "--coordinator", addr, "--salt-hex",
               salt.hex(), "--world-size", str(world), "--first-rank",
               str(first_relay * per_relay), "--relays", str(n), "--per-relay", str(per_relay),
               "--id", str(i)]
        if profile:
            cmd += ["--profile", f"{profile}.lg{i}"]
        children.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True))
        first_relay += n
    return children


async def run_case(world: int, per_relay: int, broadcasts: int, procs: int,
                   profile: str | None = None) -> dict[str, float]:
    """One formation and ``broadcasts`` values. With ``profile`` (a path prefix) the
    coordinator (``PROFILE.coord.formation``, ``PROFILE.coord.values``) and every load
    generator (``PROFILE.lgN.formation``, ...) write a cProfile per phase. The result has
    each side's CPU seconds per phase too (``cpu_coord_formation_s``, ``cpu_lg_values_s``:
    the load generators summed)."""
    salt = ft.SessionSalt.generate()
    relays = world // per_relay
    cfg = ft.CoordinatorConfig(world_size=world, formation_timeout=120, handshake_timeout=60,
                               heartbeat_timeout=120, timing_buffer=65536,
                               shutdown_grace=60)
    bound = await ft.bind_coordinator(("127.0.0.1", 0))
    addr = f"{bound.address[0]}:{bound.address[1]}"
    children = spawn_load_generators(addr, salt, world, per_relay, relays, procs, profile)
    lg_cpu: dict[str, float] = {}
    coord_cpu: dict[str, float] = {}
    try:
        for child in children:  # every local rank connected to its relay
            line = await trio.to_thread.run_sync(child.stdout.readline)  # type: ignore[union-attr]
            assert json.loads(line).get("ready"), line
        arrivals: list[dict[str, list[float]]] = []
        go_times: list[float] = []

        async def consume(coord: ft.Coordinator) -> None:
            async for _ in coord.timing:
                pass

        prof = cProfile.Profile() if profile else None
        gc_s = [0.0, 0.0]  # seconds in the garbage collector, and when the current pass began

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                gc_s[1] = time.perf_counter()
            else:
                gc_s[0] += time.perf_counter() - gc_s[1]

        gc.callbacks.append(on_gc)
        cpu_t = time.process_time()
        if prof is not None:
            prof.enable()
        for child in children:
            child.stdin.write("go\n")  # type: ignore[union-attr]
            child.stdin.flush()  # type: ignore[union-attr]
        async with ft.open_coordinator(bound, salt=salt, config=cfg) as coord:
            formed_t = time.monotonic()
            coord_cpu["formation"] = time.process_time() - cpu_t
            coord_cpu["formation_gc"], gc_s[0] = gc_s[0], 0.0
            if prof is not None:
                prof.disable()
                prof.dump_stats(f"{profile}.coord.formation")
                prof = cProfile.Profile()
                prof.enable()
            cpu_t = time.process_time()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume, coord)
                sent: list[float] = []
                calls: list[float] = []
                call_cpus: list[float] = []
                for step in range(broadcasts):
                    sent.append(time.monotonic())
                    call_cpu = time.process_time()
                    await coord.broadcast_control(SetGlobalStep(global_step=step))
                    calls.append((time.monotonic() - sent[-1]) * 1000)
                    call_cpus.append((time.process_time() - call_cpu) * 1000)
                    # Pace so each broadcast is measured on its own, not behind a backlog in
                    # the load generators (their Python ranks cost ~0.1 ms each per message).
                    await trio.sleep(0.02 + world * 0.0003)
                rss = rss_mb()
                coord_cpu["values"] = time.process_time() - cpu_t
                coord_cpu["values_gc"] = gc_s[0]
                gc.callbacks.remove(on_gc)
                if prof is not None:
                    prof.disable()
                    prof.dump_stats(f"{profile}.coord.values")
                nursery.cancel_scope.cancel()
        for child in children:
            lines = (await trio.to_thread.run_sync(child.communicate))[0].splitlines()
            for raw in lines:
                obj = json.loads(raw)
                if "go_t" in obj:
                    go_times.append(obj["go_t"])
                if "arrivals" in obj:
                    arrivals.append(obj["arrivals"])
                    for phase, seconds in obj.get("cpu_s", {}).items():
                        lg_cpu[phase] = lg_cpu.get(phase, 0.0) + seconds
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    latencies = []
    for step in range(broadcasts):
        last = max(a[str(step)][0] for a in arrivals if str(step) in a)
        count = sum(a[str(step)][1] for a in arrivals if str(step) in a)
        assert count == world, f"step {step}: {count}/{world} ranks got it"
        latencies.append((last - sent[step]) * 1000)
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))]
    return {
        "formation_ms": (formed_t - min(go_times)) * 1000,
        "p50_ms": statistics.median(latencies),
        "p99_ms": p99,
        "rss_mb": rss,
        "call_ms": statistics.median(calls),
        "call_cpu_ms": statistics.median(call_cpus),
        **{f"cpu_coord_{k}_s": v for k, v in coord_cpu.items()},
        **{f"cpu_lg_{k}_s": v for k, v in lg_cpu.items()},
    }


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer broadcasts and repetitions")
    p.add_argument("--procs", type=int, default=2, help="load-generator processes (2-4)")
    p.add_argument("--case", action="append", default=None, help="WORLDxPER, e.g. 256x8")
    p.add_argument("--broadcasts", type=int, default=None, help="values per run")
    p.add_argument("--runs", type=int, default=None, help="runs per case")
    p.add_argument("--profile", default=None, metavar="PREFIX",
                   help="cProfile every process per phase (PREFIX.coord.formation, "
                   "PREFIX.lg0.values, ...; one run per case) and print the CPU per phase")
    args = p.parse_args()
    cases = [(64, 8), (256, 8), (1024, 8), (256, 1)]
    if args.case:
        cases = [(int(w), int(k)) for w, k in (c.split("x") for c in args.case)]
    broadcasts = args.broadcasts or (50 if args.quick else 100)
    reps = args.runs or (1 if args.quick else 3)
    print(f"cores: {os.cpu_count()}  load generators: {args.procs}  broadcasts per run: "
          f"{broadcasts}  runs per case: {reps}  (medians over runs)")
    header = (f"{'world':>6} {'per relay':>9} {'formation ms':>13} {'bcast p50 ms':>13} "
              f"{'bcast p99 ms':>13} {'call p50 ms':>12} {'coord RSS MB':>13}")
    print(header)
    print("-" * len(header))
    for world, per in cases:
        runs = [await run_case(world, per, broadcasts, args.procs,
                               f"{args.profile}.{world}x{per}" if args.profile else None)
                for _ in range(reps)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"{world:>6} {per:>9} {med['formation_ms']:>13.1f} {med['p50_ms']:>13.2f} "
              f"{med['p99_ms']:>13.2f} {med['call_ms']:>12.2f} {med['rss_mb']:>13.1f}")
        ms = {k: 1000 * v for k, v in med.items() if k.startswith("cpu_")}
        print(f"       CPU ms, formation: coordinator {ms['cpu_coord_formation_s']:.0f} (GC "
              f"{ms['cpu_coord_formation_gc_s']:.0f}), load generators "
              f"{ms['cpu_lg_formation_s']:.0f} (GC {ms['cpu_lg_formation_gc_s']:.0f}); values: "
              f"coordinator {ms['cpu_coord_values_s']:.0f} (GC {ms['cpu_coord_values_gc_s']:.0f}),"
              f" load generators {ms['cpu_lg_values_s']:.0f} (system "
              f"{ms['cpu_lg_values_sys_s']:.0f}, GC {ms['cpu_lg_values_gc_s']:.0f}); "
              f"broadcast_control CPU p50 {med['call_cpu_ms']:.2f} ms")
    print("bcast p50/p99: broadcast_control called -> SetGlobalStep seen by the LAST rank's user "
          "code;\ncall p50: time inside broadcast_control (FANOUT records written to every relay)")
    print("targets (SPEC §13): formation of 1024 < 300 ms; broadcast p50 < 5 ms, p99 < 20 ms; "
          "RSS < 100 MB")


if __name__ == "__main__":
    trio.run(main)
