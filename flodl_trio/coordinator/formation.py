"""Formation (SPEC §4.2): accept, the handshakes (one hub task for plain TCP connections), and
hand every authenticated Hello to admission.

A connection that fails before authenticating is rejected, recorded and dropped
(:mod:`._outcome` counts it; formation goes on). An authenticated Hello (or Resume) is judged
and applied by admission (:mod:`._admission`, :mod:`._admit`): a contradiction fails formation,
a refusal tells the relay why, a re-dial replaces its old connection, a join covers its ranks
once its ``Ready`` verified, and a Hello naming a dead rank (and every Hello after formation)
follows the rejoin rules. The common join of a plain TCP connection goes on in the hub; every
other verdict gets a task of its own.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import trio

from .._config import CoordinatorConfig
from .._errors import FlodlError, FormationError
from ..net._handshake_hub import HandshakeHub, HubConn, hub_socket
from ..net._keepalive import KeepAlive
from ..net._listen import serve_each
from ..net._pending import PendingHandshakes, PendingSlot, min_shed_age, unread_probe
from ..net._transport import close_all, peer_of
from ..port_mux import MuxLeg, PrefixedStream
from ..timeline import Timeline
from ..wire import (
    CoordinatorHandshake,
    Established,
    Hello,
    HelloReceived,
    SessionSalt,
    max_hello_payload,
)
from ._admission import Join
from ._admit import Admitter
from ._handshake import Rejected, coordinator_handshake
from ._outcome import FormationOutcome
from ._relayconn import RelayConn
from ._roster import Roster
from ._sending import Sender
from .liveness import Liveness
from .readers import Readers

log = logging.getLogger("flodl_trio.coordinator")


class HubJoining:
    """What formation keeps of a relay whose handshake the hub advances, between its steps."""

    __slots__ = ("conn", "hub", "nursery", "peer", "pending", "slot", "stream", "verdict")

    def __init__(self, hub: HandshakeHub, nursery: trio.Nursery, stream: trio.abc.Stream,
                 peer: str) -> None:
        self.hub = hub
        self.nursery = nursery
        self.stream = stream
        self.peer = peer
        self.pending: HubConn
        self.slot: PendingSlot
        self.conn: RelayConn | None = None
        self.verdict: Join | None = None

    def end(self) -> None:
        """The hub is done with it: drop what its callbacks and its pending slot refer to, so
        that no reference cycle (this, its HubConn's callbacks, its slot's ``on_shed``) is
        left for the garbage collector (paused during formation: issue 38)."""
        for name in ("pending", "slot"):
            if hasattr(self, name):
                delattr(self, name)
        self.conn = self.verdict = None


class Formation:
    """Accepts relay connections, runs their handshakes and hands each authenticated Hello to
    admission; how formation ends is :class:`FormationOutcome`'s.

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
        self._liveness = liveness
        self._readers = readers
        self._config = config
        self._salt = salt
        self._conn_counter = 0
        self._pending = PendingHandshakes(config.max_pending_handshakes,
                                          min_age=min_shed_age(config.handshake_timeout))
        self._max_hello = max_hello_payload(config.world_size)
        self._outcome = FormationOutcome(roster=roster, liveness=liveness, config=config,
                                         timeline=timeline)
        self._admitter = Admitter(roster=roster, sender=sender, liveness=liveness,
                                  readers=readers, outcome=self._outcome, config=config,
                                  timeline=timeline, new_conn=self.new_conn, tls=tls)

    @property
    def failure(self) -> FormationError | None:
        return self._outcome.failure

    def leads(self, generation: int, *, adopted: bool) -> None:
        """The coordinator leads its session store as ``generation`` (sent to every relay as
        ``Generation``); ``adopted``: it adopted the store's session, whose relays resume."""
        self._admitter.leads(generation, adopted=adopted)

    def complete(self) -> None:
        """Every rank is covered (an adopted session that had formed): the cohort runs."""
        self._outcome.complete()

    def start_clock(self) -> None:
        """Formation's deadline and elapsed time count from now."""
        self._outcome.start_clock()

    async def watch_join_window(self) -> None:
        """An elastic world forms once its minimum is covered and its join window passed."""
        await self._outcome.watch_join_window()

    async def wait(self) -> None:
        """Return once every rank is covered (the tasks run in ``open_coordinator``'s nursery).

        Raises:
            FormationTimeout / FormationAborted / FormationError: the c/W text says why.
        """
        await self._outcome.wait()

    async def watch_abort(self, abort: trio.Event) -> None:
        await self._outcome.watch_abort(abort)

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
                                 on_accept=self._count_pending,
                                 drain_while=self._pending.has_room,
                                 handler_nursery=nursery,
                                 dispatch=None if hub is None else partial(self._to_hub, hub,
                                                                           nursery))
            finally:
                if hub is not None:
                    hub.drain()  # the handshakes it holds still end, then it returns

    def _count_pending(self, stream: trio.abc.Stream) -> None:
        self._pending.admit()

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
                self._outcome.reject(peer, "shutting down",
                                     f"{peer}: connection while the coordinator shuts down")
                return
            # One scope for both ends of the wait: shed (cancelled) or handshake_timeout.
            scope.deadline = trio.current_time() + self._config.handshake_timeout
            try:
                with scope:
                    handshake = await coordinator_handshake(
                        stream, self._salt, peer, max_hello=self._max_hello,
                        generation=self._admitter.terms.generation, on_sent=pending.touch)
            except Rejected as rej:
                await trio.aclose_forcefully(stream)
                self._outcome.reject(peer, rej.category, rej.detail,
                                     wrong_salt=rej.wrong_salt)
                return
            except BaseException:
                await close_all([stream])  # cancelled mid-handshake: the stream must not leak
                raise
        if handshake is None and trio.current_time() >= scope.deadline:
            await trio.aclose_forcefully(stream)
            self._outcome.reject(peer, "timeout", self._timeout_text(peer))
            return
        if handshake is None:  # shed: the oldest of max_pending_handshakes, and stale
            await trio.aclose_forcefully(stream)
            self._outcome.reject(peer, "shed", self._shed_text(peer))
            return
        machine, received = handshake
        await self._admitter.admit(stream, machine, peer, received)

    def _timeout_text(self, peer: str) -> str:
        return (f"{peer}: no authenticated Hello within "
                f"handshake_timeout={self._config.handshake_timeout:g}s")

    def _shed_text(self, peer: str) -> str:
        return (f"{peer}: still unauthenticated after {self._pending.min_age:g}s when "
                f"max_pending_handshakes={self._pending.limit} connections were pending; the "
                "oldest is shed")

    def new_conn(self, stream: trio.abc.Stream, machine: CoordinatorHandshake, peer: str,
                 hello: Hello) -> RelayConn:
        """The connection object of a relay whose Hello was accepted."""
        self._conn_counter += 1
        return RelayConn(
            host=hello.host, ranks=tuple(hello.ranks), peer=peer, stream=stream,
            sealer=machine.sealer, opener=machine.opener,
            write_stall_timeout=self._config.write_stall_timeout, index=self._conn_counter,
            model_sigs=dict(hello.model_sigs), on_lost=self._liveness.relay_lost)

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
                                       generation=self._admitter.terms.generation)
        joining = HubJoining(hub, nursery, stream, peer)
        slot = self._pending.take(unread=unread_probe(stream),
                                  on_shed=partial(self._hub_shed, joining))
        pending = HubConn(stream, sock, machine,
                          deadline=trio.current_time() + self._config.handshake_timeout,
                          on_event=partial(self._hub_hello, joining),
                          on_error=partial(self._hub_rejected, joining), on_sent=slot.touch)
        joining.pending, joining.slot = pending, slot
        replay = stream.take_replay() if isinstance(stream, PrefixedStream) else b""
        hub.add(pending, replay)
        return None

    def _hub_shed(self, joining: HubJoining) -> None:
        # The slot is already given back (shed): the oldest of max_pending_handshakes, stale.
        joining.hub.drop(joining.pending)
        joining.pending.sock.close()
        joining.end()
        self._outcome.reject(joining.peer, "shed", self._shed_text(joining.peer))

    def _hub_rejected(self, joining: HubJoining, exc: BaseException) -> None:
        """No authenticated Hello: the connection is rejected and closed."""
        self._pending.release(joining.slot)
        joining.pending.sock.close()
        machine = joining.pending.machine
        joining.end()
        peer = joining.peer
        if isinstance(exc, trio.TooSlowError):
            self._outcome.reject(peer, "timeout", self._timeout_text(peer))
        elif isinstance(exc, FlodlError):
            category = machine.failure_category  # type: ignore[attr-defined]
            self._outcome.reject(peer, category or "malformed", str(exc),
                                 wrong_salt=machine.salt_suspect)  # type: ignore[attr-defined]
        else:
            self._outcome.reject(peer, "connection error", f"{peer}: {exc!r}")

    def _hub_hello(self, joining: HubJoining, received: HelloReceived) -> None:
        """An authenticated Hello: a ``Join`` goes on in the hub (HelloAck, then the relay's
        Ready); any other verdict (a rejoin, a refusal, a re-dial, a contradiction) is applied
        in a task of its own, which judges again (:meth:`Admitter.admit`)."""
        self._pending.release(joining.slot)
        pending = joining.pending
        machine: CoordinatorHandshake = pending.machine  # type: ignore[assignment]
        verdict = self._admitter.judge(received, joining.peer)
        if not isinstance(verdict, Join):
            joining.end()
            joining.nursery.start_soon(self._admitter.admit, joining.stream, machine,
                                       joining.peer, received)
            return
        joining.verdict = verdict
        conn = joining.conn = self._admitter.register(joining.stream, machine, joining.peer,
                                                      received.hello)
        # FT/2: the relay covers its ranks only once its Ready verified (as in a task).
        machine.accept(cadence=self._liveness.join_cadence(conn))
        pending.then(deadline=trio.current_time() + self._config.handshake_timeout,
                     on_event=partial(self._hub_ready, joining),
                     on_error=partial(self._hub_no_ready, joining))
        joining.hub.add(pending)

    def _hub_ready(self, joining: HubJoining, established: Established) -> None:
        conn, verdict = joining.conn, joining.verdict
        assert conn is not None and verdict is not None
        joining.end()
        if self._admitter.joined(conn, verdict):
            joining.nursery.start_soon(self._readers.read_relay, conn)
        else:  # superseded while its Ready was in flight
            joining.nursery.start_soon(conn.close)

    def _hub_no_ready(self, joining: HubJoining, exc: BaseException) -> None:
        conn = joining.conn
        assert conn is not None
        joining.end()
        self._admitter.no_ready(conn, joining.peer, exc)
        joining.nursery.start_soon(conn.close)
