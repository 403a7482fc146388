"""An elastic world survives its coordinator (issue 37): the session state carries the world's
range and its retired ranks, a fixed world's state encodes as before, an older state decodes as a
fixed world, and an adopting coordinator keeps the range, the retired ranks and room to grow."""

from __future__ import annotations

import cbor2
import pytest
import trio

import flodl_trio as ft
from flodl_trio.events import RankJoined
from flodl_trio.store import SessionState
from flodl_trio.testing import EventLog, MemoryNetwork

from helpers.durable import cluster, stored, until_stored

SID = bytes(range(16))


def body_of(state: SessionState) -> dict[str, object]:
    doc = cbor2.loads(state.encode()[40:])
    assert isinstance(doc, dict)
    return doc


def test_the_range_and_retired_ranks_round_trip_and_a_fixed_world_encodes_as_before() -> None:
    elastic = SessionState(salt_id=SID, world_size=6, roster=(("host-a", (0, 1)),),
                           min_world_size=2, retired={2: "dead for 2s", 5: "drained"})
    back = SessionState.decode(elastic.encode(), source="test")
    assert back == elastic
    assert body_of(elastic)["retired"] == [[2, "dead for 2s"], [5, "drained"]]
    fixed = SessionState(salt_id=SID, world_size=4, roster=(("host-a", (0, 1, 2, 3)),))
    assert "min_world_size" not in body_of(fixed) and "retired" not in body_of(fixed)
    older = SessionState.decode(fixed.encode(), source="test")  # no such keys: fixed
    assert older.min_world_size is None and older.retired == {}


@pytest.mark.parametrize(("key", "value", "why"), [
    ("min_world_size", 0, "got min_world_size = 0, not an integer in [1, 6]"),
    ("min_world_size", 7, "got min_world_size = 7, not an integer in [1, 6]"),
    ("retired", [[6, "x"]], "got a retired entry [6, 'x']"),
    ("retired", {"2": "x"}, "got 'retired' of type dict"),
])
def test_a_damaged_range_is_refused_whole_naming_the_field(key: str, value: object,
                                                           why: str) -> None:
    import hashlib

    from flodl_trio.store._state import STATE_MAGIC

    doc = body_of(SessionState(salt_id=SID, world_size=6, min_world_size=2))
    doc[key] = value
    body = cbor2.dumps(doc, canonical=True)
    with pytest.raises(ft.StoreCorrupt) as info:
        SessionState.decode(STATE_MAGIC + hashlib.sha256(body).digest() + body, source="s")
    assert why in str(info.value)


async def test_an_adopting_coordinator_keeps_the_range_the_retired_ranks_and_room_to_grow(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    async with cluster(memory_network) as c:
        async def lose_host_b(coord: ft.Coordinator) -> None:
            for rank in (2, 3):
                await coord.declare_dead(rank, "host-b burned")
            await coord.retire([2, 3])
            await until_stored(c.store, lambda state: set(state.retired) == {2, 3})

        await c.crashed_first_run(lose_host_b, min_world_size=2)
        state = await stored(c.store)
        assert (state.min_world_size, state.roster) == (2, (("host-a", (0, 1)),))
        log = EventLog()
        # Its own config says 3..4: the session's range holds (and is logged).
        async with c.adopting(min_world_size=3, timeline=log) as coord:
            assert coord.phase == "running"  # formed: 2 of a minimum of 2
            assert coord.world_range == (2, 4) and coord.current_world == 2
            assert coord.retired_ranks == {2, 3} and coord.dead_ranks == frozenset()
            joined = await c.dial("coord-2", "host-c", (2, 3))
            assert joined.raw.acked
            await trio.sleep(0.1)
            assert [(ev.rank, ev.world) for ev in log.events_of(RankJoined)] == [(2, 4), (3, 4)]
