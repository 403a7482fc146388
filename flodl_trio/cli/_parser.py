"""The ``flodl-trio`` argument parser: every option has help text, defaults shown."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn

from .._version import __version__
from ._common import EXIT_USAGE, SALT_ENV, world_size_arg
from ._suggest import SuggestingParser

DEFAULT_BATCH_SIZE = 4
DEFAULT_TOTAL_SAMPLES = 240


class _Parser(SuggestingParser):
    def error(self, message: str) -> NoReturn:
        # One line, not argparse's usage block: scripts grep it, people read it. An unknown
        # option comes first, with the closest flag (SuggestingParser).
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(EXIT_USAGE)


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults appended to the help of every option that has one; descriptions keep their line
    breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, []):
            return action.help
        return super()._get_help_string(action)


def _add_world_size(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=int, required=True, metavar="N",
                   help="number of global ranks (required)")


def _add_batch_size(p: argparse.ArgumentParser, help_text: str) -> None:
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, metavar="B",
                   help=help_text)


def _add_salt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--salt-file", metavar="FILE",
                   help="file holding the 32-hex-char session salt, mode 0600 (`flodl-trio "
                   f"salt FILE` writes one; else ${SALT_ENV})")
    p.add_argument("--salt-hex", metavar="HEX",
                   help=f"the salt itself (visible in ps; prefer --salt-file or ${SALT_ENV})")


EXIT_CODES = """exit codes: 0 the run completed as asked; 1 it failed (one line on stderr says why);
2 usage error; 130 / 143 stopped by SIGINT / SIGTERM (after a graceful shutdown)."""


_Command = Callable[[str, str, str], argparse.ArgumentParser]


def build_parser() -> argparse.ArgumentParser:
    """The ``flodl-trio`` parser: the global options, then one sub-parser per command (in the
    order ``--help`` lists them)."""
    parser = _Parser(prog="flodl-trio", formatter_class=_Help, epilog=EXIT_CODES,
                     description="flodl-trio: the control plane of a multi-host training "
                     "cluster, on Trio.")
    parser.add_argument("--version", action="version", version=f"flodl-trio {__version__}")
    parser.add_argument("--log-level", default="WARNING",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                        help="logging level of the flodl_trio loggers (stderr)")
    parser.add_argument("--debug", action="store_true", help="tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def command(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=summary, description=description, formatter_class=_Help)

    for add in (_add_salt, _add_coordinator, _add_relay, _add_rank, _add_status, _add_demo,
                _add_plot):
        add(command)
    return parser


def _add_salt(command: _Command) -> None:
    """``salt``: a fresh session salt."""
    p = command("salt", "print a fresh session salt (32 hex chars), or write it to a file",
                "Print a fresh random session salt, or write it to FILE (mode 0600, for "
                "--salt-file);\ngive the same one to every process of a run.")
    p.add_argument("file", nargs="?", metavar="FILE",
                   help="write the salt here instead (mode 0600: only you may read it; an "
                   "existing file is never overwritten)")


def _add_coordinator(command: _Command) -> None:
    """``coordinator``: its listener, deadlines and simulated run."""
    p = command("coordinator", "run a coordinator (optionally driving a simulated run)",
                "Run a coordinator. With --epochs, drive a simulated training run with the "
                "reference SyncScheduler\nand exit 0 once every epoch completed; without it, "
                "hold the cohort until every rank exits\n(0 if all exited cleanly, 1 if any "
                "was declared dead).\n\n" + EXIT_CODES)
    p.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT",
                   help="where relays dial and the status page answers (port 0: any free port)")
    p.add_argument("--world-size", required=True, metavar="N|MIN:MAX", type=world_size_arg,
                   help="number of global ranks (required); MIN:MAX: an elastic world that "
                   "forms with MIN to MAX ranks, takes hosts that join later and retires dead "
                   "ones (relays and ranks are started with --world-size MAX: rank ids lie in "
                   "[0, MAX); docs/elastic.rst)")
    p.add_argument("--join-window", type=float, default=None, metavar="S",
                   help="an elastic world forms once MIN ranks are covered and no relay joined "
                   "for S seconds (at once with MAX; None: 1 x $FLODL_NET_TIMEOUT_SCALE)")
    p.add_argument("--retire-after", type=float, default=None, metavar="S",
                   help="retire a rank dead for S seconds: it stops counting in the world and "
                   "against --max-failure, and its id may join again (None: never; an elastic "
                   "world never shrinks below MIN)")
    _add_salt_args(p)
    p.add_argument("--tls-cert", metavar="PEM", help="serve every connection over TLS")
    p.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    p.add_argument("--formation-timeout", type=float, default=None, metavar="S",
                   help="seconds for every rank to be covered (None: 60 x "
                   "$FLODL_NET_TIMEOUT_SCALE)")
    p.add_argument("--heartbeat-timeout", type=float, default=None, metavar="S",
                   help="a rank silent this long is declared dead (None: 30 x "
                   "$FLODL_NET_TIMEOUT_SCALE)")
    p.add_argument("--max-failure", type=int, default=None, metavar="N",
                   help="stop with MAX_FAILURE_EXCEEDED once N ranks are dead (None: only when "
                   "every rank is lost)")
    p.add_argument("--allow-takeover", action="store_true",
                   help="let a relay of another host (a spare) take over ranks that are all "
                   "dead (a host that comes back may always rejoin)")
    p.add_argument("--timeline", metavar="FILE", help="append every event to FILE (JSONL)")
    p.add_argument("--epochs", type=int, default=0, metavar="E",
                   help="drive E epochs with the SyncScheduler (0: just hold the cohort until "
                   "every rank exits or a signal)")
    p.add_argument("--total-samples", type=int, default=DEFAULT_TOTAL_SAMPLES, metavar="N",
                   help="dataset size the scheduler partitions across the ranks")
    _add_batch_size(p, "samples per batch the scheduler plans with; the ranks must use the "
                    "same (a rank whose batches disagree is reported)")
    p.add_argument("--port-file", metavar="FILE", help="write HOST:PORT here once bound")
    p.add_argument("--summary-file", metavar="FILE", help="write the run summary (JSON) here")
    _add_store_options(p)
    p.add_argument("--linger", type=float, default=0.0, metavar="S",
                   help="after the run, keep serving the finished run's status page on "
                   "--listen for S seconds before exiting (SIGINT or SIGTERM end it sooner)")


def _add_store_options(p: argparse.ArgumentParser) -> None:
    """The coordinator's session store (docs/failover.rst)."""
    p.add_argument("--store", metavar="URL",
                   help="keep the session in a store so that a restarted or standby "
                   "coordinator adopts the running cohort: sqlite:PATH, "
                   "etcd://HOST:PORT[,HOST:PORT...]/PREFIX (etcds:// for TLS; options after ?: "
                   "ca, cert, key, user, password_file, ttl, election_timeout, request_timeout, "
                   "or $FLODL_ETCD_*; never a password) or memory: (docs/failover.rst)")
    p.add_argument("--standby", action="store_true",
                   help="with --store: if another coordinator leads it, wait for its "
                   "leadership to end and then adopt the session (without it: exit 1 at once)")
    p.add_argument("--fresh", action="store_true",
                   help="with --store: start a new session even if the store holds an "
                   "unfinished one (even another run's), which is discarded (a session that "
                   "ended needs no --fresh: a new one starts)")
    p.add_argument("--resume-timeout", type=float, default=None, metavar="S",
                   help="after an adoption, seconds for each relay to resume before its ranks "
                   "are declared dead (None: 30 x $FLODL_NET_TIMEOUT_SCALE)")
    p.add_argument("--store-write-rate", type=float, default=None, metavar="N",
                   help="with --store: write the session at most N times a second, changes "
                   "meanwhile coalesced (default 1; epoch boundaries are written at once; "
                   "docs/failover.rst)")


