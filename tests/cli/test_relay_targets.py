"""``flodl-trio relay --coordinator``'s targets over real loopback TCP: a fixed list tried in
turn on every attempt (a dead address first does not stop the relay), and ``etcd://`` (a
StoreDialer: the leader's address read from a real etcd again on every attempt, by a relay that
never leads)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

import flodl_trio as ft
from flodl_trio.cli._targets import CoordinatorDialer, coordinator_target
from flodl_trio.relay import StoreDialer
from flodl_trio.store import EtcdStore

from helpers.scripts import load_script

etcd_helper = load_script("_etcd")
CONFIG = ft.RelayConfig()


async def join_one_rank(target: Any, coord_bind: Any, *, store: Any = None) -> ft.Coordinator:
    """A world of one rank whose relay dials ``target``; returns once formed, having checked
    the rank is live (the block of open_coordinator was entered)."""
    salt = ft.SessionSalt.generate()
    cfg = ft.CoordinatorConfig(world_size=1, formation_timeout=20)

    async def rank(address: Any) -> None:
        async with ft.open_rank(address, salt=salt, rank=0, world_size=1) as ep:
            async for _ in ep:
                pass

    async with trio.open_nursery() as nursery:
        async def relay(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            async with ft.open_relay(target, salt=salt, host="h", ranks=[0],
                                     world_size=1) as r:
                task_status.started(r.rank_address)
                await r.wait_closed()

        rank_address = await nursery.start(relay)
        nursery.start_soon(rank, rank_address)
        async with ft.open_coordinator(coord_bind, salt=salt, config=cfg, store=store) as coord:
            assert coord.live_ranks == frozenset({0})
        return coord


async def test_a_list_is_tried_in_turn_and_a_dead_first_address_does_not_stop_the_relay(
) -> None:
    dead = ("127.0.0.1", etcd_helper.free_port())
    with trio.fail_after(20):
        bound = await ft.bind_coordinator(("127.0.0.1", 0))
        text = f"127.0.0.1:{dead[1]},127.0.0.1:{bound.address[1]}"
        target = coordinator_target(text, config=CONFIG)
        assert isinstance(target, CoordinatorDialer)
        assert target.addresses == (dead, bound.address)
        await join_one_rank(target, bound)


async def test_a_listed_address_that_accepts_but_never_answers_does_not_capture_the_relay(
) -> None:
    # A standby coordinator binds its port and waits for the leadership: the kernel accepts
    # connections it never answers (so does a proxy in front of a dead coordinator). Listed
    # first, it took every attempt (each one began with the first address that connected, and
    # its handshake timed out), so the relays never reached the leader listed after it and the
    # leader declared every rank dead after resume_timeout (found by scripts/nemesis.py).
    silent = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    quiet = ("127.0.0.1", silent.socket.getsockname()[1])
    salt = ft.SessionSalt.generate()
    relay_cfg = ft.RelayConfig(handshake_timeout=0.5, connect_timeout=20)
    with trio.fail_after(6):  # the old code: no join before connect_timeout (20 s)
        bound = await ft.bind_coordinator(("127.0.0.1", 0))
        target = coordinator_target(f"127.0.0.1:{quiet[1]},127.0.0.1:{bound.address[1]}",
                                    config=relay_cfg)
        async with trio.open_nursery() as nursery:
            async def relay(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                async with ft.open_relay(target, salt=salt, host="h", ranks=[0],
                                         world_size=1, config=relay_cfg) as r:
                    task_status.started(r.rank_address)
                    await r.wait_closed()

            async def rank(address: Any) -> None:
                async with ft.open_rank(address, salt=salt, rank=0, world_size=1) as ep:
                    async for _ in ep:
                        pass

            nursery.start_soon(rank, await nursery.start(relay))
            cfg = ft.CoordinatorConfig(world_size=1, formation_timeout=20)
            async with ft.open_coordinator(bound, salt=salt, config=cfg) as coord:
                assert coord.live_ranks == frozenset({0})
    await silent.aclose()


async def test_a_list_where_nothing_listens_is_a_refused_connection_for_the_relay() -> None:
    ports = [etcd_helper.free_port() for _ in range(2)]
    target = coordinator_target(",".join(f"127.0.0.1:{p}" for p in ports), config=CONFIG)
    with pytest.raises(OSError, match=f"127.0.0.1:{ports[1]}") as caught:
        await target()  # the last address's error, whose cause says why
    from flodl_trio.cli._errors import causes
    assert any(isinstance(c, ConnectionRefusedError) for c in causes(caught.value))


async def test_an_etcd_target_dials_the_address_its_leader_published(etcd: Any) -> None:
    url = f"etcd://{etcd.endpoint}/flodl/cli-target"
    target = coordinator_target(url, config=CONFIG)
    assert isinstance(target, StoreDialer)
    try:
        with pytest.raises(OSError, match="no coordinator leads the store now"):
            await target()  # nobody leads yet: a failed attempt the relay retries
        leader = EtcdStore(etcd.endpoint, "flodl/cli-target", ttl=1.0)
        try:
            with trio.fail_after(30):
                bound = await ft.bind_coordinator(("127.0.0.1", 0))
                coord = await join_one_rank(target, bound, store=leader)
        finally:
            await leader.aclose()
        assert coord.generation == 1
        assert target.store is not None and target.store.generation is None  # never led
    finally:
        await target.aclose()


async def test_an_etcd_target_whose_etcd_is_down_is_a_failed_attempt_naming_it() -> None:
    url = f"etcd://127.0.0.1:{etcd_helper.free_port()}/x"
    target = coordinator_target(url, config=CONFIG)
    try:
        with pytest.raises(OSError, match=r"cannot read the leader's address: .*refused"):
            await target()
    finally:
        await target.aclose()
