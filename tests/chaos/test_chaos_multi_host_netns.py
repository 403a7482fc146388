"""Two hosts for real: the coordinator in one network namespace, a relay and its simulated
ranks in another, joined by a veth pair (the rank leg stays on loopback inside the second
namespace). The coordinator CLI forms the cohort across the link and drives a one-epoch run.

Needs root and iproute2; skipped with the reason elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _chaos.netns import (
    NetnsPair,
    leftover,
    multi_host_run,
    netns_pair,
    silent_link_during_formation,
    unavailable,
)


@pytest.fixture
def namespaces() -> Iterator[NetnsPair]:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    with netns_pair() as pair:
        yield pair
    assert leftover(pair) == []


@pytest.mark.slow
async def test_relay_in_another_network_namespace_forms_and_runs_an_epoch(
    namespaces: NetnsPair, tmp_path: Path
) -> None:
    pair = namespaces
    run = await multi_host_run(pair, tmp_path)
    assert all(code == 0 for code, _ in run.status.values()), run.status
    assert run.summary["epochs_completed"] == 1, run.summary
    assert run.summary["dead_ranks"] == [] and run.summary["lost_broadcasts"] == 0, run.summary
    # The relay reached the coordinator from the other namespace's address, over the veth.
    assert [(ev["host"], ev["ranks"]) for ev in run.joined] == [("ns2-host", [0, 1])]
    assert run.joined[0]["peer"].startswith(f"{pair.address2}:")
    assert any(ev["kind"] == "FormationComplete" for ev in run.events)
    assert run.rank_leg is not None and run.rank_leg[0] == "127.0.0.1"  # loopback inside NS2


@pytest.mark.slow
async def test_a_link_that_goes_silent_is_found_by_keepalive_without_any_traffic(
    namespaces: NetnsPair, tmp_path: Path
) -> None:
    # During formation no staleness watch runs, and the coordinator's heartbeats to a joined
    # relay fit in the socket buffer: no write stall either. Its heartbeats are unacknowledged
    # data, so keepalive does not probe; TCP_USER_TIMEOUT (twice the longer of
    # heartbeat_timeout 3 s and write_stall_timeout 3 s) ends the connection within 6 s of the
    # cut. Without it the kernel retransmitted for about 15 minutes.
    took, lost = await silent_link_during_formation(namespaces, tmp_path, heartbeat_timeout=3)
    assert lost["host"] == "ns2-host"
    # The kernel gave up on the unacknowledged data: ETIMEDOUT, or the soft error it had
    # recorded meanwhile (EHOSTUNREACH: the dead link's neighbour no longer answers).
    assert "timed out" in lost["reason"] or "No route to host" in lost["reason"], lost
    assert 2.0 <= took <= 6.0 + 2.0, took
