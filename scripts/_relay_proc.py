"""One host in one process: a relay and its ranks in one Trio run (used by the failover bench
and by tests/relay/test_killed_relay_process.py, which SIGKILL or SIGSTOP it).

    python scripts/_relay_proc.py --coordinator 127.0.0.1:PORT --salt-hex HEX --host host-a \\
        --ranks 0,1 --world-size 4

The ranks iterate and print one line per control message, flushed, with the wall clock of the
arrival (``time.time()``: the bench compares it with the moment it killed a sibling process):

    relay host-a connected t=1712345678.123456
    rank 1 got DeclareDead 3 t=1712345678.223456
    rank 1 got Shutdown t=...
    rank 1 ended t=...            (clean end of iteration)
    rank 1 lost t=... reason      (CoordinatorLost)
    relay host-a exit t=... reason

With ``--sim-batch-ms MS`` each rank is a :class:`~flodl_trio.sim.SimulatedRank` instead (batches
of ``--batch-size`` samples taking MS each), for a coordinator that drives a SyncScheduler; it
prints each control message it received when it ends, in the same format.

Exit status: 0 when every rank ended cleanly, 1 otherwise.

The parent side lives here too: :class:`RelayProcess` starts one child and collects its lines.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import trio

import flodl_trio as ft
from flodl_trio import wire


def say(what: str, detail: str = "") -> None:
    """One line: what happened, the wall clock now, then any free text."""
    print(f"{what} t={time.time():.6f}" + (f" {detail}" if detail else ""), flush=True)


def parse_ranks(text: str) -> list[int]:
    """``0,1,5`` or ``0-7`` (inclusive), or a mix: ``0-3,8``."""
    out: list[int] = []
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        elif part:
            out.append(int(part))
    return out


def describe(msg: Any) -> str:
    label = wire.control_label(msg)
    if isinstance(msg, wire.DeclareDead | wire.DeclareAlive):
        return f"{label} {msg.rank}"
    if isinstance(msg, wire.StartEpoch):
        return f"{label} {msg.plan.epoch}"
    if isinstance(msg, wire.ShutdownWithSave):
        return f"{label} {ft.SaveReason(msg.reason).name}"
    return label


async def run_rank(address: tuple[str, int], rank: int, args: argparse.Namespace,
                   outcome: dict[int, bool]) -> None:
    cfg = ft.RankConfig(heartbeat_interval=args.heartbeat_interval,
                        coord_liveness_timeout=args.coord_liveness_timeout)
    async with ft.open_rank(address, salt=ft.SessionSalt.from_hex(args.salt_hex), rank=rank,
                            world_size=args.world_size, config=cfg) as ep:
        say(f"rank {rank} ready")
        if args.sim_batch_ms is not None:
            await run_sim(ep, rank, args, outcome)
            return
        try:
            async for msg in ep:
                say(f"rank {rank} got {describe(msg)}")
        except ft.CoordinatorLost as exc:
            say(f"rank {rank} lost", str(exc))
            outcome[rank] = False
            return
        say(f"rank {rank} ended")
        outcome[rank] = True


async def run_sim(ep: ft.RankEndpoint, rank: int, args: argparse.Namespace,
                  outcome: dict[int, bool]) -> None:
    from flodl_trio.sim import SimulatedRank

    sim = SimulatedRank(ep, batch_size=args.batch_size, batch_ms=args.sim_batch_ms)
    try:
        await sim.run()
    except ft.FlodlError as exc:
        say(f"rank {rank} lost", f"{type(exc).__name__}: {exc}")
        outcome[rank] = False
        return
    finally:
        for msg in sim.record.received:
            say(f"rank {rank} got {describe(msg)}")
    say(f"rank {rank} ended")
    outcome[rank] = True


async def main(args: argparse.Namespace) -> int:
    host, _, port = args.coordinator.rpartition(":")
    ranks = parse_ranks(args.ranks)
    outcome: dict[int, bool] = {}
    async with ft.open_relay((host, int(port)), salt=ft.SessionSalt.from_hex(args.salt_hex),
                             host=args.host, ranks=ranks, world_size=args.world_size) as relay:
        async with trio.open_nursery() as nursery:
            for rank in ranks:
                nursery.start_soon(run_rank, relay.rank_address, rank, args, outcome)
            await relay.wait_connected()
            say(f"relay {args.host} connected")
            exit_ = await relay.wait_closed()
        say(f"relay {args.host} exit", exit_.reason)
    return 0 if len(outcome) == len(ranks) and all(outcome.values()) else 1


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator")
    parser.add_argument("--salt-hex", required=True)
    parser.add_argument("--host", required=True, help="this relay's host name")
    parser.add_argument("--ranks", required=True, help="global ranks: 0,1 or 0-7")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--heartbeat-interval", type=float, default=1.0)
    parser.add_argument("--coord-liveness-timeout", type=float, default=30.0)
    parser.add_argument("--sim-batch-ms", type=float, default=None,
                        help="run SimulatedRanks with batches of this many ms")
    parser.add_argument("--batch-size", type=int, default=4, help="with --sim-batch-ms")
    parser.add_argument("--log-level", default="ERROR", help="of the flodl_trio loggers")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(name)s: %(message)s")
    try:
        return trio.run(main, args)
    except ft.FlodlError as exc:
        say(f"relay {args.host} failed", f"{type(exc).__name__}: {exc}")
        return 1
    except KeyboardInterrupt:
        return 130


# ------------------------------------------------------------------ the parent's side


class RelayProcess:
    """A running ``_relay_proc.py`` child and the lines it printed so far.

    Attributes:
        host: the relay's host name.
        proc: the ``trio.Process``.
        lines: every line printed so far, in order.
    """

    def __init__(self, proc: trio.Process, host: str) -> None:
        self.proc = proc
        self.host = host
        self.lines: list[str] = []
        self.ended = False  # its stdout reached EOF
        self._changed = trio.Event()

    @classmethod
    async def start(cls, nursery: trio.Nursery, *, coordinator: tuple[str, int],
                    salt: ft.SessionSalt, host: str, ranks: Sequence[int], world_size: int,
                    extra: Sequence[str] = ()) -> RelayProcess:
        argv = [sys.executable, __file__, "--coordinator", f"{coordinator[0]}:{coordinator[1]}",
                "--salt-hex", salt.hex(), "--host", host,
                "--ranks", ",".join(str(r) for r in ranks), "--world-size", str(world_size),
                *extra]
        proc = await trio.lowlevel.open_process(argv, stdout=subprocess.PIPE)
        child = cls(proc, host)
        nursery.start_soon(child.collect)
        return child

    async def collect(self) -> None:
        """Read its output into :attr:`lines` until EOF (started by :meth:`start`)."""
        assert self.proc.stdout is not None
        pending = b""
        try:
            async for chunk in self.proc.stdout:
                pending += chunk
                *complete, pending = pending.split(b"\n")
                self.lines.extend(line.decode() for line in complete)
                self._wake()
        except trio.ClosedResourceError:
            pass  # stop() closed the pipe
        finally:
            self.ended = True
            self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def matching(self, predicate: Callable[[str], bool]) -> list[str]:
        return [line for line in self.lines if predicate(line)]

    async def wait_lines(self, predicate: Callable[[str], bool], count: int = 1) -> list[str]:
        """Wait until ``count`` printed lines satisfy ``predicate`` (the caller bounds the time).

        Raises:
            RuntimeError: the process closed its output first; the message holds its lines.
        """
        while len(found := self.matching(predicate)) < count:
            if self.ended:
                raise RuntimeError(f"relay process {self.host} ended (status "
                                   f"{self.proc.returncode}) after printing: {self.lines}")
            await self._changed.wait()
        return found

    async def stop(self) -> None:
        """Kill it if it still runs, reap it, close its pipe (idempotent, shielded)."""
        with trio.CancelScope(shield=True):
            if self.proc.returncode is None:
                self.proc.kill()
            await self.proc.wait()
            if self.proc.stdout is not None:
                await self.proc.stdout.aclose()


def arrival_time(line: str) -> float:
    """The ``t=`` wall clock of one printed line."""
    for word in line.split():
        if word.startswith("t="):
            return float(word[2:])
    raise ValueError(f"no t= field in {line!r}")


if __name__ == "__main__":
    sys.exit(cli())
