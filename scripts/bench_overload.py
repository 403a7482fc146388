"""Overload benchmark (SPEC §13): 1024 ranks whose frame rate steps up to 3x the ingest capacity.

Source relays (128 x 8 ranks, scripts/_wireload.py, two processes of their own) first write flat
out for a moment: what the coordinator delivers then is its capacity C. Then the offered rate
steps to 1x, 2x and 3x C. Each step checks what a user would notice:
  - no healthy rank declared dead (``heartbeat_timeout`` is short, 3 s, so a reader starved
    for that long would show up as a death; every rank sends all the time);
  - memory stays bounded (``coord.timing`` backpressure; peak RSS of this process);
  - "written/s" is what the sources got into their sockets (blocked writes hold the rest back);
  - fan-out latency of a ``broadcast_control`` every 100 ms during the step (kernel receive
    timestamp at the last relay, as in bench_fanout.py).
The consumer drains ``coord.timing`` like bench_ingest.py's.

    .venv/bin/python scripts/bench_overload.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import _report as rep
import _wireload as load
import trio

import flodl_trio as ft
from flodl_trio import wire

RSS_MB, P99_MS = 200.0, 50.0
RANKS, PER_RELAY = 1024, 8


async def run(step_s: float, procs: int) -> list[dict[str, Any]]:
    relays = RANKS // PER_RELAY
    cfg = ft.CoordinatorConfig(world_size=RANKS, formation_timeout=120, handshake_timeout=60,
                               heartbeat_timeout=3.0, heartbeat_interval=3600,
                               shutdown_grace=10)
    rows: list[dict[str, Any]] = []
    delivered = 0
    async with load.coordinator_under_load(cfg, relays=relays, per_relay=PER_RELAY,
                                           procs=procs) as cluster, \
            trio.open_nursery() as nursery:
        coord = cluster.coord

        def count(taken: int) -> None:
            nonlocal delivered
            delivered += taken

        nursery.start_soon(load.drain, coord.timing, count)
        # Every rank speaks at once (heartbeat_timeout is 3 s); the records for the run are
        # sealed in slices meanwhile, so no slice stalls a load process for long.
        await cluster.command(f"rate {PER_RELAY} {PER_RELAY}")
        for _ in range(int(90_000 * step_s * 4 / relays / 500)):
            await cluster.command("seal 500")
        await cluster.command("rate inf 256")
        await trio.sleep(0.5)
        d0, t0 = delivered, time.monotonic()
        await trio.sleep(min(2.0, step_s))
        capacity = (delivered - d0) / (time.monotonic() - t0)
        # Let the backlog of the flat-out phase (socket buffers) drain before stepping up.
        await cluster.command(f"rate {PER_RELAY} {PER_RELAY}")
        with trio.move_on_after(30):
            while True:
                before = delivered
                await trio.sleep(0.3)
                if delivered - before < RANKS:
                    break
        written = sum(a["written"] for a in await cluster.command("report"))
        step_count = 0
        for factor in (1, 2, 3):
            per_relay_rate = factor * capacity / relays
            await cluster.command(f"rate {per_relay_rate:.1f} {max(8, int(per_relay_rate / 50))}")
            d0, t0, c0 = delivered, time.monotonic(), time.process_time()
            sent: list[float] = []
            end = t0 + step_s
            while time.monotonic() < end:
                sent.append(time.time())
                await coord.broadcast_control(wire.SetGlobalStep(global_step=step_count))
                step_count += 1
                await trio.sleep(0.1)
            elapsed = time.monotonic() - t0
            cpu = time.process_time() - c0
            rate = (delivered - d0) / elapsed
            answers = await cluster.command("report")
            now_written = sum(a["written"] for a in answers)
            offered = (now_written - written) / elapsed
            written = now_written
            lat = _latencies(sent, load.relay_arrivals(answers))
            _, peak = rep.rss_mb()
            rows.append({"factor": factor, "asked_per_s": factor * capacity,
                         "written_per_s": offered,
                         "delivered_per_s": rate, "capacity_per_s": capacity,
                         "cpu_share": cpu / elapsed,
                         "cpu_us_per_frame": cpu / max(1, delivered - d0) * 1e6,
                         "p50_ms": rep.median(lat), "p99_ms": rep.percentile(lat, 0.99),
                         "broadcasts": len(lat), "peak_rss_mb": peak,
                         "dead": len(coord.dead_ranks)})
        await cluster.command("rate 0")
        nursery.cancel_scope.cancel()
    return rows


def _latencies(sent: list[float], arrivals: list[list[float]]) -> list[float]:
    """Per broadcast, ms until its record was complete at the last relay.

    A source relay's arrivals are exactly our broadcasts (no CoordHeartbeat: the interval is an
    hour), taken in order; ``report`` cleared the earlier ones.
    """
    out = []
    for i, t in enumerate(sent):
        out.append((max(times[i] for times in arrivals) - t) * 1000)
    return out


COLUMNS = [
    ("load", "factor", "d"), ("asked/s", "asked_per_s", ",.0f"),
    ("written/s", "written_per_s", ",.0f"),
    ("delivered/s", "delivered_per_s", ",.0f"), ("coord CPU", "cpu_share", ".0%"),
    ("µs/frame", "cpu_us_per_frame", ".1f"), ("bcast p50 ms", "p50_ms", ".2f"),
    ("bcast p99 ms", "p99_ms", ".2f"), ("peak RSS MB", "peak_rss_mb", ".1f"),
    ("dead", "dead", "d"),
]


async def main(args: argparse.Namespace) -> None:
    load.raise_fd_limit()
    reps = args.runs or 3
    step_s = 3.0 if args.quick else 6.0
    print(f"{rep.machine_note()}\noverload: {RANKS} ranks over {RANKS // PER_RELAY} source "
          f"relays, {step_s:g} s per step, heartbeat_timeout 3 s, {reps} runs")
    runs = [await run(step_s, args.procs) for _ in range(reps)]
    rows = [row for r in runs for row in r]
    medians = [rep.medians([r[i] for r in runs]) for i in range(len(runs[0]))]
    capacity = rep.median([r[0]["capacity_per_s"] for r in runs])
    print(f"capacity measured flat out (median): {capacity:,.0f} frames/s")
    print(rep.table(COLUMNS, medians))
    worst = medians[-1]
    targets = [
        rep.target("overload 3x: ranks declared dead (all steps)",
                   max(m["dead"] for m in medians), "<=", 0),
        rep.target("overload 3x: peak RSS MB", max(m["peak_rss_mb"] for m in medians), "<",
                   RSS_MB),
        rep.target("overload 3x: fan-out p99 ms", worst["p99_ms"], "<=", P99_MS),
    ]
    rep.finish("overload", rows, targets, args.json, medians=medians)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="shorter steps")
    p.add_argument("--runs", type=int, default=0, help="runs (default 3)")
    p.add_argument("--procs", type=int, default=2, help="load processes")
    p.add_argument("--json", action="store_true", help="last line: one JSON object")
    trio.run(main, p.parse_args())
