"""One training run on loopback: this process is the coordinator (running the reference
scheduler), two relay processes (host-a: ranks 0, 1; host-b: ranks 2, 3) and four PyTorch rank
processes (``rank.py``).

    python run.py --out DIR [--kill [--restart] | --kill-coordinator | --grow | --drain]
        [--epochs 20] [--result FILE]

With ``--kill``, once epoch ``--kill-epoch`` has run a few syncs, host-b's relay and its two
ranks are SIGKILLed. The coordinator declares ranks 2 and 3 dead at once, the scheduler hands
their unprocessed samples to ranks 0 and 1 (``ExtendPartition``) and re-forms the process group
(``RequestNewNcclId`` to rank 0, ``NewNcclSession`` to ranks 0 and 1), and the survivors finish
the run with a gloo group of two.

With ``--restart`` too, host-b's relay and ranks are started again ``--restart-after`` seconds
after the kill: the relay rejoins the running cohort (its ranks were all dead), ranks 2 and 3
are alive again, and at the next epoch the scheduler re-forms the group of four with them (they
take rank 0's parameters) and gives them work: the run ends with four ranks, as it began.

With ``--kill-coordinator`` the coordinator is a process of its own instead (``coordinator.py``,
with its session in ``DIR/session.db``, a SQLite store); a few syncs into epoch ``--kill-epoch``
it is SIGKILLed and started again at once with the same command (``kill_coordinator.py``). The
relays keep their ranks connected and training meanwhile, re-dial and resume; the new coordinator
adopts the session and its scheduler resumes from the last checkpoint: no rank dies, and every
epoch is still covered exactly once.

With ``--grow`` the world is elastic, 4 to 6 ranks (docs/elastic.rst): it forms with host-a and
host-b, and a few syncs into epoch 1 a third host, host-c (ranks 4, 5), is
started; it joins the running cohort, and at the next epoch the scheduler re-forms the process
group with six ranks (the newcomers take rank 0's parameters) and repartitions the data over
them. Nobody is restarted.

With ``--drain`` (a world of 2 to 4 ranks) host-b's relay gets SIGTERM a few syncs into epoch
``--kill-epoch`` instead: it drains, its ranks answer one more sync and leave, the coordinator
retires them (no death), their remainder of the epoch goes to ranks 0 and 1, and the group is
re-formed with two.

Prints the scheduler's accounting (each epoch's samples, who processed them, whether they were
covered exactly once), the deaths, the held-out accuracy and the wall time; ``--result`` writes
the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import trio

import flodl_trio as ft
from flodl_trio.events import Note, RankJoined, RankRejoined, RankRetired
from flodl_trio.scheduler import SyncScheduler

HERE = Path(__file__).resolve().parent
HOSTS = {"host-a": [0, 1], "host-b": [2, 3]}
GROWN = {"host-c": [4, 5]}  # the host --grow adds
WORLD = 4
TRAIN_SAMPLES = 1347  # load_digits: 1797 samples, 25 % held out (rank.py makes the split)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def world_of(args: argparse.Namespace) -> int:
    """The rank id space: six with the host --grow adds."""
    return WORLD + 2 if args.grow else WORLD


async def after_syncs(timeline: ft.Timeline, epoch: int, syncs: int) -> int:
    """Return once ``epoch`` has started and run ``syncs`` syncs (how many it counted)."""
    seen = 0
    started = False
    async with timeline.subscribe() as events:
        async for stamped in events.channel:
            event = stamped.event
            if not isinstance(event, Note):
                continue
            if event.what == "epoch_started" and event.fields.get("epoch") == epoch:
                started = True
            elif event.what == "sync" and started:
                seen += 1
                if seen >= syncs:
                    break
    return seen


async def kill_host_b_mid_epoch(timeline: ft.Timeline, procs: dict[str, trio.Process],
                                epoch: int, syncs: int, killed: dict[str, Any]) -> None:
    """SIGKILL host-b's relay and ranks once ``epoch`` has started and run ``syncs`` syncs."""
    seen = await after_syncs(timeline, epoch, syncs)
    for name in ("relay host-b", "rank 2", "rank 3"):
        procs[name].send_signal(signal.SIGKILL)
    killed.update(at=time.monotonic(), epoch=epoch, after_syncs=seen)
    print(f"SIGKILLed relay host-b and ranks 2, 3 in epoch {epoch} after {seen} syncs",
          flush=True)


