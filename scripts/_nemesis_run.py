"""One round of a nemesis run (scripts/nemesis.py): start the cluster, run a schedule of faults
against it, wait (bounded) for the run to end and every process to exit, stop everything by
PID, collect the logs and check the history.

A round records its history (:class:`History`): what the nemesis did and observed, then what
the processes logged (scripts/_nemesis_logs.py); the checker (scripts/_nemesis_checker.py)
judges it.
"""

from __future__ import annotations

import math
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _nemesis_checker as checker
import _nemesis_faults as faults
import _nemesis_logs as logs
import attrs
import trio
from _nemesis_cluster import Cluster
from _nemesis_layout import Layout, Timings
from _nemesis_procs import fd_count, session_leftovers

SAMPLES_PER_S = 300.0      # the cluster's pace without faults: the run outlasts the window
TAIL_S = 100.0             # after the window: the longest wait for the next epoch to close
EXIT_WAIT_S = 20.0         # after the run ended: relays and ranks exit on their own
CLEAN_EPOCHS = 2           # the run's last epochs: no fault starts once they began


class History:
    """What a round recorded, in order; every entry has ``t`` (wall clock) and ``type``."""

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self.events: list[dict[str, Any]] = []

    def record(self, entry_type: str, /, **fields: Any) -> None:
        self.events.append({"t": round(time.time(), 6), "type": entry_type, **fields})


def layout_for(minutes: float, hosts_down: int) -> Layout:
    """Enough epochs that the run outlasts the fault window even at the pace of a run without
    faults (the faults then last the whole window; the epochs left after it run clean); the
    elastic world's MIN from how many hosts may be down at once."""
    base = Layout()
    epochs = max(4, math.ceil(minutes * 60 * SAMPLES_PER_S / base.total_samples))
    return Layout(epochs=epochs, hosts_down=hosts_down)


async def drive(cluster: Cluster, nemesis: faults.Nemesis, window: float) -> bool:
    """Start the cluster, run the schedule, wait (bounded) for the run's end and exits.
    Returns True when SIGTERM stopped it (everything is stopped by the caller either way)."""
    terminated = trio.Event()
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async with trio.open_nursery() as outer:
            outer.start_soon(_stop_on_signal, signals, terminated, outer.cancel_scope)
            await _drive(cluster, nemesis, window)
            outer.cancel_scope.cancel()
    return terminated.is_set()


async def _stop_on_signal(signals: Any, terminated: trio.Event,
                          scope: trio.CancelScope) -> None:
    async for _ in signals:
        terminated.set()
        scope.cancel()
        return


async def _drive(cluster: Cluster, nemesis: faults.Nemesis, window: float) -> None:
    async with trio.open_nursery() as nursery:
        await cluster.start(nursery)
        nursery.start_soon(cluster.supervise)
        nursery.start_soon(cluster.observe)
        stop = trio.Event()
        nursery.start_soon(quiet_near_the_end, cluster, stop)
        with trio.move_on_after(window + 60.0):
            await nemesis.run(stop)
        cluster.record("schedule_end", injected=len(nemesis.injected),
                       skipped=len(nemesis.skipped))
        if await wait_for_end(cluster):
            await settle(cluster)
        else:
            cluster.record("run_timeout", seconds=TAIL_S, epochs_closed=cluster.epochs_closed)
        nursery.cancel_scope.cancel()


async def wait_for_end(cluster: Cluster) -> bool:
    """Wait for the run's end as long as it progresses: at most ``TAIL_S`` without an epoch
    closing (a long window's faults leave more epochs than a fixed tail could run). Bounded by
    ``TAIL_S`` per epoch left. Returns False when the run stopped progressing."""
    closed, deadline = cluster.epochs_closed, trio.current_time() + TAIL_S
    while not cluster.finished.is_set():
        if cluster.epochs_closed != closed:
            closed, deadline = cluster.epochs_closed, trio.current_time() + TAIL_S
        if trio.current_time() >= deadline:
            return False
        with trio.move_on_after(0.5):
            await cluster.finished.wait()
    return True


async def quiet_near_the_end(cluster: Cluster, stop: trio.Event) -> None:
    """Set ``stop`` once the run ended or its last ``CLEAN_EPOCHS`` epochs began: they run
    without faults, so that the run's end is not one more fault's recovery."""
    last = cluster.layout.epochs - CLEAN_EPOCHS
    while not cluster.finished.is_set() and cluster.epochs_closed < last:  # noqa: ASYNC110 - read from a child's output
        await trio.sleep(0.2)
    cluster.record("quiet", epochs_closed=cluster.epochs_closed)
    stop.set()


