"""Slow or silent handshakes are dropped at exactly ``handshake_timeout`` while a healthy relay
forms in parallel (SPEC §4.2: one handshake task per connection, each under its own deadline)."""

from __future__ import annotations

import pytest
import trio
from _chaos.handshake_faults import UPSTREAM, silent_dialer, slow_upstream
from _chaos.util import first

from flodl_trio.chaos import FaultPlan
from flodl_trio.events import FormationComplete, HandshakeRejected, RelayJoined
from flodl_trio.testing import MemoryNetwork

HANDSHAKE_TIMEOUT = 5.0  # the coordinator's; the relay's own is 8 s (see slow_upstream)

SLOW_PLANS = {
    "drip-up-1Bps": FaultPlan().drip(1, "up"),
    "drip-down-1Bps": FaultPlan().drip(1, "down"),
    "stall-up@0": FaultPlan().stall(0, "up"),
    "stall-up@2-mid-magic": FaultPlan().stall(2, "up"),
    "stall-up@4-after-magic": FaultPlan().stall(4, "up"),
    "stall-up@30-mid-hello": FaultPlan().stall(30, "up"),
    f"stall-up@{UPSTREAM.magic + UPSTREAM.hello - 1}-last-hello-byte":
        FaultPlan().stall(UPSTREAM.magic + UPSTREAM.hello - 1, "up"),
    f"stall-up@{UPSTREAM.up - 1}-last-ready-byte": FaultPlan().stall(UPSTREAM.up - 1, "up"),
    "stall-down@0": FaultPlan().stall(0, "down"),
    "stall-down@20-mid-challenge": FaultPlan().stall(20, "down"),
    f"stall-down@{UPSTREAM.challenge - 1}-last-challenge-byte":
        FaultPlan().stall(UPSTREAM.challenge - 1, "down"),
}


@pytest.mark.parametrize("name", list(SLOW_PLANS))
async def test_slow_handshake_is_rejected_at_exactly_handshake_timeout_while_another_forms(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork, name: str
) -> None:
    out = await slow_upstream(memory_network, SLOW_PLANS[name], name=name)
    assert out.error is None and out.formed, out.error
    assert out.dead == {}
    # FT/2: a Ready that never arrives whole un-covers the relay at the same deadline.
    expected = "rejected: no ready" if name.endswith("last-ready-byte") else "rejected: timeout"
    assert out.decision == expected
    assert out.decision_time == pytest.approx(HANDSHAKE_TIMEOUT, abs=1e-9)
    rejected_at, rejected = first(out.log, HandshakeRejected)  # type: ignore[misc]
    assert f"handshake_timeout={HANDSHAKE_TIMEOUT:g}s" in rejected.reason
    # host-b was not held up by the wedged handshake: it joined before the deadline fired.
    joined_b = first(out.log, RelayJoined, lambda ev: ev.host == "host-b")
    assert joined_b is not None and joined_b[0] < rejected_at
    # host-a's re-dial completed formation after the reject.
    (formed_at, _), = out.log.of(FormationComplete)
    assert formed_at > rejected_at
    assert out.details["relays"]["host-a"] == out.details["peers"][1]
    assert out.leaks == []
    memory_network.assert_all_closed()


async def test_dialer_that_sends_nothing_is_dropped_at_exactly_handshake_timeout(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    out = await silent_dialer(memory_network, handshake_timeout=HANDSHAKE_TIMEOUT)
    assert out.error is None and out.formed and out.dead == {}
    assert out.decision == "rejected: timeout"
    assert out.decision_time == pytest.approx(HANDSHAKE_TIMEOUT, abs=1e-9)
    assert out.details["read"] == b""  # the coordinator closed it
    assert out.details["closed_at"] == pytest.approx(
        out.details["dialed_at"] + HANDSHAKE_TIMEOUT, abs=1e-9)
    # host-a formed at once in parallel; formation waited only for host-b's late rank.
    joined_a = first(out.log, RelayJoined, lambda ev: ev.host == "host-a")
    assert joined_a is not None and joined_a[0] < out.details["dialed_at"] + 1
    assert out.leaks == []
    memory_network.assert_all_closed()
