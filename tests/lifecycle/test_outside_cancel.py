"""Outside cancellation of the three ``open_*`` in the setup phases and the ways of cancelling that
``test_lifecycle.py`` does not cover: a rank re-dialing a relay that is not there, a relay inside
its upstream handshake or holding a half-open rank connection, a coordinator that nobody dialed,
a coordinator cancelled by its caller's *deadline* or from its own body, and a coordinator over
real TCP. Each time exactly one ``trio.Cancelled`` leaves the block (SPEC §4.6), every stream is
closed, and a cancelled running coordinator's relays end with a clean ``RelayExit``."""

from __future__ import annotations

import functools
import threading

import pytest
import trio
import trio.testing

import flodl_trio as ft
from flodl_trio.events import RelayLost, ShutdownComplete
from flodl_trio.testing import MemoryNetwork, MemoryStream
from flodl_trio.wire import Shutdown

from helpers import COORD, events_of, hosts_by_hand, wait_until
from helpers.lifecycle import (
    CLEAN,
    assert_relays_shut_down_cleanly,
    cancel_after,
    outside_cancel,
    rank_until_its_end,
    what_left,
)

HOSTS = {f"host-{h}": [2 * h, 2 * h + 1] for h in range(4)}


# ------------------------------------------------------------------ rank, during setup


