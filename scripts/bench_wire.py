"""Codec micro-benchmarks against their raw floor (SPEC §13, "Codec").

Each case is timed as the median of several repetitions, ours and the floor interleaved in the same
process so the ratio is not skewed by CPU frequency drift. The floor is what no codec can beat: the
same HMAC-SHA256 and CBOR work on the same bytes, with nothing around it.

Usage: .venv/bin/python scripts/bench_wire.py [--quick] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import hmac
import pstats
import statistics
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import _report as rep
import cbor2

from flodl_trio import wire

RECORD_PAYLOAD = bytes(range(100))
SEAL_TARGET_OPS = 150_000
MAX_RATIO = 1.5


@dataclass
class Case:
    name: str
    ours: Callable[[int], None]
    floor: Callable[[int], None]
    min_ops: int | None = None  # absolute ops/s target, when the SPEC sets one


def record_case() -> Case:
    key = wire.conn_key(wire.SessionSalt.generate(), b"c" * 16, b"r" * 16)
    sealer = wire.RecordSealer(key, wire.RELAY_TO_COORD)
    opener = wire.RecordOpener(key, wire.RELAY_TO_COORD)
    data = wire.RecordKind.DATA
    # The bytes the two tags cover: D ‖ seq ‖ header[0:17] ‖ payload.
    covered = b"\x01" + struct.pack("<Q", 0) + b"\0" * 17 + RECORD_PAYLOAD

    def ours(n: int) -> None:
        seal, feed, payload = sealer.seal, opener.feed, RECORD_PAYLOAD
        for _ in range(n):
            (_record,) = feed(seal(data, 3, payload))

    def floor(n: int) -> None:
        digest = hmac.digest
        for _ in range(n):
            digest(key, covered, "sha256")
            digest(key, covered, "sha256")

    return Case("seal+open DATA record, 100-byte payload", ours, floor, SEAL_TARGET_OPS)


def frame_case() -> Case:
    salt = wire.SessionSalt.generate()
    codec = wire.FrameCodec(salt)
    msg = wire.Batch(
        rank=3, batch_ms=12.5, data_ms=1.25, step_count=1000, param_norm=4.5, batch_loss=0.25,
        sync_divergence=None,
    )  # fmt: skip
    assert wire.frame_message(codec.open(codec.encode(msg))) == msg
    as_list = cbor2.loads(wire.encode(msg))
    key = bytes(salt)
    kind_len = struct.pack("<II", 2, len(wire.encode(msg)))

    def ours(n: int) -> None:
        encode, open_, message = codec.encode, codec.open, wire.frame_message
        for _ in range(n):
            message(open_(encode(msg)))

    def floor(n: int) -> None:
        dumps, loads, digest = cbor2.dumps, cbor2.loads, hmac.digest
        for _ in range(n):
            payload = dumps(as_list)
            loads(payload)
            digest(key, kind_len + payload, "sha256")
            digest(key, kind_len + payload, "sha256")

    return Case("encode+decode Batch ControlFrame", ours, floor)


def ops_per_second(fn: Callable[[int], None], n: int) -> float:
    start = time.perf_counter()
    fn(n)
    return n / (time.perf_counter() - start)


def measure(case: Case, *, ops: int, reps: int) -> tuple[float, float]:
    case.ours(ops // 10)  # warm up caches and lazy imports
    case.floor(ops // 10)
    ours, floor = [], []
    for _ in range(reps):
        ours.append(ops_per_second(case.ours, ops))
        floor.append(ops_per_second(case.floor, ops))
    return statistics.median(ours), statistics.median(floor)


def profile(case: Case, ops: int) -> None:
    print(f"\n--- cProfile: {case.name} ({ops} ops) ---")
    prof = cProfile.Profile()
    prof.runcall(case.ours, ops)
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer ops per repetition")
    parser.add_argument("--profile", action="store_true", help="cProfile each case afterwards")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 7 / 9)")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_args(argv)
    ops = 5_000 if args.quick else 30_000
    reps = args.reps or (7 if args.quick else 9)
    if reps < 7:
        parser.error("--reps must be >= 7 (medians of fewer repetitions are noise)")

    cases = [record_case(), frame_case()]
    print(f"python {sys.version.split()[0]}, cbor2 C extension: "
          f"{type(cbor2.CBORDecoder).__module__ != 'cbor2._decoder'}; "
          f"{reps} repetitions x {ops} ops, medians")  # fmt: skip
    header = ("case", "ops/s (median)", "floor ops/s", "ratio", "target", "pass")
    rows = []
    all_pass = True
    raw_rows: list[dict[str, object]] = []
    targets = []
    for case in cases:
        ours, floor = measure(case, ops=ops, reps=reps)
        ratio = floor / ours
        raw_rows.append({"case": case.name, "ops_per_s": ours, "floor_ops_per_s": floor,
                         "ratio": ratio})
        targets.append(rep.target(f"{case.name}: floor/ours", ratio, "<=", MAX_RATIO))
        if case.min_ops is not None:
            targets.append(rep.target(f"{case.name}: ops/s", ours, ">=", case.min_ops))
        target = f"ratio <= {MAX_RATIO}"
        ok = ratio <= MAX_RATIO
        if case.min_ops is not None:
            target += f", >= {case.min_ops // 1000}k/s"
            ok = ok and ours >= case.min_ops
        all_pass = all_pass and ok
        rows.append((case.name, f"{ours:,.0f}", f"{floor:,.0f}", f"{ratio:.2f}", target,
                     "yes" if ok else "NO"))  # fmt: skip
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
    if args.profile:
        for case in cases:
            profile(case, ops)
    if args.json:
        rep.finish("wire", raw_rows, targets, True)
    return 0 if all_pass else 1


if __name__ == "__main__":
    sys.exit(main())
