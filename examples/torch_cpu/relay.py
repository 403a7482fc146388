"""One host's relay as a process of its own (so that the example can SIGKILL it).

    python relay.py --coordinator 127.0.0.1:PORT --salt-hex HEX --host host-a --ranks 0,1 \
        --world-size 4 --rank-port PORT

SIGTERM makes it drain (docs/elastic.rst): its ranks finish their current sync and leave, the
coordinator retires them, and the relay ends once they are gone; a second SIGTERM stops it at
once.
"""

from __future__ import annotations

import argparse
import signal

import trio

import flodl_trio as ft


async def serve(args: argparse.Namespace) -> None:
    host, port = args.coordinator.rsplit(":", 1)
    ranks = [int(r) for r in args.ranks.split(",")]
    async with ft.open_relay((host, int(port)), salt=ft.SessionSalt.from_hex(args.salt_hex),
                             host=args.host, ranks=ranks, world_size=args.world_size,
                             rank_listen=args.rank_port) as relay:
        print(f"relay {args.host}: ranks {ranks} dial {relay.rank_address}", flush=True)
        reason = "stopped by a second SIGTERM"
        with trio.open_signal_receiver(signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(drain_on_sigterm, relay, signals, nursery.cancel_scope)
                reason = (await relay.wait_closed()).reason
                nursery.cancel_scope.cancel()
        print(f"relay {args.host}: {reason}", flush=True)


async def drain_on_sigterm(relay: ft.Relay, signals: trio.abc.ReceiveChannel[int],
                           stop: trio.CancelScope) -> None:
    """The first SIGTERM drains the host; a second one stops the relay at once."""
    async for _ in signals:
        if relay.draining is not None:
            stop.cancel()
            return
        print(f"relay {relay.host}: SIGTERM: draining", flush=True)
        await relay.drain("SIGTERM")


def main() -> None:
    p = argparse.ArgumentParser(description="one host relay")
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT")
    p.add_argument("--salt-hex", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--ranks", required=True, help="comma-separated global ranks")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--rank-port", type=int, required=True)
    trio.run(serve, p.parse_args())


if __name__ == "__main__":
    main()
