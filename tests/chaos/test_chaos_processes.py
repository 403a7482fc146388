"""Relay and rank *processes* SIGKILLed at random points of formation and of the run (real
loopback TCP, the CLI as shipped): the coordinator never hangs, and every outcome is a clean
formation or a clean, explained FlodlError within the deadlines (SPEC §4.2, §4.5)."""

from __future__ import annotations

import pytest
from _chaos.procs import explained, kill_plans, kill_scenarios

import flodl_trio as ft

PLANS = kill_plans(6, seed=1234)


@pytest.mark.slow
async def test_sigkilled_relay_and_rank_processes_end_in_formation_or_an_explained_error(
) -> None:
    outcomes = await kill_scenarios(PLANS, concurrency=2)
    report = "\n".join(f"{o.scenario}: {o.label}; {o.decision}" for o in outcomes)
    assert len(outcomes) == len(PLANS), report
    for plan, out in zip(PLANS, outcomes, strict=True):
        assert out.details.get("killed_at") is not None, f"{plan}: never killed\n{report}"
        assert explained(out, plan) == [], f"{plan}: {out.details['children']}\n{report}"
        if out.error is not None:
            assert isinstance(out.error, ft.FormationTimeout | ft.ClusterFailure), report
        # Within its deadlines (formation, the short run, shutdown grace), never hung.
        assert out.details["seconds"] < plan.deadline, report
