"""One coordinator process with a session store, driving a SyncScheduler (used by
scripts/bench_coordinator_failover.py and examples/torch_cpu/run.py, which SIGKILL, SIGSTOP and
restart it).

    python scripts/_failover_coord.py --listen 127.0.0.1:PORT --salt-hex HEX \\
        --store sqlite:/tmp/x/session.db --world-size 4 --samples 640 --batch-size 8 \\
        --epochs 4 --out DIR

Run it again on the same store (the same command) and it adopts the running session: the
scheduler resumes from ``coord.checkpoint``. Started while another process leads the store, it is
a standby: it binds its port, then waits in ``store.acquire`` until that leadership ends.

It prints one line per thing the parent waits for, flushed, with ``time.monotonic()`` (the same
clock in every process of the machine):

    coord listening t=... pid=...
    coord leader t=... generation=G resumed=0|1
    coord epoch_started t=... epoch=E
    coord sync t=... global_step=S
    coord dead t=... rank=R reason...
    coord done t=... epochs=N
    coord deposed t=... LeadershipLost: ...
    coord ended t=... SessionEnded: ...     (a standby whose leader's run ended: exit 0)

and appends to ``DIR/coverage.jsonl`` one line per epoch it closed (the scheduler's
:class:`~flodl_trio.scheduler.EpochCoverage`, with the generation), written *before* the
checkpoint that records the epoch as closed is saved: an epoch the next coordinator does not run
again is always in the file.

``SIGUSR1`` makes it act as a deposed leader that does not know it yet: it broadcasts
``SetGlobalStep(DEPOSED_MARK)`` and then ``ShutdownWithSave(REDUCE_STALL)``, which no healthy run
of this script sends; a rank that logs either accepted a deposed coordinator's record.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.events import Note, RankDeclaredDead
from flodl_trio.scheduler import SyncScheduler
from flodl_trio.store import open_store

DEPOSED_MARK = 987_654_321  # the SetGlobalStep value of a deposed coordinator's broadcast


def say(what: str, detail: str = "") -> None:
    print(f"coord {what} t={time.monotonic():.6f}" + (f" {detail}" if detail else ""),
          flush=True)


def coverage_line(cov: Any, generation: int) -> str:
    return json.dumps({
        "generation": generation, "epoch": cov.epoch, "total": cov.total,
        "samples": cov.samples, "gaps": cov.gaps, "overlaps": cov.overlaps,
        "exactly_once": cov.exactly_once,
        "per_rank": {str(r): n for r, n in sorted(cov.per_rank.items())},
    })


class CoverageFile:
    """Appends each epoch the scheduler closed, once, to ``path``."""

    def __init__(self, path: Path, generation: int) -> None:
        self.path = path
        self.generation = generation
        self.written: set[int] = set()

    def flush(self, scheduler: SyncScheduler) -> None:
        fresh = [c for c in scheduler.coverage if c.epoch not in self.written]
        if not fresh:
            return
        with open(self.path, "a") as out:
            for cov in fresh:
                out.write(coverage_line(cov, self.generation) + "\n")
                self.written.add(cov.epoch)
            out.flush()
            os.fsync(out.fileno())


async def watch(coord: ft.Coordinator) -> None:
    """Print the timeline events the parent chooses its kill moment by."""
    async with coord.timeline.subscribe() as events:
        async for stamped in events.channel:
            event = stamped.event
            if isinstance(event, RankDeclaredDead):
                say("dead", f"rank={event.rank} {event.reason}")
            elif isinstance(event, Note) and event.what in ("epoch_started", "sync"):
                say(event.what, " ".join(f"{k}={v}" for k, v in sorted(event.fields.items())
                                         if isinstance(v, int | str)))


async def act_deposed(coord: ft.Coordinator) -> None:
    """On SIGUSR1: broadcast the mark, then tell everyone to stop (each may fail: deposed)."""
    with trio.open_signal_receiver(signal.SIGUSR1) as signals:
        async for _ in signals:
            say("deposed_attempt")
            for attempt in ("broadcast", "shutdown"):
                try:
                    if attempt == "broadcast":
                        await coord.broadcast_control(wire.SetGlobalStep(global_step=DEPOSED_MARK))
                    else:
                        await coord.shutdown_with_save(ft.SaveReason.REDUCE_STALL)
                    say("deposed_sent", attempt)  # from its own point of view
                except ft.FlodlError as exc:
                    say("deposed_refused", f"{type(exc).__name__}: {exc}")
            return


async def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    host, _, port = args.listen.rpartition(":")
    store = open_store(args.store, ttl=args.ttl)
    cfg = ft.CoordinatorConfig(world_size=args.world_size, formation_timeout=20,
                               resume_timeout=args.resume_timeout,
                               heartbeat_timeout=args.heartbeat_timeout)
    salt = ft.SessionSalt.from_hex(args.salt_hex)
    bound = await ft.bind_coordinator((host, int(port)))
    say("listening", f"pid={os.getpid()} port={bound.address[1]}")
    try:
        async with ft.open_coordinator(bound, salt=salt, config=cfg, store=store) as coord:
            say("leader", f"generation={coord.generation} resumed={int(coord.resumed)}")
            coverage = CoverageFile(out / "coverage.jsonl", coord.generation)
            scheduler = SyncScheduler(coord, total_samples=args.samples,
                                      batch_size=args.batch_size, num_epochs=args.epochs)
            save = coord.save_checkpoint

            async def save_after_coverage(checkpoint: Mapping[str, Any], **kw: Any) -> None:
                coverage.flush(scheduler)  # before the checkpoint says the epoch closed
                await save(checkpoint, **kw)

            coord.save_checkpoint = save_after_coverage  # type: ignore[method-assign]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch, coord)
                nursery.start_soon(act_deposed, coord)
                summary = await scheduler.run()
                coverage.flush(scheduler)
                nursery.cancel_scope.cancel()
            say("done", f"epochs={summary.epochs_completed} deaths={sorted(summary.deaths)}")
    except ft.LeadershipLost as exc:
        say("deposed", f"LeadershipLost: {exc}")
        return 3
    except ft.SessionEnded as exc:  # a standby: the run it waited for is over
        say("ended", f"SessionEnded: {exc}")
        return 0
    finally:
        with trio.CancelScope(shield=True):
            await store.aclose()
    return 0


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT (a loopback address)")
    parser.add_argument("--salt-hex", required=True)
    parser.add_argument("--store", required=True, help="sqlite:PATH or etcd://HOST:PORT/PREFIX")
    parser.add_argument("--ttl", type=float, default=1.0, help="etcd lease TTL, seconds")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--samples", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--resume-timeout", type=float, default=10.0)
    parser.add_argument("--heartbeat-timeout", type=float, default=10.0)
    parser.add_argument("--out", required=True, help="directory of coverage.jsonl")
    parser.add_argument("--log-level", default="ERROR")
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level.upper(), format="%(name)s: %(message)s")
    try:
        return trio.run(run, args)
    except ft.FlodlError as exc:
        say("failed", f"{type(exc).__name__}: {exc}")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(cli())