async def start_host(nursery: trio.Nursery, procs: dict[str, trio.Process], host: str,
                     coordinator: str, salt: ft.SessionSalt, args: argparse.Namespace) -> None:
    """Start ``host``'s relay and rank processes (again, after a kill: the same command)."""
    py, port, ranks = sys.executable, free_port(), {**HOSTS, **GROWN}[host]
    world = str(world_of(args))
    procs[f"relay {host}"] = await nursery.start(child, [
        py, str(HERE / "relay.py"), "--coordinator", coordinator, "--salt-hex", salt.hex(),
        "--host", host, "--ranks", ",".join(map(str, ranks)), "--world-size", world,
        "--rank-port", str(port)])
    for rank in ranks:
        procs[f"rank {rank}"] = await nursery.start(child, [
            py, str(HERE / "rank.py"), "--relay", f"127.0.0.1:{port}", "--salt-hex", salt.hex(),
            "--rank", str(rank), "--world-size", world, "--out", str(args.out),
            "--batch-size", str(args.batch_size), "--step-ms", str(args.step_ms), "--lr",
            str(args.lr)])


async def kill_and_restart(timeline: ft.Timeline, procs: dict[str, trio.Process],
                           killed: dict[str, Any], coordinator: str, salt: ft.SessionSalt,
                           args: argparse.Namespace, nursery: trio.Nursery) -> None:
    await kill_host_b_mid_epoch(timeline, procs, args.kill_epoch, args.kill_after_syncs, killed)
    if not args.restart:
        return
    await trio.sleep(args.restart_after)
    await start_host(nursery, procs, "host-b", coordinator, salt, args)
    killed["restarted_at"] = time.monotonic()
    print(f"restarted relay host-b and ranks 2, 3 {args.restart_after:g}s after the kill",
          flush=True)


async def grow_or_drain(timeline: ft.Timeline, procs: dict[str, trio.Process],
                        changed: dict[str, Any], coordinator: str, salt: ft.SessionSalt,
                        args: argparse.Namespace, nursery: trio.Nursery) -> None:
    """``--grow``: start host-c a few syncs into epoch 1; ``--drain``: SIGTERM host-b's relay a
    few syncs into epoch ``--kill-epoch`` (it drains)."""
    # A new host's processes take seconds to start (torch imports): it is started in epoch 1,
    # so that it joins while the run has epochs left.
    epoch = 1 if args.grow else args.kill_epoch
    seen = await after_syncs(timeline, epoch, args.kill_after_syncs)
    changed.update(at=time.monotonic(), epoch=epoch, after_syncs=seen)
    if args.grow:
        await start_host(nursery, procs, "host-c", coordinator, salt, args)
        print(f"started host-c (ranks 4, 5) in epoch {epoch} after {seen} syncs: it joins the "
              "running cohort", flush=True)
    else:
        procs["relay host-b"].send_signal(signal.SIGTERM)
        print(f"SIGTERMed relay host-b in epoch {epoch} after {seen} syncs: it drains",
              flush=True)


def coordinator_config(args: argparse.Namespace) -> ft.CoordinatorConfig:
    """A fixed world of 4; 4 to 6 ranks with --grow, 2 to 4 with --drain (docs/elastic.rst)."""
    if args.grow:
        return ft.CoordinatorConfig(world_size=WORLD + 2, min_world_size=WORLD,
                                    formation_timeout=180)
    if args.drain:
        return ft.CoordinatorConfig(world_size=WORLD, min_world_size=2, formation_timeout=180)
    return ft.CoordinatorConfig(world_size=WORLD, formation_timeout=180)


