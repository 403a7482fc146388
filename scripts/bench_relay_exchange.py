"""The coordinator's CPU per relay exchange, in one process (issue 23): for A/B of the reader.

R relays (real loopback TCP, the library's upstream handshake, driven here) join a library
coordinator; then, one relay at a time, each writes one pre-sealed ``Liveness`` record for its 8
ranks and the script waits until the coordinator delivered the 8 ``Heartbeat`` on
``coord.timing``: one record per wake-up, as in an idle cluster. It prints the process CPU per
record (the writes and the consumer included: the same on both sides of an A/B). Deterministic
with ``valgrind --tool=callgrind``: run it with two ``--rounds`` and divide the difference of the
instruction counts by the difference of the records.

    .venv/bin/python scripts/bench_relay_exchange.py [--relays R] [--rounds N] [--json]
"""

from __future__ import annotations

import argparse
import math
import os
import time

import _report as rep
import _wireload as load
import trio

import flodl_trio as ft
from flodl_trio import wire


async def run(relays: int, rounds: int) -> dict[str, float]:
    salt = ft.SessionSalt.generate()
    bound = await ft.bind_coordinator(("127.0.0.1", 0))
    # No CoordHeartbeat and no staleness in the window: only the relays' records are measured.
    cfg = ft.CoordinatorConfig(world_size=relays * 8, formation_timeout=60,
                               heartbeat_timeout=3600, heartbeat_interval=3600,
                               relay_heartbeat_rate=math.inf, shutdown_grace=1)
    joined: list[tuple[int, list[bytes]]] = []

    async with trio.open_nursery() as nursery:
        async def join(i: int) -> None:
            stream = await trio.open_tcp_stream(*bound.address)
            ranks = tuple(range(i * 8, i * 8 + 8))
            machine = wire.RelayHandshake(salt, host=f"relay-{i}", ranks=ranks,
                                          world_size=relays * 8, coordinator="bench")
            done = await load.drive_handshake(stream, machine)
            assert isinstance(done, wire.Established), done
            payload = wire.encode(wire.Liveness(ranks=ranks, steps=(7,) * 8, ages=(0.5,) * 8))
            control = wire.RecordKind.CONTROL
            joined.append((stream.socket.fileno(),
                           [done.sealer.seal(control, 0, payload) for _ in range(rounds + 5)]))
            streams.append(stream)

        streams: list[trio.SocketStream] = []
        for i in range(relays):
            nursery.start_soon(join, i)
        async with ft.open_coordinator(bound, salt=salt, config=cfg) as coord:
            got, target = 0, 0
            arrived = trio.Event()

            def count(taken: int) -> None:
                nonlocal got
                got += taken
                if got >= target:
                    arrived.set()

            nursery.start_soon(load.drain, coord.timing, count)

            async def one_round(k: int) -> None:
                nonlocal target, arrived
                for fd, records in joined:
                    target += 8
                    arrived = trio.Event()
                    os.write(fd, records[k])
                    await arrived.wait()

            for k in range(5):  # warm-up: every relay's first records, every rank's Heartbeat
                await one_round(k)
            c0, w0 = time.process_time(), time.perf_counter()
            for k in range(5, rounds + 5):
                await one_round(k)
            cpu, wall = time.process_time() - c0, time.perf_counter() - w0
            nursery.cancel_scope.cancel()  # the coordinator shuts down (Goodbye), then:
    for stream in streams:
        await trio.aclose_forcefully(stream)
    records = rounds * relays
    return {"relays": relays, "records": records, "cpu_us": cpu / records * 1e6,
            "wall_us": wall / records * 1e6}


COLUMNS = [("relays", "relays", "d"), ("records", "records", "d"),
           ("CPU us/record", "cpu_us", ".1f"), ("wall us/record", "wall_us", ".1f")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--relays", type=int, default=64)
    p.add_argument("--rounds", type=int, default=200, help="records per relay measured")
    p.add_argument("--quick", action="store_true", help="50 rounds")
    p.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = p.parse_args()
    rounds = 50 if args.quick else args.rounds
    print(rep.machine_note())
    row = trio.run(run, args.relays, rounds)
    print(rep.table(COLUMNS, [row]))
    rep.finish("relay_exchange", [row], [], args.json)


if __name__ == "__main__":
    main()
