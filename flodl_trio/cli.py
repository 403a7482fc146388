"""The ``flodl-trio`` command line (SPEC §12).

Exit codes: 0 ok, 1 the run failed, 2 usage error. Errors print one line (a traceback only with
``--debug``). The library itself never configures logging; this module does, for the CLI only.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import trio

from ._config import CoordinatorConfig, MaxFailure, RankConfig, RelayConfig
from ._errors import ConfigError, FlodlError, UsageError
from ._transport import format_address
from ._version import __version__
from .wire import SessionSalt

log = logging.getLogger("flodl_trio.cli")

SALT_ENV = "FLODL_SALT_HEX"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, not argparse's usage block: scripts grep it, people read it.
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(EXIT_USAGE)


def parse_address(text: str, *, what: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` → (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"{what}: expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def parse_ranks(text: str) -> list[int]:
    """``0-3,8`` → [0, 1, 2, 3, 8]."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise UsageError(f"--ranks: expected a list like 0-3,8, got {text!r}")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise UsageError(f"--ranks: range {part!r} runs backwards")
        out.extend(range(a, b + 1))
    if not out:
        raise UsageError(f"--ranks: expected at least one rank, got {text!r}")
    return out


def load_salt(args: argparse.Namespace, *, long_running: bool) -> SessionSalt:
    """The salt from --salt-file, $FLODL_SALT_HEX or --salt-hex (which shows in ``ps``)."""
    if getattr(args, "salt_file", None):
        try:
            text = Path(args.salt_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"--salt-file {args.salt_file!r}: {exc.strerror}") from None
        return SessionSalt.from_hex(text)
    if getattr(args, "salt_hex", None):
        if long_running:
            warnings.warn(
                "--salt-hex puts the session secret on the command line, where `ps` shows it to "
                f"every user; prefer --salt-file or ${SALT_ENV}",
                stacklevel=1,
            )
        return SessionSalt.from_hex(args.salt_hex)
    env = os.environ.get(SALT_ENV)
    if env:
        return SessionSalt.from_hex(env)
    raise UsageError(f"no session salt: pass --salt-file FILE or set ${SALT_ENV} "
                     "(`flodl-trio salt` prints a fresh one)")