async def settle(cluster: Cluster) -> None:
    """After the run ended, its relays and ranks and the coordinator that ended it should exit
    on their own (bounded), and the standby exit or go on waiting for a leadership (bounded by
    its ``resume_timeout`` and more: a standby that adopted the finished run fails after it);
    whatever still runs then is recorded and stopped with SIGTERM."""
    limit = trio.current_time() + EXIT_WAIT_S + cluster.timings.resume_timeout
    while trio.current_time() < limit and cluster.procs.running():  # noqa: ASYNC110 - child processes
        await trio.sleep(0.2)
    late = cluster.procs.running()
    for proc in late:
        cluster.record("still_running", name=proc.name, role=proc.role, pid=proc.pid)
        proc.signal(signal.SIGTERM)
    with trio.move_on_after(5.0):
        while cluster.procs.running():  # noqa: ASYNC110 - child processes
            await trio.sleep(0.1)
    await trio.sleep(0.3)  # the supervisor records the last exits


@attrs.frozen
class Round:
    """One round's settings: its seed, fault window, kinds and how many hosts may be down."""

    index: int
    seed: int
    minutes: float
    kinds: tuple[faults.Kind, ...]
    hosts_down: int
    keep_logs: bool


def run_round(spec: Round) -> tuple[History, checker.Report, bool]:
    """Run one round in a temporary directory, removed on every way out unless kept: asked
    to (``--keep-logs``), or the round broke an invariant (its logs are what explains it, and
    a rare one may not come again on the same seed)."""
    timings = Timings()
    schedule = faults.plan(spec.seed, spec.minutes * 60, spec.kinds, timings)
    history = History(spec.index)
    history.record("config", seed=spec.seed, minutes=spec.minutes,
                   kinds=[k.name for k in spec.kinds], max_hosts_down=spec.hosts_down,
                   timings={"scale": timings.scale,
                            "heartbeat_timeout": timings.heartbeat_timeout,
                            "resume_timeout": timings.resume_timeout, "grace": timings.grace,
                            "lease_ttl": timings.lease_ttl,
                            "coord_liveness": timings.coord_liveness,
                            "rank_liveness": timings.rank_liveness,
                            "handshake": timings.handshake,
                            "join_window": timings.join_window},
                   schedule=[attrs.asdict(p) for p in schedule])
    root = Path(tempfile.mkdtemp(prefix="flodl-nemesis-"))
    report: checker.Report | None = None
    try:
        interrupted = _run_in(root, spec, history, schedule)
        report = checker.check(history.events)
    finally:
        if spec.keep_logs or (report is not None and report.violations):
            print(f"round {spec.index}: logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return history, report, interrupted


def _run_in(root: Path, spec: Round, history: History,
            schedule: list[faults.Planned]) -> bool:
    """Run the cluster and the schedule, stop everything, collect the logs; True when
    interrupted (Ctrl-C)."""
    driver_fds = fd_count()
    layout = layout_for(spec.minutes, spec.hosts_down)
    cluster = Cluster(root, Timings(), layout, history.record)
    history.record("layout", **attrs.asdict(layout), world=layout.world,
                   min_world=layout.min_world, max_world=layout.max_world)
    nemesis = faults.Nemesis(cluster, schedule, history.record, hosts_down=spec.hosts_down)
    interrupted = False
    try:
        interrupted = trio.run(drive, cluster, nemesis, spec.minutes * 60)
    except KeyboardInterrupt:
        interrupted = True
    except BaseExceptionGroup as group:
        if group.subgroup(KeyboardInterrupt) is None:
            raise
        interrupted = True
    finally:
        if interrupted:
            print("nemesis: interrupted; stopping every process", file=sys.stderr)
        sessions = [p.pid for p in cluster.procs]
        cluster.stop_everything()
    history.record("teardown", leftovers=session_leftovers(sessions),
                   tmp_files=sorted(str(p.relative_to(cluster.tmp))
                                    for p in cluster.tmp.rglob("*")),
                   driver_fds=[driver_fds, fd_count()])
    history.events.extend(logs.collect(cluster))
    history.events.sort(key=lambda e: e["t"])
    for event in history.events:
        event["round"] = spec.index
    return interrupted
