"""``flodl-trio coordinator --store URL [--standby]``: the session store on the command line
(docs/failover.rst): open it, refuse a second coordinator at once unless it is a standby, and
say what the coordinator adopted.

>>> adopted_text({"epoch": 1, "num_epochs": 3}, generation=2, live=4, dead=0,
...              store="sqlite:s.db")  # doctest: +NORMALIZE_WHITESPACE
'adopted the running session of sqlite:s.db as generation 2: 4 live ranks, 0 dead;
 resuming at epoch 2/3'
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

import trio

from .._errors import ConfigError, ForeignSession, SessionEnded, StoreCorrupt, StoreUnavailable
from ..coordinator import Coordinator
from ..events import Note
from ..store import SessionStore, open_store
from ._common import CommandFailed, UsageError

# etcd: how long each request to it may take, so an unreachable one is a fast one-line error.
ETCD_CONNECT_TIMEOUT = 3.0


def store_from(text: str, *, option: str) -> SessionStore:
    """The store ``text`` names (``sqlite:PATH``, ``etcd://HOST:PORT/PREFIX``, ``memory:``).

    Raises:
        UsageError: not one of those forms (the message quotes it and lists them).
    """
    try:
        return open_store(text, connect_timeout=ETCD_CONNECT_TIMEOUT)
    except ConfigError as exc:
        raise UsageError(f"{option}: {exc}") from None


def open_cli_store(args: argparse.Namespace) -> SessionStore | None:
    """The coordinator's ``--store`` (None without it); ``--standby`` and ``--fresh`` need
    one, and exclude each other."""
    if args.store is None:
        for flag, what in (("standby", "waits for the leadership of"),
                           ("fresh", "starts a new session in")):
            if getattr(args, flag):
                raise UsageError(f"--{flag} {what} a --store: pass --store URL")
        return None
    if args.standby and args.fresh:
        raise UsageError("--standby adopts the session its leader leaves, --fresh discards "
                         "any: choose one")
    return store_from(args.store, option="--store")


async def check_leader(store: SessionStore, *, standby: bool) -> None:
    """Refuse at once a store that a live coordinator leads, unless this one is a standby
    (then say that it waits: ``open_coordinator`` blocks until it wins).

    Raises:
        CommandFailed: the store is led and this is not a standby.
        StoreUnavailable / StoreCorrupt: the store cannot be reached, or is not a store.
    """
    owner = await store.current_leader()
    if owner is None:
        return
    if not standby:
        raise CommandFailed(f"coordinator: store {store.description} is led by {owner}; pass "
                            "--standby to wait for it")
    try:
        state = await store.load()
        would = f" (it would lead as generation {1 if state is None else state.generation + 1})"
    except (StoreCorrupt, StoreUnavailable):
        would = ""  # said in full once it leads and loads it
    print(f"standby: store {store.description} is led by {owner}; waiting for the "
          f"leadership{would}", flush=True)


def formed_text(coord: Coordinator, store: SessionStore | None) -> str:
    """The line of a coordinator that formed a new session (with a store: which generation)."""
    line = f"formed: {coord.current_world} ranks over {len(coord.relays)} relays"
    least, most = coord.world_range
    if least < most:  # an elastic world says its range: it may grow and shrink within it
        line += f" (world {least}:{most})"
    if store is not None:
        line += f" (generation {coord.generation} of {store.description}, a new session)"
    return line


def ended_text(exc: SessionEnded) -> str:
    """The line of a standby whose run ended: it exits 0, there is nothing to adopt."""
    return (f"standby: the run it waited for on {exc.store} ended (generation "
            f"{exc.generation}: {exc.outcome}); nothing to adopt")


def foreign_text(exc: ForeignSession) -> str:
    """The one line for another run's unfinished session in the store: what to do."""
    # Short: with a long store path it must stay one line of under 200 characters (--debug
    # shows the library's whole message: both salt ids, the generation).
    return (f"coordinator: {exc.store} holds another run's unfinished session: --fresh "
            "discards it, or use another store")


def adopted_text(checkpoint: Mapping[str, Any] | None, *, generation: int, live: int, dead: int,
                 store: str) -> str:
    """The line an adopting coordinator prints: its generation, the ranks it took over and the
    epoch the scheduler's checkpoint resumes at (1-based)."""
    head = (f"adopted the running session of {store} as generation {generation}: {live} live "
            f"ranks, {dead} dead")
    epoch = checkpoint.get("epoch") if checkpoint is not None else None
    if checkpoint is None or not isinstance(epoch, int):
        return f"{head}; no checkpoint yet (epoch 1)"
    total = checkpoint.get("num_epochs")
    if isinstance(total, int):
        return f"{head}; resuming at epoch {min(epoch + 1, total)}/{total}"
    return f"{head}; resuming at epoch {epoch + 1}"


def adopted(coord: Coordinator, store: SessionStore) -> str:
    """Record the adoption in ``coord``'s timeline (an ``adopted`` note: generation, live and
    dead ranks, the checkpoint's epoch, 0-based) and return the line to print."""
    checkpoint = coord.checkpoint
    epoch = checkpoint.get("epoch") if checkpoint is not None else None
    coord.timeline.event(Note(what="adopted", fields={
        "generation": coord.generation, "live": sorted(coord.live_ranks),
        "dead": sorted(coord.dead_ranks), "epoch": epoch if isinstance(epoch, int) else 0,
        "store": store.description}))
    return adopted_text(checkpoint, generation=coord.generation, live=len(coord.live_ranks),
                        dead=len(coord.dead_ranks), store=store.description)


async def close_store(store: SessionStore | None) -> None:
    """Release and close the store whatever happened (shielded)."""
    if store is not None:
        with trio.CancelScope(shield=True):
            await store.aclose()
