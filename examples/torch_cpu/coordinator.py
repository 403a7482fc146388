"""The coordinator as a process of its own, with its session in a SQLite file, so that it can be
SIGKILLed and started again (``run.py --kill-coordinator`` does both).

    python coordinator.py --listen 127.0.0.1:PORT --salt-hex HEX --store DIR/session.db \\
        --out DIR [--epochs 20] [--batch-size 16]

Started on a store that holds no session, it forms the cohort and runs the reference scheduler
from epoch 0. Started again on the same store (the same command) after the first one died, it
*adopts* the running session: the relays, which kept their ranks connected and training, re-dial
the same address and resume; the scheduler resumes from the last checkpoint the dead coordinator
saved through ``coord.save_checkpoint`` (``coord.checkpoint``), anchors every rank with one
``SyncNow`` and re-forms the process group; work after that checkpoint is kept or run again,
never lost and never counted twice.

It prints ``coordinator <what> t=<monotonic> ...`` lines (``leader``, ``epoch_started``, ``sync``,
``group``, ``dead``, ``rejoined``, ``done``), appends each epoch it closed to
``DIR/coverage.jsonl``, and when the run ends writes ``DIR/summary.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import trio
from run import TRAIN_SAMPLES, WORLD  # the same run settings as the in-process coordinator

import flodl_trio as ft
from flodl_trio.events import Note, RankDeclaredDead, RankRejoined
from flodl_trio.scheduler import SyncScheduler
from flodl_trio.store import SqliteStore


def say(what: str, detail: str = "") -> None:
    print(f"coordinator {what} t={time.monotonic():.6f} {detail}".rstrip(), flush=True)


def write_coverage(path: Path, scheduler: SyncScheduler, written: set[int]) -> None:
    """Append the epochs the scheduler closed since the last call."""
    fresh = [c for c in scheduler.coverage if c.epoch not in written]
    if not fresh:
        return
    with open(path, "a") as out:
        for cov in fresh:
            out.write(json.dumps({"epoch": cov.epoch, "samples": cov.samples, "total": cov.total,
                                  "exact": cov.exactly_once,
                                  "per_rank": {str(r): n for r, n in cov.per_rank.items()}})
                      + "\n")
            written.add(cov.epoch)


async def watch(coord: ft.Coordinator, scheduler: SyncScheduler, out: Path,
                written: set[int]) -> None:
    """Report what happens; record each closed epoch's coverage as soon as it closes."""
    async with coord.timeline.subscribe() as events:
        async for stamped in events.channel:
            event = stamped.event
            if isinstance(event, RankDeclaredDead):
                say("dead", f"rank={event.rank} {event.reason}")
            elif isinstance(event, RankRejoined):
                say("rejoined", f"rank={event.rank}")
            elif isinstance(event, Note) and event.what in ("epoch_started", "sync"):
                say(event.what, f"epoch={event.fields.get('epoch', '-')}")
            elif isinstance(event, Note) and event.what == "process_group_formed":
                say("group", json.dumps(dict(event.fields), separators=(",", ":"), default=str))
            write_coverage(out / "coverage.jsonl", scheduler, written)


async def coordinate(args: argparse.Namespace) -> None:
    out = Path(args.out)
    host, port = args.listen.rsplit(":", 1)
    config = ft.CoordinatorConfig(world_size=WORLD, formation_timeout=180)
    store = SqliteStore(args.store)
    try:
        async with ft.open_coordinator((host, int(port)), salt=ft.SessionSalt.from_hex(
                args.salt_hex), config=config, store=store) as coord:
            say("leader", f"generation={coord.generation} resumed={int(coord.resumed)}")
            scheduler = SyncScheduler(coord, total_samples=TRAIN_SAMPLES,
                                      batch_size=args.batch_size, num_epochs=args.epochs,
                                      checkpoint_every=args.epochs, process_group=True,
                                      reform_timeout=60)
            written: set[int] = set()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch, coord, scheduler, out, written)
                summary = await scheduler.run()
                nursery.cancel_scope.cancel()
            write_coverage(out / "coverage.jsonl", scheduler, written)
            (out / "summary.json").write_text(json.dumps({
                "epochs_completed": summary.epochs_completed, "syncs": summary.syncs,
                "global_step": summary.global_step, "deaths": summary.deaths,
                "resumed": summary.resumed, "first_epoch": summary.first_epoch,
                "generation": coord.generation}))
            say("done", f"epochs={summary.epochs_completed}")
    finally:
        with trio.CancelScope(shield=True):
            await store.aclose()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--listen", required=True, metavar="HOST:PORT")
    p.add_argument("--salt-hex", required=True)
    p.add_argument("--store", required=True, help="the SQLite file of the session")
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="coordinator: %(name)s: %(message)s")
    trio.run(coordinate, args)


if __name__ == "__main__":
    sys.exit(main())
