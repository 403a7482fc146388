"""A coordinator process for the flood family of ``chaos_sweep.py``: real sockets, its own RSS.

    FLODL_SALT_HEX=... python scripts/_flood_coordinator.py --world-size 2

Prints one JSON line ``{"port": N}`` once bound, ``{"formed": ms}`` once formed, logs every
``flodl_trio`` record to stderr (the parent counts the lines), and shuts down when its stdin
closes. Its status page (same port) gives the counters.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import trio

import flodl_trio as ft


async def run(args: argparse.Namespace) -> None:
    salt = ft.SessionSalt.from_hex(os.environ["FLODL_SALT_HEX"])
    cfg = ft.CoordinatorConfig(world_size=args.world_size, formation_timeout=args.formation_timeout,
                               handshake_timeout=args.handshake_timeout)
    bound = await ft.bind_coordinator(("127.0.0.1", 0))
    print(json.dumps({"port": bound.address[1]}), flush=True)
    started = trio.current_time()
    async with ft.open_coordinator(bound, salt=salt, config=cfg) as coord:
        print(json.dumps({"formed": round((trio.current_time() - started) * 1000, 1)}),
              flush=True)
        stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
        async with trio.open_nursery() as nursery:

            async def drain() -> None:
                async for _ in coord.timing:
                    pass

            nursery.start_soon(drain)
            while await stdin.receive_some(4096):
                pass
            nursery.cancel_scope.cancel()
        await stdin.aclose()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--formation-timeout", type=float, default=120.0)
    parser.add_argument("--handshake-timeout", type=float, default=10.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s %(message)s")
    trio.run(run, args)


if __name__ == "__main__":
    main()
