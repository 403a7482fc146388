"""The status page's own cost at 16,384 ranks, isolated from the ingest of heartbeats.

A roster of 2,048 relays x 8 ranks (302 dead, one exited) feeds ``serve_status``'s ``/events``
on loopback; 0, 1 and 4 viewers (scripts/_sse_viewer.py, processes of their own) read it for a
window each, and this process's CPU time / wall time is the page's cost: one document per tick
for all viewers, so 4 viewers cost about what 1 does. bench_scale.py --viewer measures the same
with the heartbeats of a real 16k-rank world on top (noisier).

    .venv/bin/python scripts/bench_board.py [--window S]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio

from flodl_trio import wire
from flodl_trio.coordinator._board import Board
from flodl_trio.coordinator._boardview import board_document
from flodl_trio.coordinator._roster import Roster
from flodl_trio.status import serve_status


class _Relay:
    def __init__(self, i: int, per_relay: int) -> None:
        self.host = f"host-{i}"
        self.ranks = tuple(range(i * per_relay, (i + 1) * per_relay))
        self.rank_set = frozenset(self.ranks)
        self.peer = f"127.0.0.1:{40000 + i}"
        self.alive = True
        self.model_sigs: dict[str, bytes] = {}


def world(size: int = 16384, per_relay: int = 8) -> tuple[Roster[Any], Board]:
    roster: Roster[Any] = Roster(size)
    board = Board(size)
    for i in range(size // per_relay):
        relay = _Relay(i, per_relay)
        roster.register(relay, 0.0)
        roster.confirm(relay)
    roster.start_running(0.0)
    for r in range(size):
        board.on_message(wire.Heartbeat(rank=r, step_count=7))
    for r in (9, 10, *range(1000, 1300)):
        roster.mark_dead(r, f"rank {r} went silent")
    roster.mark_exited(20)
    return roster, board


async def main(window: float) -> None:
    roster, board = world()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    viewer = str(Path(__file__).with_name("_sse_viewer.py"))
    async with listeners[0], trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: serve_status(
            listeners[0], lambda: {}, request_timeout=5.0, task_status=task_status,
            board_fn=lambda: board_document(roster, board, now=trio.current_time(),
                                            failed=False, extras={})))
        print("16384 ranks over 2048 relays; CPU of the serving process per viewer count")
        for viewers in (0, 1, 4):
            procs = [await trio.lowlevel.open_process(
                [sys.executable, viewer, f"127.0.0.1:{port}", str(window + 1)],
                stdout=subprocess.PIPE) for _ in range(viewers)]
            await trio.sleep(0.8)  # connected, first document read
            c0, w0 = time.process_time(), time.monotonic()
            await trio.sleep(window)
            cpu = (time.process_time() - c0) / (time.monotonic() - w0)
            seen = []
            for proc in procs:
                assert proc.stdout is not None
                out = b""
                while chunk := await proc.stdout.receive_some():
                    out += chunk
                await proc.wait()
                seen.append(out.decode().strip())
            print(f"viewers {viewers}: CPU {cpu * 100:.1f}% of a core; {seen[:1]}", flush=True)
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--window", type=float, default=10.0, help="seconds per viewer count")
    trio.run(main, parser.parse_args().window)
