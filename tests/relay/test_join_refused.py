"""A relay the coordinator refuses learns why and gives up at once (SPEC §2.6 ``Refused``,
§4.2): ``open_relay`` raises ``JoinRefused`` with the coordinator's reason, its ranks hear it,
and nothing re-dials. Formation itself fails exactly as before. Real loopback sockets where the
point is a real coordinator and relay; the in-memory network under MockClock where it is time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.testing import MemoryNetwork

from helpers import COORD, start_host, wait_until

SALT = ft.SessionSalt.generate()
PATIENCE = 20.0  # real seconds; each scenario takes well under one


@attrs.define
class RelaySpec:
    host: str
    ranks: list[int]
    world: int
    model_sigs: dict[str, bytes] | None = None


@attrs.define
class RelayRun:
    """What one relay (and its ranks) saw."""

    spec: RelaySpec
    error: BaseException | None = None
    exit: ft.RelayExit | None = None
    rank_errors: list[BaseException] = attrs.Factory(list)
    took: float | None = None  # from entering open_relay's block to its error
    settled: trio.Event = attrs.Factory(trio.Event)


async def run_over_tcp(world: int, specs: Sequence[RelaySpec]
                       ) -> tuple[BaseException | None, list[RelayRun], str]:
    """A real coordinator on loopback; the relays join one after the other (each once the one
    before it joined or failed), each with its ranks. Returns the coordinator's error, what each
    relay saw and the coordinator's address."""
    bound = await ft.bind_coordinator(("127.0.0.1", 0))
    address = f"127.0.0.1:{bound.address[1]}"
    cfg = ft.CoordinatorConfig(world_size=world, formation_timeout=30)
    coord_error: BaseException | None = None
    runs = [RelayRun(spec) for spec in specs]

    async def coordinator() -> None:
        nonlocal coord_error
        try:
            async with ft.open_coordinator(bound, salt=SALT, config=cfg):
                pass
        except ft.FlodlError as exc:
            coord_error = exc

    async def rank(addr: tuple[str, int], run: RelayRun, r: int) -> None:
        try:
            async with ft.open_rank(addr, salt=SALT, rank=r, world_size=run.spec.world) as ep:
                async for _ in ep:
                    pass
        except ft.FlodlError as exc:
            run.rank_errors.append(exc)

    async def relay(run: RelayRun, nursery: trio.Nursery) -> None:
        spec = run.spec
        started = trio.current_time()
        try:
            async with ft.open_relay(bound.address, salt=SALT, host=spec.host, ranks=spec.ranks,
                                     world_size=spec.world, model_sigs=spec.model_sigs) as r:
                for rank_no in spec.ranks:
                    nursery.start_soon(rank, r.rank_address, run, rank_no)
                nursery.start_soon(settle_when_connected, r, run)
                run.exit = await r.wait_closed()
        except ft.FlodlError as exc:
            run.error = exc
            run.took = trio.current_time() - started
        finally:
            run.settled.set()

    async def settle_when_connected(r: ft.Relay, run: RelayRun) -> None:
        async with trio.open_nursery() as either:
            for wait in (r.wait_connected, r.wait_closed):
                either.start_soon(settle_after, wait, either.cancel_scope, run)

    async def settle_after(wait: Any, scope: trio.CancelScope, run: RelayRun) -> None:
        await wait()
        run.settled.set()
        scope.cancel()

    with trio.fail_after(PATIENCE):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(coordinator)
            for run in runs:
                nursery.start_soon(relay, run, nursery)
                await run.settled.wait()
    return coord_error, runs, address


def assert_refused_at_once(run: RelayRun, address: str) -> ft.JoinRefused:
    """The relay raised JoinRefused naming itself and the coordinator, with no re-dial (a
    re-dial waits CONNECT_RETRY_INTERVAL, 0.5 s, and the attempts last connect_timeout, 30 s);
    its ranks were told why."""
    error = run.error
    assert isinstance(error, ft.JoinRefused), error
    assert error.host == run.spec.host and error.peer == address
    assert str(error).startswith(f"relay {run.spec.host!r}: refused by the coordinator at "
                                 f"{address}: ")
    assert run.took is not None and run.took < 1.0, run.took
    assert run.rank_errors and all(isinstance(e, ft.CoordinatorLost) for e in run.rank_errors)
    assert all("refused by the coordinator" in str(e) for e in run.rank_errors)
    return error


@pytest.mark.parametrize("relay_world", [2, 4], ids=["relay-smaller", "relay-larger"])
async def test_a_relay_whose_world_size_differs_is_refused_at_once_naming_both_numbers(
    relay_world: int
) -> None:
    coord_error, (run,), address = await run_over_tcp(3, [RelaySpec("host-a", [0, 1],
                                                                    relay_world)])
    error = assert_refused_at_once(run, address)
    assert error.reason == (f"world_size mismatch: the coordinator's world_size is 3, the "
                            f"relay's is {relay_world}")
    # The coordinator's own behaviour is unchanged: formation fails with today's message.
    assert type(coord_error) is ft.FormationError
    assert "world_size mismatch" in str(coord_error) and "0/3 ranks covered" in str(coord_error)


async def test_a_relay_whose_ranks_overlap_a_joined_relays_is_refused_naming_the_owner() -> None:
    coord_error, (first, second), address = await run_over_tcp(
        4, [RelaySpec("host-a", [0, 1], 4), RelaySpec("host-b", [1, 2, 3], 4)])
    error = assert_refused_at_once(second, address)
    assert error.reason.startswith("rank 1 was already announced by relay 'host-a' at ")
    assert first.error is None  # the first relay joined; the failed formation ended it cleanly
    assert first.exit is not None and first.exit.reason.startswith("coordinator said Goodbye")
    assert type(coord_error) is ft.FormationError
    assert "2/4 ranks covered" in str(coord_error)


