"""``run.py --kill-coordinator``: the run whose coordinator is SIGKILLed mid-epoch.

The coordinator is ``coordinator.py`` (its session in ``OUT/session.db``); this process starts it,
the two relays and the four ranks, SIGKILLs the coordinator ``--kill-after-syncs`` syncs into
epoch ``--kill-epoch``, and starts it again at once with the same command on the same port and
store. The relays notice the lost connection, keep their ranks connected (they get
``CoordinatorReconnecting``, not ``CoordinatorLost``), re-dial until the new coordinator answers,
and resume; it adopts the session and its scheduler resumes from the last checkpoint.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import trio
from run import HERE, free_port, start_host

import flodl_trio as ft


class CoordinatorProcess:
    """One ``coordinator.py`` process; its lines are echoed and kept."""

    def __init__(self, proc: trio.Process, name: str) -> None:
        self.proc = proc
        self.name = name
        self.lines: list[str] = []

    @classmethod
    async def start(cls, nursery: trio.Nursery, command: list[str],
                    name: str) -> CoordinatorProcess:
        proc = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE)
        this = cls(proc, name)
        nursery.start_soon(this._collect)
        return this

    async def _collect(self) -> None:
        assert self.proc.stdout is not None
        pending = b""
        async for chunk in self.proc.stdout:
            pending += chunk
            *complete, pending = pending.split(b"\n")
            for raw in complete:
                line = raw.decode(errors="replace")
                self.lines.append(line)
                print(f"[{self.name}] {line}", flush=True)

    async def wait_line(self, predicate: Any, count: int = 1) -> list[str]:
        """Poll the lines (the caller bounds the time)."""
        while len(found := [s for s in self.lines if predicate(s)]) < count:
            if self.proc.returncode is not None:
                raise RuntimeError(f"{self.name} ended (status {self.proc.returncode}) after "
                                   f"printing: {self.lines[-10:]}")
            await trio.sleep(0.01)
        return found


def clock(line: str) -> float:
    """The ``t=`` (monotonic) of a ``coordinator ...`` line."""
    return float(line.split()[2].removeprefix("t="))


def words_after_time(line: str) -> str:
    """What follows the ``t=...`` word of a ``coordinator ...`` line."""
    return line.split(" ", 3)[3] if len(line.split(" ", 3)) > 3 else ""


async def run_with_coordinator_killed(args: Any) -> tuple[Any, Any, float, dict[str, Any],
                                                          list[dict[str, Any]], list[int]]:
    out = Path(args.out)
    salt = ft.SessionSalt.generate()
    address = f"127.0.0.1:{free_port()}"
    command = [sys.executable, str(HERE / "coordinator.py"), "--listen", address, "--salt-hex",
               salt.hex(), "--store", str(out / "session.db"), "--out", str(out), "--epochs",
               str(args.epochs), "--batch-size", str(args.batch_size)]
    procs: dict[str, trio.Process] = {}
    killed: dict[str, Any] = {}
    started = time.monotonic()
    async with trio.open_nursery() as nursery:
        first = await CoordinatorProcess.start(nursery, command, "coordinator 1")
        for host in ("host-a", "host-b"):
            await start_host(nursery, procs, host, address, salt, args)
        with trio.fail_after(600):
            begun = await first.wait_line(lambda s: s.startswith("coordinator epoch_started ")
                                          and f"epoch={args.kill_epoch}" in s.split())
            since = clock(begun[0])
            await first.wait_line(lambda s: s.startswith("coordinator sync ")
                                  and clock(s) > since, args.kill_after_syncs)
            first.proc.send_signal(signal.SIGKILL)
            killed.update(at=time.monotonic(), epoch=args.kill_epoch,
                          after_syncs=args.kill_after_syncs, what="coordinator")
            print(f"SIGKILLed the coordinator in epoch {args.kill_epoch} after "
                  f"{args.kill_after_syncs} syncs; starting it again", flush=True)
            await first.proc.wait()
            second = await CoordinatorProcess.start(nursery, command, "coordinator 2")
            await second.wait_line(lambda s: s.startswith("coordinator leader "))
            killed["adopted_after_s"] = time.monotonic() - killed["at"]
            await second.proc.wait()
            if second.proc.returncode != 0:
                raise RuntimeError(f"the restarted coordinator failed: {second.lines[-10:]}")
            for name, proc in procs.items():  # the ranks evaluate, write their result, exit
                if name.startswith("rank"):
                    await proc.wait()
        nursery.cancel_scope.cancel()
    wall = time.monotonic() - started
    summary = json.loads((out / "summary.json").read_text())
    summary["deaths"] = {int(r): why for r, why in summary["deaths"].items()}
    latest: dict[int, dict[str, Any]] = {}
    for line in (out / "coverage.jsonl").read_text().splitlines():
        row = json.loads(line)
        latest[row["epoch"]] = row  # a later coordinator's record of an epoch wins
    coverage = [SimpleNamespace(epoch=e, samples=r["samples"], total=r["total"], exact=r["exact"],
                                per_rank={int(k): v for k, v in r["per_rank"].items()})
                for e, r in sorted(latest.items())]
    if len(coverage) != summary["epochs_completed"]:
        raise RuntimeError(f"coverage of epochs {sorted(latest)}, expected "
                           f"{summary['epochs_completed']} epochs")
    lines = first.lines + second.lines
    groups = [json.loads(words_after_time(s)) for s in lines
              if s.startswith("coordinator group ")]
    rejoined = sorted(int(s.split("rank=")[1].split()[0]) for s in lines
                      if s.startswith("coordinator rejoined "))
    return (SimpleNamespace(**summary), coverage, wall, killed, groups, rejoined)

