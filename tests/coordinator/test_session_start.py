"""What a new leader does with what its store holds (choose_start, pure): adopt this run's
unfinished session, start a new one over nothing, an ended session or (fresh) anything, stand
by for a run that ended (SessionEnded), refuse another run's unfinished session
(ForeignSession) and a counter that went back."""

from __future__ import annotations

import pytest

import flodl_trio as ft
from flodl_trio.coordinator._session_start import choose_start
from flodl_trio.store import SessionState

MINE, THEIRS = bytes(16), bytes(range(16))


def decide(state: SessionState | None, *, waited: bool = False, fresh: bool = False,
           generation: int = 4) -> SessionState | None:
    return choose_start(state, salt_id=MINE, world_size=4, source="sqlite:/s.db",
                        waited=waited, fresh=fresh, generation=generation)


def test_this_runs_unfinished_session_is_adopted_waited_for_or_not() -> None:
    running = SessionState(salt_id=MINE, world_size=4, generation=3)
    assert decide(running) is running and decide(running, waited=True) is running
    assert decide(None) is None and decide(None, waited=True) is None


def test_an_ended_session_is_a_new_one_for_a_new_coordinator_and_the_end_for_a_standby() -> None:
    ended = SessionState(salt_id=THEIRS, world_size=8, generation=3,
                         ended="cluster failure: ALL_RANKS_LOST", ended_at=12.5)
    assert decide(ended) is None  # whatever its salt and world size
    with pytest.raises(ft.SessionEnded) as over:
        decide(ended, waited=True)
    assert (over.value.generation, over.value.outcome, over.value.ended_at) == (
        3, "cluster failure: ALL_RANKS_LOST", 12.5)
    assert decide(ended, waited=True, fresh=True) is None


@pytest.mark.parametrize(("salt", "world", "why"), [(THEIRS, 4, "another salt"),
                                                    (MINE, 8, "world size 8, not 4")])
def test_another_runs_unfinished_session_is_refused_unless_fresh(
        salt: bytes, world: int, why: str) -> None:
    theirs = SessionState(salt_id=salt, world_size=world, generation=3)
    with pytest.raises(ft.ForeignSession) as refused:
        decide(theirs)
    assert isinstance(refused.value, ft.StoreCorrupt) and refused.value.why == why
    assert refused.value.store == "sqlite:/s.db" and refused.value.generation == 3
    assert decide(theirs, fresh=True) is None


def test_a_counter_that_went_back_is_refused_rather_than_adopted_with_a_lower_generation(
) -> None:
    running = SessionState(salt_id=MINE, world_size=4, generation=9)
    with pytest.raises(ft.StoreCorrupt, match="expected the generation counter ahead of the "
                       "stored session's generation 9, got 4"):
        decide(running, generation=4)
