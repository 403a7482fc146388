"""The status page's document (``/board.json``, each ``/events`` message), built from the roster
and the board: computed once per tick for every viewer, so its cost is per tick, not per viewer.

Up to :data:`RANK_DETAIL_LIMIT` ranks every rank is listed with its state, step count and last
heartbeat age; above it each relay is one row of counts (:data:`RELAY_COLUMNS`): a 16,384-rank
world is 2,048 relay rows, not 16,384 rank lines, and only the deaths are listed rank by rank
(the last :data:`DEATHS_LISTED`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

from ..timeline import Timeline
from ._board import Board
from ._relayconn import RelayConn
from ._roster import Roster

RANK_DETAIL_LIMIT: Final = 1024
DEATHS_LISTED: Final = 200
# A rank's state on the page: ``joined`` (it joined the running cohort: the world grew) and
# ``draining`` (its host leaves on purpose) are alive too; ``retired`` is out of the world, not
# dead (docs/elastic.rst); ``waiting`` is not covered yet (or, once an elastic world runs, room
# it may grow into).
STATES: Final = ("alive", "joined", "draining", "dead", "exited", "retired", "waiting")
RETIRED_LISTED: Final = 200


def page_phase(phase: str, failed: bool) -> str:
    """The page's phase: ``forming``, ``running``, ``shutting-down``, ``finished`` (closed:
    what ``coordinator --linger`` shows after the run) or ``failed``."""
    if failed:
        return "failed"
    if phase == "shutting_down":
        return "shutting-down"
    return "finished" if phase == "closed" else phase


class _States:
    """Each rank's state, from the roster's sets taken once per document."""

    def __init__(self, roster: Roster[RelayConn], draining: frozenset[int]) -> None:
        self.dead = roster.dead
        self.dead_set = frozenset(self.dead)
        self.exited = roster.exited
        self.covered = roster.covered
        self.live = roster.live
        self.retired = frozenset(roster.retired)
        self.draining = draining & self.live
        self.joined = frozenset(roster.joins) & self.live

    def of(self, rank: int) -> str:
        if rank in self.dead:
            return "dead"
        if rank in self.exited:
            return "exited"
        if rank in self.retired:
            return "retired"
        if rank not in self.covered:
            return "waiting"
        if rank in self.draining:
            return "draining"
        return "joined" if rank in self.joined else "alive"


def _age(seen: Mapping[int, float], rank: int, now: float) -> float | None:
    at = seen.get(rank)
    return None if at is None else round(max(0.0, now - at), 1)


def _rank_rows(ranks: Iterable[int], states: _States, board: Board,
               seen: Mapping[int, float], now: float) -> list[list[Any]]:
    steps = board.steps
    return [[r, states.of(r), steps.get(r), _age(seen, r, now)] for r in ranks]


RELAY_COLUMNS: Final = ("host", "peer", "connected", "n", "alive", "dead", "exited", "waiting",
                        "steps_min", "steps_max", "age_max", "retired", "draining")


def _relay_row(conn: RelayConn, states: _States, board: Board,
               seen: Mapping[int, float], now: float) -> list[Any]:
    """One relay's line in a large world, as a row of :data:`RELAY_COLUMNS` (a list, not an
    object: 2,048 of them go to every viewer every tick). Set intersections and ``map`` (C
    loops), since this runs for every relay of the world per document."""
    ranks, rank_set = conn.ranks, conn.rank_set
    dead = len(rank_set & states.dead_set) if states.dead_set else 0
    exited = len(rank_set & states.exited) if states.exited else 0
    retired = len(rank_set & states.retired) if states.retired else 0
    draining = len(rank_set & states.draining) if states.draining else 0
    live = rank_set & states.live
    steps = [v for v in map(board.steps.get, ranks) if v is not None]
    heard = [t for t in map(seen.get, ranks if len(live) == len(ranks) else live)
             if t is not None]
    return [conn.host, conn.peer, conn.alive, len(ranks), len(live), dead, exited,
            len(ranks) - len(live) - dead - exited - retired, min(steps, default=None),
            max(steps, default=None), round(max(0.0, now - min(heard)), 1) if heard else None,
            retired, draining]


def board_document(roster: Roster[RelayConn], board: Board, *, now: float,
                   failed: bool, extras: Mapping[str, Any],
                   coverage: Iterable[Mapping[str, Any]] = (),
                   draining: frozenset[int] = frozenset()) -> dict[str, Any]:
    """The page's document at trio time ``now``.

    Args:
        roster: membership, deaths, retirements and last-heard clocks.
        board: steps, dashboard pushes and epoch summaries.
        now: the trio clock, which the roster's clocks are on.
        failed: the run failed (formation or the failure policy).
        extras: scalars copied as they are (lost broadcasts, formation time, uptime, ...).
        coverage: the orchestrator's accounting of each epoch's samples (the
            ``epoch_covered`` notes :class:`~flodl_trio.scheduler.SyncScheduler` records):
            each epoch's row gets ``samples_covered`` of ``samples_total``, ``exactly_once``,
            ``gaps`` and ``overlaps`` from it (None without one).
        draining: ranks whose host leaves on purpose (``Coordinator.draining_ranks``).
    """
    states = _States(roster, draining)
    detailed = roster.world_size <= RANK_DETAIL_LIMIT
    dead = roster.dead
    deaths = [{"rank": r, "host": _host(roster, r), "reason": why}
              for r, why in list(dead.items())[-DEATHS_LISTED:]]
    retired = [{"rank": r, "host": roster.retired_host(r), "reason": roster.retired_reason(r)}
               for r in roster.retired[-RETIRED_LISTED:]]
    epochs = with_coverage(board.epochs(), coverage)
    return {
        "phase": page_phase(roster.phase, failed),
        "coordinator_phase": roster.phase,
        "world_size": roster.world_size,
        "world": {"min": roster.min_world, "max": roster.world_size,
                  "current": roster.current_world},
        "detail": "ranks" if detailed else "relays",
        "relay_columns": None if detailed else RELAY_COLUMNS,
        "counts": _counts(roster.world_size, states),
        "relays": _relays(roster, states, board, now, detailed=detailed),
        "deaths": deaths,
        "deaths_total": len(dead),
        "retired": retired,
        "retired_total": len(states.retired),
        "epochs": epochs,
        "throughput": epochs[-1]["samples_per_s"] if epochs else None,
        "dashboard": [p.to_dict() for p in board.pushes()],
        "dashboard_forgotten": board.forgotten_pushers,
        **extras,
    }


def _relays(roster: Roster[RelayConn], states: _States, board: Board, now: float, *,
            detailed: bool) -> list[Any]:
    """Each relay's entry (its ranks, or a row of counts in a large world); in a small world,
    the ranks no relay carries as two more: those retired from the world (``"group":
    "retired"``), and those no relay covers yet (``"group": "waiting"``)."""
    seen = roster.last_seen
    if not detailed:
        return [_relay_row(conn, states, board, seen, now) for conn in roster.relays]
    relays: list[Any] = []
    carried: set[int] = set()
    for conn in roster.relays:
        relays.append({"host": conn.host, "peer": conn.peer, "connected": conn.alive,
                       "n": len(conn.ranks), "draining": bool(conn.rank_set & states.draining),
                       "ranks": _rank_rows(conn.ranks, states, board, seen, now)})
        carried.update(conn.ranks)
    if len(carried) < roster.world_size:
        rest = [r for r in range(roster.world_size) if r not in carried]
        for group in ("retired", "waiting"):
            ranks = [r for r in rest if (r in states.retired) == (group == "retired")]
            if ranks:
                relays.append({"host": None, "peer": None, "connected": False,
                               "n": len(ranks), "group": group,
                               "ranks": _rank_rows(ranks, states, board, seen, now)})
    return relays


def _counts(world_size: int, states: _States) -> dict[str, int]:
    """Ranks per state: alive, dead, exited, retired and waiting add up to the world's
    maximum; joined and draining are counted among the alive too."""
    counts = dict.fromkeys(STATES, 0)
    counts.update(alive=len(states.live), joined=len(states.joined),
                  draining=len(states.draining), dead=len(states.dead),
                  exited=len(states.exited), retired=len(states.retired))
    counts["waiting"] = (world_size - counts["alive"] - counts["dead"] - counts["exited"]
                         - counts["retired"])
    return counts


def with_coverage(epochs: list[dict[str, Any]], coverage: Iterable[Mapping[str, Any]]
                  ) -> list[dict[str, Any]]:
    """Each epoch row with the samples its orchestrator counted covered (the same figures as
    the command line's ``240/240 samples covered (exactly once)``), or None for each."""
    noted = {int(note["epoch"]): note for note in coverage}
    for row in epochs:
        note = noted.get(row["epoch"], {})
        total, gaps = note.get("total"), note.get("gaps")
        row.update({
            "samples_covered": None if total is None or gaps is None else total - gaps,
            "samples_total": total, "exactly_once": note.get("exactly_once"),
            "gaps": gaps, "overlaps": note.get("overlaps")})
    return epochs


def _host(roster: Roster[RelayConn], rank: int) -> str | None:
    conn = roster.relay_of(rank)
    return None if conn is None else conn.host


def epoch_in_progress(timeline: Timeline) -> int | None:
    """The epoch an orchestrator last started, numbered from 1 (its ``epoch_started`` note, as
    :class:`~flodl_trio.scheduler.SyncScheduler` records it; None before the first or without
    one)."""
    fields = timeline.last_note("epoch_started")
    epoch = None if fields is None else fields.get("epoch")
    return epoch + 1 if isinstance(epoch, int) and not isinstance(epoch, bool) else None
