"""Real relay and rank processes (the ``flodl_trio`` CLI) for the kill scenarios and the
network-namespace test: start them, read what they print, SIGKILL them, always reap them."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Literal

import attrs
import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.events import FormationFailed, RankDeclaredDead

from .util import EventLog, Outcome, first

SALT_ENV = "FLODL_SALT_HEX"
_MAX_LINES = 100_000
LISTENING = re.compile(r"listening for ranks on (?P<host>[^\s]+):(?P<port>\d+)")


class Child:
    """One child process and every line it printed so far (stdout and stderr merged)."""

    def __init__(self, name: str, proc: trio.Process) -> None:
        self.name = name
        self.proc = proc
        self.lines: list[str] = []
        self.ended = False
        self.killed_at: float | None = None
        self._changed = trio.Event()

    @classmethod
    async def start(cls, nursery: trio.Nursery, name: str, argv: Sequence[str], *,
                    env: dict[str, str], prefix: Sequence[str] = ()) -> Child:
        proc = await trio.lowlevel.open_process(
            [*prefix, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=env)
        child = cls(name, proc)
        nursery.start_soon(child._collect, name=f"collect {name}")
        return child

    async def _collect(self) -> None:
        assert self.proc.stdout is not None
        pending = b""
        try:
            async for chunk in self.proc.stdout:
                pending += chunk
                *complete, pending = pending.split(b"\n")
                self.lines.extend(line.decode(errors="replace") for line in complete)
                self._wake()
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # stop() closed the pipe
        finally:
            self.ended = True
            self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    @property
    def running(self) -> bool:
        return self.proc.returncode is None

    async def wait_line(self, predicate: Callable[[str], bool]) -> str:
        """The first printed line satisfying ``predicate`` (the caller bounds the time).

        Raises:
            RuntimeError: the process closed its output first; the message holds its lines.
        """
        for _ in range(_MAX_LINES):  # each pass waits for a new line (or the end)
            for line in self.lines:
                if predicate(line):
                    return line
            if self.ended:
                raise RuntimeError(f"{self.name} ended (status {self.proc.returncode}) "
                                   f"after printing: {self.lines[-10:]}")
            await self._changed.wait()
        raise RuntimeError(f"{self.name}: no matching line in {_MAX_LINES} lines")

    def kill(self) -> None:
        """SIGKILL it now if it still runs."""
        if self.running:
            self.killed_at = trio.current_time()
            self.proc.kill()

    async def stop(self) -> None:
        """Kill it if it still runs, reap it, close its pipe (idempotent, shielded)."""
        with trio.CancelScope(shield=True):
            if self.running:
                self.proc.kill()
            await self.proc.wait()
            if self.proc.stdout is not None:
                await self.proc.stdout.aclose()


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "flodl_trio", *args]


def child_env(salt: ft.SessionSalt) -> dict[str, str]:
    env = dict(os.environ)
    env[SALT_ENV] = salt.hex()
    env.pop("FLODL_NET_TIMEOUT_SCALE", None)  # the children run with the default deadlines
    return env


def rank_address(line: str) -> tuple[str, int]:
    match = LISTENING.search(line)
    assert match is not None, line
    return match["host"], int(match["port"])


# ------------------------------------------------------------------ the SIGKILL scenarios

HOSTS = {"host-a": (0, 1), "host-b": (2,)}
WORLD = 3
VICTIMS = ("relay host-a", "relay host-b", "rank 0", "rank 1", "rank 2")
# When the kill lands in formation a timeout is one outcome. 8 s, not 5 s: the six CLI processes
# start one after another (about 1 s of imports each on a loaded 2-core machine), and a victim that
# was never spawned before the timeout is a load artefact, not an outcome.
FORMATION_TIMEOUT = 8.0
# When the kill lands in the run, formation itself is not under test: a generous deadline keeps
# a loaded CI machine (process start-up is CPU-bound) from turning into a false failure.
RUN_PHASE_FORMATION_TIMEOUT = 15.0
HANDSHAKE_TIMEOUT = 2.0
RUN_SECONDS = 1.5
SHUTDOWN_GRACE = 2.0


@attrs.frozen
class KillPlan:
    """Which process dies, in which phase, how long after that phase began."""

    victim: str
    phase: Literal["formation", "run"]
    delay: float

    @property
    def formation_timeout(self) -> float:
        return FORMATION_TIMEOUT if self.phase == "formation" else RUN_PHASE_FORMATION_TIMEOUT

    @property
    def deadline(self) -> float:
        """The scenario's bound: formation, the run, shutdown grace and process reaping."""
        return self.formation_timeout + RUN_SECONDS + SHUTDOWN_GRACE + 5

    @property
    def victim_ranks(self) -> frozenset[int]:
        kind, name = self.victim.split(" ", 1)
        return frozenset(HOSTS[name]) if kind == "relay" else frozenset({int(name)})

    def __str__(self) -> str:
        return f"kill {self.victim} {self.delay:.2f}s into {self.phase}"