def _add_salt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--salt-file", metavar="FILE", help="file holding the 32-hex-char salt")
    p.add_argument("--salt-hex", metavar="HEX",
                   help=f"the salt itself (visible in ps; prefer --salt-file or ${SALT_ENV})")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="flodl-trio", description="flodl-trio: the control plane of a "
                     "multi-host training cluster, on Trio.")
    parser.add_argument("--version", action="version", version=f"flodl-trio {__version__}")
    parser.add_argument("--log-level", default="WARNING",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                        help="default WARNING")
    parser.add_argument("--debug", action="store_true", help="tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    sub.add_parser("salt", help="print a fresh session salt (32 hex chars)")

    p = sub.add_parser("coordinator", help="run a coordinator (optionally driving a simulated "
                       "training run with the reference scheduler)")
    p.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT")
    p.add_argument("--world-size", type=int, required=True)
    _add_salt_args(p)
    p.add_argument("--tls-cert", metavar="PEM", help="serve the control leg over TLS")
    p.add_argument("--tls-key", metavar="PEM")
    p.add_argument("--formation-timeout", type=float, default=None, metavar="S")
    p.add_argument("--heartbeat-timeout", type=float, default=None, metavar="S")
    p.add_argument("--max-failure", type=int, default=None, metavar="N",
                   help="stop with MAX_FAILURE_EXCEEDED once N ranks are dead")
    p.add_argument("--timeline", metavar="FILE", help="append events to FILE (JSONL)")
    p.add_argument("--epochs", type=int, default=0,
                   help="drive this many epochs with the SyncScheduler (0: just hold the "
                   "cohort until every rank exits or SIGTERM)")
    p.add_argument("--total-samples", type=int, default=240)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--port-file", metavar="FILE", help="write HOST:PORT here once bound")
    p.add_argument("--summary-file", metavar="FILE", help="write the run summary (JSON) here")

    p = sub.add_parser("relay", help="run a host relay")
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT")
    p.add_argument("--host", required=True, help="this host's name")
    p.add_argument("--ranks", required=True, help="global ranks of this host, e.g. 0-3,8")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--rank-port", type=int, default=0, help="loopback port for local ranks")
    _add_salt_args(p)
    p.add_argument("--tls-ca", metavar="PEM", help="verify the coordinator's TLS certificate")
    p.add_argument("--tls-server-name", metavar="NAME")

    p = sub.add_parser("rank", help="run one simulated rank")
    p.add_argument("--relay", required=True, metavar="HOST:PORT")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--batch-ms", type=float, default=20.0)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--jitter", type=float, default=0.1)
    _add_salt_args(p)

    p = sub.add_parser("status", help="print a coordinator's /state.json")
    p.add_argument("address", metavar="HOST:PORT")
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--json", action="store_true", help="raw JSON")

    p = sub.add_parser("demo", help="a whole local cluster as separate processes on loopback")
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--ranks-per-host", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--total-samples", type=int, default=240)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--batch-ms", type=float, default=25.0,
                   help="base batch time; host i runs (1 + i) times slower")
    p.add_argument("--kill-relay", metavar="HOST@SECONDS", action="append", default=[],
                   help="SIGKILL that relay process SECONDS after the run starts")
    p.add_argument("--timeline", metavar="FILE", help="write the coordinator's events (JSONL)")
    p.add_argument("--no-live", action="store_true", help="plain log lines, no live table")

    p = sub.add_parser("plot", help="draw a timeline JSONL as a PNG (needs flodl-trio[plot])")
    p.add_argument("timeline", metavar="TIMELINE.jsonl")
    p.add_argument("-o", "--output", default="timeline.png")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.captureWarnings(True)
    if args.command is None:
        print(f"flodl-trio {__version__}")
        print(f"fresh session salt: {SessionSalt.generate().hex()}")
        print("commands: salt, coordinator, relay, rank, status, demo, plot (see --help)")
        return EXIT_OK
    try:
        try:
            return _dispatch(args)
        except BaseExceptionGroup as group:
            from ._lifecycle import choose_one_exception

            chosen = choose_one_exception(group, body_exc=None, failure=None,
                                          cancelled_from_outside=False, what="flodl-trio")
            if isinstance(chosen, trio.Cancelled):
                raise
            raise chosen from None
    except UsageError as exc:
        sys.stderr.write(f"flodl-trio: error: {exc}\n")
        return EXIT_USAGE
    except ConfigError as exc:
        if args.debug:
            raise
        sys.stderr.write(f"flodl-trio: error: {exc}\n")
        return EXIT_USAGE
    except FlodlError as exc:
        if args.debug:
            raise
        sys.stderr.write(f"flodl-trio: {type(exc).__name__}: {exc}\n")
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "salt":
        print(SessionSalt.generate().hex())
        return EXIT_OK
    if args.command == "status":
        return trio.run(_status, args)
    if args.command == "coordinator":
        return trio.run(_coordinator, args)
    if args.command == "relay":
        return trio.run(_relay, args)
    if args.command == "rank":
        return trio.run(_rank, args)
    if args.command == "demo":
        from ._demo import run_demo

        return run_demo(args)
    if args.command == "plot":
        from ._plot import plot_timeline

        plot_timeline(args.timeline, args.output)
        print(f"wrote {args.output}")
        return EXIT_OK
    raise UsageError(f"unknown command {args.command!r}")


async def _status(args: argparse.Namespace) -> int:
    from .status import fetch_state

    address = parse_address(args.address, what="status")
    state = await fetch_state(address, timeout=args.timeout)
    if args.json:
        print(json.dumps(state, indent=2, sort_keys=True))
        return EXIT_OK
    print(f"phase {state.get('phase')}  world {state.get('world_size')}  covered "
          f"{state.get('covered')}  uptime {state.get('uptime_s')} s")
    for relay in state.get("relays", []):
        print(f"  relay {relay['host']:<16} {relay['peer']:<22} ranks {relay['ranks']}")
    print(f"  live {state.get('live')}")
    for dead in state.get("dead", []):
        print(f"  dead rank {dead['rank']}: {dead['reason']}")
    print(f"  exited {state.get('exited')}  lost broadcasts {state.get('lost_broadcasts')}  "
          f"rejected handshakes {state.get('rejected_handshakes')}")
    return EXIT_OK


