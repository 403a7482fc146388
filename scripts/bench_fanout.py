"""Fan-out benchmark (SPEC §13): ``broadcast_control`` to 1024 ranks over 128 and 1024 relays.

The coordinator runs in this process; sink relays (scripts/_wireload.py, two processes of their
own) do the real handshake and then only count bytes. Latency of one broadcast = from the call
to the moment the LAST relay socket holds the whole record (the kernel's receive timestamp of its
last segment, so how fast the sink process runs does not count). Coordinator CPU per broadcast is
this process's CPU time across the call.

The floor, in the same run: a bare Trio server accepts the same number of raw sink connections
and pushes the same pre-sealed FANOUT bytes to each socket with ``send_all`` in a loop.

    .venv/bin/python scripts/bench_fanout.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import cProfile
import resource
import time
from typing import Any

import _report as rep
import _wireload as load
import trio

import flodl_trio as ft
from flodl_trio import wire

P50_MS, P99_MS, MAX_RATIO = 5.0, 15.0, 1.5


def latencies(sent: list[float], arrivals: list[list[float]]) -> list[float]:
    """Per broadcast, ms until the last relay had its record (the last ``len(sent)`` records)."""
    n = len(sent)
    out = []
    for i, t in enumerate(sent):
        last = max(times[len(times) - n + i] for times in arrivals)
        out.append((last - t) * 1000)
    return out


def summary(kind: str, lat: list[float], cpu: list[float],
            sys_ms: list[float]) -> dict[str, float]:
    return {f"{kind}_p50_ms": rep.median(lat), f"{kind}_p99_ms": rep.percentile(lat, 0.99),
            f"{kind}_cpu_ms": rep.median(cpu), f"{kind}_sys_ms": rep.median(sys_ms)}


def sys_time() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


async def floor_run(world: int, relays: int, per_relay: int, count: int, gap: float,
                    procs: int) -> dict[str, float]:
    salt = ft.SessionSalt.generate()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    address = listeners[0].socket.getsockname()[:2]
    loads = await load.start_load(address, salt, world=world, relays=relays,
                                  per_relay=per_relay, procs=procs, raw=True)
    streams: list[trio.SocketStream] = []
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(load.all_command, loads, "dial")
            while len(streams) < relays:
                streams.append(await listeners[0].accept())
        frame = wire.encode_frame(salt, wire.SetGlobalStep(global_step=1))
        sealer = wire.RecordSealer(bytes(32), wire.COORD_TO_RELAY)
        # The same bytes per socket as the coordinator writes (ranks listed per relay).
        records = [sealer.seal(wire.RecordKind.FANOUT, 0, wire.encode_fanout(
            range(i * per_relay, (i + 1) * per_relay), frame)) for i in range(relays)]
        sent, cpu, kernel = [], [], []
        for _ in range(count):
            c0, s0 = time.process_time(), sys_time()
            sent.append(time.time())
            for stream, record in zip(streams, records, strict=True):
                await stream.send_all(record)
            cpu.append((time.process_time() - c0) * 1000)
            kernel.append((sys_time() - s0) * 1000)
            await trio.sleep(gap)
        await trio.sleep(0.2)
        answers = await load.all_command(loads, "report")
    finally:
        for s in streams:
            await trio.aclose_forcefully(s)
        await load.stop_all(loads)
        for lst in listeners:
            await lst.aclose()
    return summary("floor", latencies(sent, load.relay_arrivals(answers)), cpu, kernel)


async def ours_run(world: int, relays: int, per_relay: int, count: int, gap: float,
                   procs: int) -> dict[str, float]:
    # No CoordHeartbeat during the run: every record a sink sees is one of ours.
    cfg = ft.CoordinatorConfig(world_size=world, formation_timeout=120, handshake_timeout=60,
                               heartbeat_timeout=600, heartbeat_interval=3600,
                               shutdown_grace=10)
    async with load.coordinator_under_load(cfg, relays=relays, per_relay=per_relay,
                                           procs=procs) as cluster:
        sent, cpu, kernel = [], [], []
        for step in range(count):
            c0, s0 = time.process_time(), sys_time()
            sent.append(time.time())
            await cluster.coord.broadcast_control(wire.SetGlobalStep(global_step=step))
            cpu.append((time.process_time() - c0) * 1000)
            kernel.append((sys_time() - s0) * 1000)
            await trio.sleep(gap)
        await trio.sleep(0.2)
        answers = await cluster.command("report")
        rss, _ = rep.rss_mb()
    out = summary("ours", latencies(sent, load.relay_arrivals(answers)), cpu, kernel)
    out["rss_mb"] = rss
    return out


async def run_case(relays: int, per_relay: int, count: int, gap: float,
                   procs: int) -> dict[str, Any]:
    world = relays * per_relay
    floor = await floor_run(world, relays, per_relay, count, gap, procs)
    ours = await ours_run(world, relays, per_relay, count, gap, procs)
    row: dict[str, Any] = {"ranks": world, "relays": relays, **ours, **floor}
    row["ratio_p50"] = row["ours_p50_ms"] / row["floor_p50_ms"]
    row["ratio_p99"] = row["ours_p99_ms"] / row["floor_p99_ms"]
    return row


COLUMNS = [
    ("ranks", "ranks", "d"), ("relays", "relays", "d"),
    ("p50 ms", "ours_p50_ms", ".2f"), ("p99 ms", "ours_p99_ms", ".2f"),
    ("CPU ms/bcast", "ours_cpu_ms", ".2f"), ("of it sys", "ours_sys_ms", ".2f"),
    ("floor p50", "floor_p50_ms", ".2f"), ("floor p99", "floor_p99_ms", ".2f"),
    ("floor CPU ms", "floor_cpu_ms", ".2f"), ("of it sys", "floor_sys_ms", ".2f"),
    ("ratio p50", "ratio_p50", ".2f"), ("ratio p99", "ratio_p99", ".2f"),
]


async def main(args: argparse.Namespace) -> None:
    load.raise_fd_limit()
    count = 100 if args.quick else 200
    reps = args.runs or 3
    print(f"{rep.machine_note()}\nfan-out: {count} broadcasts per run, {args.gap * 1000:g} ms "
          f"apart, {reps} runs per case (floor and ours alternate); {args.procs} sink processes")
    rows, medians = [], []
    cases = [tuple(int(x) for x in c.split("x")) for c in args.case] if args.case else [
        (128, 8), (1024, 1)]
    for relays, per in cases:
        runs = [await run_case(relays, per, count, args.gap, args.procs) for _ in range(reps)]
        rows += runs
        medians.append(rep.medians(runs))
    print(rep.table(COLUMNS, medians))
    print("latency: broadcast_control called -> the last relay socket holds the whole record "
          "(kernel receive timestamp);\nfloor: the same pre-sealed bytes, send_all to each "
          "socket in turn from bare Trio")
    targets = []
    for m in medians:
        what = f"fan-out {m['ranks']:.0f} ranks / {m['relays']:.0f} relays"
        if m["relays"] <= 128:
            # SPEC §13's absolute targets are for 128 relays; 1024 single-rank relays are
            # measured against the floor only (bare Trio pushing the same bytes to 1024
            # sockets takes ~25 ms on two cores, over any absolute target).
            targets += [rep.target(f"{what}: p50 ms", m["ours_p50_ms"], "<", P50_MS),
                        rep.target(f"{what}: p99 ms", m["ours_p99_ms"], "<", P99_MS)]
        targets.append(rep.target(f"{what}: p50 / floor p50", m["ratio_p50"], "<=", MAX_RATIO))
    rep.finish("fanout", rows, targets, args.json, medians=medians)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer broadcasts per run")
    p.add_argument("--runs", type=int, default=0, help="runs per case (default 3)")
    p.add_argument("--gap", type=float, default=0.02, help="seconds between broadcasts")
    p.add_argument("--procs", type=int, default=2, help="sink processes")
    p.add_argument("--case", action="append", help="RELAYSxRANKS, e.g. 128x8 (repeatable)")
    p.add_argument("--json", action="store_true", help="last line: one JSON object")
    p.add_argument("--profile", default=None, help="write a cProfile of this process here")
    ns = p.parse_args()
    if ns.profile:
        cProfile.run("trio.run(main, ns)", ns.profile)
    else:
        trio.run(main, ns)
