"""The relay's CPU per frame it forwards upstream (issue 23), for A/B of the relay's writer.

This process runs only relays (the library's ``open_relay``, ``--relays`` of them with
``--per`` ranks each); a peer process (this script with ``--peer``) runs the coordinator and the
ranks. After formation every rank sends ``Batch`` frames at ``--rate`` a second for
``--seconds``, each on its own clock (so the frames reach the relays spread out, as a training
run's do), and the coordinator counts them. The table gives this process's CPU (user + system)
per forwarded frame over that window, rank heartbeats and ``Liveness`` records included: the
same on both sides of an A/B (``PYTHONPATH=<other checkout>``). Before the join the process
freezes its start-up heap (``gc.freeze``), as ``flodl-trio relay`` does.

    .venv/bin/python scripts/bench_relay_upstream.py [--relays 8] [--per 8] [--rate 50]
        [--seconds 4] [--runs 3] [--json]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import subprocess
import sys
import time
from typing import Any

import _report as rep
import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio._gc import freeze_setup


async def peer(args: argparse.Namespace) -> None:
    """The coordinator and the ranks; reports on stdout, one JSON object per line."""
    salt = ft.SessionSalt.from_hex(args.salt)
    world = args.relays * args.per
    bound = await ft.bind_coordinator(("127.0.0.1", 0))
    print(json.dumps({"coordinator": list(bound.address)}), flush=True)
    addrs = json.loads(await trio.to_thread.run_sync(sys.stdin.readline))
    cfg = ft.CoordinatorConfig(world_size=world, formation_timeout=60, shutdown_grace=2)
    per_rank = int(args.rate * args.seconds)
    go = trio.Event()
    received = 0
    all_in = trio.Event()

    async def rank_task(addr: list[Any], rank: int) -> None:
        async with ft.open_rank((addr[0], addr[1]), salt=salt, rank=rank,
                                world_size=world) as ep:
            await go.wait()
            gap = 1.0 / args.rate
            start = trio.current_time() + (rank % 97) * gap / 97  # each on its own clock
            for i in range(per_rank):
                await trio.sleep_until(start + i * gap)
                await ep.send(wire.Batch(rank=rank, batch_ms=1.0, data_ms=0.1, step_count=i,
                                         param_norm=None, batch_loss=0.5))
            await all_in.wait()

    async with trio.open_nursery() as ranks:
        for i, addr in enumerate(addrs):
            for j in range(args.per):
                ranks.start_soon(rank_task, addr, i * args.per + j)
        async with ft.open_coordinator(bound, salt=salt, config=cfg) as coord:
            print(json.dumps({"go": True}), flush=True)
            go.set()
            with trio.move_on_after(args.seconds * 3 + 30):
                async for msg in coord.timing:
                    if isinstance(msg, wire.Batch):
                        received += 1
                        if received == per_rank * world:
                            break
            print(json.dumps({"done": received, "expected": per_rank * world}), flush=True)
            all_in.set()


def one_run(args: argparse.Namespace) -> dict[str, Any]:
    salt = ft.SessionSalt.generate()
    cmd = [sys.executable, __file__, "--peer", "--salt", salt.hex(), "--relays",
           str(args.relays), "--per", str(args.per), "--rate", str(args.rate), "--seconds",
           str(args.seconds)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        return dict(trio.run(drive, args, proc, salt))
    finally:
        proc.wait(timeout=60)


async def drive(args: argparse.Namespace, proc: subprocess.Popen[str],
                salt: ft.SessionSalt) -> dict[str, Any]:
    """Run the relays against the peer ``proc``; this process's CPU over the window."""
    assert proc.stdin is not None and proc.stdout is not None
    stdout, stdin = proc.stdout, proc.stdin

    async def line() -> dict[str, Any]:
        text = await trio.to_thread.run_sync(stdout.readline)
        if not text:
            raise RuntimeError("the peer process ended early")
        return dict(json.loads(text))

    with trio.fail_after(args.seconds * 3 + 90):
        coordinator = tuple((await line())["coordinator"])
        async with trio.open_nursery() as nursery:
            relays: list[Any] = []

            async def relay_task(i: int, ready: trio.Event) -> None:
                ranks = list(range(i * args.per, (i + 1) * args.per))
                async with ft.open_relay(coordinator, salt=salt, host=f"relay-{i}",
                                         ranks=ranks,
                                         world_size=args.relays * args.per) as relay:
                    relays.append((i, relay.rank_address))
                    ready.set()
                    await relay.wait_closed()

            for i in range(args.relays):
                ready = trio.Event()
                nursery.start_soon(relay_task, i, ready)
                await ready.wait()
            addrs = [list(addr) for _, addr in sorted(relays)]
            # As the command line's relay does before it runs (issue 38): the start-up heap out
            # of the collector's reach, so a full collection over it does not land in the join.
            freeze_setup()
            profile = cProfile.Profile() if args.profile else None
            form_cpu0, form_wall0 = time.process_time(), time.monotonic()
            if profile is not None:
                profile.enable()
            stdin.write(json.dumps(addrs) + "\n")
            stdin.flush()
            await line()  # go: formed
            if profile is not None:
                profile.disable()
                profile.dump_stats(args.profile)
            form_cpu = time.process_time() - form_cpu0
            form_wall = time.monotonic() - form_wall0
            cpu0, wall0 = time.process_time(), time.monotonic()
            done = await line()
            cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    frames = int(done["done"])
    return {"relays": args.relays, "per": args.per, "join_ms": 1e3 * form_wall,
            "join_cpu_relay": 1e3 * form_cpu / args.relays, "frames": frames,
            "expected": int(done["expected"]), "frames_s": frames / wall,
            "cpu_pct": 100 * cpu / wall, "us_frame": 1e6 * cpu / max(1, frames)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--relays", type=int, default=8)
    p.add_argument("--per", type=int, default=8, help="ranks per relay")
    p.add_argument("--rate", type=float, default=50.0, help="frames per rank per second")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one run of 2 s")
    p.add_argument("--json", action="store_true")
    p.add_argument("--profile", help="write a cProfile of the relays' join (last run) here")
    p.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--salt", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.peer:
        trio.run(peer, args)
        return
    if args.quick:
        args.runs, args.seconds = 1, 2.0
    print(rep.machine_note())
    runs = [one_run(args) for _ in range(args.runs)]
    row = rep.medians(runs)
    print(rep.table([("relays", "relays", "d"), ("ranks/relay", "per", "d"),
                     ("join ms", "join_ms", ".0f"), ("join CPU ms/relay", "join_cpu_relay", ".3f"),
                     ("frames", "frames", "d"), ("frames/s", "frames_s", ".0f"),
                     ("relay CPU %", "cpu_pct", ".1f"), ("CPU us/frame", "us_frame", ".1f")],
                    [row]))
    print("join: the ranks dial their relays, the relays join the coordinator (this process's "
          "CPU per relay);\nrelay CPU: this process (relays only) over the window, rank "
          "heartbeats and Liveness records included")
    rep.finish("relay_upstream", [row], [
        rep.target("every frame forwarded", min(r["frames"] / r["expected"] for r in runs),
                   ">=", 1.0)], args.json, runs=runs)


if __name__ == "__main__":
    main()
