"""Scale benchmark (SPEC §13): formation time, coordinator RSS and idle CPU at 1k-64k ranks.

Sink relays with 8 ranks each (scripts/_wireload.py, two processes of their own) do the real
handshake; once formed, every relay sends its ranks' liveness as a library relay does (issue
23): one sealed ``Liveness`` record naming its 8 ranks per ``coord.heartbeat_period`` (the
coordinator paces its relays: 5 s from 2,000 relays on), or with ``--load heartbeat`` one
Heartbeat frame per rank per second, the ranks of a relay in one write, which is what a relay
sent before coalescing; and it reads the CoordHeartbeats.
  - formation: from the first relay's dial to ``open_coordinator`` returning;
  - RSS: this process (the coordinator only) after the idle window;
  - idle CPU: this process's CPU time over the idle window / its wall time (heartbeats only);
  - floor, in the same run: bare Trio accepts the same number of relays and does the same
    per-connection handshake work (the library's sans-IO ``CoordinatorHandshake`` driven to
    ``Established``), without any coordinator state.

  - with ``--quiet-heartbeats``: ``CoordinatorConfig.deliver_heartbeats=False`` (the
    coalesced heartbeats refresh liveness and the board, nothing goes to ``coord.timing``);
  - with ``--viewer``: one status page viewer (scripts/_sse_viewer.py, a process of its own)
    reads ``/events`` through the idle window, so idle CPU includes building and sending the
    page's document once a second; the time to build one document is measured too.

    .venv/bin/python scripts/bench_scale.py [--quick] [--json] [--viewer] [--load KIND]
        [--quiet-heartbeats]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _report as rep
import _wireload as load
import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.testing import wait_until

# Targets by world size: formation s (issue 38; issue 23 had 1.5 and 5), coordinator RSS MB and
# idle CPU fraction of a core (issue 23).
LIMITS = {16384: (0.5, 150.0, 0.10), 65536: (2.5, 300.0, 0.25)}


async def floor_formation(relays: int, per_relay: int, procs: int) -> dict[str, float]:
    """Bare Trio completing every relay's handshake (one task per connection, the library's
    sans-IO ``CoordinatorHandshake`` to ``Established``), driven by the same load processes:
    seconds from the first dial until done, this process's CPU per relay (ms) and the load
    processes' CPU per handshake (µs)."""
    salt = ft.SessionSalt.generate()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    address = listeners[0].socket.getsockname()[:2]
    loads = await load.start_load(address, salt, world=relays * per_relay, relays=relays,
                                  per_relay=per_relay, procs=procs)
    done = 0
    all_done = trio.Event()
    done_t = 0.0
    streams: list[trio.abc.Stream] = []

    async def serve(stream: trio.SocketStream) -> None:
        nonlocal done, done_t
        streams.append(stream)
        machine = wire.CoordinatorHandshake(salt, peer="load")
        hello = await load.drive_handshake(stream, machine)
        assert isinstance(hello, wire.HelloReceived), hello
        machine.accept()
        established = await load.drive_handshake(stream, machine)
        assert isinstance(established, wire.Established), established
        done += 1
        if done == relays:
            done_t = time.monotonic()
            all_done.set()

    try:
        async with trio.open_nursery() as nursery:
            for lst in listeners:
                nursery.start_soon(trio.serve_listeners, serve, [lst])
            cpu0 = time.process_time()
            answers = await load.all_command(loads, "dial")
            with trio.fail_after(120):
                await all_done.wait()
            cpu_s = time.process_time() - cpu0
            nursery.cancel_scope.cancel()
    finally:
        for s in streams:
            await trio.aclose_forcefully(s)
        await load.stop_all(loads)
    return {"s": done_t - min(a["go_t"] for a in answers), "cpu_ms": cpu_s * 1000 / relays,
            "load_us": load.dial_cpu_us(answers)}


