"""A relay gives up on a silent durable coordinator before its ranks do (issue 34): its
``coord_liveness_timeout`` is at most two thirds of theirs -- by default (20 s against 30 s, at any
``FLODL_NET_TIMEOUT_SCALE``), and wherever both configs are known (``open_local_cluster``) a
relay deadline over that is refused, naming both values."""

from __future__ import annotations

import pytest
import trio

import flodl_trio as ft
from flodl_trio.testing import MemoryNetwork, open_local_cluster


@pytest.mark.parametrize("scale", [None, "0.5", "4"])
def test_the_relays_default_is_two_thirds_of_the_ranks_at_any_scale(
    monkeypatch: pytest.MonkeyPatch, scale: str | None
) -> None:
    if scale is None:
        monkeypatch.delenv("FLODL_NET_TIMEOUT_SCALE", raising=False)
    else:
        monkeypatch.setenv("FLODL_NET_TIMEOUT_SCALE", scale)
    relay, rank = ft.RelayConfig(), ft.RankConfig()
    assert relay.coord_liveness_timeout == pytest.approx(rank.coord_liveness_timeout * 2 / 3)
    assert relay.coord_liveness_timeout == pytest.approx(20 * float(scale or 1))


async def test_a_local_cluster_refuses_a_relay_deadline_over_two_thirds_of_a_ranks(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    with pytest.raises(ft.ConfigError) as caught:
        async with open_local_cluster({"a": [0], "b": [1]}, network=memory_network,
                                      relay_config=ft.RelayConfig(coord_liveness_timeout=25),
                                      rank_configs={1: ft.RankConfig(coord_liveness_timeout=30)}):
            pass
    assert str(caught.value).startswith(
        "RelayConfig.coord_liveness_timeout=25s: expected at most 2/3 of a rank's "
        "RankConfig.coord_liveness_timeout=30s (20s)")
    assert memory_network.open_listeners() == []  # refused before anything started


async def test_a_local_cluster_without_a_relay_config_fits_it_to_its_shortest_rank(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with open_local_cluster({"a": [0], "b": [1]}, network=memory_network,
                                  rank_configs={1: ft.RankConfig(coord_liveness_timeout=3)}
                                  ) as cluster:
        assert {h: r.config.coord_liveness_timeout for h, r in cluster.relays.items()} == {
            "a": pytest.approx(2.0), "b": pytest.approx(2.0)}
    async with open_local_cluster({"a": [0]}, network=MemoryNetwork()) as cluster:
        assert cluster.relays["a"].config == ft.RelayConfig()  # the defaults