async def run(args: argparse.Namespace) -> tuple[Any, Any, float, dict[str, Any], ft.Timeline]:
    out = Path(args.out)
    salt = ft.SessionSalt.generate()
    timeline = ft.Timeline(jsonl_path=str(out / "timeline.jsonl"))
    procs: dict[str, trio.Process] = {}
    killed: dict[str, Any] = {}
    started = time.monotonic()
    cfg = coordinator_config(args)
    async with trio.open_nursery() as nursery:
        bound = await ft.bind_coordinator(("127.0.0.1", 0))
        coordinator = f"{bound.address[0]}:{bound.address[1]}"
        for host in HOSTS:
            await start_host(nursery, procs, host, coordinator, salt, args)
        async with ft.open_coordinator(bound, salt=salt, config=cfg, timeline=timeline) as coord:
            formed = time.monotonic()
            print(f"formed: {coord.current_world} ranks over {len(coord.relays)} relays in "
                  f"{formed - started:.1f}s", flush=True)
            if args.kill or args.restart:
                nursery.start_soon(kill_and_restart, timeline, procs, killed, coordinator,
                                   salt, args, nursery)
            elif args.grow or args.drain:
                nursery.start_soon(grow_or_drain, timeline, procs, killed, coordinator, salt,
                                   args, nursery)
            scheduler = SyncScheduler(coord, total_samples=TRAIN_SAMPLES,
                                      batch_size=args.batch_size, num_epochs=args.epochs,
                                      checkpoint_every=args.epochs, process_group=True,
                                      reform_timeout=60)
            summary = await scheduler.run()
            coverage = scheduler.coverage
        survivors = [proc for name, proc in procs.items() if name.startswith("rank")
                     and not (killed and "restarted_at" not in killed
                              and name in ("rank 2", "rank 3"))]
        with trio.fail_after(60):  # the ranks evaluate, write their result and exit
            for proc in survivors:
                await proc.wait()
        nursery.cancel_scope.cancel()
    return summary, coverage, time.monotonic() - started, killed, timeline


