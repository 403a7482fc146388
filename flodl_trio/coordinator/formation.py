"""Formation (SPEC §4.2): accept, the handshakes (one hub task for plain TCP connections), coverage,
rejects.

A connection that fails before authenticating is rejected, recorded and dropped; an
authenticated Hello that contradicts the world fails formation at once; a relay that lost its
connection mid-handshake and re-dials with the same host and ranks simply replaces it. A Hello
naming a rank declared dead during formation, and every Hello after formation, goes to the
rejoin rules (:mod:`._rejoin`); so does the takeover rule for ranks whose relay was lost during
formation. Every relay refused after its Hello authenticated is refused through
:meth:`Formation.refuse`, which tells it why (``Refused``), so it gives up at once instead of
re-dialing.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import trio

from .._config import CoordinatorConfig
from .._errors import FlodlError, FormationAborted, FormationError, FormationTimeout
from ..events import FormationComplete, FormationFailed, HandshakeRejected, RelayJoined
from ..net._handshake_hub import HandshakeHub, HubConn, hub_socket
from ..net._keepalive import KeepAlive
from ..net._listen import serve_each
from ..net._pending import PendingHandshakes, PendingSlot, min_shed_age, unread_probe
from ..net._ratelimit import JunkReport
from ..net._transport import STREAM_GONE, close_all, is_local_or_private, peer_of
from ..port_mux import MuxLeg, PrefixedStream
from ..timeline import Timeline
from ..wire import (
    CoordinatorHandshake,
    DeclareDead,
    Established,
    Hello,
    HelloReceived,
    SessionSalt,
    max_hello_payload,
)
from ._handshake import Rejected, coordinator_handshake, finish_handshake, refuse
from ._rejoin import Rejoins, announce_takeovers, rejoin_problem
from ._relayconn import RelayConn
from ._roster import Roster, ranks_text
from ._sending import Sender
from .liveness import Liveness
from .readers import Readers

log = logging.getLogger("flodl_trio.coordinator")


class HubJoining:
    """What formation keeps of a relay whose handshake the hub advances, between its steps."""

    __slots__ = ("conn", "hub", "nursery", "peer", "pending", "slot", "stream", "taken")

    def __init__(self, hub: HandshakeHub, nursery: trio.Nursery, stream: trio.abc.Stream,
                 peer: str) -> None:
        self.hub = hub
        self.nursery = nursery
        self.stream = stream
        self.peer = peer
        self.pending: HubConn
        self.slot: PendingSlot
        self.conn: RelayConn | None = None
        self.taken: dict[int, str | None] = {}


class Formation:
    """Accepts relay connections, runs their handshakes and tells the roster who joined.

    Attributes:
        failure: why formation failed (set once), else None.
    """

    def __init__(
        self,
        *,
        roster: Roster[RelayConn],
        sender: Sender,
        liveness: Liveness,
        readers: Readers,
        config: CoordinatorConfig,
        salt: SessionSalt,
        timeline: Timeline,
        tls: bool,
    ) -> None:
        self._roster = roster
        self._sender = sender
        self._liveness = liveness
        self._readers = readers
        self._config = config
        self._salt = salt
        self._timeline = timeline
        self._tls = tls
        self._checked_hosts: set[str] = set()
        self._conn_counter = 0
        self._pending = PendingHandshakes(config.max_pending_handshakes,
                                          min_age=min_shed_age(config.handshake_timeout))
        self._max_hello = max_hello_payload(config.world_size)
        self._settled = trio.Event()
        self._started = 0.0
        self.failure: FormationError | None = None
        # True once a session was adopted from a store: relays of its roster await their resume.
        self._adopting = False
        # The coordinator's generation with a session store (sent as Generation), else None.
        self._generation: int | None = None
        self._rejoins = Rejoins(self, roster=roster, sender=sender, liveness=liveness,
                                readers=readers, config=config, timeline=timeline)

    def leads(self, generation: int, *, adopted: bool) -> None:
        """The coordinator leads its session store as ``generation`` (sent to every relay as
        ``Generation``); ``adopted``: it adopted the store's session, whose relays resume."""
        self._generation = generation
        self._adopting = adopted

    @property
    def pending_handshakes(self) -> int:
        """Connections routed to formation whose Hello has not verified yet."""
        return len(self._pending)

    async def accept_loop(self, listener: trio.abc.Listener[Any]) -> None:
        """Accept relay connections from ``listener``. While ``max_pending_handshakes`` are
        unauthenticated and none is stale, it stops accepting (``PendingHandshakes.room``).

        A plain TCP connection's handshake is advanced by one :class:`HandshakeHub` task with
        every other one's (issue 23: a task per connection was most of formation's CPU); it
        gets a task of its own only once its Hello needs more than the common checks (a
        rejoin, a refusal, a re-dial) or it joined (its reader). Any other stream (TLS,
        in-memory) runs :meth:`serve_connection` in a task from the start.
        """
        # The port mux already set keepalive on the connections it routes.
        keepalive = None if isinstance(listener, MuxLeg) else KeepAlive.within(
            self._config.heartbeat_timeout, write_stall=self._config.write_stall_timeout)
        async with trio.open_nursery() as nursery:
            hub = HandshakeHub() if HandshakeHub.supported() else None
            if hub is not None:
                nursery.start_soon(hub.run)
            try:
                await serve_each(listener, self.serve_connection, what="coordinator",
                                 keepalive=keepalive, room=self._pending.room,
                                 on_accept=self._admit, drain_while=self._pending.has_room,
                                 handler_nursery=nursery,
                                 dispatch=None if hub is None else partial(self._to_hub, hub,
                                                                           nursery))
            finally:
                if hub is not None:
                    hub.drain()  # the handshakes it holds still end, then it returns

    def _admit(self, stream: trio.abc.Stream) -> None:
        self._pending.admit()

    def reject(self, peer: str, category: str, detail: str, *, wrong_salt: bool = False
               ) -> None:
        """Count a connection that failed before authenticating.

        Never fatal unless ``strict_formation`` (FT/2): a count limit let anyone who can reach
        the port kill formation with 1,100 magic-and-close connections. Only a rate-limited few
        become a log line and a ``HandshakeRejected`` event, so junk cannot evict real events.
        ``wrong_salt``: it looks like a relay whose salt differs; its line is a WARNING (the
        command line shows those) and the formation error counts them.
        """
        report = self._roster.reject(category, detail, trio.current_time(),
                                     wrong_salt=wrong_salt)
        if report is not None:
            self.record_rejects(peer, category, report,
                                level=logging.WARNING if wrong_salt else logging.INFO)
        if self._roster.forming and self._config.strict_formation:
            self.fail(FormationError(self._roster.coverage_text(
                f"strict formation: handshake from {peer} rejected ({category}: {detail})")))

    def record_rejects(self, peer: str, category: str, report: JunkReport, *,
                       level: int = logging.INFO) -> None:
        log.log(level, "handshake rejected (%s): %s", category or "summary", report.text())
        reason = f"{category}: {report.text()}" if category else report.text()
        self._timeline.event(HandshakeRejected(peer=peer, reason=reason))

    def report_rejects_tail(self) -> None:
        """At the end of formation, one summary of the rejects that were not reported."""
        report = self._roster.rejects_tail(trio.current_time())
        if report is not None:
            self.record_rejects("(several)", "", report)

    def fail(self, exc: FormationError) -> None:
        if self.failure is None and self._roster.forming:
            self.failure = exc
            self._settled.set()

    async def refuse(self, stream: trio.abc.Stream, machine: CoordinatorHandshake, peer: str,
                     category: str, detail: str, *, record: bool = True) -> None:
        """Refuse a relay whose Hello authenticated (every such refusal goes through here):
        tell it why (``Refused``, the ``detail`` without the "authenticated Hello from ..."
        prefix; the write bounded by ``handshake_timeout``), close its connection and, with
        ``record``, count and report the reject with ``detail`` (the reason, naming the relay
        and the rank). A relay already acknowledged is only closed."""
        if record:  # before the close: whoever sees the EOF finds the reject recorded
            self.reject(peer, category, detail)
        if machine.refusable and machine.hello is not None:
            # The relay knows who it is: its reason starts after the "who" prefix.
            who = f"authenticated Hello from relay {machine.hello.host!r} at {peer}: "
            reason = detail.removeprefix(who)
            log.info("refusing relay %r at %s: %s", machine.hello.host, peer, reason)
            await refuse(stream, machine, reason, write_within=self._config.handshake_timeout)
        else:  # already acknowledged (a rejoin checked again after its Ready): only the close
            await trio.aclose_forcefully(stream)

    async def serve_connection(self, stream: trio.abc.Stream) -> None:
        """One connection's handshake, checks and reads, in its own task (the path of every
        stream the hub cannot drive)."""
        peer = peer_of(stream)
        handshake = None
        # First: the slot admit() counted is taken.
        with self._pending.slot(unread=unread_probe(stream)) as pending:
            scope = pending.scope
            if self._roster.shutting_down:
                await trio.aclose_forcefully(stream)
                self.reject(peer, "shutting down", f"{peer}: connection while the coordinator "
                            "shuts down")
                return
            # One scope for both ends of the wait: shed (cancelled) or handshake_timeout.
            scope.deadline = trio.current_time() + self._config.handshake_timeout
            try:
                with scope:
                    handshake = await coordinator_handshake(stream, self._salt, peer,
                                                            max_hello=self._max_hello,
                                                            generation=self._generation,
                                                            on_sent=pending.touch)
            except Rejected as rej:
                await trio.aclose_forcefully(stream)
                self.reject(peer, rej.category, rej.detail, wrong_salt=rej.wrong_salt)
                return
            except BaseException:
                await close_all([stream])  # cancelled mid-handshake: the stream must not leak
                raise
        if handshake is None and trio.current_time() >= scope.deadline:
            await trio.aclose_forcefully(stream)
            self.reject(peer, "timeout", self._timeout_text(peer))
            return
        if handshake is None:  # shed: the oldest of max_pending_handshakes, and stale
            await trio.aclose_forcefully(stream)
            self.reject(peer, "shed", self._shed_text(peer))
            return
        machine, received = handshake
        await self.after_hello(stream, machine, peer, received)

    def _timeout_text(self, peer: str) -> str:
        return (f"{peer}: no authenticated Hello within "
                f"handshake_timeout={self._config.handshake_timeout:g}s")

    def _shed_text(self, peer: str) -> str:
        return (f"{peer}: still unauthenticated after {self._pending.min_age:g}s when "
                f"max_pending_handshakes={self._pending.limit} connections were pending; the "
                "oldest is shed")

    def _no_ready_text(self, host: str, peer: str, exc: BaseException) -> str:
        detail = (f"no Ready within handshake_timeout={self._config.handshake_timeout:g}s"
                  if isinstance(exc, trio.TooSlowError) else str(exc) or repr(exc))
        return f"relay {host!r} at {peer}: HelloAck sent, {detail}; its ranks are uncovered again"

    async def after_hello(self, stream: trio.abc.Stream, machine: CoordinatorHandshake,
                          peer: str, received: HelloReceived) -> None:
        """Everything after an authenticated Hello, in the connection's task: the checks
        against the world, a rejoin or a refusal, the confirmed join, then the relay's reads."""
        hello = received.hello
        ranks = tuple(hello.ranks)
        seen = received.generation
        if seen is not None and self._generation is not None and seen > self._generation:
            # The relay follows a newer coordinator: this one is being deposed. It would
            # refuse our records anyway; no Refused, which would end it for good. Recorded
            # before the close: whoever sees the EOF finds the reject counted.
            self.reject(peer, "newer generation", f"relay {hello.host!r} at {peer}: Resume "
                        f"naming generation {seen}, expected at most this coordinator's "
                        f"{self._generation}; closed (it follows a newer coordinator)")
            await trio.aclose_forcefully(stream)
            return
        if not self._roster.forming:  # a host that comes back, a spare (issue 26), a resume
            await self._rejoins.admit(stream, machine, peer, hello, resume=received.resumed)
            return
        # A relay that lost its connection mid-handshake re-dials with the same host and ranks;
        # that is a reconnect, not a contradiction.
        superseded = self._roster.same_relay(hello.host, ranks)
        if self._adopting:  # the same host's relay of the adopted roster, awaiting its resume
            superseded += [old for old in self._roster.relays
                           if old.awaiting_resume and old.host == hello.host
                           and old not in superseded and not old.rank_set.isdisjoint(ranks)]
        for old in superseded:
            log.info("relay %r re-joined from %s; dropping its old connection", hello.host,
                     peer)
            self._roster.unregister(old)
            old.abandon("superseded by a new connection")
        if any(self._roster.is_dead(r) for r in ranks):
            # During formation a dead rank is not "announced" any more: the rejoin rules
            # bring it back (issue 26).
            for old in superseded:
                await old.close()
            await self._rejoins.admit(stream, machine, peer, hello, resume=received.resumed)
            return
        problem = self._roster.hello_problem(hello.host, ranks, peer,
                                             world_size=hello.world_size,
                                             model_sigs=hello.model_sigs)
        if problem is not None:
            self.fail(FormationError(self._roster.coverage_text(problem)))
            await self.refuse(stream, machine, peer, "contradiction", problem, record=False)
            for old in superseded:
                await old.close()
            return
        # Ranks whose relay was lost are free to their host; to another host only with
        # takeover (a refusal, not a failure: the host may still come back).
        taken = {r: self._roster.announced_by(r) for r in ranks}
        refusal = self._refusal(hello.host, ranks, peer)
        if refusal is not None:
            log.warning("relay refused during formation: %s", refusal)
            await self.refuse(stream, machine, peer, "rejoin refused", refusal)
            for old in superseded:
                await old.close()
            return
        conn = self.new_conn(stream, machine, peer, hello)
        self._roster.register(conn, trio.current_time())
        for old in superseded:  # only now: no other Hello may slip in between the checks
            await old.close()
        # FT/2: the relay covers its ranks only once its Ready verified; until then a re-dial
        # of the same relay supersedes this connection, and its end un-covers the relay.
        try:
            with trio.fail_after(self._config.handshake_timeout):
                await finish_handshake(stream, machine,
                                       cadence=self._liveness.join_cadence(conn))
        except (trio.TooSlowError, FlodlError, *STREAM_GONE) as exc:
            superseded_now = conn.lost_reason is not None
            self._roster.unregister(conn)
            conn.abandon("no Ready")
            await conn.close()
            if not superseded_now:
                self.reject(peer, "no ready", self._no_ready_text(hello.host, peer, exc))
            return
        if not self._roster.is_registered(conn):  # superseded while its Ready was in flight
            await conn.close()
            return
        self._joined(conn, taken)
        await self._readers.read_relay(conn)

    def _refusal(self, host: str, ranks: tuple[int, ...], peer: str) -> str | None:
        allow = self._config.allow_rank_takeover
        return (rejoin_problem(self._roster, host, ranks, peer, allow_takeover=allow)
                or self._rejoins.claim_problem(host, ranks, peer))

    def _joined(self, conn: RelayConn, taken: dict[int, str | None]) -> None:
        """``conn``'s Ready verified and its welcome is written: it covers its ranks."""
        complete = self._roster.confirm(conn)
        self._sender.start_writer(conn)
        self.warn_cleartext(conn.peer)
        log.info("relay %r joined from %s with ranks %s", conn.host, conn.peer,
                 ranks_text(conn.ranks))
        self._timeline.event(RelayJoined(host=conn.host, ranks=conn.ranks, peer=conn.peer))
        announce_takeovers(self._timeline, conn.host, taken)
        for dead in sorted(self._roster.dead):  # deaths told before it joined
            self._sender.post_to(conn, DeclareDead(rank=dead))
        if complete:
            self.complete()

    # ------------------------------------------------------------------ the hub's path

    def _to_hub(self, hub: HandshakeHub, nursery: trio.Nursery,
                stream: trio.abc.Stream) -> trio.abc.Stream | None:
        """``serve_each``'s dispatch: hand a plain TCP connection to ``hub`` (None), else
        give back the stream for :meth:`serve_connection`'s task."""
        sock = hub_socket(stream)
        if sock is None or self._roster.shutting_down:
            return stream
        peer = peer_of(stream)
        machine = CoordinatorHandshake(self._salt, peer=peer, max_hello=self._max_hello,
                                       generation=self._generation)
        joining = HubJoining(hub, nursery, stream, peer)
        pending = HubConn(stream, sock, machine,
                          deadline=trio.current_time() + self._config.handshake_timeout,
                          on_event=partial(self._hub_hello, joining),
                          on_error=partial(self._hub_rejected, joining))
        slot = self._pending.take(unread=unread_probe(stream),
                                  on_shed=partial(self._hub_shed, joining))
        pending.on_sent = slot.touch
        joining.pending, joining.slot = pending, slot
        replay = stream.take_replay() if isinstance(stream, PrefixedStream) else b""
        hub.add(pending, replay)
        return None

    def _hub_shed(self, joining: HubJoining) -> None:
        # The slot is already given back (shed): the oldest of max_pending_handshakes, stale.
        joining.hub.drop(joining.pending)
        joining.pending.sock.close()
        self.reject(joining.peer, "shed", self._shed_text(joining.peer))

    def _hub_rejected(self, joining: HubJoining, exc: BaseException) -> None:
        """No authenticated Hello: the connection is rejected and closed."""
        self._pending.release(joining.slot)
        joining.pending.sock.close()
        peer = joining.peer
        if isinstance(exc, trio.TooSlowError):
            self.reject(peer, "timeout", self._timeout_text(peer))
        elif isinstance(exc, FlodlError):
            machine = joining.pending.machine
            category = machine.failure_category  # type: ignore[attr-defined]
            self.reject(peer, category or "malformed", str(exc),
                        wrong_salt=machine.salt_suspect)  # type: ignore[attr-defined]
        else:
            self.reject(peer, "connection error", f"{peer}: {exc!r}")

    def _hub_hello(self, joining: HubJoining, received: HelloReceived) -> None:
        """An authenticated Hello: the common join goes on in the hub (HelloAck, then the
        relay's Ready); anything else (a rejoin, a refusal, a re-dial, a contradiction)
        continues in a task of its own (:meth:`after_hello`)."""
        self._pending.release(joining.slot)
        pending = joining.pending
        machine: CoordinatorHandshake = pending.machine  # type: ignore[assignment]
        hello = received.hello
        ranks = tuple(hello.ranks)
        if not self._plain_join(hello, ranks, received, joining.peer):
            joining.nursery.start_soon(self.after_hello, joining.stream, machine, joining.peer,
                                       received)
            return
        joining.taken = {r: self._roster.announced_by(r) for r in ranks}
        conn = joining.conn = self.new_conn(joining.stream, machine, joining.peer, hello)
        now = trio.current_time()
        self._roster.register(conn, now)
        # FT/2: the relay covers its ranks only once its Ready verified (as in after_hello).
        machine.accept(cadence=self._liveness.join_cadence(conn))
        pending.deadline = now + self._config.handshake_timeout
        pending.on_event = partial(self._hub_ready, joining)
        pending.on_error = partial(self._hub_no_ready, joining)
        pending.on_sent = None
        joining.hub.add(pending)

    def _plain_join(self, hello: Hello, ranks: tuple[int, ...], received: HelloReceived,
                    peer: str) -> bool:
        """True when ``after_hello`` would only register the relay and finish its handshake:
        formation runs, no newer generation, no earlier connection of it, no dead rank, no
        contradiction and no refusal (each of those is judged again by ``after_hello``)."""
        seen = received.generation
        if seen is not None and self._generation is not None and seen > self._generation:
            return False
        if not self._roster.forming or self._adopting:
            return False
        if self._roster.same_relay(hello.host, ranks):
            return False
        if any(self._roster.is_dead(r) for r in ranks):
            return False
        if self._roster.hello_problem(hello.host, ranks, peer, world_size=hello.world_size,
                                      model_sigs=hello.model_sigs) is not None:
            return False
        return self._refusal(hello.host, ranks, peer) is None

    def _hub_ready(self, joining: HubJoining, established: Established) -> None:
        conn = joining.conn
        assert conn is not None
        if not self._roster.is_registered(conn):  # superseded while its Ready was in flight
            joining.nursery.start_soon(conn.close)
            return
        self._joined(conn, joining.taken)
        joining.nursery.start_soon(self._readers.read_relay, conn)

    def _hub_no_ready(self, joining: HubJoining, exc: BaseException) -> None:
        conn = joining.conn
        assert conn is not None
        superseded_now = conn.lost_reason is not None
        self._roster.unregister(conn)
        conn.abandon("no Ready")
        joining.nursery.start_soon(conn.close)
        if not superseded_now:
            self.reject(joining.peer, "no ready",
                        self._no_ready_text(conn.host, joining.peer, exc))

    def new_conn(self, stream: trio.abc.Stream, machine: CoordinatorHandshake, peer: str,
                 hello: Hello) -> RelayConn:
        """The connection object of a relay whose Hello was accepted."""
        self._conn_counter += 1
        return RelayConn(
            host=hello.host, ranks=tuple(hello.ranks), peer=peer, stream=stream,
            sealer=machine.sealer, opener=machine.opener,
            write_stall_timeout=self._config.write_stall_timeout, index=self._conn_counter,
            model_sigs=dict(hello.model_sigs), on_lost=self._liveness.relay_lost)

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

    def complete(self) -> None:
        now = trio.current_time()
        self._roster.start_running(now)
        elapsed = (now - self._started) * 1000.0
        relays = len(self._roster.relays)
        world = self._roster.world_size
        self._timeline.event(FormationComplete(
            relays=relays, world_size=world, elapsed_ms=round(elapsed, 3)))
        log.info("formation complete: %d ranks over %d relays in %.1f ms", world, relays,
                 elapsed)
        self._settled.set()
        self._liveness.wake()
        self._liveness.formed()
        self.report_rejects_tail()

    def start_clock(self) -> None:
        """Formation's deadline and elapsed time count from now."""
        self._started = trio.current_time()

    async def wait(self) -> None:
        """Return once every rank is covered (the tasks run in ``open_coordinator``'s nursery).

        Raises:
            FormationTimeout / FormationAborted / FormationError: the c/W text says why.
        """
        timeout = self._config.formation_timeout
        with trio.move_on_at(self._started + timeout):
            await self._settled.wait()
        failure = self.failure
        # A coordinator woken deposed after its deadline says nothing: it steps down.
        if failure is None and self._roster.forming and self._liveness.leads():
            failure = FormationTimeout(self._roster.coverage_text(
                f"formation timed out after {timeout:g}s"))
        if failure is not None:
            self.report_rejects_tail()
            self.failure = failure
            self._timeline.event(FormationFailed(reason=str(failure),
                                                 covered=len(self._roster.covered)))
            log.error("%s", failure)
            raise failure

    async def watch_abort(self, abort: trio.Event) -> None:
        await abort.wait()
        if self._roster.forming:
            self.fail(FormationAborted(self._roster.coverage_text("formation aborted")))
