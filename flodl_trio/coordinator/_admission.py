"""Admission (issue 37): what one authenticated ``Hello`` or ``Resume`` is to the cohort.

Joining, rejoining, a restarted host superseding its old connection, a spare taking over, a
relay resuming after a failover and growing the world are one question, answered here
by one pure function: :func:`judge` takes the roster, the relay's ``Hello`` (or ``Resume``), the
coordinator's terms (generation, takeover, adoption) and the rejoins in flight, and returns one
verdict. No trio, no IO, no clock: :mod:`._admit` asks and applies the verdict, in one place.

The table; the first row that holds wins ("the ranks" are the ranks the relay names)::

   #  phase    when                                                       verdict
   1  any      a Resume naming a generation newer than ours               Reject
   2  FORMING  a re-dial: a registered relay with its host and exactly    Replace(old), then
               its ranks, or (adopting) its host's relay awaiting its      judged again
               resume that carries one of them
   3  FORMING  no rank is dead, and the Hello contradicts the world:      Contradiction
               world size, model, the rank list, a rank announced by a
               relay that carries it now
   4  FORMING  no rank is dead; a rank belongs to another host whose      Refuse
               relay was lost (takeover off), or another relay's
               rejoin claims it
   5  FORMING  no rank is dead                                            Join(taken)
   6  ENDING   shutting down, or the failure policy stopped the run       Refuse
   7  any      another world size or model, or a rank list that is not    Refuse
               one (empty, unsorted, a rank twice or out of range)
   8  any      a rank exited cleanly (a fixed world), is alive on a       Refuse
               relay it does not supersede, or belongs to another host
               (takeover off)
   9  any      another relay's rejoin claims a rank                       Refuse
  10  RUNNING  a rank is alive on its own host's connection               Supersede(old)
  11  RUNNING  a Resume; a rank is on its host's relay awaiting resume    Resume(conns)
  12  RUNNING  every rank uncovered, and the world has room for them      Grow
  13  any      a rank was last carried by another host (takeover on)      TakeOver(previous)
  14  any      otherwise: every rank dead or uncovered (or exited, in an  Rejoin
               elastic world), of its own host

FORMING: the roster is forming. RUNNING: it runs and the failure policy has not stopped the run;
ENDING: it runs and the policy stopped the run, or it is shutting down. During formation rows
6 to 14 judge a Hello naming a dead rank (rows 3 to 5 need none): a rank declared dead is not
"already announced", the rejoin rules bring it back (issue 26).

Who is told what: a ``Reject`` is closed without a word (the relay follows a newer coordinator;
a ``Refused`` would end it for good) and counted; a ``Contradiction`` fails formation and the
relay is refused; a ``Refuse`` tells the relay why (``Refused``) and is counted as a rejected
handshake ``rejoin refused``, the run goes on. ``Join`` covers the ranks once its ``Ready``
verified (``RelayJoined``; ``RankTakenOver`` for ranks of a lost relay's host, takeover on).
Rows 10 to 14 claim the ranks until the relay's ``Ready`` and then bring them back
(``RelayJoined``, ``RankTakenOver``, ``RankRejoined`` and ``DeclareAlive`` for the dead ones);
a ``Supersede`` first loses the old connections and declares their live ranks dead (the failure
policy judges those deaths before the ranks come back), a ``Resume`` takes its ranks over as
they are (no death, no ``DeclareAlive`` for a live one).

A Hello whose ranks fall in several of rows 10 to 14 (one dead, one alive on the host's
restarted relay, say) is admitted whole, as the first of those rows: the roster takes each
rank as it is.

Row 12 is elastic membership (issue 37, docs/elastic.rst): a running cohort has room for ranks
it does not cover -- an elastic world formed below its maximum, a rank retired since -- and a
relay naming only such ranks grows the world (``RankJoined`` for each, ``DeclareAlive`` to the
others; no rank can lie above the maximum, row 7 refuses it). A fixed world covers every rank
once it formed and never retires one, so the row never matches there. An uncovered rank belongs
to no host once the cohort formed (``Roster.start_running``, ``Roster.retire``): any host may
grow into it.

Asked again: after the ``Ready`` of rows 10 to 14 (``ready=True``), rows 6 and 8 only (the run
may have stopped, a rank may have exited or come back elsewhere meanwhile; the rank list and the
claims were settled at the Hello, and the relay holds its claims), a relay awaiting its resume
still counting as superseded; after a ``Supersede``'s deaths were told, row 6 only
(:func:`ending`).

Cost: a plain join (row 5) is O(ranks named) and O(model signature names): a few dict lookups
per rank and one small dict (``taken``), as formation's hub asks it once per relay.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Generic, Protocol, TypeAlias, TypeVar

import attrs

from ..wire import HelloReceived
from ._roster import Member, Roster


class Candidate(Member, Protocol):
    """What admission reads of a relay connection, besides what the roster does."""

    @property
    def awaiting_resume(self) -> bool: ...

    @property
    def rank_set(self) -> frozenset[int]: ...


C = TypeVar("C", bound=Candidate)


@attrs.frozen
class Terms:
    """The coordinator's standing terms of admission.

    Attributes:
        allow_takeover: a host may take over ranks another host announced
            (``CoordinatorConfig.allow_rank_takeover``).
        generation: this coordinator's generation in its session store, None without one.
        adopting: it adopted a session from its store: the relays of its roster are to resume.
    """

    allow_takeover: bool = False
    generation: int | None = None
    adopting: bool = False


# ---------------------------------------------------------------------------------- verdicts


@attrs.frozen
class Reject:
    """Row 1: close without a word and count it (``category``, ``detail``)."""

    category: str
    detail: str


@attrs.frozen
class Contradiction:
    """Row 3: an authenticated peer contradicts the cohort; formation fails with ``reason``."""

    reason: str


@attrs.frozen
class Refuse:
    """Rows 4, 6-9: tell the relay why and count it; ``forming``: formation's own rule (row 4)
    refused it, not the rejoin rules."""

    reason: str
    forming: bool = False


@attrs.frozen
class Replace(Generic[C]):
    """Row 2: the same relay re-dialed during formation; ``old`` are dropped (uncovered, not
    dead), whatever the Hello is judged to be next."""

    old: tuple[C, ...]


@attrs.frozen
class Join:
    """Row 5: register now, cover once its ``Ready`` verified. ``taken``: each rank's host
    before (None: never covered), for the ``RankTakenOver`` of a lost relay's ranks."""

    taken: Mapping[int, str | None]


