"""An orchestrator that survives a restart of itself (docs/embedding.rst, "A run's life in its
store"): its coordinator keeps the session in an SQLite file and its salt in a salt file, both in
one state directory, so that the same program started again after a crash adopts its own running
session; started again after the run ended, it starts a new one.

Two processes share the state directory (any directory that exists)::

    python examples/embedding_store.py hosts /tmp/run1 &       # one relay and its 4 ranks
    python examples/embedding_store.py orchestrate /tmp/run1   # the coordinator

Kill the orchestrator (``kill -9``) while it runs and start it again: it says ``adopted ...``
and finishes the run (the relay rides the outage out and finds it again through the store).
Ctrl-C is not a crash: it ends the run gracefully (the ranks are told to stop), and the next
start is a new session.
"""

from __future__ import annotations

import sys
from pathlib import Path

import trio

import flodl_trio as ft
from flodl_trio.store import SqliteStore

WORLD = 4
ROUNDS = 8  # StartEpoch rounds in a run
STEPS = 3  # batches each rank trains per round


def keep(state_dir: Path) -> tuple[ft.SessionSalt, SqliteStore]:
    """The salt (made once, mode 0600: every restart must use the same one, or it could not
    adopt its own session) and the session store, both in ``state_dir``."""
    salt = ft.SessionSalt.from_file(state_dir / "salt", create=True)
    return salt, SqliteStore(state_dir / "session.db")


async def orchestrate(state_dir: Path) -> None:
    salt, store = keep(state_dir)
    config = ft.CoordinatorConfig(world_size=WORLD, resume_timeout=10)
    try:
        # Port 0: the store publishes whichever port it gets, and the relay reads it there.
        async with ft.open_coordinator(("127.0.0.1", 0), salt=salt, config=config,
                                       store=store) as coord:
            first = 0 if coord.checkpoint is None else int(coord.checkpoint["round"])
            if coord.resumed:
                print(f"adopted the session of {store.description} as generation "
                      f"{coord.generation}, resuming at round {first + 1}", flush=True)
            else:
                print(f"new session of {store.description} as generation {coord.generation}",
                      flush=True)
            for round_ in range(first, ROUNDS):
                await run_round(coord, round_)
                # Durable before it returns: a restarted orchestrator goes on from here.
                await coord.save_checkpoint({"round": round_ + 1})
                print(f"round {round_ + 1}/{ROUNDS} done", flush=True)
        # Leaving the block ends the session: the ranks get Shutdown, the store the end.
    finally:
        await store.aclose()


async def run_round(coord: ft.Coordinator, round_: int) -> None:
    """Start ``round_`` on every rank; return once each has trained its batches of it."""
    for rank in range(coord.world_size):
        plan = ft.EpochPlan(epoch=round_, partition_offset=rank * STEPS, partition_size=STEPS)
        await coord.send_control(rank, ft.StartEpoch(plan=plan))
    target = (round_ + 1) * STEPS
    steps = dict.fromkeys(range(coord.world_size), 0)
    # Heartbeats carry the step count too: after a takeover, a rank whose last Batch went to
    # the coordinator that died still says how far it got.
    async for msg in coord.timing:
        if isinstance(msg, ft.Batch | ft.Heartbeat):
            steps[msg.rank] = max(steps[msg.rank], msg.step_count)
        if min(steps.values()) >= target:
            return


async def run_hosts(state_dir: Path) -> None:
    salt, store = keep(state_dir)

    async def dial() -> trio.abc.Stream:  # whichever coordinator leads the store now
        addresses = await store.resolve_address()
        if not addresses:
            raise OSError(f"no coordinator leads {store.description} yet")
        return await trio.open_tcp_stream(*addresses[0])

    try:
        async with ft.open_relay(dial, salt=salt, host="host-a", ranks=list(range(WORLD)),
                                 world_size=WORLD) as relay:
            async with trio.open_nursery() as nursery:
                for rank in range(WORLD):
                    nursery.start_soon(run_rank, relay.rank_address, salt, rank)
            print(f"relay: {await relay.wait_closed()}", flush=True)
    finally:
        await store.aclose()


async def run_rank(relay: tuple[str, int], salt: ft.SessionSalt, rank: int) -> None:
    async with ft.open_rank(relay, salt=salt, rank=rank, world_size=WORLD) as ep:
        next_round = 0
        async for msg in ep:
            # A restarted orchestrator repeats the round in progress: done once, not twice.
            if isinstance(msg, ft.StartEpoch) and msg.plan.epoch >= next_round:
                for _ in range(STEPS):
                    await trio.sleep(0.05)  # the batch
                    ep.step_count += 1
                    await ep.send(ft.Batch(rank=rank, batch_ms=50.0, data_ms=0.0,
                                           step_count=ep.step_count, param_norm=None,
                                           batch_loss=1.0 / ep.step_count))
                next_round = msg.plan.epoch + 1


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("orchestrate", "hosts"):
        sys.exit("usage: python examples/embedding_store.py orchestrate|hosts STATE_DIR")
    trio.run(orchestrate if sys.argv[1] == "orchestrate" else run_hosts, Path(sys.argv[2]))