async def test_a_relay_whose_model_signatures_differ_is_refused_naming_the_model() -> None:
    coord_error, (first, second), address = await run_over_tcp(
        3, [RelaySpec("host-a", [0, 1], 3, {"encoder": b"\x01" * 32, "head": b"\x02" * 32}),
            RelaySpec("host-b", [2], 3, {"encoder": b"\x01" * 32, "head": b"\x0f" * 32})])
    error = assert_refused_at_once(second, address)
    assert error.reason.startswith("model signature mismatch: relay 'host-b' and relay 'host-a'")
    assert "'head'" in error.reason and "'encoder'" not in error.reason
    assert first.error is None
    assert "model signature mismatch" in str(coord_error)


# ------------------------------------------------------------------ in memory, MockClock


async def test_a_refused_relay_dials_once_and_gives_up_without_waiting(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    cfg = ft.CoordinatorConfig(world_size=3, formation_timeout=60)
    dials: list[float] = []

    async def dial() -> trio.abc.Stream:
        dials.append(trio.current_time())
        return await memory_network.connect(COORD)

    listener = memory_network.listener(COORD)
    async with trio.open_nursery() as nursery:

        async def coordinator() -> None:
            with pytest.raises(ft.FormationError, match="world_size mismatch"):
                async with ft.open_coordinator(listener, salt=SALT, config=cfg):
                    pytest.fail("formation must fail")

        nursery.start_soon(coordinator)
        with pytest.raises(ft.JoinRefused) as info:
            async with ft.open_relay(dial, salt=SALT, host="host-a", ranks=[0], world_size=5,
                                     rank_listen=memory_network.listener("relay:a")) as relay:
                async with ft.open_rank(lambda: memory_network.connect("relay:a"), salt=SALT,
                                        rank=0, world_size=5):
                    await relay.wait_closed()
    assert len(dials) == 1
    assert trio.current_time() - dials[0] == pytest.approx(0)  # no deadline was waited for
    assert "the coordinator's world_size is 3, the relay's is 5" in info.value.reason
    memory_network.assert_all_closed()


async def test_a_relay_refused_after_formation_gives_up_at_once_with_the_rejoin_reason(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    # After formation a Hello goes to the rejoin rules; one naming a live rank is refused, and
    # the relay hears why instead of re-dialing for connect_timeout.
    cfg = ft.CoordinatorConfig(world_size=1, formation_timeout=60)
    listener = memory_network.listener(COORD)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            formed = trio.Event()
            late_done = trio.Event()

            async def coordinator() -> None:
                async with ft.open_coordinator(listener, salt=SALT, config=cfg):
                    formed.set()
                    await late_done.wait()

            nursery.start_soon(coordinator)
            host = await start_host(nursery, memory_network, "host-a", [0], salt=SALT, world=1)
            await formed.wait()
            started = trio.current_time()
            with pytest.raises(ft.JoinRefused) as info:
                async with ft.open_relay(lambda: memory_network.connect(COORD), salt=SALT,
                                         host="host-late", ranks=[0], world_size=1,
                                         rank_listen=memory_network.listener("relay:late")
                                         ) as relay:
                    async with ft.open_rank(lambda: memory_network.connect("relay:late"),
                                            salt=SALT, rank=0, world_size=1):
                        await relay.wait_closed()
            assert trio.current_time() - started == pytest.approx(0)
            late_done.set()
            await wait_until(lambda: host.all_done)
    assert info.value.reason.startswith(
        "expected every rank it names to be dead, but rank 0 is alive on relay 'host-a'")


async def test_a_forged_refused_is_a_failed_attempt_and_the_relay_re_dials_and_joins(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    from flodl_trio.net._handshake_io import run_handshake

    listener = memory_network.listener(COORD)
    dials: list[float] = []

    async def dial() -> trio.abc.Stream:
        dials.append(trio.current_time())
        return await memory_network.connect(COORD)

    async def fake_coordinator() -> None:
        # First connection: a Refused in the right place under the right key, but echoing
        # another nonce (what a replayed one looks like). Second: a genuine HelloAck.
        for attempt in range(2):
            stream = await listener.accept()
            if attempt == 1:
                await listener.aclose()
            machine = wire.CoordinatorHandshake(SALT, peer="test")
            assert isinstance(await run_handshake(stream, machine), wire.HelloReceived)
            if attempt == 0:
                forged = wire.Refused(bytes(16), "go away")
                await stream.send_all(machine.sealer.seal(wire.RecordKind.CONTROL, 0,
                                                          wire.encode(forged)))
                await stream.aclose()
                continue
            machine.accept()
            assert isinstance(await run_handshake(stream, machine), wire.Established)
            await stream.aclose()  # joined; then gone without a Goodbye

    async with trio.open_nursery() as nursery:
        nursery.start_soon(fake_coordinator)
        async with ft.open_relay(dial, salt=SALT, host="host-a", ranks=[0], world_size=1,
                                 rank_listen=memory_network.listener("relay:a")) as relay:
            async with ft.open_rank(lambda: memory_network.connect("relay:a"), salt=SALT,
                                    rank=0, world_size=1):
                await relay.wait_connected()
                exit_ = await relay.wait_closed()
    assert [round(t - dials[0], 3) for t in dials] == [0.0, 0.5]  # one re-dial, then joined
    assert not exit_.clean  # joined on the second attempt, then its coordinator vanished
    memory_network.assert_all_closed()
