"""Load generator for the cluster benchmarks: many relays and their ranks in one Trio run.

It never hosts the coordinator. Protocol with the parent (one JSON object per stdout line):
    {"ready": true}                      every local rank is connected to its relay
    (parent writes "go\\n" on stdin)     relays then dial the coordinator
    {"go_t": <monotonic>}                when the relays were released
    {"arrivals": {step: [last_t, n]}}    after Shutdown: per SetGlobalStep value, the latest
                                         arrival time (time.monotonic, one clock machine-wide)
                                         and how many ranks of this process saw it; with it
                                         "cpu_s": this process's CPU seconds per phase (setup:
                                         until "go"; formation: until every local relay joined;
                                         values: until a rank got Shutdown; shutdown: the rest)

With ``--profile F`` each phase after "go" is profiled separately (cProfile: ``F.formation``,
``F.values``, ``F.shutdown``).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import resource
import sys
import time

import trio

import flodl_trio as ft
from flodl_trio.wire import SetGlobalStep


def emit(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def main(args: argparse.Namespace) -> None:
    salt = ft.SessionSalt.from_hex(args.salt_hex)
    host, port = args.coordinator.rsplit(":", 1)
    target = (host, int(port))
    go = trio.Event()
    arrivals: dict[int, list[float]] = {}
    ranks_ready = 0
    total_ranks = args.relays * args.per_relay
    all_ready = trio.Event()
    lost: list[str] = []
    phases = Phases(args.profile)
    joined = 0

    async def dial_when_released() -> trio.abc.Stream:
        await go.wait()
        # The address is numeric: one socket and one connect, as the library's own dial does
        # for a (host, port) target (open_tcp_stream's happy eyeballs cost a nursery, a task
        # and a resolver call per relay).
        sock = trio.socket.socket()
        try:
            await sock.connect(target)
        except BaseException:
            sock.close()
            raise
        return trio.SocketStream(sock)

    async def rank_task(addr: tuple[str, int], rank: int) -> None:
        nonlocal ranks_ready
        cfg = ft.RankConfig(connect_timeout=60, coord_liveness_timeout=120)
        try:
            async with ft.open_rank(addr, salt=salt, rank=rank, world_size=args.world_size,
                                    config=cfg) as ep:
                ranks_ready += 1
                if ranks_ready == total_ranks:
                    all_ready.set()
                async for msg in ep:
                    if isinstance(msg, SetGlobalStep):
                        now = time.monotonic()
                        slot = arrivals.setdefault(int(msg.global_step), [0.0, 0])
                        slot[0] = max(slot[0], now)
                        slot[1] += 1
                phases.enter("shutdown")  # the first rank told to shut down
        except ft.CoordinatorLost as exc:
            lost.append(str(exc))

    async def relay_task(index: int, nursery: trio.Nursery) -> None:
        nonlocal joined
        first = args.first_rank + index * args.per_relay
        ranks = list(range(first, first + args.per_relay))
        cfg = ft.RelayConfig(rank_accept_timeout=120, connect_timeout=120, handshake_timeout=60)
        async with ft.open_relay(dial_when_released, salt=salt, host=f"lg{args.id}-r{index}",
                                 ranks=ranks, world_size=args.world_size, config=cfg) as relay:
            for r in ranks:
                nursery.start_soon(rank_task, relay.rank_address, r)
            await relay.wait_connected()
            joined += 1
            if joined == args.relays:
                phases.enter("values")
            await relay.wait_closed()

    async def read_go() -> None:
        line = await trio.to_thread.run_sync(sys.stdin.readline)
        if line.strip() == "go":
            phases.enter("formation")
            emit({"go_t": time.monotonic()})
            go.set()

    async with trio.open_nursery() as nursery:
        for i in range(args.relays):
            nursery.start_soon(relay_task, i, nursery)
        await all_ready.wait()
        # The setup objects of 128 relays and their ranks in ONE process (a harness artifact:
        # a real host runs one relay and its ranks in processes of their own) are moved out of
        # the collector's reach, as a long-running service does after start-up (gc.freeze);
        # otherwise a full collection over them fell inside the formation window (about 95 ms
        # of the two load generators' 255 ms of formation CPU at 1 rank per relay).
        gc.collect()
        gc.freeze()
        emit({"ready": True})
        nursery.start_soon(read_go)
    phases.enter("end")
    emit({"arrivals": {str(k): v for k, v in arrivals.items()}, "lost": lost[:3],
          "lost_count": len(lost), "cpu_s": phases.cpu})


class Phases:
    """CPU seconds per phase of this process, and with ``profile`` a cProfile per phase."""

    def __init__(self, profile: str | None) -> None:
        self.cpu: dict[str, float] = {}
        self._profile = profile
        self._name = "setup"
        self._t = time.process_time()
        self._sys = resource.getrusage(resource.RUSAGE_SELF).ru_stime
        self._prof: cProfile.Profile | None = None
        self._gc = 0.0  # seconds in the garbage collector during this phase
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self._gc += time.perf_counter() - self._gc_start

    def enter(self, name: str) -> None:
        if name == self._name:
            return
        now = time.process_time()
        self.cpu[self._name] = self.cpu.get(self._name, 0.0) + now - self._t
        sys_now = resource.getrusage(resource.RUSAGE_SELF).ru_stime
        key = f"{self._name}_sys"
        self.cpu[key] = self.cpu.get(key, 0.0) + sys_now - self._sys
        self._sys = sys_now
        if self._prof is not None:
            self._prof.disable()
            self._prof.dump_stats(f"{self._profile}.{self._name}")
            self._prof = None
        gc_key = f"{self._name}_gc"
        self.cpu[gc_key] = self.cpu.get(gc_key, 0.0) + self._gc
        self._gc = 0.0
        self._name, self._t = name, time.process_time()
        if self._profile is not None and name != "end":
            self._prof = cProfile.Profile()
            self._prof.enable()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--coordinator", required=True)
    p.add_argument("--salt-hex", required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--first-rank", type=int, required=True)
    p.add_argument("--relays", type=int, required=True)
    p.add_argument("--per-relay", type=int, required=True)
    p.add_argument("--id", type=int, default=0)
    p.add_argument("--profile", default=None, help="write cProfiles of the formation and the "
                   "values phases to PROFILE.formation and PROFILE.values")
    trio.run(main, p.parse_args())
