"""``flodl-trio demo``: a whole local cluster as separate OS processes on loopback.

One coordinator process (driving the SyncScheduler), one relay process per host and one
simulated-rank process per rank. The story comes from the coordinator's timeline file (see
:mod:`flodl_trio.demo._story`): formation, epochs, each death and its cause, each
redistribution; ``--kill-relay HOST@SECONDS`` SIGKILLs a relay process that long after formation
to show the failure path, and ``--restart-relay HOST@SECONDS`` starts that host's relay and rank
processes again that long after the kill, to show it rejoining the running cohort. The temporary
directory of process logs is removed at the end unless ``--keep-logs`` (or the run failed, when
the logs are what one wants to read).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from .._timeouts import clock_time_in
from ..cli._common import CommandFailed, Terminated, UsageError, check_writable
from ..cli._errors import MAX_LINE, shorten
from ..wire import SessionSalt
from ._cluster import LOG_HINT, Cluster
from ._story import Story
from ._watch import Director

START_DEADLINE_S = 30.0


def _parse_kills(specs: list[str], hosts: list[str],
                 option: str = "--kill-relay") -> dict[str, float]:
    kills: dict[str, float] = {}
    for spec in specs:
        host, sep, seconds = spec.partition("@")
        try:
            when = float(seconds)
        except ValueError:
            when = -1.0
        if not sep or host not in hosts or when < 0:
            raise UsageError(f"{option}: expected HOST@SECONDS with HOST one of {hosts}, "
                             f"got {spec!r}")
        if host in kills:  # the demo kills (and restarts) a host once
            raise UsageError(f"{option}: expected each host at most once, got {host} twice "
                             f"({host}@{kills[host]:g} and {spec})")
        kills[host] = when
    return kills


def _parse_restarts(specs: list[str], hosts: list[str],
                    kills: dict[str, float]) -> dict[str, float]:
    restarts = _parse_kills(specs, hosts, "--restart-relay")
    unkilled = sorted(set(restarts) - set(kills))
    if unkilled:
        raise UsageError(f"--restart-relay: expected a host that --kill-relay kills, got "
                         f"{', '.join(unkilled)} (killed: {sorted(kills) or 'none'})")
    return restarts


def _parse_elastic(args: argparse.Namespace, hosts: list[str], kills: dict[str, float]
                   ) -> tuple[dict[str, float], dict[str, float]]:
    """``--add-host`` (the new hosts' names and when) and ``--drain-relay`` (which and when)."""
    drains = _parse_kills(args.drain_relay, hosts, "--drain-relay")
    both = sorted(set(drains) & set(kills))
    if both:
        raise UsageError(f"--drain-relay: expected a host --kill-relay does not kill, got "
                         f"{', '.join(both)}")
    if any(not when >= 0 for when in args.add_host):
        raise UsageError(f"--add-host: expected seconds >= 0, got {args.add_host}")
    added = {f"host-{chr(ord('a') + len(hosts) + i)}": when
             for i, when in enumerate(args.add_host)}
    return added, drains


def run_demo(args: argparse.Namespace) -> int:
    hosts = [f"host-{chr(ord('a') + i)}" if i < 26 else f"host-{i}" for i in range(args.hosts)]
    per = args.ranks_per_host
    if args.hosts < 1 or per < 1 or args.epochs < 1:
        raise UsageError("demo: expected --hosts, --ranks-per-host and --epochs >= 1")
    layout = {h: list(range(i * per, (i + 1) * per)) for i, h in enumerate(hosts)}
    world = args.hosts * per
    kills = _parse_kills(args.kill_relay, hosts)
    restarts = _parse_restarts(args.restart_relay, hosts, kills)
    added, drains = _parse_elastic(args, hosts, kills)
    if args.kill_coordinator is not None and not args.kill_coordinator >= 0:
        raise UsageError(f"--kill-coordinator: expected seconds >= 0, got "
                         f"{args.kill_coordinator!r}")
    if not args.linger >= 0:
        raise UsageError(f"--linger: expected seconds >= 0, got {args.linger!r}")
    if args.timeline:
        check_writable(args.timeline, what="--timeline")
        Path(args.timeline).unlink()
    env = dict(os.environ, FLODL_SALT_HEX=SessionSalt.generate().hex())
    work = Path(tempfile.mkdtemp(prefix="flodl-demo-"))
    logs = work / "logs"
    logs.mkdir()
    timeline = Path(args.timeline) if args.timeline else work / "timeline.jsonl"
    store = f"sqlite:{work / 'session.db'}" if args.kill_coordinator is not None else None
    cluster = Cluster(args, env, logs, timeline, work / "summary.json", store=store)
    if added or drains:  # an elastic world: from the hosts that stay to every host there is
        cluster.elastic(world - per * len(drains), world + per * len(added))
    keep = bool(args.keep_logs)
    print(f"flodl-trio demo: {args.hosts} hosts x {per} ranks = world {world}, {args.epochs} "
          f"epochs of {args.total_samples} samples in batches of {args.batch_size}", flush=True)
    try:
        address = cluster.start(layout, world)
        print(f"coordinator on {address}, {len(cluster.relays)} relay and "
              f"{len(cluster.ranks)} rank processes started", flush=True)
        kept = (f"kept up {args.linger:g} s after the run" if args.linger else
                "--linger S keeps it up S seconds after the run")
        print(f"live page: http://{address}/ (open it in a browser; {kept}; "
              f"/state.json for scripts)", flush=True)
        director = Director(args, cluster, kills, restarts, added=added, drains=drains)
        director.watch(_table)
        code = _conclude(args, cluster, director.story, director.killed, layout)
        keep = keep or code != 0
        return code
    except BaseException as exc:
        keep = keep or not isinstance(exc, KeyboardInterrupt | Terminated | UsageError)
        if not isinstance(exc, Exception):  # Ctrl-C or SIGTERM: say what happens next
            print(f"interrupted: stopping the coordinator, {len(cluster.relays)} relays and "
                  f"{len(cluster.ranks)} ranks", flush=True)
        raise
    finally:
        cluster.stop()
        if keep:
            print(f"process logs kept in {logs}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)


def _table(director: Director) -> Any:
    from rich.table import Table

    story, cluster = director.story, director.cluster
    layout, killed = cluster.layout, director.killed - cluster.restarted
    table = Table(title="flodl-trio demo", min_width=64,
                  caption=story.status_line(cluster.world))
    for column in ("host", "rank", "status"):
        table.add_column(column, justify="right" if column == "rank" else "left")
    colours = {"dead": "red", "exited": "blue", "alive": "green", "starting": "yellow",
               "retired": "magenta"}
    for host, ranks in layout.items():
        for r in ranks:
            state = story.rank_state(r)
            why = f": {story.dead[r]}" if r in story.dead else ""
            table.add_row(host + (" (killed)" if host in killed else ""), str(r),
                          f"[{colours[state]}]{state}[/{colours[state]}]{why}")
    return table


def _stop_the_late(cluster: Cluster, story: Story, layout: dict[str, list[int]]
                   ) -> dict[str, list[int]]:
    """Stop the hosts started again (``--restart-relay``) or added (``--add-host``) that the
    run ended before they were back or joined, saying so; returns the added ones."""
    late = {h for h in cluster.restarted if not set(layout[h]) <= story.rejoined}
    for host in sorted(late):  # restarted, but the run ended before they were back
        print(f"  {host} was restarted but the run ended before its ranks rejoined")
        for p in [cluster.relays[host], *(cluster.ranks[r] for r in layout[host])]:
            p.terminate()
    unjoined = {h: rs for h, rs in cluster.layout.items()  # --add-host, too late to join
                if h not in layout and not set(rs) <= set(story.joined)}
    for host, ranks in unjoined.items():
        print(f"  {host} was started but the run ended before it joined")
        for p in [cluster.relays[host], *(cluster.ranks[r] for r in ranks)]:
            p.terminate()
    return unjoined


def _conclude(args: argparse.Namespace, cluster: Cluster, story: Story, killed: set[str],
              layout: dict[str, list[int]]) -> int:
    assert cluster.coord is not None
    code = cluster.coord.poll()  # None: it keeps the page up (--linger) after its summary
    unjoined = _stop_the_late(cluster, story, layout)
    for p in cluster.children():  # after the final Shutdown they end on their own
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)
    summary = _read_summary(cluster.summary)
    codes = {r: p.poll() for r, p in cluster.ranks.items()}
    if "failed" in summary or "epochs_completed" not in summary:
        # The coordinator failed (a ClusterFailure, ...): no run summary, one line of why.
        print(f"  rank process exit codes: {dict(sorted(codes.items()))}")
        reason = summary.get("failed") or f"the coordinator exited with code {code} and wrote " \
            "no summary"
        room = MAX_LINE - len(f"flodl-trio: demo: the run failed: {LOG_HINT}") - 1
        raise CommandFailed(f"demo: the run failed: {shorten(reason, room)}{LOG_HINT}")
    done = summary.get("epochs_completed")
    lost = story.lost_broadcasts if cluster.coordinators > 1 else summary.get("lost_broadcasts")
    print(f"summary: {done}/{args.epochs} epochs in {_run_time(story, summary)}, "
          f"{summary.get('syncs')} syncs, global step {summary.get('global_step')}, "
          f"{lost} lost broadcasts")
    for m in summary.get("epoch_metrics", []):  # numbered from 1; the whole run's
        loss = m.get("avg_loss")
        print(f"  epoch {m['epoch']}: " + (f"avg loss {loss:.4f}" if loss is not None
                                           else "no rank's metrics reached a coordinator"))
    dead = summary.get("dead_ranks", [])
    finished = len(cluster.ranks) - len(dead) - sum(map(len, unjoined.values()))
    print(f"  ranks: {finished} finished, dead {dead}"
          + (f" (relays SIGKILLed: {', '.join(sorted(killed))})" if killed else "")
          + (f"; {story.restarts_text(layout, cluster.restarted)}, rejoins "
             f"{summary.get('rejoins', {})}" if cluster.restarted else ""))
    print(f"  rank process exit codes: {dict(sorted(codes.items()))}")
    if cluster.world_range is not None:
        print(story.elastic_text(cluster.world_range, summary.get("retired", [])))
    coverage = summary.get("coverage", {})
    if cluster.coordinators > 1:
        print(_failover_text(story, cluster, dead))
        coverage = _coverage_across(story, args.epochs)
    print("  every epoch covered exactly once" if coverage.get("exact") else
          f"  epochs NOT covered exactly once: {coverage.get('inexact')}")
    if args.timeline:
        # scripts/demo installs flodl-trio alone: the plot's matplotlib is an extra.
        needs = "" if importlib.util.find_spec("matplotlib") else (
            " (needs matplotlib, the plot extra: `python -m pip install -e '.[plot]'` in the "
            "clone)")
        print(f"timeline: {args.timeline} ({story.events} events); draw it with "
              f"`flodl-trio plot {args.timeline} -o timeline.png`{needs}")
    inexact = ", an epoch not covered exactly once"
    if code not in (0, None) or done != args.epochs or not coverage.get("exact"):
        raise CommandFailed(f"demo: the run failed: {done}/{args.epochs} epochs, coordinator "
                            f"exit code {code}{'' if coverage.get('exact') else inexact}"
                            f"{LOG_HINT}")
    print("run completed")
    if code is None:
        _linger(args, cluster)
    return 0


def _run_time(story: Story, summary: dict[str, Any]) -> str:
    """How long the epochs took: the scheduler's run; after an adoption, from formation to the
    last epoch on the story's clock, and the adopting coordinator's part."""
    elapsed = float(summary.get("elapsed_s", 0.0))
    formed, last = story.formed_at_ms, story.last_aggregated_ms
    if not summary.get("resumed") or formed is None or last is None:
        return f"{elapsed:.1f} s"
    first, done = int(summary.get("first_epoch", 0)) + 1, int(summary["epochs_completed"])
    after = (f"epoch {done}" if first == done else f"epochs {first}-{done}" if first < done
             else "no epoch")
    return (f"{(last - formed) / 1000.0:.1f} s from formation to the last epoch ({after} run "
            f"by the adopting coordinator, in {elapsed:.1f} s)")


def _linger(args: argparse.Namespace, cluster: Cluster) -> None:
    """``--linger``: the coordinator keeps the live page up; wait for it (Ctrl-C ends it)."""
    assert cluster.coord is not None
    print(f"live page: http://{cluster.address}/ stays up until "
          f"{clock_time_in(args.linger)} (--linger {args.linger:g}; Ctrl-C ends it sooner)",
          flush=True)
    try:
        cluster.coord.wait(timeout=args.linger + START_DEADLINE_S)
    except (KeyboardInterrupt, Terminated, subprocess.TimeoutExpired):
        pass  # the run is over and told: stop() ends the coordinator


def _failover_text(story: Story, cluster: Cluster, dead: list[int]) -> str:
    """The summary's line on the coordinator's failover: the adoption, the relays that
    resumed, and whether any rank was declared dead."""
    hosts = sorted(cluster.layout)
    waiting = [h for h in hosts if h not in story.resumed]
    adopted = (f"adopted as generation {story.generation}" if story.generation is not None
               else "NOT adopted (no adoption in the timeline)")
    resumed = (f"relays resumed: {', '.join(h for h in hosts if h in story.resumed) or 'none'}"
               + (f" (not: {', '.join(waiting)})" if waiting else ""))
    deaths = "no rank declared dead" if not dead else f"ranks declared dead: {dead}"
    return f"  coordinator SIGKILLed and restarted: {adopted}; {resumed}; {deaths}"


def _coverage_across(story: Story, epochs: int) -> dict[str, Any]:
    """The run's coverage from the ``epoch_covered`` notes of every coordinator (the last
    summary holds only the epochs its own scheduler closed)."""
    inexact = [{"epoch": e + 1, "exactly_once": story.epoch_coverage.get(e, "not recorded")}
               for e in range(epochs) if story.epoch_coverage.get(e) is not True]
    return {"exact": not inexact, "inexact": inexact}


def _read_summary(path: Path) -> dict[str, Any]:
    """The coordinator's ``--summary-file``, or ``{}`` when it wrote none (or only part)."""
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}