def _add_relay(command: _Command) -> None:
    """``relay``: its coordinator, host, ranks and rank port."""
    p = command("relay", "run a host relay",
                "Run a host relay: accept the local ranks on loopback, then carry their frames "
                "to the coordinator.\nExits 0 once its ranks exited or the coordinator shut "
                "down cleanly, 1 if the upstream link broke.\n\n" + EXIT_CODES)
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT",
                   help="the coordinator's --listen address (required); or several, "
                   "HOST:PORT,HOST:PORT, tried in turn on every attempt; or "
                   "etcd[s]://HOST:PORT/PREFIX[?OPTIONS], the --store of the coordinators, "
                   "whose leader's address is read again on every attempt")
    p.add_argument("--coordinator-grace", type=float, default=None, metavar="S",
                   help="seconds to ride out a lost coordinator that runs with a --store "
                   "(ranks kept, their frames queued, re-dialing) before giving up; 0: give up "
                   "at once (None: 30 x $FLODL_NET_TIMEOUT_SCALE)")
    p.add_argument("--coord-liveness-timeout", type=float, default=None, metavar="S",
                   help="a coordinator that runs with a --store and sends nothing for S seconds "
                   "is lost (then ridden out); keep it at most 2/3 of the ranks' own (None: 20 "
                   "x $FLODL_NET_TIMEOUT_SCALE)")
    p.add_argument("--no-rejoin-when-fenced", dest="rejoin_when_fenced", action="store_false",
                   help="once the coordinator fenced every rank of this host (it froze past "
                   "--heartbeat-timeout), end as before instead of joining again with the "
                   "ranks still running (docs/elastic.rst, Waking up)")
    p.add_argument("--host", required=True, metavar="NAME", help="this host's name (required)")
    p.add_argument("--ranks", required=True, metavar="LIST",
                   help="global ranks of this host, e.g. 0-3,8 (required)")
    _add_world_size(p)
    p.add_argument("--rank-port", type=int, default=0, metavar="PORT",
                   help="loopback port the local ranks dial (0: any free port, printed)")
    p.add_argument("--model-sig", metavar="NAME=HEX", action="append", default=[],
                   help="a model signature this host announces (repeatable; default: none); "
                   "relays that disagree on a name fail formation")
    _add_salt_args(p)
    p.add_argument("--tls-ca", metavar="PEM", help="verify the coordinator's TLS certificate")
    p.add_argument("--tls-server-name", metavar="NAME",
                   help="name to check in the coordinator's certificate")
    # Also after the command (``relay --debug``); SUPPRESS keeps the global flag's value.
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="tracebacks and the full detail of a refusal or a salt that differs")


