"""A relay whose world size disagrees with the coordinator's fails formation at its Hello, in
either direction, naming both numbers (SPEC §2.7 Hello, §4.2; FT/2). FT/1 carried no world size:
a smaller coordinator world completed a run with exit 0, a larger one timed out after 60 s."""

from __future__ import annotations

import pytest
import trio
from _chaos.handshake_faults import world_mismatch

import flodl_trio as ft
from flodl_trio.events import FormationFailed
from flodl_trio.testing import MemoryNetwork


@pytest.mark.parametrize("relay_world", [2, 4], ids=["relay-smaller", "relay-larger"])
async def test_world_size_disagreement_fails_formation_naming_both_numbers(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, relay_world: int
) -> None:
    out = await world_mismatch(memory_network, relay_world=relay_world)
    assert type(out.error) is ft.FormationError, out.error
    text = str(out.error)
    assert "world_size mismatch" in text
    assert "coordinator's world_size is 3" in text and f"relay's is {relay_world}" in text
    assert "relay 'host-a'" in text
    # At host-a's Hello, within the handshake deadline: not at the 60 s formation deadline.
    assert out.decision_time is not None and out.decision_time <= 5.0
    assert len(out.log.of(FormationFailed)) == 1
    assert not out.formed
    assert out.leaks == []
    memory_network.assert_all_closed()
