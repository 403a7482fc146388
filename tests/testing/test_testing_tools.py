"""The public testing tools: ``wait_until`` and the ``event_log`` fixture."""

from __future__ import annotations

import pytest
import trio

from flodl_trio.events import FormationComplete, Listening
from flodl_trio.pytest_plugin import LocalClusterFactory
from flodl_trio.testing import EventLog, wait_until


async def test_wait_until_returns_when_the_condition_turns_true(
    autojump_clock: trio.abc.Clock,
) -> None:
    flag: list[bool] = []

    async def set_later() -> None:
        await trio.sleep(2.3)
        flag.append(True)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(set_later)
        await wait_until(lambda: bool(flag), step=0.5)
        assert trio.current_time() == pytest.approx(2.5)  # the first poll after it turned true


async def test_wait_until_says_what_it_waited_for_when_it_gives_up(
    autojump_clock: trio.abc.Clock,
) -> None:
    with pytest.raises(trio.TooSlowError,
                       match=r"expected rank 3 declared dead to become true within 5s"):
        await wait_until(lambda: False, limit=5, what="rank 3 declared dead")
    assert trio.current_time() == pytest.approx(5)
    with pytest.raises(ValueError, match="expected step > 0 seconds, got 0"):
        await wait_until(lambda: True, step=0)


async def test_event_log_fixture_records_the_trio_time_of_each_event(
    autojump_clock: trio.abc.Clock, event_log: EventLog,
    local_cluster_factory: LocalClusterFactory,
) -> None:
    await trio.sleep(7)
    async with local_cluster_factory({"host-a": [0, 1]}, timeline=event_log):
        pass
    (formed,) = event_log.events_of(FormationComplete)
    assert formed.world_size == 2
    ((when, _),) = event_log.of(FormationComplete)
    assert when >= 7
    assert event_log.events_of(Listening) == []  # a MemoryNetwork listener binds no port
