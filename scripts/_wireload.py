"""Wire-level load relays for the scale benchmarks (SPEC §13), and the parent's handle on them.

A load process hosts many relay connections in one Trio run and never hosts the coordinator.
Each connection does the real upstream handshake through the library (so protocol changes flow
through), then:
  - reads raw: counts bytes, walks record headers only to timestamp each record's last byte --
    never verifies or decodes (a *sink*). The timestamp is the kernel's receive time of the
    segment (``SO_TIMESTAMPNS``, CLOCK_REALTIME, compare with ``time.time()``): on loopback it is
    taken when the sender's ``send()`` hands the bytes over, so how late this process gets to
    run never counts against the coordinator;
  - optionally writes pre-sealed DATA records carrying rank frames, as fast as asked (a
    *source*): records are sealed ahead of time (``seal N``) and, if the run outlives them,
    sealed on the fly in batches. With ``--frame liveness`` each record is instead the CONTROL
    ``Liveness`` record a library relay sends once per heartbeat interval for all its ranks
    (issue 23: the relay verifies its ranks' Heartbeats and coalesces them).
``--raw`` skips the handshake (the bare-trio floor servers in the benchmarks).

Commands on stdin, one per line; every answer is one JSON object per stdout line:
    dial                  connect every relay (one selectors loop, see ``dial_all``)
                          -> {"dialed": n, "go_t": t, "done_t": t, "errors": [..],
                              "redials": n, "attempts": n, "cpu_s": this process's CPU,
                              "failures": {exception type: count}}
    seal N                seal N records per relay ahead -> {"sealed": total}
    rate R [BURST] [spread]
                          write R records/s per relay (inf: flat out), BURST records per write;
                          with "spread" the relays' writes are spread evenly over one period
                          instead of all at once (relays that joined at different moments)
                          -> {"rate": R, "t": now}
    report                -> {"arrivals": [[t, ...] per relay], "bytes": n, "written": n,
                              "t": monotonic time of the counts}
                          (arrival lists are cleared after each report)
    exit (or EOF)         close everything and exit
"""

from __future__ import annotations

import argparse
import cProfile
import errno
import heapq
import itertools
import json
import math
import os
import resource
import selectors
import socket
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

import flodl_trio as ft
from flodl_trio import wire