def kill_plans(count: int, *, seed: int = 1234) -> list[KillPlan]:
    """``count`` kill plans: phases alternate, victims rotate, the moment is drawn from
    ``random.Random(seed)`` (formation: 0-1.6 s after the processes are started, which spans
    their start-up, the rank handshakes, the upstream handshakes and the first moments after
    formation; run: 0-1.1 s after formation)."""
    rng = random.Random(seed)
    plans = []
    for i in range(count):
        phase: Literal["formation", "run"] = "formation" if i % 2 == 0 else "run"
        top = 1.6 if phase == "formation" else RUN_SECONDS - 0.4
        victim = VICTIMS[i % len(VICTIMS)]  # 10 plans: every victim in both phases
        plans.append(KillPlan(victim, phase, round(rng.uniform(0.0, top), 3)))
    return plans


async def kill_scenario(plan: KillPlan) -> Outcome:
    """Coordinator here, relays and ranks as CLI processes on 127.0.0.1; one is SIGKILLed.

    The coordinator broadcasts ``SetGlobalStep`` for ``RUN_SECONDS`` once formed. Its config
    (``max_failure=2``) turns the loss of host-a into a ``ClusterFailure``.
    """
    salt = ft.SessionSalt.generate()
    env = child_env(salt)
    out = Outcome(str(plan), EventLog())
    children: dict[str, Child] = {}
    config = ft.CoordinatorConfig(
        world_size=WORLD, formation_timeout=plan.formation_timeout,
        handshake_timeout=HANDSHAKE_TIMEOUT, heartbeat_timeout=5, shutdown_grace=SHUTDOWN_GRACE,
        max_failure=ft.MaxFailure.absolute(2))
    phase_started = {"formation": trio.current_time()}
    formed = trio.Event()

    async def start_host(nursery: trio.Nursery, host: str, ranks: Sequence[int],
                         port: int) -> None:
        relay = await Child.start(nursery, f"relay {host}", cli(
            "relay", "--coordinator", f"127.0.0.1:{port}", "--host", host,
            "--ranks", ",".join(map(str, ranks)), "--world-size", str(WORLD)), env=env)
        children[relay.name] = relay
        try:
            line = await relay.wait_line(lambda s: "listening for ranks" in s)
        except RuntimeError:
            if relay.killed_at is not None:
                return  # killed before it bound its rank port: its ranks are never started
            raise
        address = rank_address(line)
        for r in ranks:
            child = await Child.start(nursery, f"rank {r}", cli(
                "rank", "--relay", f"{address[0]}:{address[1]}", "--rank", str(r),
                "--world-size", str(WORLD), "--batch-ms", "5"), env=env)
            children[child.name] = child

    async def killer() -> None:
        if plan.phase == "run":
            await formed.wait()
        await trio.sleep_until(phase_started[plan.phase] + plan.delay)
        for _ in range(int(plan.deadline / 0.005)):  # not spawned yet: kill it at birth
            if plan.victim in children:
                break
            await trio.sleep(0.005)
        victim = children.get(plan.victim)
        if victim is not None:
            victim.kill()
            out.details["killed_at"] = victim.killed_at

    async def body(coord: ft.Coordinator) -> None:
        phase_started["run"] = trio.current_time()
        formed.set()
        with trio.move_on_after(RUN_SECONDS):
            for step in range(1, int(RUN_SECONDS / 0.05) + 1):
                out.details["steps"] = step
                try:
                    await coord.broadcast_control(wire.SetGlobalStep(global_step=step))
                except ft.BroadcastError as exc:
                    out.details.setdefault("broadcast_errors", []).append(exc)
                await trio.sleep(0.05)

    started = trio.current_time()
    try:
        with trio.fail_after(plan.deadline):  # the coordinator never hangs
            async with trio.open_nursery() as nursery:
                bound = await ft.bind_coordinator(("127.0.0.1", 0))
                for host, ranks in HOSTS.items():
                    nursery.start_soon(start_host, nursery, host, ranks, bound.address[1])
                nursery.start_soon(killer)
                try:
                    async with ft.open_coordinator(bound, salt=salt, config=config,
                                                   timeline=out.log) as coord:
                        out.formed = True
                        try:
                            await body(coord)
                        finally:
                            out.dead = {r: coord.dead_reason(r) or ""
                                        for r in sorted(coord.dead_ranks)}
                except (ft.FormationError, ft.ClusterFailure) as exc:
                    out.error = exc
                    if isinstance(exc, ft.ClusterFailure) and not out.dead:
                        out.dead = dict.fromkeys(sorted(exc.dead), "")
                await _let_survivors_exit(out, plan, children)
                nursery.cancel_scope.cancel()
    finally:
        for child in children.values():
            await child.stop()
    out.details["seconds"] = trio.current_time() - started
    out.details["children"] = {name: (c.proc.returncode, c.lines[-5:])
                               for name, c in children.items()}
    out.leaks = [name for name, c in children.items() if c.running]
    _decide(out)
    return out