def _add_rank(command: _Command) -> None:
    """``rank``: one simulated rank."""
    p = command("rank", "run one simulated rank",
                "Run one simulated rank (SimulatedRank): it processes the samples it is given "
                "in batches,\nanswers syncs and exits 0 on a graceful Shutdown, 1 on a failed "
                "run or a lost coordinator.\n\n" + EXIT_CODES)
    p.add_argument("--relay", required=True, metavar="HOST:PORT",
                   help="the address the relay printed for its ranks (required)")
    p.add_argument("--rank", type=int, required=True, metavar="R",
                   help="this rank's global rank (required)")
    _add_world_size(p)
    p.add_argument("--batch-ms", type=float, default=20.0, metavar="MS",
                   help="simulated milliseconds per batch")
    _add_batch_size(p, "samples per batch; must equal the coordinator's --batch-size")
    p.add_argument("--jitter", type=float, default=0.1, metavar="FRACTION",
                   help="random spread of each batch time, as a fraction of --batch-ms")
    p.add_argument("--coord-liveness-timeout", type=float, default=None, metavar="S",
                   help="no frame from the coordinator (nor from the relay riding a lost one "
                   "out) for S seconds: the rank gives up; keep its relay's at most 2/3 of it "
                   "(None: 30 x $FLODL_NET_TIMEOUT_SCALE)")
    p.add_argument("--no-rejoin-when-fenced", dest="rejoin_when_fenced", action="store_false",
                   help="once the coordinator fenced this rank, exit 1 (RankEvicted) instead of "
                   "waiting for its relay to bring it back (docs/elastic.rst, Waking up)")
    _add_salt_args(p)


