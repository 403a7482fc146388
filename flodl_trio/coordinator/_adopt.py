"""Adoption (SPEC §4.7): a coordinator that found a session in its store takes the cohort over.

The saved roster's relays are installed as relays *awaiting their resume*
(:meth:`RelayConn.awaiting`): their ranks are covered and live from now (not dead, and their
silence is not counted), the saved dead ranks are dead with their reasons, the exited ones
exited. A saved state that was ``formed`` completes formation at once, so the block is entered
without waiting for anybody; the failure policy then judges the restored deaths as it judged
them before the failover.

A relay of the roster that resumes (``Resume`` naming its ranks) takes its ranks over through
the rejoin rules (:mod:`._admission`, row 11): no ``DeclareAlive`` for ranks that never died.
One that has not resumed within ``resume_timeout`` is given up on: its live ranks are declared
dead the usual way (the reason names its host and the timeout) and it is lost; it may still
come back later, as any dead host may. While any relay awaits its resume,
``broadcast_control`` and a ``send_control`` to one of its ranks wait for it (or for its
death): what the user sends after a failover reaches every rank that comes back.
"""

from __future__ import annotations

import logging

import trio

from .._config import CoordinatorConfig
from ..store import SessionState
from ._relayconn import RelayConn
from ._roster import Roster, ranks_text
from ._sending import Sender
from .liveness import Liveness

log = logging.getLogger("flodl_trio.coordinator")


class Adoption:
    """The relays of an adopted session that have not resumed yet, and their deadline."""

    def __init__(self, state: SessionState, *, roster: Roster[RelayConn], sender: Sender,
                 liveness: Liveness, config: CoordinatorConfig, source: str) -> None:
        self._state = state
        self._roster = roster
        self._sender = sender
        self._liveness = liveness
        self._config = config
        self._source = source
        self._pending: dict[RelayConn, None] = {}
        self._deadline = 0.0

    @property
    def pending(self) -> tuple[RelayConn, ...]:
        """Relays of the saved roster that have not resumed (nor been given up on) yet."""
        return tuple(self._pending)

    def install(self, generation: int) -> None:
        """Put the saved roster, deaths and exits in the roster; ``resume_timeout`` counts from
        now. Formation is completed by the caller when the saved state was formed."""
        state, roster = self._state, self._roster
        now = trio.current_time()
        self._deadline = now + self._config.resume_timeout
        least = state.world_size if state.min_world_size is None else state.min_world_size
        if least != self._config.min_world:
            log.warning("the adopted session's world is %d..%d ranks, this coordinator's "
                        "config says %d..%d: the session's range holds", least,
                        state.world_size, self._config.min_world, self._config.world_size)
        roster.restore_world(least, state.retired)
        for index, (host, ranks) in enumerate(state.roster, start=1):
            conn = RelayConn.awaiting(host=host, ranks=ranks, model_sigs=dict(state.model_sigs),
                                      index=-index,
                                      write_stall_timeout=self._config.write_stall_timeout)
            roster.register(conn, now)
            for rank in ranks:
                reason = state.dead.get(rank)
                if reason is not None:
                    roster.mark_dead(rank, reason)
                elif rank in state.exited:
                    roster.mark_exited(rank)
            roster.confirm(conn)
            self._pending[conn] = None
        if self._pending:
            self._sender.await_resumes()
            for conn in list(self._pending):  # all dead or exited: not waited for
                self.check(conn)
        log.info("adopted the session of %s as generation %d: %d relays to resume, %d ranks "
                 "dead, %d exited", self._source, generation, len(self._pending),
                 len(state.dead), len(state.exited))

    def check(self, conn: RelayConn) -> None:
        """``conn``'s part of the roster changed: forget it if it resumed or was given up on
        (or carries no live rank any more), and wake the sends waiting for it -- even when it
        did not settle: a resume may have taken some of its ranks. O(its ranks): this runs on
        every roster change."""
        if conn not in self._pending:
            return
        if (not conn.awaiting_resume or not self._roster.is_registered(conn)
                or not self._roster.live_of(conn)):
            del self._pending[conn]
        self._sender.resumes_moved(all_done=not self._pending)

    async def resume_deadline(self) -> None:
        """Give up on the relays that have not resumed within ``resume_timeout``."""
        await trio.sleep_until(self._deadline)
        if not self._liveness.leads():
            return  # deposed meanwhile (it stepped down): nothing to give up on, nothing said
        timeout = self._config.resume_timeout
        for conn in list(self._pending):
            if not conn.awaiting_resume or not self._roster.is_registered(conn):
                continue
            cause = (f"did not resume within resume_timeout={timeout:g}s of the coordinator "
                     f"adopting the session of {self._source}")
            if not self._roster.forming:
                for rank in self._roster.live_of(conn):
                    self._liveness.mark_dead(rank, f"relay {conn.host!r} {cause}")
            log.warning("relay %r (ranks %s) %s", conn.host, ranks_text(conn.ranks), cause)
            self._liveness.relay_lost(conn, cause)
        self._pending.clear()
        self._sender.resumes_moved(all_done=True)
