"""The flood family of ``chaos_sweep.py`` (issue 12): junk against a real coordinator process.

Each scenario starts ``_flood_coordinator.py`` (its own process, so its RSS is its own), floods
its port from this process over real loopback sockets, then lets a genuine relay (in this process)
join, and reads the coordinator's counters from its status page and its log lines from its
stderr:

- ``magic-and-close``: connections that send the public control magic and close (FT/1 failed
  formation past 1,024 of them);
- ``silent``: connections that send nothing and stay open (the port mux drops them at
  ``peek_timeout``);
- ``magic-then-silent``: connections that send the magic and then nothing (slowloris at the
  handshake: ``max_pending_handshakes`` sheds the oldest);
- ``partial Hello``: connections that each buffer a Hello as large as the ceiling allows minus
  one byte, held open (FT/1: 303 MB for 1,000 of them);
- ``foreign-rank frames``: an authenticated relay that sends frames speaking for a rank it does
  not carry (FT/1: one WARNING and one event each);
- ``wrong-salt rank hellos``: at a relay's rank port while one of its ranks waits (FT/1: one
  WARNING and one list entry each).
"""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.net._handshake_io import run_handshake
from flodl_trio.status import fetch_state

CHILD = str(Path(__file__).resolve().parent / "_flood_coordinator.py")
DIAL_CONCURRENCY = 100


@attrs.define
class FloodResult:
    scenario: str
    sent: int
    formed: bool = False
    formed_ms: float | None = None
    counts: dict[str, int] = attrs.Factory(dict)
    junk_log_lines: int = 0
    rss_before_mb: float = 0.0
    rss_peak_mb: float = 0.0
    ok: bool = False
    note: str = ""