def document_build_ms(coord: ft.Coordinator, rounds: int = 5) -> tuple[float, int]:
    """Median CPU ms to build and encode the page's document once (CPU, not wall: the load
    processes share the cores), and its size in bytes."""
    times, size = [], 0
    for _ in range(rounds):
        t0 = time.process_time()
        size = len(json.dumps(coord.board(), separators=(",", ":")))
        times.append((time.process_time() - t0) * 1000)
    return sorted(times)[rounds // 2], size


async def run_case(ranks: int, per_relay: int, idle_s: float, procs: int,
                   viewer: bool = False, kind: str = "liveness",
                   deliver: bool = True) -> dict[str, Any]:
    relays = ranks // per_relay
    floor = await floor_formation(relays, per_relay, procs)
    floor_s = floor["s"]
    # deliver_heartbeats only when off: this script also measures a coordinator from before it.
    quiet: dict[str, Any] = {} if deliver else {"deliver_heartbeats": False}
    cfg = ft.CoordinatorConfig(world_size=ranks, formation_timeout=120, handshake_timeout=60,
                               shutdown_grace=10, **quiet)
    async with load.coordinator_under_load(cfg, relays=relays, per_relay=per_relay,
                                           procs=procs, frame=kind,
                                           profile=FORMATION_PROFILE) as cluster, \
            trio.open_nursery() as nursery:
        formation_s = cluster.formation_s
        coord = cluster.coord
        # Relays shed while more than max_pending_handshakes were unauthenticated, re-dialed.
        redials = sum(int(d.get("redials", 0)) for d in cluster.dialed)
        why: dict[str, int] = {}
        for d in cluster.dialed:
            for name, n in d.get("failures", {}).items():
                why[name] = why.get(name, 0) + n
        formation = {"coord_cpu_ms": cluster.formation_cpu_s * 1000 / relays,
                     "redial_causes": " ".join(f"{k}={v}" for k, v in sorted(why.items())),
                     "shed": coord.state()["rejected_handshakes"].get("shed", 0),
                     "load_us": load.dial_cpu_us(cluster.dialed),
                     "floor_cpu_ms": floor["cpu_ms"], "floor_load_us": floor["load_us"]}

        nursery.start_soon(load.drain, coord.timing)
        # The coordinator paces the relays (issue 23): wait until it told them the period its
        # relays call for (it re-paces once per period, so formation may leave an older one).
        rate, timeout = cfg.relay_heartbeat_rate, cfg.heartbeat_timeout
        settled = max(cfg.heartbeat_interval, min(relays / rate, timeout / 4))
        await wait_until(lambda: coord.heartbeat_period == settled, limit=30, step=0.1,
                         what="the coordinator paced its relays")
        period = coord.heartbeat_period
        # A library relay sends one Liveness record per period (its ranks' heartbeats since the
        # last one); --load heartbeat: a relay before coalescing, a frame per rank per second.
        if kind == "liveness":
            beats, per_s = 1, 1 / period
        else:
            beats, per_s = per_relay, float(per_relay)
        idle_s = max(idle_s, 2 * period)  # whole periods: the CoordHeartbeat fan-outs too
        # Formation leaves a full (generation 2) collection due: one pause of 0.2 to 0.9 s at
        # 65,536 ranks that fell in the window in some runs and not in others. It is
        # formation's, once, not the idle cost: taken here, so the window's "GC ms" is the
        # collector's share of the idle traffic only.
        gc.collect()
        await cluster.command(f"seal {beats * int(idle_s + period + 5)}")
        # Spread over the period: relays joined at different moments, so their tickers are too.
        await cluster.command(f"rate {per_s!r} {beats} spread")
        # Settle: a load relay writes its first record one period after its offset, so after
        # two periods every relay has sent a round (and the coordinator built its Heartbeats).
        await trio.sleep(max(1.5, 2 * beats / per_s + 0.5))
        watcher: trio.Process | None = None
        if viewer:
            host, port = coord.address
            watcher = await trio.lowlevel.open_process(
                [sys.executable, str(Path(__file__).with_name("_sse_viewer.py")),
                 f"{host}:{port}", str(idle_s + 1.0)], stdout=subprocess.PIPE)
            await trio.sleep(0.5)  # connected, first document sent
        gc_clock = GcClock()
        before = await cluster.command("report")
        w0, c0 = time.monotonic(), time.process_time()
        if PROFILE is not None:
            PROFILE.enable()
        with gc_clock:
            await trio.sleep(idle_s)
        if PROFILE is not None:
            PROFILE.disable()
        cpu = (time.process_time() - c0) / (time.monotonic() - w0)
        # What the load relays wrote meanwhile (loaded machines make them fall behind): the
        # heartbeats per second the coordinator was actually offered.
        after = await cluster.command("report")
        records_s = sum((a["written"] - b["written"]) / (a["t"] - b["t"])
                        for a, b in zip(after, before, strict=True))
        beats_s = records_s * (per_relay if kind == "liveness" else 1)
        rss, peak = rep.rss_mb()
        dead = len(coord.dead_ranks)
        seen: dict[str, Any] = {}
        if watcher is not None:
            assert watcher.stdout is not None
            out = b""
            with trio.fail_after(10):
                while chunk := await watcher.stdout.receive_some():
                    out += chunk
                await watcher.wait()
            seen = json.loads(out)
        build_ms, doc_bytes = document_build_ms(coord)
        await cluster.command("rate 0")
        nursery.cancel_scope.cancel()
    return {"ranks": ranks, "relays": relays, "period_s": period,
            "formation_ms": formation_s * 1000,
            "floor_ms": floor_s * 1000, "ratio": formation_s / floor_s,
            "rss_mb": rss, "peak_rss_mb": peak, "idle_cpu_pct": cpu * 100, "dead": dead,
            "redials": redials, "viewer_msgs": seen.get("messages", 0),
            "gc_ms": gc_clock.ms, "gc_full": gc_clock.full, "beats_s": beats_s,
            "us_per_beat": cpu * 1e6 / beats_s if beats_s else float("nan"),
            "nominal_cpu_pct": cpu * 100 * ranks / beats_s if beats_s else float("nan"),
            "doc_kb": doc_bytes / 1024, "doc_ms": build_ms, **formation}


PROFILE: cProfile.Profile | None = None  # --profile: the idle windows only
FORMATION_PROFILE: cProfile.Profile | None = None  # --profile-formation: formations only


class GcClock:
    """CPU the cyclic garbage collector took while in the block (it counts in the idle CPU: a
    full collection of the objects formation left can cost a large part of a short window),
    and how many full (generation 2) collections ran."""

    def __init__(self) -> None:
        self.ms = 0.0
        self.full = 0
        self._t0 = 0.0

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.process_time()
            return
        self.ms += (time.process_time() - self._t0) * 1000
        self.full += info.get("generation") == 2

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_gc)