async def _stop_on_signals(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            scope.cancel()
            return


async def _coordinator(args: argparse.Namespace) -> int:
    from . import bind_coordinator, open_coordinator
    from .timeline import Timeline

    salt = load_salt(args, long_running=True)
    listen = parse_address(args.listen, what="--listen")
    overrides: dict[str, Any] = {}
    if args.formation_timeout is not None:
        overrides["formation_timeout"] = args.formation_timeout
    if args.heartbeat_timeout is not None:
        overrides["heartbeat_timeout"] = args.heartbeat_timeout
    if args.max_failure is not None:
        overrides["max_failure"] = MaxFailure.absolute(args.max_failure)
    config = CoordinatorConfig(world_size=args.world_size, **overrides)
    ssl_context = None
    if args.tls_cert:
        import ssl

        ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ssl_context.load_cert_chain(args.tls_cert, args.tls_key)
    timeline = Timeline(jsonl_path=args.timeline) if args.timeline else Timeline()
    bound = await bind_coordinator(listen, timeline=timeline)
    text = format_address(bound.address)
    print(f"coordinator listening on {text}", flush=True)
    if args.port_file:
        await trio.Path(args.port_file).write_text(text + "\n", encoding="utf-8")
    summary: dict[str, Any] = {}
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signals, nursery.cancel_scope)
            async with open_coordinator(bound, salt=salt, config=config, timeline=timeline,
                                        ssl_context=ssl_context) as coord:
                print(f"formed: {coord.world_size} ranks over {len(coord.relays)} relays",
                      flush=True)
                if args.epochs > 0:
                    from .scheduler import SyncScheduler

                    sched = SyncScheduler(coord, total_samples=args.total_samples,
                                          batch_size=args.batch_size, num_epochs=args.epochs)
                    result = await sched.run()
                    summary = _summary_dict(result, coord)
                else:
                    await _hold_until_all_exit(coord)
                    summary = {"exited": sorted(coord.exited_ranks),
                               "dead": sorted(coord.dead_ranks)}
            nursery.cancel_scope.cancel()
    if scope.cancelled_caught:
        summary.setdefault("stopped", "signal")
    timeline.close()
    if args.summary_file:
        await trio.Path(args.summary_file).write_text(json.dumps(summary, indent=2),
                                                      encoding="utf-8")
    print(json.dumps({"summary": summary}), flush=True)
    return EXIT_OK


def _summary_dict(result: Any, coord: Any) -> dict[str, Any]:
    import attrs

    out: dict[str, Any] = {}
    for field in attrs.fields(type(result)):
        value = getattr(result, field.name)
        if field.name == "epoch_metrics":
            value = [{"epoch": m.epoch, "avg_loss": m.avg_loss} for m in value]
        elif isinstance(value, dict):
            value = {str(k): v for k, v in value.items()}
        elif isinstance(value, tuple | frozenset | set):
            value = sorted(value) if not value or not isinstance(next(iter(value)), tuple) \
                else [list(v) for v in value]
        out[field.name] = value
    out["dead_ranks"] = sorted(coord.dead_ranks)
    out["lost_broadcasts"] = coord.lost_broadcasts
    return out


async def _hold_until_all_exit(coord: Any) -> None:
    async for _ in coord.timing:
        if not coord.live_ranks:
            return


async def _relay(args: argparse.Namespace) -> int:
    from . import open_relay

    salt = load_salt(args, long_running=True)
    target = parse_address(args.coordinator, what="--coordinator")
    ranks = parse_ranks(args.ranks)
    ssl_context = None
    if args.tls_ca:
        import ssl

        ssl_context = ssl.create_default_context(cafile=args.tls_ca)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signals, nursery.cancel_scope)
        async with open_relay(target, salt=salt, host=args.host, ranks=ranks,
                              world_size=args.world_size, rank_listen=args.rank_port,
                              config=RelayConfig(), ssl_context=ssl_context,
                              server_hostname=args.tls_server_name) as relay:
            print(f"relay {args.host} ranks {ranks} listening for ranks on "
                  f"{format_address(relay.rank_address)}", flush=True)
            outcome = await relay.wait_closed()
            print(f"relay {args.host} ended: {outcome.reason}", flush=True)
        nursery.cancel_scope.cancel()
    return EXIT_OK


async def _rank(args: argparse.Namespace) -> int:
    from . import open_rank
    from .sim import SimulatedRank

    salt = load_salt(args, long_running=True)
    target = parse_address(args.relay, what="--relay")
    async with open_rank(target, salt=salt, rank=args.rank, world_size=args.world_size,
                         config=RankConfig()) as ep:
        sim = SimulatedRank(ep, batch_ms=args.batch_ms, jitter=args.jitter,
                            batch_size=args.batch_size, seed=args.rank)
        record = await sim.run()
    print(json.dumps({"rank": args.rank, "batches": getattr(record, "batches", None)}),
          flush=True)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
