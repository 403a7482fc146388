"""One lifecycle for the three ``open_*`` (SPEC §4.6): an outside cancellation, during setup or
while running, lets exactly one ``trio.Cancelled`` out (a user's ``except trio.Cancelled`` runs),
closes every stream, and a cancelled coordinator still shuts its relays down cleanly."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

import pytest
import trio

import flodl_trio as ft
from flodl_trio._lifecycle import Lifecycle, choose_one_exception, open_lifecycle
from flodl_trio.testing import MemoryNetwork

from helpers import COORD, hosts_by_hand, wait_until
from helpers.lifecycle import (
    assert_relays_shut_down_cleanly,
    cancel_after,
    outside_cancel,
    rank_until_its_end,
)

# ------------------------------------------------------------------ coordinator


async def test_coordinator_cancelled_during_formation_raises_one_cancelled(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    seen: list[str] = []
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=60)
    async with hosts_by_hand(memory_network, 4, {"host-a": [0, 1]}) as hosts:
        host_a = hosts.runs["host-a"]
        half_open = await memory_network.connect(COORD)  # mid-handshake when the cancel lands
        await half_open.send_all(b"\xe2\x17")
        async with outside_cancel(seen) as scope:
            hosts.nursery.start_soon(cancel_after, scope, 5.0)
            async with hosts.coordinator(cfg):
                pytest.fail("formation cannot complete: host-b never comes")
        assert await half_open.receive_some(100) == b""
        await half_open.aclose()
        await wait_until(lambda: host_a.all_done)
    assert seen == ["Cancelled"]
    memory_network.assert_all_closed()


async def test_coordinator_cancelled_while_running_shuts_every_relay_down_cleanly(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    layout = {f"host-{h}": [2 * h, 2 * h + 1] for h in range(12)}
    seen: list[str] = []
    async with hosts_by_hand(memory_network, 24, layout) as hosts:
        async with outside_cancel(seen) as scope:
            async with hosts.coordinator():
                # Heartbeats are flowing by then.
                hosts.nursery.start_soon(cancel_after, scope, 2.5)
                await trio.sleep_forever()
        await wait_until(lambda: hosts.all_done)
    assert seen == ["Cancelled"]
    assert list(hosts.runs) == list(layout)
    assert_relays_shut_down_cleanly(list(hosts.runs.values()), hosts.timeline)
    memory_network.assert_all_closed()


# ------------------------------------------------------------------ relay


async def relay_block(net: MemoryNetwork, salt: ft.SessionSalt, body: Callable[[ft.Relay],
                      Awaitable[None]]) -> None:
    async with ft.open_relay(lambda: net.connect(COORD), salt=salt, host="host-a",
                             ranks=[0, 1], world_size=2,
                             rank_listen=net.listener("relay:host-a")) as relay:
        await body(relay)


async def test_relay_cancelled_while_accepting_its_ranks_raises_one_cancelled(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    seen: list[str] = []
    async with trio.open_nursery() as nursery:
        entered = trio.Event()

        async def body(relay: ft.Relay) -> None:
            entered.set()
            await relay.wait_closed()

        async with outside_cancel(seen) as scope:
            nursery.start_soon(cancel_after, scope, 3.0)
            await relay_block(memory_network, salt, body)
        assert entered.is_set()
    assert seen == ["Cancelled"]
    memory_network.assert_all_closed()


async def test_relay_cancelled_while_dialing_the_coordinator_raises_one_cancelled(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    seen: list[str] = []
    async with trio.open_nursery() as nursery:
        outcomes: dict[int, BaseException | str] = {}

        async def body(relay: ft.Relay) -> None:
            for r in (0, 1):
                nursery.start_soon(functools.partial(
                    rank_until_its_end, memory_network, salt, r, world_size=2,
                    outcomes=outcomes))
            await relay.wait_closed()

        async with outside_cancel(seen) as scope:
            nursery.start_soon(cancel_after, scope, 3.0)  # no coordinator: it keeps re-dialing
            await relay_block(memory_network, salt, body)
        await wait_until(lambda: len(outcomes) == 2, limit=5)
    assert seen == ["Cancelled"]
    assert all(isinstance(o, ft.CoordinatorLost) for o in outcomes.values())
    memory_network.assert_all_closed()


async def test_relay_cancelled_while_running_raises_one_cancelled(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    seen: list[str] = []
    formed = trio.Event()
    outcomes: dict[int, str | BaseException] = {}

    async def relay_task(nursery: trio.Nursery, salt: ft.SessionSalt) -> None:
        async with outside_cancel(seen) as scope:
            async with ft.open_relay(
                    lambda: memory_network.connect(COORD), salt=salt, host="host-a",
                    ranks=[0, 1], world_size=4,
                    rank_listen=memory_network.listener("relay:host-a")) as relay:
                for r in (0, 1):
                    nursery.start_soon(functools.partial(
                        rank_until_its_end, memory_network, salt, r, world_size=4,
                        outcomes=outcomes))
                await formed.wait()
                nursery.start_soon(cancel_after, scope, 2.0)
                await relay.wait_closed()

    async with hosts_by_hand(memory_network, 4) as hosts:
        hosts.nursery.start_soon(relay_task, hosts.nursery, hosts.salt)
        host_b = await hosts.start("host-b", [2, 3])
        async with hosts.coordinator() as coord:
            formed.set()
            await wait_until(lambda: coord.dead_ranks == frozenset({0, 1}))
            assert coord.live_ranks == frozenset({2, 3})
        await wait_until(lambda: host_b.all_done and len(outcomes) == 2)
    assert seen == ["Cancelled"]
    assert all(isinstance(o, ft.CoordinatorLost) for o in outcomes.values())
    memory_network.assert_all_closed()


# ------------------------------------------------------------------ rank


async def test_rank_cancelled_while_waiting_for_its_ack_raises_one_cancelled(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    seen: list[str] = []
    listener = memory_network.listener("relay:mute")  # accepts, never answers the hello
    async with trio.open_nursery() as nursery:
        accepted: list[trio.abc.Stream] = []

        async def mute_relay() -> None:
            accepted.append(await listener.accept())

        nursery.start_soon(mute_relay)
        async with outside_cancel(seen) as scope:
            nursery.start_soon(cancel_after, scope, 2.0)
            async with ft.open_rank(lambda: memory_network.connect("relay:mute"), salt=salt,
                                    rank=0, world_size=1):
                pytest.fail("the relay never acks")
        (stream,) = accepted
        assert len(await stream.receive_some(100)) == 24  # its hello, then EOF
        assert await stream.receive_some(100) == b""
        await stream.aclose()
        await listener.aclose()
    assert seen == ["Cancelled"]
    memory_network.assert_all_closed()


async def test_rank_cancelled_while_running_raises_one_cancelled_and_sends_no_exiting(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    seen: list[str] = []
    formed = trio.Event()

    async def rank_one(salt: ft.SessionSalt) -> None:
        async with outside_cancel(seen) as scope:
            async with ft.open_rank(lambda: memory_network.connect("relay:host-a"),
                                    salt=salt, rank=1, world_size=2) as ep:
                await formed.wait()
                scope.deadline = trio.current_time() + 3.0
                async for _ in ep:
                    pass

    async with hosts_by_hand(memory_network, 2) as hosts:
        host = await hosts.start("host-a", [0, 1], start_ranks=[0])
        hosts.nursery.start_soon(rank_one, hosts.salt)
        async with hosts.coordinator() as coord:
            formed.set()
            exits: list[int] = []
            async for msg in coord.timing:
                if isinstance(msg, ft.wire.Exiting):
                    exits.append(msg.rank)
                if coord.dead_ranks:
                    break
            assert exits == []  # leaving by an exception says no Exiting
            assert coord.dead_ranks == frozenset({1})
            assert "rank 1" in (coord.dead_reason(1) or "")
        await wait_until(lambda: host.done.is_set() and host.ranks[0].done.is_set() and bool(seen))
    assert seen == ["Cancelled"]
    memory_network.assert_all_closed()


# ------------------------------------------------------------------ the rule, on its own


async def test_body_exception_wins_and_a_task_failure_becomes_its_context(
    autojump_clock: trio.abc.Clock,
) -> None:
    boom = ValueError("the body's own bug")
    lost = ft.SendError("send_control(SyncNow) to rank 3: relay 'host-b' is gone")

    async def failing_task() -> None:
        await trio.sleep(1)
        raise lost

    with pytest.raises(ValueError) as excinfo:
        async with open_lifecycle("test", failure=lambda: None) as life:
            life.nursery.start_soon(failing_task)
            with life.body():
                try:
                    await trio.sleep_forever()
                except trio.Cancelled:
                    raise boom from None
    assert excinfo.value is boom
    context = excinfo.value.__context__
    assert isinstance(context, BaseExceptionGroup)
    assert list(context.exceptions) == [lost]


async def test_task_bug_without_outside_cancel_is_an_internal_error_from_the_group(
    autojump_clock: trio.abc.Clock,
) -> None:
    async def buggy_task() -> None:
        await trio.sleep(1)
        raise KeyError("rank 7")

    with pytest.raises(ft.FlodlInternalError, match=r"test: .*KeyError\('rank 7'\)") as excinfo:
        async with open_lifecycle("test", failure=lambda: None) as life:
            life.nursery.start_soon(buggy_task)
            with life.body():
                await trio.sleep_forever()
    cause = excinfo.value.__cause__
    assert isinstance(cause, BaseExceptionGroup)
    assert [type(e) for e in cause.exceptions] == [KeyError]


async def test_recorded_failure_comes_out_alone_after_it_cancelled_the_body(
    autojump_clock: trio.abc.Clock,
) -> None:
    failure = ft.FormationError("relay 'host-a' contradicted the world")
    recorded: list[BaseException] = []
    body_cancelled = False

    async def failing_component(life: Lifecycle) -> None:
        await trio.sleep(1)
        recorded.append(failure)
        life.cancel_body()

    with pytest.raises(ft.FormationError) as excinfo:
        async with open_lifecycle("test", failure=lambda: recorded[0] if recorded else None
                                  ) as life:
            life.nursery.start_soon(failing_component, life)
            with life.body():
                try:
                    await trio.sleep_forever()
                except trio.Cancelled:
                    body_cancelled = True
                    raise
    assert excinfo.value is failure and excinfo.value.__context__ is None
    assert body_cancelled


async def test_outside_cancel_with_a_flodl_error_lets_the_flodl_error_out(
    autojump_clock: trio.abc.Clock,
) -> None:
    lost = ft.CoordinatorLost("rank 0 (via relay r): link ended without Shutdown")
    seen: list[str] = []

    async def failing_late() -> None:
        with trio.CancelScope(shield=True):
            await trio.sleep(2)  # fails during the shutdown that follows the cancel
        raise lost

    with trio.move_on_after(1):
        try:
            async with open_lifecycle("test", failure=lambda: None) as life:
                life.nursery.start_soon(failing_late)
                with life.body():
                    try:
                        await trio.sleep_forever()
                    finally:
                        with trio.CancelScope(shield=True):
                            await trio.sleep(5)
        except ft.CoordinatorLost as exc:
            seen.append(type(exc).__name__)
    assert seen == ["CoordinatorLost"]


async def test_outside_cancel_with_a_task_bug_is_one_cancelled_carrying_the_bug(
    autojump_clock: trio.abc.Clock,
) -> None:
    seen: list[BaseException] = []

    async def buggy_during_shutdown() -> None:
        await trio.sleep(2)
        raise KeyError("rank 7")

    with trio.move_on_after(1):
        try:
            async with open_lifecycle("test", failure=lambda: None) as life:
                life.nursery.start_soon(buggy_during_shutdown)
                try:
                    with life.body():
                        await trio.sleep_forever()
                finally:
                    with trio.CancelScope(shield=True):
                        await trio.sleep(5)
        except trio.Cancelled as exc:
            seen.append(exc)
            raise
    (cancelled,) = seen
    assert isinstance(cancelled.__context__, BaseExceptionGroup)
    assert [type(e) for e in cancelled.__context__.exceptions] == [KeyError]


async def test_background_tasks_outlive_an_outside_cancel_until_the_block_ends(
    autojump_clock: trio.abc.Clock,
) -> None:
    ticks: list[float] = []
    stopped_at: list[float] = []

    async def ticker() -> None:
        try:
            while True:
                await trio.sleep(1)
                ticks.append(trio.current_time())
        finally:
            stopped_at.append(trio.current_time())

    with trio.move_on_after(2.5):
        async with open_lifecycle("test", failure=lambda: None) as life:
            life.nursery.start_soon(ticker)
            try:
                with life.body():
                    await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True):  # a graceful shutdown that needs the tasks
                    await trio.sleep(3)
    assert ticks == [1, 2, 3, 4, 5]
    assert stopped_at == [5.5]


def test_choose_prefers_keyboard_interrupt_over_a_flodl_error() -> None:
    interrupt = KeyboardInterrupt()
    group = BaseExceptionGroup("g", [ft.SendError("x"), interrupt])
    chosen = choose_one_exception(group, body_exc=None, failure=None,
                                  cancelled_from_outside=True)
    assert chosen is interrupt


# ------------------------------------------------------------------ a task's bug stops all


async def test_a_task_bug_stops_the_start_up_wait_at_once_beside_a_shielded_task(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A background task that fails while the component still waits to start (formation),
    beside a task its graceful shutdown needs (shielded, as the coordinator's writers are):
    the wait is cancelled at once, the shutdown runs, and the bug comes out; it used to wait
    out the start-up deadline first."""
    shutdown_done = trio.Event()
    ended_at: list[float] = []

    async def shielded_helper() -> None:  # ends only with the component's shutdown
        with trio.CancelScope(shield=True):
            await shutdown_done.wait()

    async def buggy_task() -> None:
        await trio.sleep(1)
        raise KeyError("rank 7")

    with pytest.raises(ft.FlodlInternalError, match=r"KeyError\('rank 7'\)"):
        async with open_lifecycle("test", failure=lambda: None) as life:
            life.nursery.start_soon(shielded_helper)
            life.nursery.start_soon(buggy_task)
            try:
                await trio.sleep(600)  # the start-up wait, before the body
                pytest.fail("the start-up wait outlived the task's bug")
            finally:
                ended_at.append(trio.current_time())
                shutdown_done.set()
    assert ended_at == [1.0]


async def test_a_coordinator_task_bug_during_formation_ends_open_coordinator_at_once(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug in one of the coordinator's background tasks while it forms ends
    ``open_coordinator`` with ``FlodlInternalError`` within a second, not after
    ``formation_timeout`` (the relay writers' host is shielded: it used to hold the bug
    until formation timed out)."""
    from flodl_trio.coordinator import liveness

    async def buggy_watch(self: object) -> None:
        await trio.sleep(0.5)
        raise KeyError("rank 7")

    monkeypatch.setattr(liveness.Liveness, "staleness_watch", buggy_watch)
    cfg = ft.CoordinatorConfig(world_size=4, formation_timeout=60)
    async with hosts_by_hand(memory_network, 4, {"host-a": [0, 1]}) as hosts:
        with pytest.raises(ft.FlodlInternalError, match=r"KeyError\('rank 7'\)"):
            async with hosts.coordinator(cfg):
                pytest.fail("formation cannot complete: host-b never comes")
        assert trio.current_time() < 2.0
        await wait_until(lambda: hosts.runs["host-a"].all_done)
    memory_network.assert_all_closed()
