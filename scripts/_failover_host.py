"""One host in one process for the coordinator-failover benchmark: a relay and its simulated
ranks (:class:`~flodl_trio.sim.SimulatedRank`), each rank logging every control message it
receives with ``time.monotonic()`` (CLOCK_MONOTONIC: the same clock in every process of the
machine, so the parent compares it with the moment it SIGKILLed a coordinator).

    python scripts/_failover_host.py --coordinator 127.0.0.1:PORT --salt-hex HEX --host host-a \\
        --ranks 0,1 --world-size 4 --log DIR/host-a.log
    python scripts/_failover_host.py --etcd 127.0.0.1:2379 --prefix flodl/bench ...
    python scripts/_failover_host.py --etcd 'etcds://127.0.0.1:2379/flodl/bench?ca=...' ...

With ``--etcd`` the relay's coordinator target is the store itself (``open_relay(store)``): it
reads the leader's address (``store.resolve_address()``) on every dial, so a relay that lost its
coordinator re-dials whichever coordinator leads now (a standby on another port), and reads it
once per heartbeat period while connected, so that it leaves a frozen leader for a newer one.

The log has one line per message, flushed as it arrives::

    <monotonic> <rank> <label> [<value>]

(``value``: the epoch of a ``StartEpoch``, the step of a ``SetGlobalStep``, the rank of a
``DeclareDead``, the reason of a ``ShutdownWithSave``, the generation of a
``CoordinatorResumed``), plus ``<monotonic> <rank> ended|lost <why>`` when the rank stops and
``<monotonic> relay exit <reason>`` when the relay does.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any, TextIO

import trio
from _relay_proc import parse_ranks

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.sim import SimulatedRank
from flodl_trio.store import EtcdStore, open_store


def value_of(msg: Any) -> str:
    """The one field of a message that the benchmark reads, as text ('' for the others)."""
    for cls, field in (("StartEpoch", None), ("SetGlobalStep", "global_step"),
                       ("DeclareDead", "rank"), ("DeclareAlive", "rank"),
                       ("CoordinatorResumed", "generation")):
        if type(msg).__name__ == cls:
            return str(msg.plan.epoch if field is None else getattr(msg, field))
    if isinstance(msg, wire.ShutdownWithSave):
        return ft.SaveReason(msg.reason).name
    return ""


class Stamped:
    """A rank endpoint whose received messages are logged; everything else is the endpoint's
    (a SimulatedRank reads ``step_count`` and sets it, sends, iterates)."""

    def __init__(self, endpoint: ft.RankEndpoint, log: TextIO) -> None:
        object.__setattr__(self, "_ep", endpoint)
        object.__setattr__(self, "_log", log)

    def __aiter__(self) -> Stamped:
        return self

    async def __anext__(self) -> Any:
        msg = await self._ep.__anext__()
        line = f"{time.monotonic():.6f} {self._ep.rank} {wire.control_label(msg)} {value_of(msg)}"
        self._log.write(line.rstrip() + "\n")
        self._log.flush()
        return msg

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ep, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._ep, name, value)


def note(log: TextIO, who: object, what: str, detail: str = "") -> None:
    log.write(f"{time.monotonic():.6f} {who} {what} {detail}".rstrip() + "\n")
    log.flush()


async def run_rank(address: tuple[str, int], rank: int, args: argparse.Namespace,
                   log: TextIO, outcome: dict[int, bool]) -> None:
    cfg = ft.RankConfig(coord_liveness_timeout=args.rank_liveness)
    try:
        async with ft.open_rank(address, salt=ft.SessionSalt.from_hex(args.salt_hex),
                                rank=rank, world_size=args.world_size, config=cfg) as ep:
            sim = SimulatedRank(Stamped(ep, log),  # type: ignore[arg-type]
                                batch_size=args.batch_size, batch_ms=args.batch_ms,
                                jitter=0.2, seed=rank)
            await sim.run()
    except ft.FlodlError as exc:
        note(log, rank, "lost", f"{type(exc).__name__}: {exc}".replace("\n", " "))
        outcome[rank] = False
        return
    note(log, rank, "ended")
    outcome[rank] = True


def coordinator_target(args: argparse.Namespace) -> Any:
    """A fixed address, or (``--etcd``) the store: the relay reads the leader's address from
    it on every dial, and watches it while connected (it leaves a frozen leader for a newer
    one as soon as the store names it)."""
    if args.etcd is None:
        host, _, port = args.coordinator.rpartition(":")
        return (host, int(port))
    # a whole store URL (etcds:// with its TLS and user options), or HOST:PORT and --prefix
    return open_store(args.etcd) if "://" in args.etcd else EtcdStore(args.etcd, args.prefix)


async def main(args: argparse.Namespace, log: TextIO) -> int:
    ranks = parse_ranks(args.ranks)
    outcome: dict[int, bool] = {}
    cfg = ft.RelayConfig(coordinator_grace=args.grace, coord_liveness_timeout=args.liveness,
                         handshake_timeout=args.handshake_timeout)
    async with ft.open_relay(coordinator_target(args),
                             salt=ft.SessionSalt.from_hex(args.salt_hex), host=args.host,
                             ranks=ranks, world_size=args.world_size, config=cfg) as relay:
        async with trio.open_nursery() as nursery:
            for rank in ranks:
                nursery.start_soon(run_rank, relay.rank_address, rank, args, log, outcome)
            exit_ = await relay.wait_closed()
        note(log, "relay", "exit", exit_.reason.replace("\n", " "))
    return 0 if len(outcome) == len(ranks) and all(outcome.values()) else 1


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--coordinator", help="HOST:PORT of the coordinator")
    where.add_argument("--etcd", help="etcd HOST:PORT (or a whole etcd[s]:// store URL) whose "
                       "store names the leader")
    parser.add_argument("--prefix", default="flodl/bench", help="with --etcd: the store prefix")
    parser.add_argument("--salt-hex", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--ranks", required=True, help="0,1 or 0-3")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batch-ms", type=float, default=20.0)
    parser.add_argument("--grace", type=float, default=20.0, help="RelayConfig.coordinator_grace")
    parser.add_argument("--liveness", type=float, default=1.0,
                        help="RelayConfig.coord_liveness_timeout (a SIGSTOPped coordinator)")
    parser.add_argument("--handshake-timeout", type=float, default=2.0,
                        help="RelayConfig.handshake_timeout: a re-dial that reaches a SIGSTOPped "
                             "old leader (its address still published) hangs this long")
    parser.add_argument("--rank-liveness", type=float, default=30.0)
    parser.add_argument("--log", required=True)
    parser.add_argument("--log-level", default="ERROR")
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level.upper(), format="%(name)s: %(message)s")
    with open(args.log, "a") as log:
        try:
            return trio.run(main, args, log)
        except ft.FlodlError as exc:
            note(log, "relay", "failed", f"{type(exc).__name__}: {exc}".replace("\n", " "))
            return 1
        except KeyboardInterrupt:
            return 130


if __name__ == "__main__":
    sys.exit(cli())
