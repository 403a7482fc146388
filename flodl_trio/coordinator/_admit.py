"""Admission, applied (issue 26, issue 37): the one place a verdict of :func:`._admission.judge`
takes effect.

Formation hands every authenticated ``Hello`` (or ``Resume``) here; :meth:`Admitter.admit` asks
the judge and does what the verdict says: closes (``Reject``), fails formation
(``Contradiction``), refuses (``Refuse``: the relay is told why and gives up), drops a re-dialed
relay's old connection (``Replace``, then asks again), registers a joining relay and covers its
ranks once its ``Ready`` verified (``Join``), or claims the ranks, loses the superseded
connections, waits for the ``Ready`` and brings the ranks back (``Supersede``, ``Resume``,
``TakeOver``, ``Rejoin``). Formation's hub runs the common ``Join`` itself, with
:meth:`Admitter.register`, :meth:`Admitter.joined` and :meth:`Admitter.no_ready`.

Every admitted relay is entered by :meth:`Admitter._enter`, in one order: the roster, its
writer, the events, the deaths it is told, the ``DeclareAlive`` of ranks that came back.

A rejoin re-checks after its ``Ready`` (the run may have stopped, a rank may have exited), and a
``Supersede`` checks that the run still goes on once the policy judged the deaths it caused. A
rejoin that ends without joining (refused after its ``Ready``, superseded by a re-dial, no
``Ready`` within ``handshake_timeout``, or still waiting when the coordinator shuts down)
leaves nothing open.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import attrs
import trio

from .._config import CoordinatorConfig
from .._errors import FlodlError, FormationError
from ..events import RankJoined, RankRejoined, RankTakenOver, RelayJoined
from ..net._transport import STREAM_GONE, is_local_or_private
from ..timeline import Timeline
from ..wire import CoordinatorHandshake, DeclareAlive, DeclareDead, Hello, HelloReceived
from ._admission import (
    BringBack,
    Contradiction,
    Join,
    Refuse,
    Reject,
    Replace,
    Supersede,
    Terms,
    Verdict,
    ending,
    judge,
)
from ._handshake import finish_handshake, refuse
from ._outcome import FormationOutcome
from ._relayconn import RelayConn
from ._roster import Roster, ranks_text
from ._sending import Sender
from .liveness import Liveness
from .readers import Readers

log = logging.getLogger("flodl_trio.coordinator")

NewConn = Callable[[trio.abc.Stream, CoordinatorHandshake, str, Hello], RelayConn]
# What ends a wait for a relay's Ready without its Ready.
NO_READY = (trio.TooSlowError, FlodlError, *STREAM_GONE)


class Admitter:
    """Judges each authenticated Hello and applies the verdict (see the module doc)."""

    def __init__(self, *, roster: Roster[RelayConn], sender: Sender, liveness: Liveness,
                 readers: Readers, outcome: FormationOutcome, config: CoordinatorConfig,
                 timeline: Timeline, new_conn: NewConn, tls: bool) -> None:
        self._roster = roster
        self._sender = sender
        self._liveness = liveness
        self._readers = readers
        self._outcome = outcome
        self._config = config
        self._timeline = timeline
        self._new_conn = new_conn
        self._tls = tls
        self._checked_hosts: set[str] = set()
        self._claims: dict[int, RelayConn] = {}  # ranks of rejoins still waiting for Ready
        self.terms = Terms(allow_takeover=config.allow_rank_takeover)

    def leads(self, generation: int, *, adopted: bool) -> None:
        """The coordinator leads its store as ``generation``; ``adopted``: its relays resume."""
        self.terms = attrs.evolve(self.terms, generation=generation, adopting=adopted)

    def judge(self, received: HelloReceived, peer: str, *,
              ready: bool = False) -> Verdict[RelayConn]:
        """The verdict on ``received`` now (:func:`._admission.judge`)."""
        failure = self._liveness.failure
        return judge(self._roster, received, peer, terms=self.terms, claims=self._claims,
                     stopped=None if failure is None else str(failure), ready=ready)

    async def admit(self, stream: trio.abc.Stream, machine: CoordinatorHandshake, peer: str,
                    received: HelloReceived) -> None:
        """Everything after an authenticated Hello, in the connection's task: the verdict,
        applied; an admitted relay's connection is then read here until it ends."""
        verdict = self.judge(received, peer)
        replaced: list[RelayConn] = []
        if isinstance(verdict, Replace):
            replaced = self._replace(verdict.old, received.hello.host, peer)
            verdict = self.judge(received, peer)  # without them (row 2 cannot match again)
        if isinstance(verdict, Join):
            await self._join(stream, machine, peer, received.hello, verdict, replaced)
        elif isinstance(verdict, BringBack):
            await self._bring_back(stream, machine, peer, received, verdict, replaced)
        else:
            await self._turn_away(stream, machine, peer, verdict)
            for old in replaced:
                await old.close()

    # ------------------------------------------------------------------ refusals

    async def _turn_away(self, stream: trio.abc.Stream, machine: CoordinatorHandshake,
                         peer: str, verdict: Verdict[RelayConn]) -> None:
        if isinstance(verdict, Reject):
            # The relay follows a newer coordinator: this one is being deposed. It would
            # refuse our records anyway; no Refused, which would end it for good. Recorded
            # before the close: whoever sees the EOF finds the reject counted.
            self._outcome.reject(peer, verdict.category, verdict.detail)
            await trio.aclose_forcefully(stream)
        elif isinstance(verdict, Contradiction):
            self._outcome.fail(FormationError(self._roster.coverage_text(verdict.reason)))
            await self.refuse(stream, machine, peer, "contradiction", verdict.reason,
                              record=False)
        elif isinstance(verdict, Refuse):
            log.warning("relay refused during formation: %s" if verdict.forming
                        else "rejoin refused: %s", verdict.reason)
            await self.refuse(stream, machine, peer, "rejoin refused", verdict.reason)

    async def refuse(self, stream: trio.abc.Stream, machine: CoordinatorHandshake, peer: str,
                     category: str, detail: str, *, record: bool = True) -> None:
        """Refuse a relay whose Hello authenticated (every such refusal goes through here):
        tell it why (``Refused``, the ``detail`` without the "authenticated Hello from ..."
        prefix; the write bounded by ``handshake_timeout``), close its connection and, with
        ``record``, count and report the reject with ``detail`` (the reason, naming the relay
        and the rank). A relay already acknowledged is only closed."""
        if record:  # before the close: whoever sees the EOF finds the reject recorded
            self._outcome.reject(peer, category, detail)
        if machine.refusable and machine.hello is not None:
            # The relay knows who it is: its reason starts after the "who" prefix.
            who = f"authenticated Hello from relay {machine.hello.host!r} at {peer}: "
            reason = detail.removeprefix(who)
            log.info("refusing relay %r at %s: %s", machine.hello.host, peer, reason)
            await refuse(stream, machine, reason, write_within=self._config.handshake_timeout)
        else:  # already acknowledged (a rejoin checked again after its Ready): only the close
            await trio.aclose_forcefully(stream)

    # ------------------------------------------------------------------ a join (row 5)

    def _replace(self, old: Iterable[RelayConn], host: str, peer: str) -> list[RelayConn]:
        """Row 2: a relay that lost its connection mid-handshake re-dials with the same host
        and ranks; its old connections are dropped now (their ranks uncovered, not dead), and
        closed by the caller once the new verdict's own changes are made."""
        replaced = list(old)
        for relay in replaced:
            log.info("relay %r re-joined from %s; dropping its old connection", host, peer)
            self._roster.unregister(relay)
            relay.abandon("superseded by a new connection")
        return replaced

    def register(self, stream: trio.abc.Stream, machine: CoordinatorHandshake, peer: str,
                 hello: Hello) -> RelayConn:
        """A ``Join``: the relay's connection, its ranks reserved. FT/2: it covers them only
        once its Ready verified (:meth:`joined`); until then a re-dial of the same relay
        supersedes it, and its end un-covers the relay."""
        conn = self._new_conn(stream, machine, peer, hello)
        self._roster.register(conn, trio.current_time())
        self._outcome.moved(joined=True)
        return conn

    async def _join(self, stream: trio.abc.Stream, machine: CoordinatorHandshake, peer: str,
                    hello: Hello, verdict: Join, replaced: list[RelayConn]) -> None:
        conn = self.register(stream, machine, peer, hello)
        for old in replaced:  # only now: no other Hello may slip in between the checks
            await old.close()
        try:
            with trio.fail_after(self._config.handshake_timeout):
                await finish_handshake(stream, machine,
                                       cadence=self._liveness.join_cadence(conn))
        except NO_READY as exc:
            self.no_ready(conn, peer, exc)
            await conn.close()
            return
        if not self.joined(conn, verdict):
            await conn.close()
            return
        await self._readers.read_relay(conn)

    def joined(self, conn: RelayConn, verdict: Join) -> bool:
        """``conn``'s Ready verified and its welcome is written: it covers its ranks. False
        when it was superseded while its Ready was in flight (the caller closes it)."""
        if not self._roster.is_registered(conn):
            return False
        self._enter(conn, verdict)
        return True

    def no_ready(self, conn: RelayConn, peer: str, exc: BaseException) -> None:
        """A joining relay's Ready did not come: its ranks are uncovered again (the caller
        closes it). Counted as a reject unless a re-dial superseded it meanwhile."""
        superseded = conn.lost_reason is not None
        self._roster.unregister(conn)
        self._outcome.moved(joined=False)
        conn.abandon("no Ready")
        if not superseded:
            detail = (f"no Ready within handshake_timeout={self._config.handshake_timeout:g}s"
                      if isinstance(exc, trio.TooSlowError) else str(exc) or repr(exc))
            self._outcome.reject(peer, "no ready", f"relay {conn.host!r} at {peer}: HelloAck "
                                 f"sent, {detail}; its ranks are uncovered again")

    # ------------------------------------------------------------------ rows 10 to 14

    async def _bring_back(self, stream: trio.abc.Stream, machine: CoordinatorHandshake,
                          peer: str, received: HelloReceived, verdict: BringBack,
                          replaced: list[RelayConn]) -> None:
        """Claim the ranks, lose what it supersedes, wait for its Ready, judge again, bring
        the ranks back; then read the relay until its connection ends."""
        conn = self._new_conn(stream, machine, peer, received.hello)
        earlier = self._claim(conn)
        doubles = verdict.old if isinstance(verdict, Supersede) else ()
        self._supersede(doubles, conn.host, peer)  # synchronous: nothing came in between
        joined = False
        try:
            for old in replaced:
                await old.close()
            for old in earlier:  # the same relay re-dialed before its Ready arrived
                old.abandon("superseded by a new connection")
                await old.close()  # its wait for a Ready ends now
            with trio.fail_after(self._config.handshake_timeout):
                if doubles and not await self._deaths_judged(conn, machine, doubles):
                    return
                await finish_handshake(stream, machine,
                                       cadence=self._liveness.join_cadence(conn))
        except NO_READY as exc:
            conn.abandon("no Ready")
            log.info("relay %r at %s: rejoin abandoned before its Ready (%s)", conn.host, peer,
                     "handshake_timeout" if isinstance(exc, trio.TooSlowError) else exc)
            return
        else:
            if conn.lost_reason is not None:  # superseded by a re-dial of the same relay
                return
            # Judged again: a death, another rejoin or the shutdown may have come since.
            again = self.judge(received, peer, ready=True)
            if isinstance(again, Refuse):
                log.warning("rejoin refused after its Ready: %s", again.reason)
                conn.abandon(f"rejoin refused: {again.reason}")
                await self.refuse(stream, machine, peer, "rejoin refused", again.reason)
                return
            self._enter(conn, verdict)
            joined = True
        finally:
            self._release(conn)
            if not joined:  # refused, superseded, no Ready or cancelled: nothing may leak
                await conn.close()  # aclose_forcefully inside: it never waits
        await self._readers.read_relay(conn)

    def _claim(self, conn: RelayConn) -> list[RelayConn]:
        """``conn`` claims its ranks until its Ready; returns the earlier claims it takes
        over (the same relay's re-dial: the judge refused any other)."""
        earlier = {old: None for rank in conn.ranks if (old := self._claims.get(rank))}
        for rank in conn.ranks:
            self._claims[rank] = conn
        return list(earlier)

    def _release(self, conn: RelayConn) -> None:
        for rank in conn.ranks:
            if self._claims.get(rank) is conn:
                del self._claims[rank]

    def _supersede(self, doubles: Iterable[RelayConn], host: str, peer: str) -> None:
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

    async def _deaths_judged(self, conn: RelayConn, machine: CoordinatorHandshake,
                             doubles: Iterable[RelayConn]) -> bool:
        """The failure policy judges the superseded ranks' deaths before they come back:
        False when it stopped the run meanwhile (the relay was refused)."""
        for old in doubles:
            await old.close()
        await self._liveness.wait_told()
        failure = self._liveness.failure
        problem = ending(self._roster, conn.host, conn.peer,
                         None if failure is None else str(failure))
        if problem is None:
            return True
        log.warning("rejoin refused: %s", problem)
        conn.abandon(f"rejoin refused: {problem}")
        await self.refuse(conn.stream, machine, conn.peer, "rejoin refused", problem)
        return False

    # ------------------------------------------------------------------ entering

    def _enter(self, conn: RelayConn, verdict: Join | BringBack) -> None:
        """``conn``'s Ready verified and its welcome is written: it carries its ranks. A
        ``Join`` was registered at its Hello (its ranks are confirmed now); the others take
        their ranks over now, the dead ones back. Everyone is told in the same order."""
        roster = self._roster
        dropped: list[RelayConn] = []
        back: list[int] = []
        returned: list[int] = []  # exited, back in an elastic world (no DeclareDead was told)
        # Ranks new to a running cohort (never covered, or retired): the world grows (issue 37).
        grown = ([rank for rank in conn.ranks if roster.relay_of(rank) is None]
                 if roster.running else [])
        if isinstance(verdict, Join):
            roster.confirm(conn)
            previous = verdict.taken
        else:
            was_dead, had_left = roster.dead, roster.exited
            previous, dropped = roster.rejoin(conn, trio.current_time())
            back = [rank for rank in conn.ranks if rank in was_dead]
            returned = [rank for rank in conn.ranks if rank in had_left]
        self._sender.start_writer(conn)
        self.warn_cleartext(conn.peer)
        for old in dropped:  # every rank it carried is back elsewhere
            if old.alive:
                old.abandon(f"its ranks rejoined through {conn.describe()}")
        if log.isEnabledFor(logging.INFO):  # thousands join: no ranks text nobody reads
            log.info("relay %r %s from %s with ranks %s", conn.host,
                     "joined" if isinstance(verdict, Join) else "rejoined", conn.peer,
                     ranks_text(conn.ranks))
        self._timeline.event(RelayJoined(host=conn.host, ranks=conn.ranks, peer=conn.peer))
        for rank, before in previous.items():
            if before is not None and before != conn.host:
                log.warning("rank %d of host %r taken over by host %r (allow_rank_takeover)",
                            rank, before, conn.host)
                self._timeline.event(RankTakenOver(rank=rank, host=conn.host,
                                                   previous_host=before))
        for rank in (*back, *returned):
            self._timeline.event(RankRejoined(rank=rank, host=conn.host))
        if grown:
            world = roster.current_world
            log.info("relay %r grew the world to %d ranks (%d..%d) with ranks %s", conn.host,
                     world, roster.min_world, roster.world_size, ranks_text(grown))
            for rank in grown:
                self._timeline.event(RankJoined(rank=rank, host=conn.host, world=world))
        # The newcomers learn who is still dead; everyone learns who is back, or new. Both are
        # queued behind the welcome on the new connection, and never wait on any relay.
        for dead in sorted(roster.dead):
            self._sender.post_to(conn, DeclareDead(rank=dead))
        for rank in (*back, *grown):
            self._sender.post(DeclareAlive(rank=rank))
        if not isinstance(verdict, Join):
            self._liveness.wake()  # its ranks' clocks start now
        if roster.complete:  # the last ranks are covered (a rejoin during formation too)
            self._outcome.complete()
        elif roster.forming:  # an elastic world's join window starts again
            self._outcome.moved(joined=True)

    def warn_cleartext(self, peer: str) -> None:
        host = peer.rsplit(":", 1)[0].strip("[]")
        # Each address once (thousands of relays join from a few): parsed, warned or not.
        if self._tls or host in self._checked_hosts:
            return
        self._checked_hosts.add(host)
        if is_local_or_private(host) or host.startswith("<") or host.startswith("mem:"):
            return
        log.warning("relay at %s joined over cleartext from outside loopback/private ranges: "
                    "frames are authenticated but readable on the network; use TLS "
                    "(ssl_context=)", peer)