async def test_rank_cancelled_while_re_dialing_a_relay_that_is_not_listening_raises_one_cancelled(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    seen: list[str] = []
    dials = 0

    async def dial() -> MemoryStream:
        nonlocal dials
        dials += 1
        return await memory_network.connect("relay:not-there")  # ConnectionRefusedError

    async with outside_cancel(seen) as scope:
        scope.deadline = trio.current_time() + 3.0  # well inside connect_timeout (30 s)
        async with ft.open_rank(dial, salt=salt, rank=0, world_size=1):
            pytest.fail("no relay listens: the rank cannot connect")
    assert seen == ["Cancelled"]
    assert dials >= 2  # it was in its retry loop, not in its first dial
    memory_network.assert_all_closed()


# ------------------------------------------------------------------ relay, during setup


async def test_relay_cancelled_inside_its_upstream_handshake_raises_one_cancelled(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    seen: list[str] = []
    listener = memory_network.listener(COORD)  # accepts and reads, never answers
    outcomes: dict[int, BaseException | str] = {}

    async with trio.open_nursery() as nursery:
        accepted: list[trio.abc.Stream] = []
        heard = trio.Event()

        async def mute_coordinator() -> None:
            stream = await listener.accept()
            accepted.append(stream)
            assert await stream.receive_some(4096)  # the relay's magic (and more)
            heard.set()

        nursery.start_soon(mute_coordinator)
        async with outside_cancel(seen) as scope:
            async with ft.open_relay(lambda: memory_network.connect(COORD), salt=salt,
                                     host="host-a", ranks=[0], world_size=1,
                                     rank_listen=memory_network.listener("relay:host-a")
                                     ) as relay:
                # The relay dials upstream once its local ranks are in.
                nursery.start_soon(functools.partial(
                    rank_until_its_end, memory_network, salt, 0, world_size=1,
                    outcomes=outcomes))
                await heard.wait()
                nursery.start_soon(cancel_after, scope, 2.0)  # handshake_timeout is 10 s
                await relay.wait_closed()
        (stream,) = accepted
        with trio.fail_after(1):
            while await stream.receive_some(4096):
                pass  # the relay closed its side: EOF
        await stream.aclose()
        await listener.aclose()
        await wait_until(lambda: bool(outcomes), limit=5)
    assert seen == ["Cancelled"]
    assert [type(o) for o in outcomes.values()] == [ft.CoordinatorLost]
    memory_network.assert_all_closed()


async def test_relay_cancelled_with_a_rank_half_way_through_its_hello_raises_one_cancelled(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    salt = ft.SessionSalt.generate()
    seen: list[str] = []
    half_open: list[MemoryStream] = []
    async with outside_cancel(seen) as scope:
        async with ft.open_relay(lambda: memory_network.connect(COORD), salt=salt,
                                 host="host-a", ranks=[0, 1], world_size=2,
                                 rank_listen=memory_network.listener("relay:host-a")) as relay:
            stream = await memory_network.connect("relay:host-a")
            half_open.append(stream)
            await stream.send_all(b"\x00\x01\x02")  # three bytes of a rank hello, then silence
            scope.deadline = trio.current_time() + 2.0
            await relay.wait_closed()
    assert seen == ["Cancelled"]
    (stream,) = half_open
    assert await stream.receive_some(100) == b""  # the relay closed the rank connection
    await stream.aclose()
    memory_network.assert_all_closed()


# ------------------------------------------------------------------ coordinator, during setup


async def test_coordinator_cancelled_before_any_relay_dialed_raises_one_cancelled(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    seen: list[str] = []
    timeline = ft.Timeline()
    with trio.move_on_after(5) as scope:  # the caller's deadline, inside formation_timeout
        with what_left(seen):
            async with ft.open_coordinator(memory_network.listener(COORD),
                                           salt=ft.SessionSalt.generate(),
                                           config=ft.CoordinatorConfig(world_size=2),
                                           timeline=timeline):
                pytest.fail("nobody dials: formation cannot complete")
    assert scope.cancelled_caught
    assert seen == ["Cancelled"]
    assert len(events_of(timeline, ShutdownComplete)) == 1
    memory_network.assert_all_closed()


# ------------------------------------------------------------------ coordinator, running


@pytest.mark.parametrize("how", ["callers-deadline", "body-cancels-its-scope"])
async def test_coordinator_cancelled_while_running_any_way_shuts_every_relay_down_cleanly(
    how: str, autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    seen: list[str] = []
    async with hosts_by_hand(memory_network, 8, HOSTS) as hosts:
        with trio.CancelScope() as scope:
            with what_left(seen):
                async with hosts.coordinator() as coord:
                    if how == "callers-deadline":
                        scope.deadline = trio.current_time() + 2.5
                        await trio.sleep_forever()
                    await trio.sleep(2.5)  # heartbeats are flowing by then
                    assert coord.live_ranks == frozenset(range(8))
                    scope.cancel()
                    await trio.sleep_forever()
        assert scope.cancelled_caught
        await wait_until(lambda: hosts.all_done)
    assert seen == ["Cancelled"]
    assert_relays_shut_down_cleanly(list(hosts.runs.values()), hosts.timeline)
    memory_network.assert_all_closed()


@pytest.mark.slow
async def test_coordinator_over_tcp_cancelled_while_running_shuts_every_relay_down_cleanly(
) -> None:
    # Real sockets: the half-close and drain of the graceful path against the kernel's buffers,
    # where an aborted shutdown shows as "upstream connection lost while writing".
    salt = ft.SessionSalt.generate()
    seen: list[str] = []
    timeline = ft.Timeline()
    exits: dict[str, object] = {}
    outcomes: dict[int, object] = {}
    last: dict[int, object] = {}
    bound = await ft.bind_coordinator(("127.0.0.1", 0))
    port = bound.address[1]

    async def rank_task(addr: tuple[str, int], rank: int) -> None:
        try:
            async with ft.open_rank(addr, salt=salt, rank=rank, world_size=8) as ep:
                async for msg in ep:
                    last[rank] = msg
            outcomes[rank] = "ended"
        except ft.FlodlError as exc:
            outcomes[rank] = exc

    async def relay_task(host: str, ranks: list[int], nursery: trio.Nursery) -> None:
        try:
            async with ft.open_relay(("127.0.0.1", port), salt=salt, host=host, ranks=ranks,
                                     world_size=8) as relay:
                assert relay.rank_address is not None
                for rank in ranks:
                    nursery.start_soon(rank_task, relay.rank_address, rank)
                exits[host] = await relay.wait_closed()
        except ft.FlodlError as exc:
            exits[host] = exc

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for host, ranks in HOSTS.items():
                nursery.start_soon(relay_task, host, ranks, nursery)
            with trio.CancelScope() as scope:
                with what_left(seen):
                    async with ft.open_coordinator(bound, salt=salt,
                                                   config=ft.CoordinatorConfig(world_size=8),
                                                   timeline=timeline):
                        scope.deadline = trio.current_time() + 1.5
                        await trio.sleep_forever()
            assert scope.cancelled_caught
    assert seen == ["Cancelled"]
    assert not events_of(timeline, RelayLost)
    assert exits == dict.fromkeys(HOSTS, CLEAN)
    assert outcomes == dict.fromkeys(range(8), "ended")
    assert last == dict.fromkeys(range(8), Shutdown())


# ------------------------------------------------------------------ cancelled before it began


@pytest.mark.parametrize("component", ["coordinator", "relay", "rank"])
def test_open_cancelled_before_its_first_checkpoint_returns_one_cancelled_at_once(
    component: str,
) -> None:
    # A caller that cancels its nursery in the same tick it starts the task (a supervisor
    # tearing down, a test's cancel) used to leave a shielded task host stranded in
    # nursery.start: the open_* never returned, and no deadline could reach it. So the run goes
    # in a thread of its own, and a hang fails the test instead of the suite.
    seen: list[str] = []
    outcome: list[object] = []

    async def scenario() -> None:
        memory_network = MemoryNetwork()
        salt = ft.SessionSalt.generate()

        async def run() -> None:
            with what_left(seen):
                if component == "coordinator":
                    async with ft.open_coordinator(memory_network.listener(COORD), salt=salt,
                                                   config=ft.CoordinatorConfig(world_size=2)):
                        await trio.sleep_forever()
                elif component == "relay":
                    async with ft.open_relay(lambda: memory_network.connect(COORD), salt=salt,
                                             host="h", ranks=[0], world_size=1,
                                             rank_listen=memory_network.listener("relay:h")):
                        await trio.sleep_forever()
                else:
                    async with ft.open_rank(lambda: memory_network.connect("relay:h"),
                                            salt=salt, rank=0, world_size=1):
                        await trio.sleep_forever()

        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            nursery.cancel_scope.cancel()
        outcome.append(trio.current_time() - start)
        memory_network.assert_all_closed()

    def in_thread() -> None:
        try:
            trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))
        except BaseException as exc:  # reported by the test below
            outcome.append(exc)

    thread = threading.Thread(target=in_thread, daemon=True)
    thread.start()
    thread.join(timeout=20)
    assert not thread.is_alive(), f"open_{component} cancelled before it began never returned"
    assert len(outcome) == 1 and isinstance(outcome[0], float), outcome
    assert outcome[0] < 1  # seconds of the mock clock: no deadline had to fire
    assert seen == ["Cancelled"]
