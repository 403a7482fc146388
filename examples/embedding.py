"""Embedding the coordinator in a Trio orchestrator (docs/embedding.rst, the README).

One relay and its four ranks run in the same Trio run as the coordinator, over loopback TCP, so
the example forms, trains a few steps and finishes on its own:
``python examples/embedding.py`` prints the relay's exit and the number of batches. The message
classes it uses (``StartEpoch``, ``EpochPlan``, ``Batch``, ``SetGlobalStep``) are re-exported by
``flodl_trio``; every other one is in ``flodl_trio.wire``.
"""

from __future__ import annotations

import trio

import flodl_trio as ft

WORLD = 4
STEPS = 3  # batches each rank trains before the orchestrator is satisfied


async def orchestrate(bound: ft.CoordinatorBind, salt: ft.SessionSalt) -> int:
    config = ft.CoordinatorConfig(world_size=WORLD, max_failure=ft.MaxFailure.percent(25))
    async with ft.open_coordinator(bound, salt=salt, config=config) as coord:  # formed here
        for rank in range(coord.world_size):
            plan = ft.EpochPlan(epoch=0, partition_offset=rank * 100, partition_size=100)
            await coord.send_control(rank, ft.StartEpoch(plan=plan))
        batches = 0
        async for msg in coord.timing:  # Batch, SyncAck, Heartbeat, ...
            if isinstance(msg, ft.Batch):
                batches += 1
                if batches % coord.world_size == 0:
                    await coord.broadcast_control(ft.SetGlobalStep(global_step=batches))
                if batches == STEPS * coord.world_size or not coord.live_ranks:
                    break
    # leaving the block: Shutdown to every rank, connections closed, channels ended
    return batches


async def run_host(coordinator: tuple[str, int], salt: ft.SessionSalt) -> ft.RelayExit:
    async with ft.open_relay(coordinator, salt=salt, host="host-a", ranks=list(range(WORLD)),
                             world_size=WORLD) as relay:
        async with trio.open_nursery() as nursery:
            for rank in range(WORLD):  # each rank dials relay.rank_address
                nursery.start_soon(run_rank, relay.rank_address, salt, rank)
        return await relay.wait_closed()  # RelayExit(reason=..., clean=...)


async def run_rank(relay: tuple[str, int], salt: ft.SessionSalt, rank: int) -> None:
    async with ft.open_rank(relay, salt=salt, rank=rank, world_size=WORLD) as ep:
        async for msg in ep:  # ControlMsg; CoordHeartbeat is absorbed; ends after Shutdown
            if isinstance(msg, ft.StartEpoch):
                for step in range(1, STEPS + 1):
                    ep.step_count = step  # reported by the automatic Heartbeat
                    await ep.send(ft.Batch(rank=rank, batch_ms=10.0, data_ms=1.0,
                                           step_count=step, param_norm=None,
                                           batch_loss=1.0 / step))
    # leaving the block without an exception sends Exiting


async def main() -> None:
    salt = ft.SessionSalt.generate()
    # Loopback here; a real orchestrator binds ("0.0.0.0", port) and publishes
    # bound.addresses_for_peers() (bound.address would be 0.0.0.0, which no relay can dial).
    bound = await ft.bind_coordinator(("127.0.0.1", 0))
    exits: list[ft.RelayExit] = []

    async def host() -> None:
        exits.append(await run_host(bound.address, salt))

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(host)
            batches = await orchestrate(bound, salt)
    print(f"relay: {exits[0]}")
    print(f"orchestrator saw {batches} batches from {WORLD} ranks")


if __name__ == "__main__":
    trio.run(main)
