"""Ingest benchmark (SPEC §13): TIMING frames the coordinator verifies, decodes and delivers.

The coordinator runs in this process with a consumer that drains ``coord.timing``; source relays
(scripts/_wireload.py, one process of their own) do the real handshake, then write pre-sealed DATA
records carrying Batch frames flat out. Measured over the middle 90% of the frames:
  - frames/s delivered (wall clock) and coordinator CPU µs per frame (process CPU time; the
    coordinator is one thread, so 1e6 / µs-per-frame is its rate on one core);
  - the consumer takes everything queued before it waits again (``--consumer iter`` measures a
    bare ``async for``, which costs one scheduler pass per message on top);
  - the floor, in the same run and process: the codec alone (RecordOpener.feed of the same bytes,
    FrameCodec.open, decode_timing) in a tight loop, and the raw work under it (two HMAC-SHA256
    and one cbor2.loads per frame).

    .venv/bin/python scripts/bench_ingest.py [--quick] [--json] [--profile FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import hmac
import time
from typing import Any

import _report as rep
import _wireload as load
import cbor2
import trio

import flodl_trio as ft
from flodl_trio import wire

TARGET_RATE = 80_000
MAX_RATIO = 2.0


def floor_us(salt: ft.SessionSalt, ranks: list[int], n: int) -> tuple[float, float]:
    """(codec floor, raw floor) in µs per frame on the same kind of bytes."""
    key = wire.conn_key(salt, b"c" * 16, b"r" * 16)
    sealer = wire.RecordSealer(key, wire.RELAY_TO_COORD)
    opener = wire.RecordOpener(key, wire.RELAY_TO_COORD)
    codec = wire.FrameCodec(salt)
    frames = [load.rank_frame(salt, "batch", r) for r in ranks]
    chunks = []
    for start in range(0, n, 512):  # the reader's receive_some returns many records at once
        chunks.append(b"".join(sealer.seal(wire.RecordKind.DATA, ranks[i % len(ranks)],
                                           frames[i % len(frames)])
                               for i in range(start, min(n, start + 512))))
    decode, open_frame, feed = wire.decode_timing, codec.open, opener.feed
    t0 = time.process_time()  # CPU time, like the coordinator's: the machine is shared
    for chunk in chunks:
        for rec in feed(chunk):
            decode(open_frame(rec.payload).payload)
    codec_us = (time.process_time() - t0) / n * 1e6
    covered = bytes(9) + bytes(17) + frames[0]
    body = frames[0][24:]
    digest, loads = hmac.digest, cbor2.loads
    t0 = time.process_time()
    for _ in range(n):
        digest(key, covered, "sha256")
        digest(key, body, "sha256")
        loads(body)
    raw_us = (time.process_time() - t0) / n * 1e6
    return codec_us, raw_us


async def run_case(ranks: int, per_relay: int, frames: int, drain: bool) -> dict[str, Any]:
    relays = ranks // per_relay
    cfg = ft.CoordinatorConfig(world_size=ranks, formation_timeout=120, handshake_timeout=60,
                               heartbeat_timeout=300, shutdown_grace=10)
    warm, end = frames // 20, frames - frames // 20
    marks: dict[str, float] = {}
    async with load.coordinator_under_load(cfg, relays=relays, per_relay=per_relay,
                                           procs=1) as cluster, trio.open_nursery() as nursery:
        coord = cluster.coord
        await cluster.command(f"seal {frames // relays + 256}")
        done = trio.Event()

        async def consume() -> None:
            # Takes everything queued before waiting again (``--consumer iter``: one
            # ``async for`` step, i.e. one scheduler pass, per message).
            count = 0
            receive, receive_nowait = coord.timing.receive, coord.timing.receive_nowait
            while True:
                await receive()
                count += 1
                if drain:
                    try:
                        while count != warm and count != end:
                            receive_nowait()
                            count += 1
                    except trio.WouldBlock:
                        pass
                if count == warm:
                    marks["t0"], marks["cpu0"] = time.perf_counter(), time.process_time()
                elif count == end:
                    marks["t1"], marks["cpu1"] = time.perf_counter(), time.process_time()
                    done.set()
                    return

        nursery.start_soon(consume)
        await cluster.command("rate inf 512")
        with trio.fail_after(300):
            await done.wait()
        await cluster.command("rate 0")
        _, peak = rep.rss_mb()
        dead = len(coord.dead_ranks)
    n = end - warm
    cpu_us = (marks["cpu1"] - marks["cpu0"]) / n * 1e6
    codec_us, raw_us = floor_us(ft.SessionSalt.generate(), list(range(per_relay)),
                                min(frames, 100_000))
    return {
        "ranks": ranks, "relays": relays,
        "frames_per_s": n / (marks["t1"] - marks["t0"]),
        "cpu_us_per_frame": cpu_us,
        "core_frames_per_s": 1e6 / cpu_us,
        "floor_us": codec_us, "raw_floor_us": raw_us,
        "ratio": cpu_us / codec_us, "ratio_raw": cpu_us / raw_us,
        "peak_rss_mb": peak, "dead": dead,
    }


COLUMNS = [
    ("ranks", "ranks", "d"), ("relays", "relays", "d"), ("frames/s (wall)", "frames_per_s", ",.0f"),
    ("coord µs/frame", "cpu_us_per_frame", ".2f"), ("frames/s/core", "core_frames_per_s", ",.0f"),
    ("codec floor µs", "floor_us", ".2f"), ("ratio", "ratio", ".2f"),
    ("raw floor µs", "raw_floor_us", ".2f"), ("ratio raw", "ratio_raw", ".2f"),
    ("peak RSS MB", "peak_rss_mb", ".1f"),
]


async def main(args: argparse.Namespace) -> None:
    load.raise_fd_limit()
    frames = 100_000 if args.quick else 300_000
    reps = args.runs or 3
    print(f"{rep.machine_note()}\ningest: {frames:,} Batch frames per run, {reps} runs per case; "
          f"one load process; consumer: {args.consumer}")
    rows, medians = [], []
    for ranks in args.ranks or (128, 1024):
        runs = [await run_case(ranks, 8, frames, args.consumer == "drain") for _ in range(reps)]
        rows += runs
        medians.append(rep.medians(runs))
    print(rep.table(COLUMNS, medians))
    print("frames/s/core = 1e6 / coordinator CPU µs per frame; ratio = that CPU / codec floor "
          "(open+verify+decode of the same bytes, tight loop, same process)")
    targets = []
    for m in medians:
        r = m["ranks"]
        targets.append(rep.target(f"ingest {r:.0f} ranks: frames/s on one core",
                                  m["core_frames_per_s"], ">=", TARGET_RATE))
        targets.append(rep.target(f"ingest {r:.0f} ranks: ratio to the codec floor", m["ratio"],
                                  "<=", MAX_RATIO))
        targets.append(rep.target(f"ingest {r:.0f} ranks: ranks declared dead", m["dead"], "<=", 0))
    rep.finish("ingest", rows, targets, args.json, medians=medians)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer frames per run")
    p.add_argument("--runs", type=int, default=0, help="runs per case (default 3)")
    p.add_argument("--consumer", choices=("drain", "iter"), default="drain",
                   help="drain: receive_nowait until empty, then wait; iter: async for")
    p.add_argument("--ranks", type=int, action="append", help="only this world (repeatable)")
    p.add_argument("--json", action="store_true", help="last line: one JSON object")
    p.add_argument("--profile", default=None, help="write a cProfile of the coordinator here")
    ns = p.parse_args()
    if ns.profile:
        cProfile.run("trio.run(main, ns)", ns.profile)
    else:
        trio.run(main, ns)
