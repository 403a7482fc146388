"""TCPStore side of bench_vs_tcpstore.py; runs under a Python that has torch.

    python _tcpstore_bench.py master --world N --port P --runs R
    python _tcpstore_bench.py clients --world N --port P --first I --count K

Protocol on stdout (one JSON per line). Clients block in a thread each, like a rank's get().
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist


def emit(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def master(args: argparse.Namespace) -> None:
    holder: dict[str, object] = {}

    def construct() -> None:
        # Listens at once, returns when every worker joined (wait_for_workers).
        holder["store"] = dist.TCPStore("127.0.0.1", args.port, args.world + 1, True,
                                        timeout=timedelta(seconds=60), wait_for_workers=True)
        holder["formed"] = time.monotonic()

    thread = threading.Thread(target=construct, daemon=True)
    thread.start()
    time.sleep(0.5)  # the listening socket exists before any client is released
    emit({"ready": True})
    sys.stdin.readline()  # "go": the clients are released now
    t0 = time.monotonic()
    thread.join(timeout=120)
    store = holder["store"]
    assert isinstance(store, dist.TCPStore)
    formed = float(holder["formed"])  # type: ignore[arg-type]
    emit({"formed_ms": (formed - t0) * 1000})
    for run in range(args.runs):
        sys.stdin.readline()  # the parent says when the clients wait on this key
        sent = time.monotonic()
        store.set(f"value-{run}", "x")
        emit({"sent": sent, "run": run})
    sys.stdin.readline()
    del store


def clients(args: argparse.Namespace) -> None:
    arrivals: dict[int, list[float]] = {}
    lock = threading.Lock()
    go = threading.Event()
    connected = threading.Barrier(args.count + 1)

    def client(i: int) -> None:
        go.wait()
        store = dist.TCPStore("127.0.0.1", args.port, args.world + 1, False,
                              timeout=timedelta(seconds=60))
        connected.wait()
        for run in range(args.runs):
            store.get(f"value-{run}")
            now = time.monotonic()
            with lock:
                arrivals.setdefault(run, []).append(now)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.count)]
    for t in threads:
        t.start()
    emit({"ready": True})
    sys.stdin.readline()
    go.set()
    connected.wait()
    emit({"connected": True})
    for t in threads:
        t.join(timeout=120)
    emit({"arrivals": {str(k): [max(v), len(v)] for k, v in arrivals.items()}})


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["master", "clients"])
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--count", type=int, default=0)
    ns = p.parse_args()
    master(ns) if ns.role == "master" else clients(ns)
