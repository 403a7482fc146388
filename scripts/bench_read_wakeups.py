"""What one read wake-up costs in Trio, and what reading many sockets from one task would save
(issue 23: is a coordinator-side reader hub worth building for the idle cluster?).

N loopback socket pairs; a child process writes one 120-byte message to one socket after the
other at ``--rate`` a second (each arrives alone, as an idle cluster's ``Liveness`` records do).
This process reads them in one of three ways and reports its CPU per message read:

- ``tasks``: one Trio task per socket, ``wait_readable`` then ``read`` (the coordinator's
  readers today);
- ``hub``: one task waits on a private ``epoll`` holding every socket (registered once), then
  reads each ready socket (as ``net._handshake_hub`` does for handshakes);
- ``hub + tick``: the same, sleeping ``--tick`` seconds after each wake-up, so that the messages
  of that time are read in one wake-up (adds up to ``--tick`` of latency to every message).

    .venv/bin/python scripts/bench_read_wakeups.py [--sockets 512 2048] [--rate 1000]
        [--runs 3] [--json]
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import time
from typing import Any

import _report as rep
import trio

MESSAGE = b"x" * 120


def _writer(peers: list[socket.socket], rate: float, seconds: float) -> None:
    gap, start, i = 1.0 / rate, time.monotonic(), 0
    while time.monotonic() - start < seconds:
        try:
            peers[i % len(peers)].send(MESSAGE)
        except BlockingIOError:
            pass
        i += 1
        pause = start + i * gap - time.monotonic()
        if pause > 0:
            time.sleep(pause)


async def _read(mode: str, socks: list[socket.socket], tick: float, window: float
                ) -> tuple[int, float, float]:
    count = 0

    async def one(sock: socket.socket) -> None:
        nonlocal count
        fd = sock.fileno()
        while True:
            await trio.lowlevel.wait_readable(fd)
            os.read(fd, 65536)
            count += 1

    async def hub() -> None:
        nonlocal count
        with select.epoll() as ep:
            for sock in socks:
                ep.register(sock.fileno(), select.EPOLLIN)
            while True:
                await trio.lowlevel.wait_readable(ep.fileno())
                for fd, _ in ep.poll(0, 512):
                    os.read(fd, 65536)
                    count += 1
                if tick:
                    await trio.sleep(tick)

    async with trio.open_nursery() as nursery:
        if mode == "tasks":
            for sock in socks:
                nursery.start_soon(one, sock)
        else:
            nursery.start_soon(hub)
        await trio.sleep(0.5)  # warm up
        c0, p0, w0 = count, time.process_time(), time.monotonic()
        await trio.sleep(window)
        reads, cpu, wall = count - c0, time.process_time() - p0, time.monotonic() - w0
        nursery.cancel_scope.cancel()
    return reads, cpu, wall


def one_run(mode: str, sockets: int, rate: float, tick: float, window: float) -> dict[str, Any]:
    pairs = [socket.socketpair() for _ in range(sockets)]
    for a, b in pairs:
        a.setblocking(False)
        b.setblocking(False)
    pid = os.fork()
    if pid == 0:  # the writer
        try:
            for a, _ in pairs:
                a.close()
            _writer([b for _, b in pairs], rate, window + 1.0)
        finally:
            os._exit(0)
    try:
        for _, b in pairs:
            b.close()
        reads, cpu, wall = trio.run(_read, mode, [a for a, _ in pairs], tick, window)
    finally:
        os.waitpid(pid, 0)
        for a, _ in pairs:
            a.close()
    return {"mode": mode if not tick else f"hub + {tick * 1000:g} ms tick", "sockets": sockets,
            "reads_s": reads / wall, "cpu_pct": 100 * cpu / wall,
            "us_read": 1e6 * cpu / max(1, reads)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sockets", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--rate", type=float, default=1000.0, help="messages a second, in all")
    p.add_argument("--tick", type=float, default=0.005)
    p.add_argument("--seconds", type=float, default=3.0, help="measured window per run")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one run of 1.5 s per case")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.runs, args.seconds = 1, 1.5
    print(rep.machine_note())
    rows = []
    for sockets in args.sockets:
        for mode, tick in (("tasks", 0.0), ("hub", 0.0), ("hub", args.tick)):
            runs = [one_run(mode, sockets, args.rate, tick, args.seconds)
                    for _ in range(args.runs)]
            rows.append(rep.medians(runs))
    print(rep.table([("read by", "mode", ""), ("sockets", "sockets", "d"),
                     ("reads/s", "reads_s", ".0f"), ("CPU %", "cpu_pct", ".1f"),
                     ("CPU us/read", "us_read", ".1f")], rows))
    print(f"medians of {args.runs} runs; one message per socket in turn, {args.rate:g}/s in all")
    # The comparison is the table; the target only says the measurement is valid (every
    # message was read as it came, the reader never fell behind).
    targets = [rep.target(f"{r['mode']}, {int(r['sockets'])} sockets: reads / messages sent",
                          r["reads_s"] / args.rate, ">=", 0.95) for r in rows]
    rep.finish("read_wakeups", rows, targets, args.json)


if __name__ == "__main__":
    main()