async def child(command: list[str], *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """A child process whose exit status is its own business (the killed ones die of it)."""
    await trio.run_process(command, check=False, task_status=task_status)


def from_timeline(timeline: ft.Timeline) -> tuple[list[dict[str, Any]], list[int]]:
    """The process groups formed and the ranks that rejoined, from the coordinator's timeline."""
    groups = [dict(e.fields) for e in timeline.events()
              if isinstance(e, Note) and e.what == "process_group_formed"]
    return groups, sorted(e.rank for e in timeline.events() if isinstance(e, RankRejoined))


def elastic_from(timeline: ft.Timeline) -> dict[str, list[int]]:
    """The ranks that joined the running cohort and those retired, from the timeline."""
    events = timeline.events()
    return {"joined": sorted(e.rank for e in events if isinstance(e, RankJoined)),
            "retired": sorted(e.rank for e in events if isinstance(e, RankRetired))}


def report(summary: Any, coverage: Any, results: dict[int, dict[str, Any]], wall: float,
           killed: dict[str, Any], groups: list[dict[str, Any]],
           rejoined: list[int], elastic: dict[str, list[int]] | None = None) -> dict[str, Any]:
    elastic = elastic or {"joined": [], "retired": []}
    print(f"epochs completed: {summary.epochs_completed}, syncs {summary.syncs}, global step "
          f"{summary.global_step}")
    for rank, reason in summary.deaths.items():
        print(f"  rank {rank} declared dead: {reason}")
    for g in groups:
        print(f"  process group {g['generation']}: ranks {g['ranks']}")
    if rejoined:
        print(f"  ranks {rejoined} rejoined the running cohort")
    if elastic["joined"]:
        print(f"  ranks {elastic['joined']} joined the running cohort (the world grew)")
    if elastic["retired"]:
        print(f"  ranks {elastic['retired']} drained and were retired (not dead)")
    exact = True
    for cov in coverage:
        exact = exact and cov.exact
        who = ", ".join(f"rank {r}: {n}" for r, n in sorted(cov.per_rank.items()))
        print(f"  epoch {cov.epoch}: {cov.samples}/{cov.total} samples, covered exactly once: "
              f"{'yes' if cov.exact else 'NO'} ({who})")
    accuracies = {r: res["accuracy"] for r, res in results.items()}
    left = {r for r, res in results.items() if res.get("ended_with") == "Drain"}
    print("held-out accuracy by rank: " + ", ".join(
        f"rank {r}: {a:.2%}" + (" (when it left)" if r in left else "")
        for r, a in sorted(accuracies.items())))
    accuracy = accuracies[min(accuracies)] if accuracies else 0.0
    print(f"wall time: {wall:.1f}s")
    return {"accuracy": accuracy, "accuracies": accuracies, "wall_s": wall,
            "epochs": summary.epochs_completed, "deaths": dict(summary.deaths),
            "groups": groups, "covered_exactly_once": exact, "killed": killed,
            "rejoined": rejoined, **elastic,
            "coverage": [[c.epoch, c.samples, c.total, c.exact,
                          {str(k): v for k, v in c.per_rank.items()}]
                         for c in coverage]}


def main() -> None:
    p = argparse.ArgumentParser(description="the torch_cpu example: one run")
    p.add_argument("--out", required=True)
    p.add_argument("--kill", action="store_true", help="SIGKILL host-b mid-epoch")
    p.add_argument("--restart", action="store_true",
                   help="SIGKILL host-b mid-epoch, then start it again: it rejoins")
    p.add_argument("--kill-coordinator", action="store_true",
                   help="the coordinator runs as a process with a SQLite session store; it is "
                        "SIGKILLed mid-epoch and started again at once: it adopts the run")
    p.add_argument("--grow", action="store_true",
                   help="an elastic world of 4 to 6: host-c (ranks 4, 5) joins mid-epoch")
    p.add_argument("--drain", action="store_true",
                   help="a world of 2 to 4: host-b's relay gets SIGTERM mid-epoch and drains")
    p.add_argument("--restart-after", type=float, default=1.0, metavar="S",
                   help="seconds between the kill and the restart")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--step-ms", type=float, default=10.0)
    p.add_argument("--lr", type=float, default=0.025, help="the ranks' learning rate per replica")
    p.add_argument("--kill-epoch", type=int, default=3)
    p.add_argument("--kill-after-syncs", type=int, default=4)
    p.add_argument("--result", help="write the outcome as JSON here")
    args = p.parse_args()
    if sum((args.kill or args.restart, args.kill_coordinator, args.grow, args.drain)) > 1:
        p.error("choose one of --kill/--restart, --kill-coordinator, --grow and --drain")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for pattern in ("rank-*.json", "session.db*", "coverage.jsonl", "summary.json"):
        for stale in out.glob(pattern):
            stale.unlink()
    if args.kill_coordinator:
        from kill_coordinator import run_with_coordinator_killed

        summary, coverage, wall, killed, groups, rejoined = trio.run(
            run_with_coordinator_killed, args)
        elastic = None
    else:
        summary, coverage, wall, killed, timeline = trio.run(run, args)
        groups, rejoined = from_timeline(timeline)
        elastic = elastic_from(timeline)
    results = {int(p.stem.split("-")[1]): json.loads(p.read_text())
               for p in sorted(out.glob("rank-*.json"))}
    outcome = report(summary, coverage, results, wall, killed, groups, rejoined, elastic)
    if args.result:
        Path(args.result).write_text(json.dumps(outcome, indent=2))
    sys.exit(0 if outcome["covered_exactly_once"] and outcome["accuracy"] > 0 else 1)


if __name__ == "__main__":
    main()
