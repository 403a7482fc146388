"""The lifecycle tests' tools (SPEC §4.6): the caller's own cancel scope and what left the block
through it, a cancel after a delay, a rank that iterates until its end, and what a cleanly shut
down run looks like from its relays and ranks."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import trio

import flodl_trio as ft
from flodl_trio.events import RelayLost, ShutdownComplete, ShutdownStarted
from flodl_trio.testing import MemoryNetwork
from flodl_trio.wire import Shutdown

from helpers import HostRun, events_of

# FT/2: each relay hears the shutdown reason in a Goodbye before the coordinator's EOF.
CLEAN = ft.RelayExit("coordinator said Goodbye: cancelled", True)


@contextmanager
def what_left(seen: list[str]) -> Iterator[None]:
    """Record the name of what leaves the block; ``except trio.Cancelled`` sits beside
    ``except BaseException``, so a group of ``Cancelled`` is told apart from one ``Cancelled``
    (a scope absorbs a group of them as well, so ``cancelled_caught`` alone cannot tell)."""
    try:
        yield
    except trio.Cancelled:
        seen.append("Cancelled")
        raise
    except BaseException as exc:
        seen.append(type(exc).__name__)
        raise


@asynccontextmanager
async def outside_cancel(seen: list[str]) -> AsyncIterator[trio.CancelScope]:
    """The caller's own cancel scope; ``seen`` gets the name of what left the block through it."""
    with trio.CancelScope() as scope:
        with what_left(seen):
            yield scope
    assert scope.cancelled_caught


async def cancel_after(scope: trio.CancelScope, seconds: float) -> None:
    await trio.sleep(seconds)
    scope.cancel()


async def rank_until_its_end(net: MemoryNetwork, salt: ft.SessionSalt, rank: int, *,
                             world_size: int, outcomes: dict[int, str | BaseException],
                             relay: str = "relay:host-a") -> None:
    """A rank that dials ``relay`` and iterates; ``outcomes[rank]`` says how it ended:
    ``"ended"`` (its iteration ended), or the ``CoordinatorLost`` it raised."""
    try:
        async with ft.open_rank(lambda: net.connect(relay), salt=salt, rank=rank,
                                world_size=world_size) as ep:
            async for _ in ep:
                pass
        outcomes[rank] = "ended"
    except ft.CoordinatorLost as exc:
        outcomes[rank] = exc


def assert_relays_shut_down_cleanly(runs: list[HostRun], timeline: ft.Timeline) -> None:
    """A coordinator cancelled while running: one shutdown, no relay lost, each relay told
    Goodbye, each rank's last message ``Shutdown`` and its iteration ended."""
    (started,) = events_of(timeline, ShutdownStarted)
    assert started.reason == "cancelled"
    assert len(events_of(timeline, ShutdownComplete)) == 1
    assert not events_of(timeline, RelayLost)
    assert {hr.host: hr.exit for hr in runs} == {hr.host: CLEAN for hr in runs}
    for hr in runs:
        for run in hr.ranks.values():
            assert run.received[-1] == Shutdown() and run.outcome == "ended"