class Coordinator:
    """The child process, its output lines and its RSS."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self.out: list[str] = []
        self.err: list[str] = []
        self.port = 0
        self.changed = trio.Event()

    async def collect(self, stream: trio.abc.ReceiveStream, lines: list[str]) -> None:
        pending = b""
        async for chunk in stream:
            pending += chunk
            *complete, pending = pending.split(b"\n")
            lines.extend(line.decode(errors="replace") for line in complete)
            self.changed.set()
            self.changed = trio.Event()

    async def wait_line(self, key: str, timeout: float) -> Any:  # noqa: ASYNC109
        with trio.move_on_after(timeout):
            while True:
                for line in self.out:
                    if line.startswith("{") and key in (doc := json.loads(line)):
                        return doc[key]
                await self.changed.wait()
        return None

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def junk_lines(self) -> int:
        return sum(1 for line in self.err if "rejected" in line or "dropped" in line)


async def with_coordinator(world: int, salt: ft.SessionSalt,
                           scenario: Callable[[Coordinator], Awaitable[None]]) -> None:
    env = {**os.environ, "FLODL_SALT_HEX": salt.hex()}
    proc = await trio.lowlevel.open_process(
        [sys.executable, CHILD, "--world-size", str(world)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    child = Coordinator(proc)
    try:
        async with trio.open_nursery() as nursery:
            assert proc.stdout is not None and proc.stderr is not None
            nursery.start_soon(child.collect, proc.stdout, child.out)
            nursery.start_soon(child.collect, proc.stderr, child.err)
            port = await child.wait_line("port", 30)
            if port is None:
                raise RuntimeError(f"flood coordinator did not start: {child.err[-5:]}")
            child.port = int(port)
            await scenario(child)
            assert proc.stdin is not None
            await proc.stdin.aclose()
            with trio.move_on_after(30):
                await proc.wait()
            nursery.cancel_scope.cancel()
    finally:
        if proc.returncode is None:
            proc.kill()
        with trio.CancelScope(shield=True):
            await proc.wait()


async def genuine_relay(port: int, salt: ft.SessionSalt, child: Coordinator,
                        result: FloodResult) -> None:
    """A real relay with two ranks joins; record whether (and when) formation completed."""
    async with trio.open_nursery() as nursery:
        async with ft.open_relay(("127.0.0.1", port), salt=salt, host="genuine", ranks=[0, 1],
                                 world_size=2) as relay:
            for rank in (0, 1):
                nursery.start_soon(_rank, relay.rank_address, salt, rank)
            formed = await child.wait_line("formed", 60)
            result.formed = formed is not None
            result.formed_ms = formed
            result.counts = (await fetch_state(("127.0.0.1", port), timeout=10))[
                "rejected_handshakes"]
            nursery.cancel_scope.cancel()


async def _rank(address: tuple[str, int], salt: ft.SessionSalt, rank: int) -> None:
    async with ft.open_rank(address, salt=salt, rank=rank, world_size=2) as ep:
        async for _ in ep:
            pass


async def dial_many(port: int, count: int, opener: Callable[[trio.abc.Stream], Awaitable[None]],
                    held: list[trio.abc.Stream]) -> None:
    limiter = trio.CapacityLimiter(DIAL_CONCURRENCY)

    async def one() -> None:
        async with limiter:
            try:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
            except OSError:
                return
            held.append(stream)
            try:
                await opener(stream)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one)


async def close_all(held: list[trio.abc.Stream]) -> None:
    for stream in held:
        await trio.aclose_forcefully(stream)
    held.clear()


def connection_flood(name: str, count: int, opener: Callable[[trio.abc.Stream], Awaitable[None]],
                     *, hold: bool) -> Callable[[], Awaitable[FloodResult]]:
    async def run() -> FloodResult:
        salt = ft.SessionSalt.generate()
        result = FloodResult(name, count)

        async def scenario(child: Coordinator) -> None:
            result.rss_before_mb = child.rss_mb()
            held: list[trio.abc.Stream] = []
            await dial_many(child.port, count, opener, held)
            if not hold:
                await close_all(held)
            await trio.sleep(1.0)  # let the coordinator read what was sent
            result.rss_peak_mb = child.rss_mb()
            await genuine_relay(child.port, salt, child, result)
            result.rss_peak_mb = max(result.rss_peak_mb, child.rss_mb())
            result.junk_log_lines = child.junk_lines()
            await close_all(held)

        await with_coordinator(2, salt, scenario)
        return result

    return run


async def send_magic(stream: trio.abc.Stream) -> None:
    await stream.send_all(wire.CHANNEL_MAGIC_CONTROL)


async def send_magic_and_close(stream: trio.abc.Stream) -> None:
    await stream.send_all(wire.CHANNEL_MAGIC_CONTROL)
    await stream.aclose()


async def send_nothing(stream: trio.abc.Stream) -> None:
    await trio.lowlevel.checkpoint()


async def send_partial_hello(stream: trio.abc.Stream) -> None:
    """Magic, wait for the Challenge, then a Hello record declaring the largest payload the
    ceiling allows, all of it but the last byte."""
    await stream.send_all(wire.CHANNEL_MAGIC_CONTROL)
    with trio.move_on_after(10):
        await stream.receive_some(65536)
    size = wire.max_hello_payload(2)
    head = struct.pack("<IIBII", wire.RECORD_MAGIC, wire.PROTOCOL_VERSION,
                       int(wire.RecordKind.CONTROL), 0, size)
    await stream.send_all(head + bytes(8) + os.urandom(size - 1))


async def foreign_frames(count: int) -> FloodResult:
    salt = ft.SessionSalt.generate()
    result = FloodResult("foreign-rank frames (authenticated relay)", count)

    async def scenario(child: Coordinator) -> None:
        result.rss_before_mb = child.rss_mb()
        stream = await trio.open_tcp_stream("127.0.0.1", child.port)
        machine = wire.RelayHandshake(salt, host="forger", ranks=(0,), world_size=1,
                                      coordinator=f"127.0.0.1:{child.port}")
        done = await run_handshake(stream, machine)
        assert isinstance(done, wire.Established)
        formed = await child.wait_line("formed", 30)
        result.formed, result.formed_ms = formed is not None, formed
        codec = wire.FrameCodec(salt)
        frames = [codec.encode(wire.Heartbeat(rank=7, step_count=i)) for i in range(count)]
        for start in range(0, count, 1000):
            await stream.send_all(b"".join(done.sealer.seal(wire.RecordKind.DATA, 0, f)
                                           for f in frames[start:start + 1000]))
        with trio.move_on_after(60):
            while True:
                state = await fetch_state(("127.0.0.1", child.port), timeout=10)
                result.counts = state.get("invalid_frames", {})
                if sum(result.counts.values()) >= count:
                    break
                await trio.sleep(0.2)
        result.rss_peak_mb = child.rss_mb()
        result.junk_log_lines = child.junk_lines()
        await trio.aclose_forcefully(stream)

    await with_coordinator(1, salt, scenario)
    return result


class _CountingHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "rejected" in record.getMessage() or "rank port" in record.getMessage():
            self.lines += 1


async def rank_port_flood(count: int) -> FloodResult:
    """Wrong-salt hellos at a relay's rank port while one of its ranks waits (this process's
    relay: its log lines are counted here; the RSS column is the coordinator's)."""
    salt, other = ft.SessionSalt.generate(), ft.SessionSalt.generate()
    result = FloodResult("wrong-salt rank hellos at a relay's rank port", count)
    counter = _CountingHandler()
    relay_log = logging.getLogger("flodl_trio.relay")
    relay_log.addHandler(counter)
    relay_log.setLevel(logging.INFO)

    async def scenario(child: Coordinator) -> None:
        result.rss_before_mb = child.rss_mb()
        async with trio.open_nursery() as nursery:
            async with ft.open_relay(("127.0.0.1", child.port), salt=salt, host="flooded",
                                     ranks=[0, 1], world_size=2) as relay:
                nursery.start_soon(_rank, relay.rank_address, salt, 0)
                hello = wire.encode_rank_hello(other, 1, 2)

                async def wrong_salt(stream: trio.abc.Stream) -> None:
                    await stream.send_all(hello)
                    await stream.receive_some(100)  # the relay closes without an ack
                    await stream.aclose()

                await dial_many(relay.rank_address[1], count, wrong_salt, [])
                result.counts = relay.rank_port_rejects
                nursery.start_soon(_rank, relay.rank_address, salt, 1)
                formed = await child.wait_line("formed", 60)
                result.formed, result.formed_ms = formed is not None, formed
                result.rss_peak_mb = child.rss_mb()
                nursery.cancel_scope.cancel()

    try:
        await with_coordinator(2, salt, scenario)
    finally:
        relay_log.removeHandler(counter)
    result.junk_log_lines = counter.lines
    return result


