"""The long-running ``flodl-trio`` commands: coordinator, relay, rank, and the status query.

Each returns its exit code: 0 only when the run completed as asked, 1 (by raising
:class:`CommandFailed`, or a :class:`FlodlError` from the library) when it did not, and 130 / 143
after a graceful stop on SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import ssl
import sys
from typing import Any

import attrs
import trio

from .._config import CoordinatorConfig, MaxFailure, RankConfig
from .._errors import FlodlError, ForeignSession, LeadershipLost, SessionEnded
from ..coordinator import Coordinator, CoordinatorBind, bind_coordinator, open_coordinator
from ..net._transport import format_address
from ..rank import open_rank
from ..scheduler import RunSummary, SyncScheduler
from ..sim import SimulatedRank
from ..status import fetch_state
from ..store import SessionStore
from ..timeline import Timeline
from ..wire import SaveReason, SessionSalt, Shutdown, ShutdownWithSave
from ._common import (
    EXIT_OK,
    STOP_SIGNALS,
    CommandFailed,
    SignalStop,
    UsageError,
    check_replaceable,
    check_writable,
    liveness_seconds,
    load_salt,
    os_error_text,
    parse_address,
    parse_world_range,
    replace_text,
)
from ._durable import (
    adopted,
    check_leader,
    close_store,
    ended_text,
    foreign_text,
    formed_text,
    open_cli_store,
)
from ._linger import linger
from ._progress import EpochProgress, print_progress
from ._watch import check_interval, watch


def stopped(stop: SignalStop, what: str) -> int:
    sys.stderr.write(f"flodl-trio: {what} stopped by {stop.describe()} (graceful shutdown "
                     "done)\n")
    return stop.exit_code


def _tls_server(args: argparse.Namespace) -> ssl.SSLContext | None:
    if not args.tls_cert:
        return None
    if not args.tls_key:
        raise UsageError("--tls-cert needs --tls-key")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(args.tls_cert, args.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise UsageError(f"--tls-cert {args.tls_cert!r} / --tls-key {args.tls_key!r}: "
                         f"{os_error_text(exc)}") from None
    return context


def _coordinator_config(args: argparse.Namespace) -> CoordinatorConfig:
    overrides: dict[str, Any] = {}
    if args.formation_timeout is not None:
        overrides["formation_timeout"] = args.formation_timeout
    if args.heartbeat_timeout is not None:
        overrides["heartbeat_timeout"] = args.heartbeat_timeout
    if args.max_failure is not None:
        overrides["max_failure"] = MaxFailure.absolute(args.max_failure)
    if args.resume_timeout is not None:
        overrides["resume_timeout"] = args.resume_timeout
    if args.store_write_rate is not None:
        overrides["store_write_rate"] = args.store_write_rate
    least, most = parse_world_range(args.world_size)
    if least < most:
        overrides["min_world_size"] = least
    for flag, name in (("--join-window", "join_window"), ("--retire-after", "retire_after")):
        value = getattr(args, name)
        if value is None:
            continue
        if not value >= 0 or (name == "retire_after" and not value > 0):
            limit = "> 0" if name == "retire_after" else ">= 0"
            raise UsageError(f"{flag}: expected seconds {limit}, got {value!r}")
        overrides[name] = value
    return CoordinatorConfig(world_size=most, allow_rank_takeover=args.allow_takeover,
                             **overrides)


async def run_coordinator(args: argparse.Namespace) -> int:
    salt = load_salt(args, long_running=True)
    listen = parse_address(args.listen, what="--listen")
    config = _coordinator_config(args)
    if not args.linger >= 0:
        raise UsageError(f"--linger: expected seconds >= 0, got {args.linger!r}")
    ssl_context = _tls_server(args)
    if args.timeline:
        check_writable(args.timeline, what="--timeline")  # appended to: it may exist
    for path, what in ((args.summary_file, "--summary-file"), (args.port_file, "--port-file")):
        if path:  # written whole at once, never left empty (a killed process leaves none)
            check_replaceable(path, what=what)
    store = open_cli_store(args)
    try:
        return await _coordinate(args, salt, listen, config, ssl_context, store)
    finally:
        await close_store(store)


async def _coordinate(args: argparse.Namespace, salt: SessionSalt, listen: tuple[str, int],
                      config: CoordinatorConfig, ssl_context: ssl.SSLContext | None,
                      store: SessionStore | None) -> int:
    timeline = Timeline(jsonl_path=args.timeline) if args.timeline else Timeline()
    summary: dict[str, Any] = {}
    failure: str | None = None
    crash: FlodlError | None = None
    finished: Coordinator | None = None  # its status page stays up with --linger
    with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
        stop = SignalStop(signals)
        if store is not None:
            await check_leader(store, standby=args.standby)
        bound = await _bind(args, listen, timeline)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop.watch, nursery.cancel_scope)
            try:
                async with open_coordinator(bound, salt=salt, config=config, timeline=timeline,
                                            ssl_context=ssl_context, store=store,
                                            fresh=args.fresh, standby=args.standby) as coord:
                    finished = coord
                    if store is not None and coord.resumed:
                        print(adopted(coord, store), flush=True)
                    else:
                        print(formed_text(coord, store), flush=True)
                    summary, failure = await _drive(args, coord, nursery)
            except (SessionEnded, ForeignSession, LeadershipLost) as exc:
                crash = exc  # nothing of this run to summarise: the store's leader owns it
            except FlodlError as exc:  # ClusterFailure, FormationTimeout, ...: summarised too
                crash = exc
                summary = {"failed": f"{type(exc).__name__}: {exc}"}
                dead = getattr(exc, "dead", None)
                if dead is not None:
                    summary["dead_ranks"] = sorted(dead)
            nursery.cancel_scope.cancel()
    timeline.close()
    if stop.signum is None and isinstance(crash, SessionEnded | ForeignSession | LeadershipLost):
        return _not_leading(crash)
    if stop.signum is not None:
        summary["stopped"] = stop.describe()
    if args.summary_file:
        await replace_text(args.summary_file, json.dumps(summary, indent=2),
                           what="--summary-file")
    print(json.dumps({"summary": summary}), flush=True)
    if args.linger > 0 and stop.signum is None and finished is not None:
        await linger(bound.address, finished, args.linger)
    if stop.signum is not None:
        return stopped(stop, "coordinator")
    if crash is not None:
        raise crash
    if failure is not None:
        raise CommandFailed(f"coordinator: {failure}")
    return EXIT_OK


def _not_leading(exc: FlodlError) -> int:
    """The end of a coordinator that does not lead the run (it writes no summary: the store's
    leader does): a standby whose run ended exits 0 saying so; another run's session and a
    lost leadership are one line, exit 1."""
    if isinstance(exc, SessionEnded):
        print(ended_text(exc), flush=True)
        return EXIT_OK
    if isinstance(exc, ForeignSession):
        raise CommandFailed(foreign_text(exc)) from exc
    # As short as the error's own name was: the cause must fit the one line.
    raise CommandFailed(f"stepping down: {str(exc).removesuffix('; stepping down')}")


async def _bind(args: argparse.Namespace, listen: tuple[str, int],
                timeline: Timeline) -> CoordinatorBind:
    """Bind ``--listen``, print where, write ``--port-file``."""
    try:
        bound = await bind_coordinator(listen, timeline=timeline)
    except OSError as exc:
        raise CommandFailed(f"coordinator: cannot listen on {args.listen}: "
                            f"{os_error_text(exc)}") from None
    text = format_address(bound.address)
    print(f"coordinator listening on {text}", flush=True)
    peers = ", ".join(format_address(a) for a in bound.addresses_for_peers())
    print(f"relays can dial: {peers}", flush=True)
    if args.port_file:
        await replace_text(args.port_file, text + "\n", what="--port-file")
    return bound


async def _drive(args: argparse.Namespace, coord: Coordinator,
                 nursery: trio.Nursery) -> tuple[dict[str, Any], str | None]:
    """The formed cohort's run: the summary, and what fell short of what was asked (or None).

    A line per completed epoch and per death goes to stdout meanwhile (a task of ``nursery``,
    cancelled with it)."""
    if args.epochs > 0:
        sched = SyncScheduler(coord, total_samples=args.total_samples,
                              batch_size=args.batch_size, num_epochs=args.epochs)
        progress = EpochProgress(args.epochs, lambda: sched.coverage)
        await nursery.start(print_progress, coord.timeline, progress, sys.stdout)
        result = await sched.run()
        summary = summary_dict(result, coord)
        # Each epoch's samples counted exactly once (deaths, redistributions and rejoins
        # included): the one check of the scheduler a user of the command line can read.
        summary["coverage"] = {"exact": all(c.exact for c in sched.coverage), "inexact": [
            {"epoch": c.epoch, "samples": c.samples, "total": c.total, "overlaps": c.overlaps,
             "gaps": c.gaps} for c in sched.coverage if not c.exact]}
        print(coverage_line(result.epochs_completed, args.epochs, summary["coverage"]),
              flush=True)
        if result.epochs_completed != args.epochs:
            return summary, (f"the run ended after {result.epochs_completed}/{args.epochs} "
                             "epochs")
        return summary, None
    await nursery.start(print_progress, coord.timeline, EpochProgress(0, tuple), sys.stdout)
    await _hold_until_all_exit(coord)
    summary = {"exited": sorted(coord.exited_ranks), "dead": sorted(coord.dead_ranks)}
    if coord.dead_ranks:
        # The last death may still be on its way through the failure policy, which then
        # cancels this block with the ClusterFailure the run really ended in: give it a moment.
        # The sleep is cancelled as soon as it does; it ends on its own when none follows.
        if coord.failure is None:
            await trio.sleep(1.0)
        return summary, (f"ranks {sorted(coord.dead_ranks)} were declared dead, "
                         f"{len(coord.exited_ranks)} exited cleanly")
    return summary, None


def coverage_line(done: int, asked: int, coverage: dict[str, Any]) -> str:
    """The line that says whether every epoch was covered exactly once.

    >>> coverage_line(3, 3, {"exact": True, "inexact": []})
    'coordinator: 3/3 epochs, every epoch covered exactly once'
    >>> coverage_line(2, 3, {"exact": False, "inexact": [{"epoch": 1}]})
    'coordinator: 2/3 epochs, NOT covered exactly once: epoch(s) [2]'
    """
    if coverage["exact"]:
        return f"coordinator: {done}/{asked} epochs, every epoch covered exactly once"
    epochs = [entry["epoch"] + 1 for entry in coverage["inexact"]]
    return f"coordinator: {done}/{asked} epochs, NOT covered exactly once: epoch(s) {epochs}"


def summary_dict(result: RunSummary, coord: Coordinator) -> dict[str, Any]:
    """The scheduler's :class:`RunSummary` as JSON-ready values, plus the coordinator's view."""
    out: dict[str, Any] = {}
    for field in attrs.fields(type(result)):
        value = getattr(result, field.name)
        if field.name == "epoch_losses":
            continue  # the epoch_metrics below
        if field.name == "epoch_metrics":
            # The whole run's, across a takeover; numbered from 1, as the progress lines and
            # the demo number them (null: no rank's Metrics of that epoch arrived).
            value = [{"epoch": epoch + 1, "avg_loss": loss}
                     for epoch, loss in enumerate(result.epoch_losses)]
        elif field.name == "first_epoch":
            value += 1  # the epoch this coordinator's scheduler began in
        elif isinstance(value, dict):
            value = {str(k): v for k, v in value.items()}
        elif isinstance(value, tuple | frozenset | set):
            value = sorted(value) if not value or not isinstance(next(iter(value)), tuple) \
                else [list(v) for v in value]
        out[field.name] = value
    out["dead_ranks"] = sorted(coord.dead_ranks)
    out["rejoins"] = {str(rank): n for rank, n in sorted(coord.rejoins.items())}
    least, most = coord.world_range
    if least < most:  # an elastic world: its range, its size at the end, who left it
        out["world"] = {"min": least, "max": most, "current": coord.current_world}
        out["retired"] = sorted(coord.retired_ranks)
    out["lost_broadcasts"] = coord.lost_broadcasts
    return out


async def _hold_until_all_exit(coord: Coordinator) -> None:
    async for _ in coord.timing:
        if not coord.live_ranks:
            return


async def run_rank(args: argparse.Namespace) -> int:
    salt = load_salt(args, long_running=True)
    target = parse_address(args.relay, what="--relay")
    with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
        stop = SignalStop(signals)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop.watch, nursery.cancel_scope)
            config = RankConfig(rejoin_when_fenced=args.rejoin_when_fenced) \
                if args.coord_liveness_timeout is None else RankConfig(
                    coord_liveness_timeout=liveness_seconds(args.coord_liveness_timeout),
                    rejoin_when_fenced=args.rejoin_when_fenced)
            async with open_rank(target, salt=salt, rank=args.rank, world_size=args.world_size,
                                 config=config) as ep:
                sim = SimulatedRank(ep, batch_ms=args.batch_ms, jitter=args.jitter,
                                    batch_size=args.batch_size, seed=args.rank)
                record = await sim.run()
            nursery.cancel_scope.cancel()
    if stop.signum is not None:
        return stopped(stop, f"rank {args.rank}")
    last = record.received[-1] if record.received else None
    print(json.dumps({"rank": args.rank, "batches": record.batches, "syncs": record.syncs}),
          flush=True)
    if ep.readmissions:  # fenced while its host was frozen, and brought back by its relay
        print(f"rank {args.rank}: fenced and brought back by its relay {ep.readmissions} "
              "time(s)", flush=True)
    if ep.draining is not None:  # its host left on purpose: it left after its last sync
        print(f"rank {args.rank}: its host drained ({ep.draining}); left after its last sync",
              flush=True)
        return EXIT_OK
    if isinstance(last, ShutdownWithSave) and last.reason != SaveReason.GRACEFUL_SHUTDOWN:
        raise CommandFailed(f"rank {args.rank}: the coordinator stopped the run: "
                            f"ShutdownWithSave({last.reason.name})")
    if not isinstance(last, Shutdown | ShutdownWithSave):
        raise CommandFailed(f"rank {args.rank}: the run ended without a Shutdown")
    return EXIT_OK


async def run_status(args: argparse.Namespace) -> int:
    address = parse_address(args.address, what="status")
    interval = check_interval(args.interval) if args.watch else 0.0
    if args.watch and args.json:
        raise UsageError("status: --watch shows a view, --json one document: choose one")
    # Like the other commands, a signal stops it with 130 / 143 and one line (SIGTERM used to
    # kill it outright, and SIGINT inherited as ignored by a background job was ignored).
    with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
        stop = SignalStop(signals)
        state: dict[str, Any] = {}
        code = EXIT_OK
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop.watch, nursery.cancel_scope)
            if args.watch:
                code = await watch(address, args.address, interval=interval,
                                   timeout=args.timeout)
            else:
                state = await fetch_state(address, timeout=args.timeout)
            nursery.cancel_scope.cancel()
    what = "status --watch" if args.watch else "status"
    if stop.signum is not None:
        sys.stderr.write(f"flodl-trio: {what} {args.address} stopped by {stop.describe()}\n")
        return stop.exit_code
    if args.watch:
        return code
    if args.json:
        print(json.dumps(state, indent=2, sort_keys=True))
        return EXIT_OK
    epoch = f"  epoch {state['epoch']}" if state.get("epoch") is not None else ""
    print(f"phase {state.get('phase')}  world {state.get('world_size')}  covered "
          f"{state.get('covered')}{epoch}  uptime {state.get('uptime_s')} s")
    standby = state.get("standby")
    if isinstance(standby, dict):  # waiting for the store's leadership: nothing forms yet
        print(f"  standby for {standby.get('store')}, led by {standby.get('leader')}; it "
              f"would lead as generation {standby.get('would_lead_as')}")
    # .get() throughout: a document from another version (or another server) is printed as far
    # as it goes, never a KeyError traceback.
    for relay in _entries(state.get("relays")):
        up = "connected" if relay.get("connected", True) else "gone"
        print(f"  relay {relay.get('host', '?')!s:<16} {relay.get('peer', '?')!s:<22} {up:<9} "
              f"ranks {relay.get('ranks', '?')}")
    print(f"  live {state.get('live')}")
    for dead in _entries(state.get("dead")):
        print(f"  dead rank {dead.get('rank', '?')}: {dead.get('reason', '?')}")
    print(f"  exited {state.get('exited')}  lost broadcasts {state.get('lost_broadcasts')}  "
          f"rejected handshakes {state.get('rejected_handshakes')}")
    return EXIT_OK


def _entries(value: object) -> list[dict[str, Any]]:
    """The JSON objects of a list in a status document (anything else is skipped)."""
    return [entry for entry in value if isinstance(entry, dict)] if isinstance(value, list) else []
