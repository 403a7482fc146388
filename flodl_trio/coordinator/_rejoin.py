"""Rejoin (issue 26): a host that comes back, or a spare that takes over.

A relay that dials the running coordinator runs the full FT/2 handshake (fresh nonces, so a
recorded join replayed is still refused). Its authenticated Hello is admitted when the world size
and the model signatures agree with the cohort's and every rank it names is currently dead (a
relay naming a rank that is alive elsewhere, or one that exited cleanly, is refused); a rank of a
*different* host is taken over only with ``allow_rank_takeover``. Once its ``Ready`` verified, the
ranks are alive again on the new connection: ``RankRejoined`` events, ``DeclareAlive`` to every
live rank, and the ranks still dead are told to the newcomers with ``DeclareDead``.

A host restarted before its death was noticed (frozen, partitioned, or a crash whose connection
has not reset yet) names ranks still alive on its old connection: an authenticated Hello whose
host is the host of the live connection(s) carrying every rank it names supersedes them. They
are lost at once ("superseded: ..."), their live ranks declared dead the usual way (the failure
policy counts these deaths), and the new connection rejoins in the same handshake. A rank alive
on another host's connection is still refused.

While one rejoin waits for its ``Ready``, its ranks are claimed: a second relay naming them is
refused, except a re-dial of the same host with the same ranks, which supersedes it.

During formation the same rules judge a Hello naming a rank declared dead (its relay dropped it,
or the relay was lost after the death): the rank is not "already announced", it is brought back
here, and formation completes once every rank is covered again.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from typing import Protocol

import trio

from .._config import CoordinatorConfig
from .._errors import FlodlError
from ..events import RankRejoined, RankTakenOver, RelayJoined
from ..net._transport import STREAM_GONE
from ..timeline import Timeline
from ..wire import CoordinatorHandshake, DeclareAlive, DeclareDead, Hello
from ._handshake import finish_handshake
from ._relayconn import RelayConn
from ._roster import M, Roster, ranks_text
from ._sending import Sender
from .liveness import Liveness
from .readers import Readers

log = logging.getLogger("flodl_trio.coordinator")


class Admitter(Protocol):
    """What a rejoin needs from formation: the one refusal path and the connection factory."""

    async def refuse(self, stream: trio.abc.Stream, machine: CoordinatorHandshake, peer: str,
                     category: str, detail: str, *, record: bool = True) -> None: ...

    def new_conn(self, stream: trio.abc.Stream, machine: CoordinatorHandshake, peer: str,
                 hello: Hello) -> RelayConn: ...

    def warn_cleartext(self, peer: str) -> None: ...

    def complete(self) -> None: ...


def rejoin_problem(roster: Roster[M], host: str, ranks: Iterable[int], peer: str, *,
                   allow_takeover: bool, superseding: Collection[M] = ()) -> str | None:
    """Why a relay may not bring ``ranks`` back into the running cohort, or None.

    Every rank must be dead (or not covered); a rank that exited cleanly never comes back; a
    rank announced by another host needs ``allow_takeover`` (during formation too, once the
    relay that announced it was lost). The Hello's shape, world size and model signatures are
    checked before (``Roster.hello_problem``). A rank alive on one of ``superseding`` (the
    same host's live connections, about to be superseded) counts as dead.
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
            return (f"{who}: expected every rank it names to be dead, but rank {rank} exited "
                    "cleanly and does not rejoin")
        if not roster.is_dead(rank) and owner not in superseding:
            return (f"{who}: expected every rank it names to be dead, but rank {rank} is alive "
                    f"on relay {owner.host!r} at {owner.peer}")
        if owner.host != host and not allow_takeover:
            return (f"{who}: rank {rank} was announced by host {owner.host!r}; expected that "
                    "host to bring it back (a different host takes over dead ranks only with "
                    "CoordinatorConfig(allow_rank_takeover=True), CLI --allow-takeover)")
    return None


class Rejoins:
    """Admits relays after formation; see the module doc."""

    def __init__(self, admitter: Admitter, *, roster: Roster[RelayConn], sender: Sender,
                 liveness: Liveness, readers: Readers, config: CoordinatorConfig,
                 timeline: Timeline) -> None:
        self._admitter = admitter
        self._roster = roster
        self._sender = sender
        self._liveness = liveness
        self._readers = readers
        self._config = config
        self._timeline = timeline
        self._claims: dict[int, RelayConn] = {}  # ranks of rejoins still waiting for Ready

    def claim_problem(self, host: str, ranks: tuple[int, ...], peer: str) -> str | None:
        """Why ``ranks`` may not be named now: another relay's rejoin of them waits for its
        ``Ready`` (a re-dial of that same relay may)."""
        for rank in ranks:
            other = self._claims.get(rank)
            if other is not None and (other.host != host or other.ranks != ranks):
                return (f"authenticated Hello from relay {host!r} at {peer}: rank {rank} is "
                        f"being rejoined by relay {other.host!r} at {other.peer}")
        return None

    async def admit(self, stream: trio.abc.Stream, machine: CoordinatorHandshake, peer: str,
                    hello: Hello, *, resume: bool = False) -> None:
        """Admit or refuse one relay whose Hello (or ``Resume``) authenticated after
        formation; an admitted relay's connection is then read here until it ends.

        A ``Resume`` from the host of an adopted relay awaiting its resume (SPEC §4.7) takes
        its ranks over as they are: the live ones stay live (no death, no ``DeclareAlive``),
        the dead ones rejoin. A ``Hello`` naming them is a relay that restarted: they are
        superseded like any live double."""
        ranks = tuple(hello.ranks)
        roster = self._roster
        doubles = self._live_doubles(hello.host, ranks)
        resuming = [old for old in doubles if resume and old.awaiting_resume]
        doubles = [old for old in doubles if old not in resuming]
        problem = (self._phase_problem(hello.host, peer)
                   or roster.hello_problem(hello.host, ranks, peer, world_size=hello.world_size,
                                        model_sigs=hello.model_sigs, rejoin=True)
                   or rejoin_problem(roster, hello.host, ranks, peer,
                                     allow_takeover=self._config.allow_rank_takeover,
                                     superseding=doubles + resuming)
                   or self.claim_problem(hello.host, ranks, peer))
        if problem is not None:
            log.warning("rejoin refused: %s", problem)
            await self._admitter.refuse(stream, machine, peer, "rejoin refused", problem)
            return
        conn = self._admitter.new_conn(stream, machine, peer, hello)
        superseded = {old: None for rank in ranks if (old := self._claims.get(rank))}
        for rank in ranks:
            self._claims[rank] = conn
        self._supersede(doubles, hello.host, peer)  # synchronous: nothing came in between
        joined = False
        try:
            for old in superseded:  # the same relay re-dialed before its Ready arrived
                old.abandon("superseded by a new connection")
                await old.close()  # its wait for a Ready ends now
            with trio.fail_after(self._config.handshake_timeout):
                if doubles:  # the policy judges the momentary deaths before they come back
                    for old in doubles:
                        await old.close()
                    await self._liveness.wait_told()
                    problem = self._phase_problem(hello.host, peer)
                    if problem is not None:
                        log.warning("rejoin refused: %s", problem)
                        conn.abandon(f"rejoin refused: {problem}")
                        await self._admitter.refuse(stream, machine, peer, "rejoin refused",
                                                    problem)
                        return
                await finish_handshake(stream, machine,
                                       cadence=self._liveness.join_cadence(conn))
        except (trio.TooSlowError, FlodlError, *STREAM_GONE) as exc:
            conn.abandon("no Ready")
            log.info("relay %r at %s: rejoin abandoned before its Ready (%s)", hello.host, peer,
                     "handshake_timeout" if isinstance(exc, trio.TooSlowError) else exc)
            return
        else:
            if conn.lost_reason is not None:  # superseded by a re-dial of the same relay
                return
            # Checked again: a death, another rejoin or the shutdown may have come since.
            problem = self._phase_problem(hello.host, peer) or rejoin_problem(
                roster, hello.host, ranks, peer,
                allow_takeover=self._config.allow_rank_takeover,
                superseding=[old for old in resuming if old.awaiting_resume])
            if problem is not None:
                log.warning("rejoin refused after its Ready: %s", problem)
                conn.abandon(f"rejoin refused: {problem}")
                await self._admitter.refuse(stream, machine, peer, "rejoin refused", problem)
                return
            self._join(conn)
            joined = True
        finally:
            self._release(conn)
            if not joined:  # refused, superseded, no Ready or cancelled: nothing may leak
                await conn.close()  # aclose_forcefully inside: it never waits
        await self._readers.read_relay(conn)

    def _live_doubles(self, host: str, ranks: tuple[int, ...]) -> list[RelayConn]:
        """The live connections of ``host`` carrying a live rank among ``ranks``: an
        authenticated Hello from ``host`` naming them supersedes them (the host restarted
        before its death was noticed) -- only if nothing else refuses it (a rank alive on
        another host's connection, say), which ``admit`` checks first."""
        if not self._roster.running:
            return []
        doubles: dict[RelayConn, None] = {}
        for rank in ranks:
            owner = self._roster.relay_of(rank)
            if (owner is not None and owner.host == host and not self._roster.is_dead(rank)
                    and not self._roster.has_exited(rank)):
                doubles[owner] = None
        return list(doubles)

    def _supersede(self, doubles: list[RelayConn], host: str, peer: str) -> None:
        """Lose each of ``doubles`` now: its live ranks are declared dead the usual way
        (survivors told, failure policy applied) before the new connection brings them back."""
        cause = f"superseded: host {host!r} re-joined from {peer}"
        for old in doubles:
            log.warning("%s: %s", old.describe(), cause)
            self._liveness.relay_lost(old, cause)
            for rank in old.ranks:  # declared even without declare_dead_on_relay_loss
                if self._roster.carries(old, rank):
                    self._liveness.mark_dead(rank, f"relay {old.host!r} at {old.peer} lost: "
                                             f"{cause}")

    def _phase_problem(self, host: str, peer: str) -> str | None:
        who = f"authenticated Hello from relay {host!r} at {peer}"
        if self._roster.forming:
            return None
        if not self._roster.running:
            return (f"{who}: expected a running cohort to rejoin, but the coordinator is "
                    f"{self._roster.phase.replace('_', ' ')}")
        if self._liveness.failure is not None:  # the run is stopping: nothing to rejoin
            return f"{who}: expected a running cohort to rejoin, but {self._liveness.failure}"
        return None

    def _release(self, conn: RelayConn) -> None:
        for rank in conn.ranks:
            if self._claims.get(rank) is conn:
                del self._claims[rank]

    def _join(self, conn: RelayConn) -> None:
        was_dead = self._roster.dead
        previous, dropped = self._roster.rejoin(conn, trio.current_time())
        self._sender.start_writer(conn)
        self._admitter.warn_cleartext(conn.peer)
        for old in dropped:  # every rank it carried is back elsewhere
            if old.alive:
                old.abandon(f"its ranks rejoined through {conn.describe()}")
        log.info("relay %r rejoined from %s with ranks %s", conn.host, conn.peer,
                 ranks_text(conn.ranks))
        self._timeline.event(RelayJoined(host=conn.host, ranks=conn.ranks, peer=conn.peer))
        announce_takeovers(self._timeline, conn.host, previous)
        back = [rank for rank in conn.ranks if rank in was_dead]
        for rank in back:
            self._timeline.event(RankRejoined(rank=rank, host=conn.host))
        # The newcomers learn who is still dead; everyone learns who is back. Both are queued
        # behind the welcome on the new connection, and never wait on any relay.
        for dead in sorted(self._roster.dead):
            self._sender.post_to(conn, DeclareDead(rank=dead))
        for rank in back:
            self._sender.post(DeclareAlive(rank=rank))
        self._liveness.wake()
        if self._roster.complete:  # a rejoin during formation covered the last ranks
            self._admitter.complete()


def announce_takeovers(timeline: Timeline, host: str,
                       previous: dict[int, str | None]) -> None:
    """Log and record each rank that ``host`` took over from another host."""
    for rank, before in previous.items():
        if before is not None and before != host:
            log.warning("rank %d of host %r taken over by host %r (allow_rank_takeover)",
                        rank, before, host)
            timeline.event(RankTakenOver(rank=rank, host=host, previous_host=before))
