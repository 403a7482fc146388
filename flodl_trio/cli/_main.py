"""The ``flodl-trio`` command line (docs/cli.rst).

Exit codes: 0 the run completed as asked, 1 it failed, 2 usage error, 130 / 143 stopped by
SIGINT / SIGTERM after a graceful shutdown. Errors print one line (a traceback only with
``--debug``), operating-system errors included (a port in use, an unreadable file: the line names
the address or the file). The library itself never configures logging; this module does, for the
CLI only.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

import trio

from .._errors import ConfigError, FlodlError
from .._gc import freeze_setup
from .._version import __version__
from ..wire import SessionSalt
from ._common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    EXIT_USAGE,
    CommandFailed,
    Terminated,
    UsageError,
    os_error_text,
)
from ._errors import MAX_LINE, PEERS, error_line, shorten
from ._parser import build_parser


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated


# Library log records that a command tells on stdout in a line of its own (or, for a step-down,
# in its one final line): dropped, so that nothing is said twice. Keyed by the logger and the
# start of the record's format string.
SAID_ELSEWHERE = {
    "relay": (("flodl_trio.relay", "relay %r: lost the coordinator"),),
    "coordinator": (("flodl_trio.coordinator.liveness", "rank %d (host %s) declared dead"),
                    ("flodl_trio.coordinator", "stepping down, without a word")),
}


class _SaidElsewhere(logging.Filter):
    """Drops the records of :data:`SAID_ELSEWHERE` for one command."""

    def __init__(self, dropped: tuple[tuple[str, str], ...]) -> None:
        super().__init__()
        self.dropped = dropped

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(record.name == name and str(record.msg).startswith(start)
                       for name, start in self.dropped)


def _one_exception(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The exception the user should see from a nursery's group (None: only cancellations)."""
    _, rest = group.split(trio.Cancelled)
    if rest is None:
        return None
    leaves: list[BaseException] = []
    pending: list[BaseException] = [rest]
    while pending:
        exc = pending.pop()
        if isinstance(exc, BaseExceptionGroup):
            pending.extend(exc.exceptions)
        else:
            leaves.append(exc)
    for kinds in ((KeyboardInterrupt, Terminated, SystemExit), (UsageError, ConfigError),
                  (CommandFailed, FlodlError, OSError)):
        for leaf in leaves:
            if isinstance(leaf, kinds):
                return leaf
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.captureWarnings(True)
    said = _SaidElsewhere(SAID_ELSEWHERE.get(args.command or "", ()))
    # On the loggers themselves (a filter there sees only their own records), removed at the
    # end: main() also runs inside other programs and tests, whose logging is theirs.
    loggers = [logging.getLogger(name) for name, _ in said.dropped]
    for logger in loggers:
        logger.addFilter(said)
    try:
        return _main(args, own_process=argv is None)
    finally:
        for logger in loggers:
            logger.removeFilter(said)


def _main(args: Any, *, own_process: bool = False) -> int:
    """``own_process``: this is the process's own command line (``main()`` with no argv),
    not ``main()`` called inside another program."""
    if args.command is None:
        print(f"flodl-trio {__version__}")
        print(f"fresh session salt: {SessionSalt.generate().hex()}")
        print("commands: salt, coordinator, relay, rank, status, demo, plot (see --help)")
        return EXIT_OK
    # Trio's own signal receiver takes SIGTERM over in the Trio commands (a graceful stop);
    # raising from a Python handler inside Trio's machinery would not be safe, so only the
    # synchronous commands get this one.
    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    if args.command in ("demo", "plot"):
        signal.signal(signal.SIGTERM, _raise_terminated)
        # Explicitly, like Trio's signal receiver in the other commands: a process started in
        # the background by a non-interactive shell inherits SIGINT *ignored*, and the demo would
        # then never stop its children on SIGINT.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        try:
            return _dispatch(args, own_process=own_process)
        except BaseExceptionGroup as group:
            chosen = _one_exception(group)
            if chosen is None or args.debug:
                raise
            raise chosen from chosen.__cause__  # keeps what the one-line hint reads
    except (UsageError, ConfigError) as exc:
        if args.debug:
            raise
        sys.stderr.write(shorten(f"flodl-trio: error: {exc}", MAX_LINE) + "\n")
        return EXIT_USAGE
    except CommandFailed as exc:
        if args.debug:
            raise
        sys.stderr.write(_failure_line(args, exc, f"flodl-trio: {exc}") + "\n")
        return EXIT_FAILED
    except FlodlError as exc:
        if args.debug:
            raise
        sys.stderr.write(_failure_line(args, exc, None) + "\n")
        return EXIT_FAILED
    except OSError as exc:  # one we did not name more precisely on the way
        if args.debug:
            raise
        where = f" {exc.filename!r}" if exc.filename else ""
        line = f"flodl-trio: {args.command}:{where} {os_error_text(exc)}"
        sys.stderr.write(_failure_line(args, exc, line) + "\n")
        return EXIT_FAILED
    except KeyboardInterrupt:
        sys.stderr.write(f"flodl-trio: {args.command} interrupted by SIGINT\n")
        return EXIT_SIGINT
    except Terminated:
        sys.stderr.write(f"flodl-trio: {args.command} stopped by SIGTERM\n")
        return EXIT_SIGTERM
    finally:
        if args.command in ("demo", "plot"):
            for signum, handler in zip((signal.SIGTERM, signal.SIGINT), previous, strict=True):
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def _failure_line(args: Any, exc: BaseException, line: str | None) -> str:
    """The one stderr line of a failed command: a network cause a person can act on first
    (connection refused, unknown name), else ``line`` (None: the error's type and message)."""
    who = {"relay": f"relay {getattr(args, 'host', '')}",
           "rank": f"rank {getattr(args, 'rank', '')}"}.get(args.command, args.command)
    option = PEERS.get(args.command, (None, None))[1]
    address = getattr(args, option, None) if option else None
    return error_line(exc, command=args.command, who=who, address=address, default=line)


def _dispatch(args: Any, *, own_process: bool = False) -> int:
    if args.command == "salt":
        salt = SessionSalt.generate()
        if args.file is None:
            print(salt.hex())
        else:
            salt.save(args.file)  # ConfigError (it exists, or cannot be written): one line, 2
            print(f"wrote a fresh session salt to {args.file} (mode 0600)")
        return EXIT_OK
    if args.command in ("status", "coordinator", "relay", "rank"):
        from . import _relay as _cli_relay, _run as _cli_run

        run = {"status": _cli_run.run_status, "coordinator": _cli_run.run_coordinator,
               "relay": _cli_relay.run_relay, "rank": _cli_run.run_rank}[args.command]
        if own_process and args.command != "status":  # one component for its whole life
            freeze_setup()
        return trio.run(run, args)
    if args.command == "demo":
        from ..demo._run import run_demo

        return run_demo(args)
    if args.command == "plot":
        from ._plot import plot_timeline

        plot_timeline(args.timeline, args.output)
        print(f"wrote {args.output}")
        return EXIT_OK
    raise UsageError(f"unknown command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