@attrs.frozen
class BringBack:
    """Rows 10-14: claim ``ranks`` until the relay's ``Ready``, then bring them back."""

    ranks: tuple[int, ...]


@attrs.frozen
class Supersede(BringBack, Generic[C]):
    """Row 10: the host restarted before its death was seen: ``old`` are lost first."""

    old: tuple[C, ...] = ()


@attrs.frozen
class Resume(BringBack, Generic[C]):
    """Row 11: a relay of the adopted roster resumes: it takes ``conns``' ranks as they are."""

    conns: tuple[C, ...] = ()


@attrs.frozen
class Grow(BringBack):
    """Row 12: new ranks join a running cohort (elastic membership: the world grows)."""


@attrs.frozen
class TakeOver(BringBack):
    """Row 13: a spare carries ranks of another host (``previous``: rank -> that host)."""

    previous: Mapping[int, str] = attrs.field(factory=dict)


@attrs.frozen
class Rejoin(BringBack):
    """Row 14: dead (or uncovered) ranks come back on their own host."""


# Supersede and Resume are BringBack too; named for the connections they carry.
Verdict: TypeAlias = (Reject | Contradiction | Refuse | Replace[C] | Join | BringBack
                      | Supersede[C] | Resume[C])


# ---------------------------------------------------------------------------------- the judge