HERE = Path(__file__).resolve().parent
_LEN_AT = 13  # offset of payload_len in a record header
_HEAD = wire.RECORD_HEADER_LEN
# Linux (asm-generic/socket.h); Python's socket module does not name them.
SO_TIMESTAMPNS = 35
_TIMESPEC = struct.Struct("@qq")


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one (2,048 relays need ~4k descriptors here)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def emit(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def rank_frame(salt: ft.SessionSalt, kind: str, rank: int) -> bytes:
    """The ControlFrame a load rank sends: a TIMING Batch or a Heartbeat."""
    if kind == "heartbeat":
        return wire.encode_frame(salt, wire.Heartbeat(rank=rank, step_count=7))
    return wire.encode_frame(salt, wire.Batch(rank=rank, batch_ms=12.5, data_ms=0.25,
                                              step_count=1000, param_norm=None,
                                              batch_loss=0.125))


def liveness_payload(ranks: Sequence[int]) -> bytes:
    """The CBOR of the ``Liveness`` record a relay of ``ranks`` sends once per interval (each
    rank heard from once, its heartbeat verified half an interval ago)."""
    return wire.encode(wire.Liveness(ranks=tuple(ranks), steps=(7,) * len(ranks),
                                     ages=(0.5,) * len(ranks)))


async def drive_handshake(stream: trio.abc.Stream,
                          machine: wire.RelayHandshake | wire.CoordinatorHandshake) -> object:
    """Run a sans-IO handshake machine over ``stream`` until its next event that is not
    NEED_DATA (what it queued is written first)."""
    while True:
        event = machine.next_event()
        if out := machine.data_to_send():
            await stream.send_all(out)
        if not isinstance(event, wire.NeedData):
            return event
        machine.receive_data(bytes(await stream.receive_some(65536)))


class LoadRelay:
    """One upstream connection of a load process."""

    def __init__(self, host: str, ranks: list[int], frames: list[bytes], world_size: int,
                 liveness: bytes | None = None) -> None:
        self.host = host
        self.liveness = liveness  # a Liveness payload: every record is that CONTROL record
        self.world_size = world_size
        self.redials = 0
        self.ranks = ranks
        self.frames = frames  # one per rank, cycled through
        self.sock: socket.socket | None = None  # the joined connection (dial_all)
        self.stream: trio.SocketStream | None = None  # the same, once handed to Trio
        self.sealer: wire.RecordSealer | None = None
        self.arrivals: list[float] = []
        self.bytes = 0
        self.written = 0
        self.next_rank = 0
        self.sealed: list[bytes] = []  # pre-sealed records, oldest first
        self.taken = 0
        self._pending = bytearray()  # received bytes not yet forming a whole record

    def seal_ahead(self, n: int) -> None:
        assert self.sealer is not None
        if self.liveness is not None:
            control, payload = wire.RecordKind.CONTROL, self.liveness
            self.sealed.extend(self.sealer.seal(control, 0, payload) for _ in range(n))
            return
        seal, frames, k = self.sealer.seal, self.frames, len(self.frames)
        data = wire.RecordKind.DATA
        ranks = self.ranks
        out = self.sealed
        i = self.next_rank
        for _ in range(n):
            out.append(seal(data, ranks[i], frames[i]))
            i = (i + 1) % k
        self.next_rank = i

    def take(self, n: int) -> bytes:
        """The next ``n`` records as one write, sealing more when the pre-sealed ones run out."""
        if len(self.sealed) - self.taken < n:
            del self.sealed[: self.taken]
            self.taken = 0
            self.seal_ahead(max(n, 256))
        chunk = b"".join(self.sealed[self.taken : self.taken + n])
        self.taken += n
        self.written += n
        return chunk

    def on_bytes(self, data: bytes, now: float) -> None:
        self.bytes += len(data)
        buf = self._pending
        buf += data
        pos = 0
        while len(buf) - pos >= _HEAD:
            end = pos + _HEAD + int.from_bytes(buf[pos + _LEN_AT : pos + _LEN_AT + 4], "little")
            if len(buf) < end:
                break
            self.arrivals.append(now)
            pos = end
        if pos:
            del buf[:pos]

    async def read(self) -> None:
        assert self.stream is not None
        sock = self.stream.socket
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        try:
            while True:
                data, ancillary, _, _ = await sock.recvmsg(262144, 64)
                if not data:
                    break
                now = math.nan
                for level, kind, value in ancillary:
                    if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                        sec, nsec = _TIMESPEC.unpack(value[: _TIMESPEC.size])
                        now = sec + nsec * 1e-9
                self.on_bytes(data, time.time() if math.isnan(now) else now)
        except (OSError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(self.stream)  # the coordinator ended: so do we

    async def write(self, pace: Pace) -> None:
        assert self.stream is not None
        try:
            while True:
                await pace.changed_or_due(self)
                n = pace.due(self)
                if n:
                    await self.stream.send_all(self.take(n))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


REDIAL_AFTER = 0.5  # like the library's relay: a failed attempt is retried this much later
DIAL_PATIENCE = 30.0  # ... for this long at most


class _Attempt:
    """One connection attempt of a load relay in ``dial_all``'s loop."""

    __slots__ = ("machine", "mask", "out", "relay", "sock", "state")

    def __init__(self, relay: LoadRelay, sock: socket.socket,
                 machine: wire.RelayHandshake | None) -> None:
        self.relay = relay
        self.sock = sock
        self.machine = machine
        self.state = "connect"  # then "handshake", "tail" (records after the welcome), "done"
        self.out = b""  # bytes the kernel did not take yet
        self.mask = selectors.EVENT_WRITE  # what the selector waits for (connect: writable)


def dial_all(relays: Sequence[LoadRelay], target: tuple[str, int], salt: ft.SessionSalt,
             raw: bool, failures: dict[str, int] | None = None) -> list[str]:
    """Dial and handshake every relay at once: one non-blocking socket each, driven by one
    ``selectors`` loop (no Trio task, cancel scope or wrapper per connection, so this process's
    own CPU is as small as the handshake allows), each through the library's sans-IO
    ``wire.RelayHandshake``. A failed attempt (a connection the coordinator shed) is retried
    ``REDIAL_AFTER`` later, for ``DIAL_PATIENCE`` at most (``failures`` counts why, by
    exception type). Leaves each joined relay's
    non-blocking socket in ``relay.sock`` and its ``sealer`` set; returns the errors.

    Blocks this process's Trio loop while it runs: the process does nothing else meanwhile."""
    sel = selectors.DefaultSelector()
    coordinator = f"{target[0]}:{target[1]}"
    errors: list[str] = []
    retry: list[tuple[float, int, LoadRelay]] = []  # (due, tie-break, relay), a heap
    ties = itertools.count()
    deadline = time.monotonic() + DIAL_PATIENCE
    left = len(relays)

    def start(relay: LoadRelay) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        machine = None if raw else wire.RelayHandshake(
            salt, host=relay.host, ranks=tuple(relay.ranks), world_size=relay.world_size,
            coordinator=coordinator)
        attempt = _Attempt(relay, sock, machine)
        err = sock.connect_ex(target)
        if err not in (0, errno.EINPROGRESS):
            failed(attempt, OSError(err, os.strerror(err)), registered=False)
            return
        if machine is not None:
            # The magic at once, as a relay sends it: on loopback the connection is usually
            # up before connect_ex returns. If not, it goes once the socket is writable.
            magic = machine.data_to_send()
            try:
                sent = sock.send(magic)
            except OSError:  # not connected yet
                sent = 0
            attempt.out = magic[sent:]
            if not attempt.out:
                attempt.state = "handshake"
                attempt.mask = selectors.EVENT_READ
        sel.register(sock, attempt.mask, attempt)

    def failed(attempt: _Attempt, exc: BaseException, *, registered: bool = True) -> None:
        nonlocal left
        if registered:
            sel.unregister(attempt.sock)
        attempt.sock.close()
        relay = attempt.relay
        relay.redials += 1
        if failures is not None:
            why = type(exc).__name__
            failures[why] = failures.get(why, 0) + 1
        now = time.monotonic()
        if now + REDIAL_AFTER > deadline:
            errors.append(f"{relay.host}: {exc!r}")
            left -= 1
        else:
            heapq.heappush(retry, (now + REDIAL_AFTER, next(ties), relay))

    def joined(attempt: _Attempt) -> None:
        nonlocal left
        sel.unregister(attempt.sock)
        attempt.state = "done"
        attempt.relay.sock = attempt.sock
        left -= 1

    def send(attempt: _Attempt, data: bytes) -> None:
        data = attempt.out + data
        sent = attempt.sock.send(data) if data else 0
        attempt.out = data[sent:]
        mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if attempt.out else 0)
        if mask != attempt.mask:  # one epoll_ctl only when it changes
            attempt.mask = mask
            sel.modify(attempt.sock, mask, attempt)

    def advance(attempt: _Attempt, data: bytes | None) -> None:
        machine = attempt.machine
        assert machine is not None
        if attempt.state == "tail":
            # Records that followed the welcome in its read (a CoordHeartbeat when this
            # process read late): open them until the opener is at a record boundary, so the
            # reader (``on_bytes``) starts on one.
            opener = machine.opener
            if data is not None:
                if not data:
                    raise ft.WireError("EOF right after the welcome")
                opener.push(data)
            while not opener.at_boundary:
                if opener.next_record() is None:
                    return
                attempt.relay.arrivals.append(time.time())
            joined(attempt)
            return
        if data is not None:
            machine.receive_data(data)
        event = machine.next_event()
        send(attempt, machine.data_to_send())
        if isinstance(event, wire.NeedData):
            return
        if not isinstance(event, wire.Established):
            raise ft.HandshakeError(f"{attempt.relay.host}: expected Established, got {event}")
        attempt.relay.sealer = event.sealer
        attempt.state = "tail"
        advance(attempt, None)

    for relay in relays:
        start(relay)
    while left:  # every round handles ready sockets or a due re-dial; bounded by the deadline
        now = time.monotonic()
        while retry and retry[0][0] <= now:
            start(heapq.heappop(retry)[2])
        if not left:
            break
        wait = (retry[0][0] if retry else deadline) - now
        if now > deadline + 5:  # a socket that never answers: give up on what is left
            for key in list(sel.get_map().values()):
                failed(key.data, TimeoutError("no answer"))
            continue
        for key, mask in sel.select(max(0.0, min(wait, 1.0))):
            attempt: _Attempt = key.data
            try:
                if attempt.state == "connect":
                    err = attempt.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if err:
                        raise OSError(err, os.strerror(err))
                    if raw:
                        attempt.relay.sealer = wire.RecordSealer(bytes(32), wire.RELAY_TO_COORD)
                        joined(attempt)
                        continue
                    attempt.state = "handshake"
                    advance(attempt, None)  # the magic
                    continue
                if mask & selectors.EVENT_WRITE and attempt.out:
                    send(attempt, b"")
                if mask & selectors.EVENT_READ:
                    try:
                        data = attempt.sock.recv(65536)
                    except BlockingIOError:
                        continue
                    advance(attempt, data)
            except (OSError, ft.FlodlError) as exc:
                if attempt.state != "done":
                    failed(attempt, exc)
    sel.close()
    return errors


class Pace:
    """The write rate every relay of this process follows (records/s per relay)."""

    def __init__(self) -> None:
        self.rate = 0.0
        self.burst = 64
        self.since = 0.0
        self.base: dict[int, int] = {}  # id(relay) -> written when the rate was set
        self.phase: dict[int, float] = {}  # id(relay) -> its offset into the period (spread)
        self.changed = trio.Event()

    def set(self, rate: float, burst: int, relays: Sequence[LoadRelay],
            spread: bool = False) -> None:
        self.rate, self.burst, self.since = rate, burst, time.monotonic()
        self.base = {id(r): r.written for r in relays}
        period = burst / rate if spread and rate and not math.isinf(rate) else 0.0
        self.phase = {id(r): period * i / len(relays) for i, r in enumerate(relays)} \
            if period else {}
        self.changed.set()
        self.changed = trio.Event()

    def _sent(self, relay: LoadRelay) -> int:
        return relay.written - self.base.get(id(relay), relay.written)

    def due(self, relay: LoadRelay) -> int:
        if self.rate == 0:
            return 0
        if math.isinf(self.rate):
            return self.burst
        elapsed = time.monotonic() - self.since - self.phase.get(id(relay), 0.0)
        owed = int(elapsed * self.rate) - self._sent(relay)
        return max(0, min(owed, self.burst))

    async def changed_or_due(self, relay: LoadRelay) -> None:
        if self.rate == 0:
            await self.changed.wait()
        elif math.isinf(self.rate):
            await trio.lowlevel.checkpoint()
        elif self.phase:
            # Until this relay's next burst is due (a period after the last, without drift).
            due_at = (self.since + self.phase.get(id(relay), 0.0)
                      + (self._sent(relay) + self.burst) / self.rate)
            with trio.move_on_after(max(0.0, due_at - time.monotonic())):
                await self.changed.wait()
        else:
            wait = self.burst / self.rate
            with trio.move_on_after(wait):
                await self.changed.wait()


async def child_main(args: argparse.Namespace) -> None:
    raise_fd_limit()
    salt = ft.SessionSalt.from_hex(args.salt_hex)
    host, port = args.connect.rsplit(":", 1)
    target = (host, int(port))
    relays = []
    for i in range(args.relays):
        first = args.first_rank + i * args.per_relay
        ranks = list(range(first, first + args.per_relay))
        frames = [rank_frame(salt, args.frame, r) for r in ranks]
        relays.append(LoadRelay(f"load{args.id}-{i}", ranks, frames, args.world_size,
                                liveness_payload(ranks) if args.frame == "liveness" else None))
    pace = Pace()
    lines = _stdin_lines()
    async with trio.open_nursery() as nursery:
        async for line in lines:
            cmd, *rest = line.split()
            if cmd == "dial":
                go_t = time.monotonic()
                cpu0 = time.process_time()
                failures: dict[str, int] = {}
                errors = dial_all(relays, target, salt, args.raw, failures)
                cpu_s = time.process_time() - cpu0
                done_t = time.monotonic()
                for relay in relays:
                    if relay.sock is not None:
                        relay.stream = trio.SocketStream(trio.socket.from_stdlib_socket(relay.sock))
                        nursery.start_soon(relay.read)
                        nursery.start_soon(relay.write, pace)
                redials = sum(r.redials for r in relays)
                emit({"dialed": len(relays) - len(errors), "go_t": go_t, "done_t": done_t,
                      "errors": errors[:5], "redials": redials, "cpu_s": cpu_s,
                      "attempts": len(relays) + redials, "failures": failures})
            elif cmd == "seal":
                for relay in relays:
                    relay.seal_ahead(int(rest[0]))
                emit({"sealed": sum(len(r.sealed) for r in relays)})
            elif cmd == "rate":
                pace.set(float(rest[0]), int(rest[1]) if len(rest) > 1 else 64, relays,
                         spread=rest[2:] == ["spread"])
                emit({"rate": rest[0], "t": time.monotonic()})
            elif cmd == "report":
                emit({"arrivals": [r.arrivals for r in relays],
                      "bytes": sum(r.bytes for r in relays),
                      "written": sum(r.written for r in relays), "t": time.monotonic()})
                for relay in relays:
                    relay.arrivals = []
            elif cmd == "exit":
                break
        nursery.cancel_scope.cancel()
    for relay in relays:
        if relay.stream is not None:
            await trio.aclose_forcefully(relay.stream)


async def _stdin_lines() -> Any:
    stdin = trio.lowlevel.FdStream(sys.stdin.fileno())
    pending = b""
    async for chunk in stdin:
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for line in complete:
            if line.strip():
                yield line.decode()


# ------------------------------------------------------------------ the parent's side


class LoadProcess:
    """One running load process: send it commands, await its JSON answers."""

    def __init__(self, proc: trio.Process, relays: int) -> None:
        self.proc = proc
        self.relays = relays
        self._buf = b""

    async def command(self, text: str) -> dict[str, Any]:
        """Send one command and return its JSON answer."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        await self.proc.stdin.send_all((text + "\n").encode())
        while b"\n" not in self._buf:
            chunk = await self.proc.stdout.receive_some(1 << 20)
            if not chunk:
                raise RuntimeError(f"load process ended (status {self.proc.returncode}) "
                                   f"while answering {text!r}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def stop(self) -> None:
        with trio.CancelScope(shield=True):
            if self.proc.returncode is None and self.proc.stdin is not None:
                try:
                    await self.proc.stdin.send_all(b"exit\n")
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            with trio.move_on_after(10):
                await self.proc.wait()
            if self.proc.returncode is None:
                self.proc.kill()
                await self.proc.wait()


async def start_load(target: tuple[str, int], salt: ft.SessionSalt, *, world: int,
                     relays: int, per_relay: int, procs: int, frame: str = "batch",
                     raw: bool = False) -> list[LoadProcess]:
    """Start ``procs`` load processes sharing ``relays`` relays of ``per_relay`` ranks each."""
    out: list[LoadProcess] = []
    first_relay = 0
    for i in range(procs):
        n = relays // procs + (1 if i < relays % procs else 0)
        if n == 0:
            continue
        argv = [sys.executable, str(HERE / "_wireload.py"), "--connect",
                f"{target[0]}:{target[1]}", "--salt-hex", salt.hex(), "--world-size", str(world),
                "--first-rank", str(first_relay * per_relay), "--relays", str(n),
                "--per-relay", str(per_relay), "--id", str(i), "--frame", frame]
        if raw:
            argv.append("--raw")
        proc = await trio.lowlevel.open_process(argv, stdin=subprocess.PIPE,
                                                stdout=subprocess.PIPE)
        out.append(LoadProcess(proc, n))
        first_relay += n
    return out


async def all_command(procs: Sequence[LoadProcess], text: str) -> list[dict[str, Any]]:
    """Send ``text`` to every process at once; their answers in process order."""
    answers: list[dict[str, Any]] = [{} for _ in procs]

    async def one(i: int) -> None:
        answers[i] = await procs[i].command(text)

    async with trio.open_nursery() as nursery:
        for i in range(len(procs)):
            nursery.start_soon(one, i)
    return answers


async def stop_all(procs: Sequence[LoadProcess]) -> None:
    for p in procs:
        await p.stop()


class Cluster:
    """A coordinator of this process, formed by load relays of other processes."""

    def __init__(self, coord: ft.Coordinator, loads: list[LoadProcess],
                 dialed: list[dict[str, Any]], formed_t: float, formation_cpu_s: float) -> None:
        self.coord = coord
        self.loads = loads
        self.dialed = dialed
        self.formed_t = formed_t  # time.monotonic() when open_coordinator returned
        self.formation_cpu_s = formation_cpu_s  # this process's CPU from the dial to then

    @property
    def formation_s(self) -> float:
        """From the first relay's dial to formation complete."""
        return self.formed_t - min(d["go_t"] for d in self.dialed)

    async def command(self, text: str) -> list[dict[str, Any]]:
        return await all_command(self.loads, text)


async def drain(channel: trio.MemoryReceiveChannel[Any],
                on_batch: Callable[[int], None] | None = None) -> None:
    """Consume ``channel`` (``coord.timing``) as the benchmarks do: take everything queued
    before waiting again (an ``async for`` step is one scheduler pass per message, the
    consumer's cost, not the coordinator's); ``on_batch(n)`` after each wake-up, with how many
    it took."""
    receive, receive_nowait = channel.receive, channel.receive_nowait
    while True:
        await receive()
        taken = 1
        try:
            while True:
                receive_nowait()
                taken += 1
        except trio.WouldBlock:
            pass
        if on_batch is not None:
            on_batch(taken)


@asynccontextmanager
async def coordinator_under_load(config: ft.CoordinatorConfig, *, relays: int, per_relay: int,
                                 procs: int, frame: str = "batch",
                                 profile: cProfile.Profile | None = None) -> AsyncIterator[Cluster]:
    """Start the load processes, let them dial, and run a coordinator until they formed it.

    With ``profile``, it is enabled from the dial until formation completed (the coordinator's
    formation, this process only)."""
    salt = ft.SessionSalt.generate()
    bound = await ft.bind_coordinator(("127.0.0.1", 0))
    loads = await start_load(bound.address, salt, world=config.world_size, relays=relays,
                             per_relay=per_relay, procs=procs, frame=frame)
    try:
        async with trio.open_nursery() as nursery:
            dialed: list[dict[str, Any]] = []
            all_dialed = trio.Event()

            async def dial() -> None:
                dialed.extend(await all_command(loads, "dial"))
                all_dialed.set()

            cpu0 = time.process_time()
            nursery.start_soon(dial)
            if profile is not None:
                profile.enable()
            try:
                async with ft.open_coordinator(bound, salt=salt, config=config) as coord:
                    formed_t = time.monotonic()
                    formation_cpu_s = time.process_time() - cpu0
                    if profile is not None:
                        profile.disable()
                    with trio.fail_after(60):
                        await all_dialed.wait()
                    errors = [e for d in dialed for e in d["errors"]]
                    if errors:
                        raise RuntimeError(f"load relays failed to dial: {errors}")
                    yield Cluster(coord, loads, dialed, formed_t, formation_cpu_s)
            finally:
                if profile is not None:
                    profile.disable()  # formation failed: the profile ends anyway
    finally:
        await stop_all(loads)


def dial_cpu_us(answers: Sequence[dict[str, Any]]) -> float:
    """The load processes' CPU per handshake attempt (µs) in their ``dial`` answers."""
    attempts = sum(int(a.get("attempts", 0)) for a in answers)
    return sum(float(a.get("cpu_s", 0.0)) for a in answers) * 1e6 / attempts if attempts \
        else math.nan


def relay_arrivals(answers: Sequence[dict[str, Any]]) -> list[list[float]]:
    """Every relay's record arrival times, across processes."""
    return [times for a in answers for times in a["arrivals"]]


def cli() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--connect", required=True, help="HOST:PORT")
    p.add_argument("--salt-hex", required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--first-rank", type=int, required=True)
    p.add_argument("--relays", type=int, required=True)
    p.add_argument("--per-relay", type=int, required=True)
    p.add_argument("--id", type=int, default=0)
    p.add_argument("--frame", choices=("batch", "heartbeat", "liveness"), default="batch")
    p.add_argument("--raw", action="store_true", help="no handshake (bare-trio floor servers)")
    trio.run(child_main, p.parse_args())


if __name__ == "__main__":
    cli()
