"""One simulated rank for scripts/nemesis.py: ``flodl-trio rank`` with a log of every control
message it is handed, so that the checker can tell which coordinator generation each one came
from (the relay tells its ranks ``CoordinatorResumed{generation}`` when it resumes).

    python scripts/_nemesis_rank.py --relay 127.0.0.1:PORT --rank 3 --world-size 8 \\
        --salt-file SALT --batch-ms 100 --batch-size 4 --log DIR/rank-3.log

The log has one line per message, flushed as it arrives, with the wall clock (``time.time()``,
the clock of every other log of the run)::

    1712345678.123456 msg SyncNow
    1712345678.223456 msg CoordinatorResumed 2
    1712345679.000000 end ok Shutdown            (or: end lost CoordinatorLost: ...)
    1712345679.000000 end drained SIGTERM        (its host drained: it left after its sync)

Deadlines come from ``FLODL_NET_TIMEOUT_SCALE`` as for the command, but
``--coord-liveness-timeout``. Exit status as ``flodl-trio rank``: 0 after a graceful
``Shutdown`` or when its host drained (docs/elastic.rst), 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.sim import SimulatedRank


def value_of(msg: Any) -> str:
    """The one field of a message the checker reads ('' for the others)."""
    if isinstance(msg, wire.CoordinatorResumed):
        return str(msg.generation)
    if isinstance(msg, wire.StartEpoch):
        return str(msg.plan.epoch)
    if isinstance(msg, wire.DeclareDead | wire.DeclareAlive):
        return str(msg.rank)
    if isinstance(msg, wire.ShutdownWithSave):
        return ft.SaveReason(msg.reason).name
    return ""


def write(log: TextIO, text: str) -> None:
    log.write(f"{time.time():.6f} {text}".rstrip() + "\n")
    log.flush()


class Logged:
    """A rank endpoint whose delivered messages are logged; everything else is the endpoint's
    (the SimulatedRank reads and sets ``step_count``, sends, iterates)."""

    def __init__(self, endpoint: ft.RankEndpoint, log: TextIO) -> None:
        object.__setattr__(self, "_ep", endpoint)
        object.__setattr__(self, "_log", log)

    def __aiter__(self) -> Logged:
        return self

    async def __anext__(self) -> Any:
        msg = await self._ep.__anext__()
        write(self._log, f"msg {wire.control_label(msg)} {value_of(msg)}")
        return msg

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ep, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._ep, name, value)


async def run(args: argparse.Namespace, salt: ft.SessionSalt, log: TextIO) -> int:
    host, _, port = args.relay.rpartition(":")
    async with ft.open_rank((host, int(port)), salt=salt, rank=args.rank,
                            world_size=args.world_size, config=ft.RankConfig(
                                coord_liveness_timeout=args.coord_liveness_timeout)) as ep:
        write(log, "connected")
        sim = SimulatedRank(Logged(ep, log),  # type: ignore[arg-type]
                            batch_size=args.batch_size, batch_ms=args.batch_ms, jitter=0.2,
                            seed=args.rank)
        record = await sim.run()
    if ep.draining is not None:  # its host left on purpose: it left after its last sync
        write(log, f"end drained {ep.draining}")
        return 0
    last = record.received[-1] if record.received else None
    if isinstance(last, wire.Shutdown) or (
            isinstance(last, wire.ShutdownWithSave)
            and last.reason == ft.SaveReason.GRACEFUL_SHUTDOWN):
        write(log, f"end ok {wire.control_label(last)}")
        return 0
    write(log, f"end failed {wire.control_label(last) if last is not None else 'nothing'}")
    return 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--relay", required=True, help="HOST:PORT of the relay's rank port")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--salt-file", required=True)
    parser.add_argument("--batch-ms", type=float, default=100.0)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--log", required=True)
    parser.add_argument("--coord-liveness-timeout", type=float, default=30.0)
    args = parser.parse_args()
    with open(args.log, "a", encoding="utf-8") as log:
        write(log, "start")
        try:
            salt = ft.SessionSalt.from_hex(Path(args.salt_file).read_text().strip())
            return trio.run(run, args, salt, log)
        except ft.FlodlError as exc:
            text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
            write(log, f"end lost {text}")
            return 1
        except KeyboardInterrupt:
            write(log, "end interrupted")
            return 130


if __name__ == "__main__":
    sys.exit(main())