def judge(roster: Roster[C], received: HelloReceived, peer: str, *, terms: Terms,
          claims: Mapping[int, C], stopped: str | None = None, ready: bool = False) -> Verdict[C]:
    """What ``received`` (an authenticated Hello or Resume from ``peer``) is to the cohort: the
    first row of the module's table that holds.

    Args:
        roster: the membership as it is now.
        received: the relay's Hello (a Resume's Hello fields and its generation).
        peer: the relay's address, for the reasons.
        terms: the coordinator's :class:`Terms`.
        claims: rank -> the connection of a rejoin waiting for its ``Ready``.
        stopped: why the failure policy stopped the run, None while it has not.
        ready: asked again once the relay's ``Ready`` verified (rows 6 and 8 only).
    """
    hello = received.hello
    ranks = hello.ranks
    seen = received.generation
    if seen is not None and terms.generation is not None and seen > terms.generation:
        return Reject("newer generation", (
            f"relay {hello.host!r} at {peer}: Resume naming generation {seen}, expected at most "
            f"this coordinator's {terms.generation}; closed (it follows a newer coordinator)"))
    if roster.forming and not ready:
        old = redials(roster, hello.host, ranks, adopting=terms.adopting)
        if old:
            return Replace(tuple(old))
        if not any(roster.is_dead(r) for r in ranks):
            return _formation_rules(roster, received, peer, terms=terms, claims=claims)
    return _rejoin_rules(roster, received, peer, terms=terms, claims=claims, stopped=stopped,
                         ready=ready)


def _formation_rules(roster: Roster[C], received: HelloReceived, peer: str, *, terms: Terms,
                     claims: Mapping[int, C]) -> Verdict[C]:
    """Rows 3 to 5: a forming cohort, no rank of the Hello dead."""
    hello = received.hello
    host, ranks = hello.host, hello.ranks
    problem = roster.hello_problem(host, ranks, peer, world_size=hello.world_size,
                                   model_sigs=hello.model_sigs)
    if problem is not None:
        return Contradiction(problem)
    problem = (rejoin_problem(roster, host, ranks, peer, allow_takeover=terms.allow_takeover)
               or claim_problem(claims, host, ranks, peer))
    if problem is not None:
        return Refuse(problem, forming=True)
    return Join({r: roster.announced_by(r) for r in ranks})


def _rejoin_rules(roster: Roster[C], received: HelloReceived, peer: str, *, terms: Terms,
                  claims: Mapping[int, C], stopped: str | None, ready: bool) -> Verdict[C]:
    """Rows 6 to 14 (with ``ready``, rows 6 and 8, then the row that admits)."""
    hello = received.hello
    host, ranks = hello.host, hello.ranks
    problem = ending(roster, host, peer, stopped)
    if problem is not None:
        return Refuse(problem)
    doubles, resuming = live_doubles(roster, host, ranks, resume=received.resumed)
    if ready:  # the superseded doubles' ranks are dead now; those awaiting resume are not
        problem = rejoin_problem(roster, host, ranks, peer, allow_takeover=terms.allow_takeover,
                                 superseding=resuming)
    else:
        problem = (roster.hello_problem(host, ranks, peer, world_size=hello.world_size,
                                        model_sigs=hello.model_sigs, rejoin=True)
                   or rejoin_problem(roster, host, ranks, peer,
                                     allow_takeover=terms.allow_takeover,
                                     superseding=doubles + resuming)
                   or claim_problem(claims, host, ranks, peer))
    if problem is not None:
        return Refuse(problem)
    ranks = tuple(ranks)
    if doubles:
        return Supersede(ranks, old=tuple(doubles))
    if resuming:
        return Resume(ranks, conns=tuple(resuming))
    if roster.running and all(roster.relay_of(r) is None for r in ranks) and (
            len(roster.covered) + len(ranks) <= roster.world_size):
        return Grow(ranks)
    previous = {r: before for r in ranks
                if (before := _carried_by(roster, r)) is not None and before != host}
    if previous:
        return TakeOver(ranks, previous=previous)
    return Rejoin(ranks)


def _carried_by(roster: Roster[C], rank: int) -> str | None:
    owner = roster.relay_of(rank)
    return roster.announced_by(rank) if owner is None else owner.host


# ---------------------------------------------------------------------------------- the rows


def redials(roster: Roster[C], host: str, ranks: tuple[int, ...], *,
            adopting: bool) -> list[C]:
    """Row 2: the registered relays this Hello re-dials during formation -- its host with
    exactly its ranks (a relay that lost its connection mid-handshake; a reconnect, not a
    contradiction) and, ``adopting``, its host's relays of the adopted roster that await their
    resume and carry one of its ranks."""
    old = roster.same_relay(host, ranks)
    if adopting:
        old += [relay for relay in roster.relays_of_host(host)
                if relay.awaiting_resume and relay not in old
                and not relay.rank_set.isdisjoint(ranks)]
    return old


