"""What a coordinator that just became its store's leader does with what the store holds
(SPEC §4.7, docs/failover.rst "A run's life in its store"). Pure: no Trio, no IO.

- nothing stored: a new session;
- a session that *ended* (its coordinator shut the cohort down and recorded it): a new session
  on the same store, the generation counter going on -- unless this coordinator waited for the
  leadership (a standby), which was waiting for *that* session: :class:`SessionEnded`;
- a session that did not end (its coordinator died or stepped down): adopted, if it is this
  run's (same salt id and world size); another run's is :class:`ForeignSession`, whose message
  says how to start a new session there instead;
- ``fresh``: a new session whatever is stored (an unfinished session is discarded).

>>> from flodl_trio.store import SessionState
>>> running = SessionState(salt_id=bytes(16), world_size=4, generation=3)
>>> choose_start(running, salt_id=bytes(16), world_size=4, source="memory:m", waited=False,
...              fresh=False, generation=4) is running
True
>>> ended = SessionState(salt_id=bytes(16), world_size=4, generation=3, ended="the block exited")
>>> print(choose_start(ended, salt_id=bytes(16), world_size=4, source="memory:m",
...                    waited=False, fresh=False, generation=4))
None
"""

from __future__ import annotations

import attrs

from .._errors import ForeignSession, SessionEnded, StoreCorrupt
from ..store import SessionState


@attrs.frozen
class StandbyView:
    """What a coordinator waiting for its store's leadership waits for (the status page's
    ``standby`` entry).

    Attributes:
        store: the store's description.
        leader: who leads it (the owner its leader gave ``acquire``).
        generation: the generation this coordinator would take if it won now (the stored
            state's generation plus one), or None when the state could not be read.
    """

    store: str
    leader: str
    generation: int | None

    def fields(self) -> dict[str, object]:
        return {"store": self.store, "leader": self.leader, "would_lead_as": self.generation}


def choose_start(state: SessionState | None, *, salt_id: bytes, world_size: int, source: str,
                 waited: bool, fresh: bool, generation: int) -> SessionState | None:
    """The state to adopt, or None to start a new session (see the module doc).

    Args:
        state: what the store holds (None: nothing).
        salt_id: this run's salt id; world_size: this run's world size.
        source: the store's description, for messages.
        waited: another coordinator led the store when this one asked for the leadership
            (or it was opened as a standby): it stands by for the run the store holds.
        fresh: start a new session whatever is stored.
        generation: the generation this coordinator was given.

    Raises:
        StoreCorrupt: the session to adopt has a generation not below ``generation`` (the
            store's counter went back: fencing would not hold).
        SessionEnded: ``waited`` (not ``fresh``) and the session had ended.
        ForeignSession: an unfinished session of another run (not ``fresh``).
    """
    if state is None or fresh:
        return None
    if state.ended is not None:
        if waited:
            raise SessionEnded(store=source, generation=state.generation, outcome=state.ended,
                               ended_at=state.ended_at)
        return None
    why = foreign_why(state, salt_id=salt_id, world_size=world_size)
    if why is not None:
        raise ForeignSession(
            f"store {source}: expected this run's session (salt id {salt_id.hex()}, world "
            f"size {world_size}) or none, got another run's unfinished session (generation "
            f"{state.generation}, salt id {state.salt_id.hex()}, world size "
            f"{state.world_size}); refusing it (nothing was loaded): to start a new session "
            "there, discarding it, open the coordinator with fresh=True (flodl-trio "
            "coordinator --fresh), or use another store path or prefix",
            store=source, generation=state.generation, why=why)
    if state.generation >= generation:  # its relays would refuse this leader's generation
        raise StoreCorrupt(f"store {source}: expected the generation counter ahead of the "
                           f"stored session's generation {state.generation}, got {generation} "
                           "(the counter was reset or replaced); refusing it (nothing was "
                           "loaded): fencing needs it to grow")
    return state


def foreign_why(state: SessionState, *, salt_id: bytes, world_size: int) -> str | None:
    """What makes ``state`` another run's (its salt id or world size), or None."""
    if state.salt_id != salt_id:
        return "another salt"
    if state.world_size != world_size:
        return f"world size {state.world_size}, not {world_size}"
    return None


def ended_note(state: SessionState | None, *, generation: int, fresh: bool) -> str | None:
    """The log line of a new session started on a store that held one, or None."""
    if state is None:
        return None
    if state.ended is not None:
        return (f"the session of generation {state.generation} ended ({state.ended}); "
                f"starting a new session as generation {generation}")
    if fresh:
        return (f"discarding the unfinished session of generation {state.generation} "
                f"(fresh=True); starting a new session as generation {generation}")
    return None