COLUMNS = [
    ("ranks", "ranks", "d"), ("relays", "relays", "d"), ("formation ms", "formation_ms", ".0f"),
    ("floor ms", "floor_ms", ".0f"), ("ratio", "ratio", ".2f"), ("RSS MB", "rss_mb", ".1f"),
    ("period s", "period_s", ".2f"),
    ("idle CPU %", "idle_cpu_pct", ".1f"), ("beats/s", "beats_s", ".0f"),
    ("CPU us/beat", "us_per_beat", ".1f"), ("at 1 beat/s/rank %", "nominal_cpu_pct", ".1f"),
    ("dead", "dead", "d"), ("re-dials", "redials", "d"),
    ("GC ms", "gc_ms", ".0f"), ("full GCs", "gc_full", "d"), ("viewer msgs", "viewer_msgs", "d"),
    ("doc KB", "doc_kb", ".0f"), ("doc CPU ms", "doc_ms", ".1f"),
]


# Formation's cost, per relay: this process's CPU (coordinator; bare Trio for the floor) and the
# load processes' CPU per handshake attempt.
FORMATION_COLUMNS = [
    ("ranks", "ranks", "d"), ("formation ms", "formation_ms", ".0f"),
    ("floor ms", "floor_ms", ".0f"), ("re-dials", "redials", "d"), ("shed", "shed", "d"),
    ("coord CPU ms/relay", "coord_cpu_ms", ".3f"), ("floor CPU ms/relay", "floor_cpu_ms", ".3f"),
    ("load CPU us/handshake", "load_us", ".0f"),
    ("floor load us/handshake", "floor_load_us", ".0f"), ("re-dial causes", "redial_causes", ""),
]


