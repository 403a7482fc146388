"""The handshake step maps of flodl_trio.chaos are where the bytes are: a cut one byte short of
a step's end and a cut right after it land on different sides of that step (in memory, under
MockClock, through ``faults=`` of the local cluster); ``faults=`` and FaultyDialer check what
they are given."""

from __future__ import annotations

import pytest
import trio

import flodl_trio as ft
from flodl_trio.chaos import (
    FaultPlan,
    FaultyDialer,
    rank_handshake_bytes,
    upstream_handshake_bytes,
)
from flodl_trio.events import HandshakeRejected
from flodl_trio.local_cluster import layout
from flodl_trio.pytest_plugin import LocalClusterFactory
from flodl_trio.testing import MemoryNetwork

HOSTS = layout(1, 2)  # host-0: ranks 0 and 1


async def rejects_with(factory: LocalClusterFactory, faults: dict[str | int, FaultPlan]
                       ) -> tuple[list[str], dict[str, int]]:
    """The coordinator's reject reasons and the relay's rank-port rejects of one run."""
    timeline = ft.Timeline()
    async with factory(HOSTS, faults=faults, timeline=timeline) as cluster:
        assert cluster.coord.live_ranks == {0, 1}  # the re-dial after the fault joined
        rank_port = cluster.relays["host-0"].rank_port_rejects
    return [ev.reason for ev in timeline.events(HandshakeRejected)
            if isinstance(ev, HandshakeRejected)], rank_port


@pytest.mark.parametrize(("short", "category"), [(1, "eof before hello"), (0, "no ready")])
async def test_a_cut_just_short_of_the_hellos_end_or_right_after_it_lands_on_either_side(
    autojump_clock: trio.abc.Clock, local_cluster_factory: LocalClusterFactory, short: int,
    category: str,
) -> None:
    steps = upstream_handshake_bytes(host="host-0", ranks=HOSTS["host-0"], world_size=2)
    offset, direction = steps.after("Hello")
    assert direction == "up" and offset == steps.up["Ready"].start
    reasons, _ = await rejects_with(local_cluster_factory,
                                    {"host-0": FaultPlan().cut(offset - short, direction)})
    assert [r.partition(":")[0] for r in reasons] == [category], reasons


@pytest.mark.parametrize(("short", "reject"), [(1, "eof before hello"), (0, "no first frame")])
async def test_a_rank_cut_just_short_of_its_hellos_end_or_right_after_it_lands_on_either_side(
    autojump_clock: trio.abc.Clock, local_cluster_factory: LocalClusterFactory, short: int,
    reject: str,
) -> None:
    offset, direction = rank_handshake_bytes(rank=1).after("rank Hello")
    assert (offset, direction) == (ft.wire.RANK_HELLO_LEN, "up")
    reasons, rank_port = await rejects_with(local_cluster_factory,
                                            {1: FaultPlan().cut(offset - short, direction)})
    assert reasons == [] and rank_port == {reject: 1}


async def test_a_list_of_plans_faults_the_first_few_connections_and_not_the_next(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork,
) -> None:
    listener = memory_network.listener("target")

    async def dial() -> trio.abc.Stream:
        return await memory_network.connect("target")

    dialer = FaultyDialer(dial, [FaultPlan().cut(2, "up"), FaultPlan().cut(3, "up")])
    sent = []
    for _ in range(3):
        stream = await dialer()
        server = await listener.accept()
        try:
            await stream.send_all(b"abcdef")
        except trio.BrokenResourceError:
            pass
        sent.append(await server.receive_some(100))
        await stream.aclose()
        await server.aclose()
    await listener.aclose()
    assert sent == [b"ab", b"abc", b"abcdef"]
    assert [s.bytes_sent for s in dialer.streams] == [2, 3] and dialer.dials == 3


async def test_faults_for_a_part_the_cluster_does_not_have_are_a_config_error(
    local_cluster_factory: LocalClusterFactory,
) -> None:
    with pytest.raises(ft.ConfigError, match=r"expected faults for hosts \['host-0'\] or ranks "
                                             r"\[0, 1\], got \['host-9', 7\]"):
        async with local_cluster_factory(HOSTS, faults={"host-9": FaultPlan(), 7: FaultPlan()}):
            pass  # pragma: no cover
    with pytest.raises(ft.ConfigError, match="expected a FaultPlan or a non-empty sequence"):
        FaultyDialer(trio.sleep_forever, [])  # type: ignore[arg-type]
    with pytest.raises(ft.ConfigError, match=r"expected one of \['rank Hello', "
                                             r"'first Heartbeat', 'ack'\], got 'Hello'"):
        rank_handshake_bytes(rank=0).after("Hello")