def ending(roster: Roster[C], host: str, peer: str, stopped: str | None) -> str | None:
    """Row 6: why nothing may rejoin now (the coordinator shuts down, or the failure policy
    stopped the run), or None."""
    if roster.forming:
        return None
    who = f"authenticated Hello from relay {host!r} at {peer}"
    if not roster.running:
        return (f"{who}: expected a running cohort to rejoin, but the coordinator is "
                f"{roster.phase.replace('_', ' ')}")
    if stopped is not None:  # the run is stopping: nothing to rejoin
        return f"{who}: expected a running cohort to rejoin, but {stopped}"
    return None


def live_doubles(roster: Roster[C], host: str, ranks: Iterable[int], *,
                 resume: bool) -> tuple[list[C], list[C]]:
    """Rows 10 and 11: the connections of ``host`` carrying a live rank among ``ranks`` in a
    running cohort -- those a Hello supersedes (the host restarted before its death was seen),
    and apart, with ``resume``, those awaiting their resume (a Resume takes them over)."""
    if not roster.running:
        return [], []
    doubles: dict[C, None] = {}
    for rank in ranks:
        owner = roster.relay_of(rank)
        if (owner is not None and owner.host == host and not roster.is_dead(rank)
                and not roster.has_exited(rank)):
            doubles[owner] = None
    resuming = [old for old in doubles if resume and old.awaiting_resume]
    return [old for old in doubles if old not in resuming], resuming


def rejoin_problem(roster: Roster[C], host: str, ranks: Iterable[int], peer: str, *,
                   allow_takeover: bool, superseding: Collection[C] = ()) -> str | None:
    """Rows 4 and 8: why a relay may not bring ``ranks`` (back) into the cohort, or None.

    Every rank must be dead (or not covered); a rank that exited cleanly never comes back to a
    fixed world, and comes back to an elastic one like a dead rank (the minimum kept it in the
    world, its host drained or not); a rank announced by another host needs
    ``allow_takeover`` (during formation too, once the relay that announced it was lost). A
    rank alive on one of ``superseding`` (the same host's connections, about to be superseded
    or resumed) counts as dead.
    """
    who = f"authenticated Hello from relay {host!r} at {peer}"
    for rank in ranks:
        owner = roster.relay_of(rank)
        if owner is None:
            announced = roster.announced_by(rank)
            if announced is not None and announced != host and not allow_takeover:
                return (f"{who}: rank {rank} was announced by host {announced!r}, whose relay "
                        "was lost; expected that host to bring it back (a different host "
                        "takes over ranks only with CoordinatorConfig(allow_rank_takeover="
                        "True), CLI --allow-takeover)")
            continue
        if roster.has_exited(rank):
            if roster.min_world == roster.world_size:  # else elastic: it may come back
                return (f"{who}: expected every rank it names to be dead, but rank {rank} "
                        "exited cleanly and does not rejoin")
        elif not roster.is_dead(rank) and owner not in superseding:
            return (f"{who}: expected every rank it names to be dead, but rank {rank} is alive "
                    f"on relay {owner.host!r} at {owner.peer}")
        if owner.host != host and not allow_takeover:
            return (f"{who}: rank {rank} was announced by host {owner.host!r}; expected that "
                    "host to bring it back (a different host takes over dead ranks only with "
                    "CoordinatorConfig(allow_rank_takeover=True), CLI --allow-takeover)")
    return None


def claim_problem(claims: Mapping[int, C], host: str, ranks: tuple[int, ...],
                  peer: str) -> str | None:
    """Rows 4 and 9: why ``ranks`` may not be named now -- another relay's rejoin of one of
    them waits for its ``Ready`` (a re-dial of that same relay may: it supersedes it)."""
    for rank in ranks:
        other = claims.get(rank)
        if other is not None and (other.host != host or other.ranks != ranks):
            return (f"authenticated Hello from relay {host!r} at {peer}: rank {rank} is "
                    f"being rejoined by relay {other.host!r} at {other.peer}")
    return None