async def main(args: argparse.Namespace) -> None:
    load.raise_fd_limit()
    reps = args.runs or 3
    idle_s = 3.0 if args.quick else 6.0
    worlds = [int(w) for w in args.world] if args.world else [1024, 4096, 16384, 65536]
    print(f"{rep.machine_note()}\nscale: 8 ranks per relay, idle window {idle_s:g} s, {reps} runs "
          f"per case, {args.procs} load processes, load {args.load}"
          + (", heartbeats not delivered" if args.quiet_heartbeats else "")
          + (", one /events viewer" if args.viewer else ""))
    rows, medians = [], []
    for world in worlds:
        runs = [await run_case(world, 8, idle_s, args.procs, args.viewer, args.load,
                               not args.quiet_heartbeats) for _ in range(reps)]
        rows += runs
        medians.append(rep.medians(runs))
    print(rep.table(COLUMNS, medians))
    print(rep.table(FORMATION_COLUMNS, medians))
    print("formation: first dial -> open_coordinator returned; floor: bare Trio accepts + the "
          "same handshake work;\nperiod: the coordinator's heartbeat_period (each relay sends "
          "one Liveness record, and gets one CoordHeartbeat, per period);\nidle CPU: "
          "coordinator process CPU / wall while every relay reports its ranks once a period "
          "(at least two periods);\nbeats/s: rank heartbeats the load relays reported in the "
          "window (they fall behind on a loaded machine); at 1 beat/s/rank: idle CPU scaled to "
          "one reported heartbeat per rank per second")
    targets = []
    for m in medians:
        what = f"scale {m['ranks']:.0f} ranks"
        if m["ranks"] in LIMITS:
            form_s, rss_mb, idle_cpu = LIMITS[int(m["ranks"])]
            targets += [rep.target(f"{what}: formation s", m["formation_ms"] / 1000, "<", form_s),
                        rep.target(f"{what}: coordinator RSS MB", m["rss_mb"], "<", rss_mb),
                        rep.target(f"{what}: idle CPU fraction of a core", m["idle_cpu_pct"] / 100,
                                   "<", idle_cpu)]
        if m["ranks"] == 1024:
            targets.append(rep.target(f"{what}: formation s", m["formation_ms"] / 1000, "<", 0.3))
        targets.append(rep.target(f"{what}: ranks declared dead", m["dead"], "<=", 0))
    rep.finish("scale", rows, targets, args.json, medians=medians)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="shorter idle window")
    p.add_argument("--runs", type=int, default=0, help="runs per case (default 3)")
    p.add_argument("--world", action="append", help="only this world size (repeatable)")
    p.add_argument("--procs", type=int, default=2, help="load processes")
    p.add_argument("--json", action="store_true", help="last line: one JSON object")
    p.add_argument("--viewer", action="store_true",
                   help="one status page viewer reads /events through the idle window")
    p.add_argument("--load", choices=("liveness", "heartbeat"), default="liveness",
                   help="what each relay sends once a second: one Liveness record for its "
                        "ranks (a library relay, issue 23) or one Heartbeat frame per rank "
                        "(a relay before coalescing)")
    p.add_argument("--quiet-heartbeats", action="store_true",
                   help="CoordinatorConfig.deliver_heartbeats=False")
    p.add_argument("--profile", default=None,
                   help="write a cProfile of the coordinator's idle windows here")
    p.add_argument("--profile-formation", default=None,
                   help="write a cProfile of the coordinator's formations (first dial to "
                        "open_coordinator returned) here")
    ns = p.parse_args()
    if ns.profile:
        PROFILE = cProfile.Profile()
    if ns.profile_formation:
        FORMATION_PROFILE = cProfile.Profile()
    trio.run(main, ns)
    if PROFILE is not None:
        PROFILE.dump_stats(ns.profile)
    if FORMATION_PROFILE is not None:
        FORMATION_PROFILE.dump_stats(ns.profile_formation)
