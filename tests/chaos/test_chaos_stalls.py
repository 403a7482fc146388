"""Issue 13 with real processes (the relay CLI as shipped, real loopback TCP): a relay or a rank
that stops reading while its socket stays open hurts nobody else, and a relay SIGSTOPped past
``heartbeat_timeout`` and then resumed ends its ranks with ``RankEvicted``. The scenarios live
in ``_stalls.py`` (the chaos sweep's ``stall`` family runs them too)."""

from __future__ import annotations

import pytest
from _chaos.stalls import (
    rank_stops_reading,
    relay_paused_past_heartbeat_timeout,
    relay_stops_reading,
)

pytestmark = pytest.mark.slow


async def test_relay_that_stops_reading_is_lost_after_write_stall_while_others_get_everything(
) -> None:
    r = await relay_stops_reading()
    assert set(r.dead) == {2} and "write stall" in r.dead[2], r
    # Lost write_stall_timeout (2 s) after its writer blocked (filling its buffers takes a moment).
    assert r.decided_after is not None and 2.0 <= r.decided_after < 6.0, r
    assert r.late == {0: {}, 1: {}}, r  # every broadcast within 1 s
    assert r.healthy_errors == {}, r  # every heartbeat kept coming: never lost the coordinator
    assert r.counters["relay_write_stalls"] == 1, r


async def test_rank_that_stops_reading_is_dropped_by_its_relay_and_its_sibling_keeps_up() -> None:
    r = await rank_stops_reading()
    assert set(r.dead) == {1}, r
    assert r.dead[1].startswith("relay 'host-a' dropped rank 1: it "), r
    assert "write_stall_timeout=3s" in r.dead[1], r
    assert r.decided_after is not None and 3.0 <= r.decided_after < 7.0, r
    assert r.late == {0: {}}, r
    assert r.healthy_errors == {}, r


async def test_relay_sigstopped_past_heartbeat_timeout_ends_its_ranks_evicted_after_sigcont(
) -> None:
    r = await relay_paused_past_heartbeat_timeout()
    assert set(r.dead) == {1, 2}, r
    assert r.evicted == {1: "heartbeat stale (>2s)", 2: "heartbeat stale (>2s)"}, r
    assert r.decided_after is not None and r.decided_after < 5.0, r
    assert r.connection_closed, r
    assert r.counters["relays_disconnected"] == 1 and r.counters["fenced_ranks"] == 2, r
    assert r.healthy_errors == {}, r