def judge(result: FloodResult) -> FloodResult:
    """Formation completed, fewer than 100 junk log lines, RSS under 100 MB."""
    result.ok = result.formed and result.junk_log_lines < 100 and result.rss_peak_mb < 100
    return result


async def run_floods(*, scale: float = 1.0) -> list[FloodResult]:
    def n(count: int) -> int:
        return max(1, int(count * scale))

    scenarios = [
        connection_flood("magic-and-close", n(1100), send_magic_and_close, hold=False),
        connection_flood("silent (no bytes), held", n(5000), send_nothing, hold=True),
        connection_flood("magic then silent, held", n(5000), send_magic, hold=True),
        connection_flood("partial Hello (ceiling - 1 B), held", n(1000), send_partial_hello,
                         hold=True),
    ]
    results = [judge(await scenario()) for scenario in scenarios]
    results.append(judge(await foreign_frames(n(20000))))
    results.append(judge(await rank_port_flood(n(5000))))
    return results


def print_floods(results: list[FloodResult]) -> None:
    headers = ("flood", "sent", "formed (ms after start)", "counts by reason", "junk log lines",
               "coordinator RSS before -> peak", "ok")
    rows = [(r.scenario, str(r.sent),
             "no" if not r.formed else f"yes ({r.formed_ms})",
             ", ".join(f"{k} {v}" for k, v in sorted(r.counts.items())) or "-",
             str(r.junk_log_lines), f"{r.rss_before_mb:.1f} -> {r.rss_peak_mb:.1f} MB",
             "yes" if r.ok else "NO") for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    print(" | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for row in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
