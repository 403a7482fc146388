"""A relay's upstream cut, reset or stalled while broadcasts run (SPEC §4.4, §4.5): its ranks
are declared dead, every other rank receives every broadcast once and in order, nothing else
fails and nothing leaks."""

from __future__ import annotations

import pytest
import trio
from _chaos.run_faults import (
    FAULTS,
    HEARTBEAT_TIMEOUT,
    SURVIVOR_RANKS,
    VICTIM_RANKS,
    WRITE_STALL_TIMEOUT,
    mid_run,
    network_for,
)

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.events import ClusterFailed, LostBroadcast, RankDeclaredDead, RelayLost

STEPS = 50
FAULT_AT = 20
EXPECTED_CAUSE = {
    "cut": "connection closed by the relay (EOF)",
    "reset": "connection reset",
    "stall-write": f"write stall: no progress for {WRITE_STALL_TIMEOUT:g}s",
    "stall-silent": f"heartbeat stale (>{HEARTBEAT_TIMEOUT:g}s)",
}


@pytest.mark.parametrize("fault", FAULTS)
async def test_upstream_fault_mid_run_kills_only_that_relays_ranks_and_the_rest_get_every_step(
    autojump_clock: trio.abc.Clock, fault: str
) -> None:
    net = network_for(fault)  # type: ignore[arg-type]
    out = await mid_run(net, fault, fault_at=FAULT_AT, steps=STEPS)  # type: ignore[arg-type]
    assert out.error is None and out.formed, out.error
    # Exactly host-a's ranks died, for the reason the fault implies.
    assert set(out.dead) == VICTIM_RANKS
    for reason in out.dead.values():
        assert EXPECTED_CAUSE[fault] in reason
        if fault != "stall-silent":
            assert "relay 'host-a'" in reason
    assert {ev.host for _, ev in out.log.of(RankDeclaredDead)} == {"host-a"}
    assert {ev.host for _, ev in out.log.of(RelayLost)} <= {"host-a"}
    assert out.details["live_at_end"] == SURVIVOR_RANKS
    assert not out.log.of(ClusterFailed)
    # Detected promptly: at once for EOF/RST, at the deadline for a stall.
    deadline = {"cut": 1.0, "reset": 1.0, "stall-write": 5.0,
                "stall-silent": HEARTBEAT_TIMEOUT + 1.5}[fault]
    assert out.decision_time is not None and out.decision_time <= deadline
    # At most the broadcast during which the relay broke failed, and only for host-a's ranks.
    errors = out.details["broadcast_errors"]
    assert len(errors) <= 1
    for step, exc in errors:
        assert step >= FAULT_AT
        assert exc.failed_ranks == VICTIM_RANKS
        assert "ranks [0, 1]" in str(exc) and "host-a" in str(exc)
        assert exc.result.delivered == SURVIVOR_RANKS
    for _, ev in out.log.of(LostBroadcast):
        assert set(ev.failures) == VICTIM_RANKS
    # Every survivor got every step exactly once, in order, and was told of both deaths.
    for host in out.hosts.values():
        for rank in host.ranks:
            steps = host.steps(rank)
            if rank in SURVIVOR_RANKS:
                assert steps == list(range(1, STEPS + 1)), (rank, steps)
                told = {int(m.rank) for m in host.received[rank]
                        if isinstance(m, wire.DeclareDead)}
                assert told == VICTIM_RANKS
                assert host.rank_outcome[rank] == "ended"
            else:
                # The victims saw a gap-free prefix, then lost their coordinator.
                assert steps == list(range(1, len(steps) + 1))
                assert len(steps) >= FAULT_AT - 1
                assert isinstance(host.rank_outcome[rank], ft.CoordinatorLost)
    for name in ("host-b", "host-c"):
        exit_ = out.hosts[name].relay_exit
        assert exit_.clean and exit_.reason.startswith("coordinator said Goodbye: "), exit_
    assert out.leaks == []
    net.assert_all_closed()
