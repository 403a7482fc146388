"""Helpers of the session-store tests (tests/store/): a state to save, a flag that a background
task (a standby, a leader's keeper) sets when it won or lost, and those two tasks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from flodl_trio.store import SessionState, SessionStore, SqliteStore, salt_id
from flodl_trio.wire import SessionSalt

SALT = SessionSalt(bytes(range(16)))


def state(generation: int, **kw: object) -> SessionState:
    fields: dict[str, object] = dict(
        salt_id=salt_id(SALT), world_size=4, model_sigs={"m": b"\x01"},
        roster=(("a", (0, 1)), ("b", (2, 3))), dead={2: "relay lost"}, failures=1,
        generation=generation, formed=True, checkpoint={"epoch": 2})
    fields.update(kw)
    return SessionState(**fields)  # type: ignore[arg-type]


class Flag:
    """What a background task reports (its result, and when), and an event to wait for it."""

    def __init__(self) -> None:
        self.event = trio.Event()
        self.value: Any = None
        self.at = 0.0

    def set(self, value: Any = True) -> None:
        self.value, self.at = value, trio.current_time()
        self.event.set()

    def __bool__(self) -> bool:
        return self.event.is_set()

    async def wait(self, limit: float) -> None:
        with trio.fail_after(limit):
            await self.event.wait()


def keeping(nursery: trio.Nursery, leader: SessionStore) -> trio.CancelScope:
    """Start ``leader`` renewing its leadership; cancelling the scope returned stops it (as a
    crash or a frozen process would)."""
    keeper = trio.CancelScope()

    async def keep() -> None:
        with keeper:
            await leader.keep_leadership()

    nursery.start_soon(keep)
    return keeper


def standing_by(nursery: trio.Nursery, standby: SessionStore, owner: str) -> Flag:
    """Start ``standby`` waiting to lead as ``owner``; the flag is set to the generation it won,
    when it won."""
    won = Flag()

    async def wait_as_standby() -> None:
        won.set(await standby.acquire(owner=owner))

    nursery.start_soon(wait_as_standby)
    return won


def another_runs_session(path: Path, *, owner: str, **fields: Any) -> None:
    """A session of another run (another salt, world 2; ``fields`` on top) left unfinished in
    the SQLite store at ``path`` by ``owner``, a coordinator of that run that crashed."""

    async def save() -> None:
        store = SqliteStore(path)
        generation = await store.acquire(owner=owner)
        await store.save(SessionState(salt_id=salt_id(SessionSalt(bytes(16))), world_size=2,
                                      generation=generation, **fields))
        await store.aclose()

    trio.run(save)
