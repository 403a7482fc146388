"""RankClient (issue 16): a synchronous worker on its own thread, a coordinator and relays in the
test's Trio run, real loopback TCP between them (the point is two threads and two Trio runs)."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

import flodl_trio as ft
from flodl_trio.wire import Batch, ControlMsg, Metrics, SetGlobalStep, StartEpoch, SyncNow

from helpers import wait_until

HB = 0.1  # heartbeat cadence of both sides in these tests
FAST_RANK = ft.RankConfig(heartbeat_interval=HB, connect_timeout=10, handshake_timeout=5)


def batch(rank: int, step: int) -> Batch:
    return Batch(rank=rank, batch_ms=1.0, data_ms=0.0, step_count=step, param_norm=None,
                 batch_loss=0.5)


async def run_relay(address: Any, salt: ft.SessionSalt, host: str, ranks: list[int], world: int,
                    *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    with trio.CancelScope() as scope:
        async with ft.open_relay(address, salt=salt, host=host, ranks=ranks,
                                 world_size=world) as relay:
            task_status.started((relay.rank_address, scope))
            await relay.wait_closed()


async def in_thread(nursery: trio.Nursery, fn: Callable[[], None]) -> trio.Event:
    """Run a blocking worker on a thread; the event is set when it returned (its error is
    re-raised in the test's run)."""
    done = trio.Event()

    async def runner() -> None:
        try:
            await trio.to_thread.run_sync(fn)
        finally:
            done.set()
    nursery.start_soon(runner)
    return done


async def next_timing(coord: ft.Coordinator, cls: type[Any]) -> Any:
    async for msg in coord.timing:
        if isinstance(msg, cls):
            return msg
    raise AssertionError("timing channel ended")


def wait_for_its_error(rc: ft.RankClient) -> None:
    """Until the client's own thread noticed what ended it (bounded: 10 s)."""
    for _ in range(200):
        if rc.error is not None:
            break
        time.sleep(0.05)


@asynccontextmanager
async def client_run(salt: ft.SessionSalt, worker: Callable[[Any], None], *, world: int,
                     limit: float = 40, **config: Any
                     ) -> AsyncIterator[tuple[ft.Coordinator, trio.CancelScope]]:
    """``worker`` (a RankClient on a thread, given its relay's address) as rank 0 behind relay
    host-a, with (world 2) a Trio rank 1 behind host-b, and the coordinator (``config`` on top
    of HB and a 20 s formation): yields it and host-a's relay's cancel scope."""
    cfg = ft.CoordinatorConfig(world_size=world, heartbeat_interval=HB, formation_timeout=20,
                               **config)
    with trio.fail_after(limit):
        async with trio.open_nursery() as nursery:
            if world == 1:
                bound = await ft.bind_coordinator(("127.0.0.1", 0))
                address, relay_a = await nursery.start(run_relay, bound.address, salt, "host-a",
                                                       [0], 1)
                await in_thread(nursery, lambda: worker(address))
            else:
                bound, relay_a = await two_host_cluster(nursery, salt, worker)
            async with ft.open_coordinator(bound, salt=salt, config=cfg) as coord:
                yield coord, relay_a


async def test_worker_blocked_longer_than_heartbeat_timeout_is_not_declared_dead() -> None:
    salt = ft.SessionSalt.generate()
    got: list[ControlMsg | None] = []
    close_s: list[float] = []

    def worker(relay_address: Any) -> None:
        rc = ft.RankClient(relay_address, salt=salt, rank=0, world_size=1, config=FAST_RANK,
                           close_timeout=5)
        with rc:
            got.append(rc.recv(timeout=10))
            time.sleep(3.0)  # a long step: the GIL is released, the heartbeats go on
            rc.step_count = 1
            rc.send(batch(0, 1))
            got.append(rc.recv(timeout=10))
            time.sleep(0.5)  # the second one arrives meanwhile
            got.append(rc.recv(timeout=0))  # already there: delivered without waiting
            assert rc.recv(timeout=0.05) is None  # nothing else pending: a timeout, not an error
            started = time.monotonic()
        close_s.append(time.monotonic() - started)

    async with client_run(salt, worker, world=1, heartbeat_timeout=1.0) as (coord, _):
        await coord.send_control(0, SyncNow())
        msg = await next_timing(coord, Batch)
        assert msg.rank == 0 and msg.step_count == 1
        assert coord.dead_ranks == frozenset()
        await coord.send_control(0, SetGlobalStep(global_step=7))
        await coord.send_control(0, SetGlobalStep(global_step=8))
        while 0 not in coord.exited_ranks:
            await next_timing(coord, ft.wire.Exiting)
        assert coord.dead_ranks == frozenset()
    assert isinstance(got[0], SyncNow)
    assert got[1:] == [SetGlobalStep(global_step=7), SetGlobalStep(global_step=8)]
    assert close_s[0] < 5.0


async def test_iteration_ends_after_shutdown_and_metrics_arrive() -> None:
    salt = ft.SessionSalt.generate()
    seen: list[str] = []
    entered = threading.Event()

    def worker(relay_address: Any) -> None:
        with ft.RankClient(relay_address, salt=salt, rank=0, world_size=1,
                           config=FAST_RANK) as rc:
            entered.set()
            for msg in rc:
                seen.append(type(msg).__name__)
                if isinstance(msg, StartEpoch):
                    rc.send(Metrics(rank=0, epoch=0, avg_loss=0.25, batches_processed=2,
                                    epoch_ms=3.0, samples_processed=msg.plan.partition_size,
                                    share_complete_ms=3.0, compute_only_ms=2.0,
                                    data_starve_ms=0.0, scalars={}))
            with pytest.raises(trio.EndOfChannel):
                rc.recv(timeout=1)

    async with client_run(salt, worker, world=1, limit=30) as (coord, _):
        await coord.send_control(0, StartEpoch(plan=ft.wire.EpochPlan(0, 0, 10)))
        report = await coord.metrics.receive()
        assert (report.rank, report.samples_processed) == (0, 10)
        # leaving the block broadcasts Shutdown
    assert seen == ["StartEpoch", "Shutdown"]


async def two_host_cluster(nursery: trio.Nursery, salt: ft.SessionSalt,
                           worker: Callable[[Any], None]) -> tuple[Any, trio.CancelScope]:
    """Relay host-a serves the RankClient (rank 0); host-b a Trio rank 1 that idles."""
    bound = await ft.bind_coordinator(("127.0.0.1", 0))
    address_a, scope_a = await nursery.start(run_relay, bound.address, salt, "host-a", [0], 2)
    address_b, _ = await nursery.start(run_relay, bound.address, salt, "host-b", [1], 2)

    async def rank_1() -> None:
        async with ft.open_rank(address_b, salt=salt, rank=1, world_size=2,
                                config=FAST_RANK) as ep:
            async for _ in ep:
                pass
    nursery.start_soon(rank_1)
    await in_thread(nursery, lambda: worker(address_a))
    return bound, scope_a


async def test_coordinator_lost_while_computing_is_raised_at_the_next_send_and_again() -> None:
    salt = ft.SessionSalt.generate()
    killed = threading.Event()
    errors: list[BaseException] = []

    def worker(relay_address: Any) -> None:
        with ft.RankClient(relay_address, salt=salt, rank=0, world_size=2,
                           config=FAST_RANK) as rc:
            assert killed.wait(20)
            wait_for_its_error(rc)  # the client notices the EOF on its own thread
            for _ in range(2):
                with pytest.raises(ft.CoordinatorLost, match="rank 0") as excinfo:
                    rc.send(batch(0, 1))
                errors.append(excinfo.value)
            with pytest.raises(ft.CoordinatorLost):
                rc.recv(timeout=1)
        # the error was seen: leaving the block does not raise it again

    async with client_run(salt, worker, world=2) as (coord, relay_a):
        relay_a.cancel()
        await wait_until(lambda: 0 in coord.dead_ranks, limit=20)
        killed.set()
    assert "without Shutdown" in str(errors[0]) or "lost" in str(errors[0])
    assert errors[0] is errors[1]


async def test_error_after_the_last_call_is_raised_when_the_block_is_left() -> None:
    salt = ft.SessionSalt.generate()
    killed = threading.Event()
    outcome: list[BaseException] = []

    def worker(relay_address: Any) -> None:
        try:
            with ft.RankClient(relay_address, salt=salt, rank=0, world_size=2,
                               config=FAST_RANK) as rc:
                assert killed.wait(20)
                wait_for_its_error(rc)
        except ft.CoordinatorLost as exc:
            outcome.append(exc)

    async with client_run(salt, worker, world=2) as (coord, relay_a):
        relay_a.cancel()
        await wait_until(lambda: 0 in coord.dead_ranks, limit=20)
        killed.set()
    assert len(outcome) == 1 and "rank 0" in str(outcome[0])


async def test_eviction_while_computing_is_raised_as_rank_evicted_at_the_next_recv() -> None:
    salt = ft.SessionSalt.generate()
    evicted = threading.Event()
    errors: list[ft.RankEvicted] = []

    def worker(relay_address: Any) -> None:
        with ft.RankClient(relay_address, salt=salt, rank=0, world_size=2,
                           config=FAST_RANK) as rc:
            assert evicted.wait(20)  # "computing": no call while the coordinator fences us
            wait_for_its_error(rc)
            for _ in range(2):
                with pytest.raises(ft.RankEvicted) as excinfo:
                    rc.recv(timeout=1)
                errors.append(excinfo.value)
            with pytest.raises(ft.RankEvicted):
                rc.send(batch(0, 1))
        # seen already: leaving the block does not raise it again

    async with client_run(salt, worker, world=2) as (coord, _):
        await coord.declare_dead(0, "the orchestrator saw it hang")
        evicted.set()
    assert errors[0] is errors[1] and isinstance(errors[0], ft.CoordinatorLost)  # a subclass
    assert errors[0].reason == "declared by the orchestrator: the orchestrator saw it hang"


async def test_handshake_failure_is_raised_by_entering_the_block() -> None:
    salt = ft.SessionSalt.generate()
    outcome: list[BaseException] = []

    def worker(relay_address: Any) -> None:
        wrong = ft.SessionSalt.generate()
        cfg = ft.RankConfig(connect_timeout=1.0, handshake_timeout=1.0)
        try:
            with ft.RankClient(relay_address, salt=wrong, rank=0, world_size=1, config=cfg):
                pytest.fail("entered with a wrong salt")
        except ft.HandshakeError as exc:
            outcome.append(exc)

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            address, scope = await nursery.start(run_relay, ("127.0.0.1", 9), salt, "host-a",
                                                 [0], 1)
            done = await in_thread(nursery, lambda: worker(address))
            await done.wait()
            scope.cancel()
    assert len(outcome) == 1
    assert "rank 0" in str(outcome[0]) and "connect_timeout=1s" in str(outcome[0])


async def test_many_threads_send_concurrently_and_every_frame_arrives() -> None:
    salt = ft.SessionSalt.generate()
    threads, each = 4, 25

    def worker(relay_address: Any) -> None:
        with ft.RankClient(relay_address, salt=salt, rank=0, world_size=1,
                           config=FAST_RANK) as rc:
            def sender(k: int) -> None:
                for i in range(each):
                    rc.send(batch(0, k * 1000 + i))
            pool = [threading.Thread(target=sender, args=(k,)) for k in range(threads)]
            for t in pool:
                t.start()
            for t in pool:
                t.join(20)

    async with client_run(salt, worker, world=1) as (coord, _):
        steps: set[int] = set()
        while len(steps) < threads * each:
            steps.add((await next_timing(coord, Batch)).step_count)
    assert steps == {k * 1000 + i for k in range(threads) for i in range(each)}


def test_invalid_use_is_a_config_error_before_any_thread() -> None:
    salt = ft.SessionSalt.generate()
    with pytest.raises(ft.ConfigError, match="expected rank < world_size"):
        ft.RankClient(("127.0.0.1", 9), salt=salt, rank=2, world_size=2)
    with pytest.raises(ft.ConfigError, match="close_timeout"):
        ft.RankClient(("127.0.0.1", 9), salt=salt, rank=0, world_size=2, close_timeout=0)
    rc = ft.RankClient(("127.0.0.1", 9), salt=salt, rank=0, world_size=2)
    with pytest.raises(ft.ConfigError, match="before open"):
        rc.recv(timeout=0)
    with pytest.raises(ft.ConfigError, match="expects a TimingMsg or Metrics"):
        rc.send(SyncNow())  # type: ignore[arg-type]
    rc.close()  # never opened: nothing to join


async def test_leaving_the_block_with_an_exception_says_no_exiting_and_keeps_that_exception(
) -> None:
    salt = ft.SessionSalt.generate()
    outcome: list[BaseException] = []
    crash = threading.Event()

    def worker(relay_address: Any) -> None:
        try:
            with ft.RankClient(relay_address, salt=salt, rank=0, world_size=2,
                               config=FAST_RANK):
                assert crash.wait(20)
                raise RuntimeError("the training step blew up")
        except RuntimeError as exc:
            outcome.append(exc)

    async with client_run(salt, worker, world=2) as (coord, _):
        crash.set()
        await wait_until(lambda: 0 in coord.dead_ranks, limit=20)
        assert 0 not in coord.exited_ranks
        assert "without Exiting" in (coord.dead_reason(0) or "")
    assert [str(e) for e in outcome] == ["the training step blew up"]