def _add_status(command: _Command) -> None:
    """``status``: a coordinator's status page."""
    p = command("status", "print a coordinator's /state.json (--watch: a live view)",
                "Query a coordinator's status page (its --listen port). Exits 0 with an "
                "answer, 1 without one;\nwith --watch, 0 once the coordinator went away.")
    p.add_argument("address", metavar="HOST:PORT", help="the coordinator's address")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S",
                   help="seconds for the whole exchange")
    p.add_argument("--json", action="store_true", help="print the raw JSON document")
    p.add_argument("--watch", action="store_true",
                   help="a one-screen view refreshed in place (hosts, ranks alive/dead, epoch, "
                   "lost broadcasts) until Ctrl-C or the coordinator goes away (then exit 0)")
    p.add_argument("--interval", type=float, default=1.0, metavar="S",
                   help="seconds between --watch refreshes, 0.2 to 60")


def _add_demo(command: _Command) -> None:
    """``demo``: a local cluster of processes."""
    p = command("demo", "a whole local cluster as separate processes on loopback",
                "Run a coordinator, one relay per host and simulated ranks as separate "
                "processes on loopback,\ntell the story (formation, deaths, redistributions) "
                "and exit 0 once every epoch completed.\n\n" + EXIT_CODES)
    p.add_argument("--hosts", type=int, default=3, metavar="N", help="relay processes")
    p.add_argument("--ranks-per-host", type=int, default=2, metavar="N",
                   help="rank processes per relay")
    p.add_argument("--epochs", type=int, default=3, metavar="E", help="epochs to train")
    p.add_argument("--total-samples", type=int, default=DEFAULT_TOTAL_SAMPLES, metavar="N",
                   help="dataset size")
    _add_batch_size(p, "samples per batch (coordinator and ranks alike)")
    p.add_argument("--batch-ms", type=float, default=25.0, metavar="MS",
                   help="base batch time; host i runs (1 + i) times slower")
    p.add_argument("--kill-relay", metavar="HOST@SECONDS", action="append", default=[],
                   help="SIGKILL that relay process SECONDS after formation (repeatable, one "
                   "per host)")
    p.add_argument("--restart-relay", metavar="HOST@SECONDS", action="append", default=[],
                   help="start a killed host's relay and ranks again SECONDS after the kill: "
                   "they rejoin the running cohort (repeatable, one per host)")
    p.add_argument("--add-host", type=float, action="append", default=[], metavar="SECONDS",
                   help="start one more host (a relay and --ranks-per-host ranks) SECONDS after "
                   "formation: it joins the running cohort, whose world is elastic then "
                   "(repeatable; docs/elastic.rst)")
    p.add_argument("--drain-relay", metavar="HOST@SECONDS", action="append", default=[],
                   help="SIGTERM that relay process SECONDS after formation: its ranks finish "
                   "their current sync and leave, and are retired from the (elastic) world "
                   "(repeatable, one per host)")
    p.add_argument("--kill-coordinator", type=float, default=None, metavar="SECONDS",
                   help="run the coordinator with a session store (sqlite: in the temporary "
                   "directory), SIGKILL it SECONDS after formation and start it again at once "
                   "on the same port: it adopts the running session, the relays resume and the "
                   "run goes on")
    p.add_argument("--timeline", metavar="FILE", help="also keep the coordinator's events here "
                   "(JSONL)")
    p.add_argument("--keep-logs", action="store_true",
                   help="keep the temporary directory of process logs (otherwise removed, unless "
                   "the run failed)")
    p.add_argument("--no-live", action="store_true", help="plain log lines, no live table")
    p.add_argument("--linger", type=float, default=0.0, metavar="S",
                   help="keep the live page (printed at the start) up S seconds after the run")


def _add_plot(command: _Command) -> None:
    """``plot``: a timeline as a picture."""
    p = command("plot", "draw a timeline JSONL as a PNG (needs matplotlib)",
                "Draw one lane per rank (alive, dead, exited) with formation, epochs, syncs, "
                "lost broadcasts and deaths.")
    p.add_argument("timeline", metavar="TIMELINE.jsonl", help="a --timeline file")
    p.add_argument("-o", "--output", default="timeline.png", metavar="PNG",
                   help="where to write the picture")