async def _let_survivors_exit(out: Outcome, plan: KillPlan, children: dict[str, Child]) -> None:
    """After a formed run the untouched processes must end on their own (Shutdown, EOF)."""
    if not out.formed:
        return
    doomed = {f"rank {r}" for r in plan.victim_ranks} | {plan.victim}
    survivors = [c for name, c in children.items() if name not in doomed]
    with trio.move_on_after(5):
        for child in survivors:
            await child.proc.wait()
    out.details["survivor_status"] = {c.name: c.proc.returncode for c in survivors}


def _decide(out: Outcome) -> None:
    killed_at = out.details.get("killed_at")
    if killed_at is None:
        out.decision = "victim never killed"
        return
    failed = first(out.log, FormationFailed)
    death = first(out.log, RankDeclaredDead)
    if failed is not None:
        out.decision = f"formation failed: {failed[1].reason.split(':', 1)[0]}"
        out.decision_time = failed[0] - killed_at
    elif death is not None:
        out.decision = f"declared dead: {death[1].reason}"
        out.decision_time = death[0] - killed_at
    else:
        out.decision = "no effect (killed after the run)"


async def kill_scenarios(plans: Sequence[KillPlan], *, concurrency: int = 2) -> list[Outcome]:
    """Run the scenarios, ``concurrency`` at a time (each has its own coordinator and ports)."""
    outcomes: list[Outcome | None] = [None] * len(plans)
    limiter = trio.CapacityLimiter(concurrency)

    async def one(i: int) -> None:
        async with limiter:
            outcomes[i] = await kill_scenario(plans[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(plans)):
            nursery.start_soon(one, i)
    return [o for o in outcomes if o is not None]


def explained(out: Outcome, plan: KillPlan) -> list[str]:
    """Every way ``out`` is not a clean formation or a clean, explained FlodlError."""
    problems: list[str] = []
    if out.leaks:
        problems.append(f"processes left running: {out.leaks}")
    if out.error is not None:
        text = str(out.error)
        if isinstance(out.error, ft.FormationTimeout):
            match = re.search(r"(\d+)/3 ranks covered", text)
            if match is None or int(match[1]) >= WORLD:
                problems.append(f"FormationTimeout without c/W: {text}")
            if plan.phase != "formation":
                problems.append(f"formation failed although the kill was in the run: {text}")
        elif isinstance(out.error, ft.ClusterFailure):
            if out.error.reason is not ft.SaveReason.MAX_FAILURE_EXCEEDED:
                problems.append(f"unexpected ClusterFailure reason: {text}")
            if not out.error.dead <= plan.victim_ranks:
                problems.append(f"ClusterFailure names ranks that were not killed: {text}")
        else:
            problems.append(f"unexpected {type(out.error).__name__}: {text}")
    if not set(out.dead) <= plan.victim_ranks:
        problems.append(f"dead {sorted(out.dead)} but only {sorted(plan.victim_ranks)} died")
    for rank, why in out.dead.items():
        if why and not any(word in why for word in ("relay", "Exiting", "heartbeat")):
            problems.append(f"rank {rank} dead without an explanation: {why!r}")
    if out.formed and out.error is None and plan.phase == "run" and not out.dead:
        problems.append("a process was killed during the run but nobody was declared dead")
    if out.decision_time is not None and out.decision_time > plan.formation_timeout + 1:
        problems.append(f"decision took {out.decision_time:.2f}s")
    if (plan.phase == "run" and out.decision.startswith("declared dead")
            and out.decision_time is not None and out.decision_time > 1.0):
        # EOF of a killed process reaches the coordinator at once (SPEC §13: < 100 ms).
        problems.append(f"death declared {out.decision_time:.2f}s after the kill")
    bad_exit = {n: s for n, s in out.details.get("survivor_status", {}).items() if s != 0}
    if bad_exit and out.error is None:
        problems.append(f"survivors did not exit cleanly: {bad_exit}")
    return problems
