"""The coordinator's side of its session store (SPEC §4.7): leadership, the saved session and
the adoption of a running one.

:meth:`Leader.lead` makes the coordinator the store's leader (a standby blocks in ``acquire``),
loads what the store holds and either adopts it (:mod:`._adopt`) or starts a fresh session; a
state of another session is refused whole. From then on every roster change is saved by one
coalescing writer (:mod:`._persist`), the leadership is kept alive in the background, and its
loss (``LeadershipLost``, from the store or from a fenced save) deposes the coordinator through
the ``step_down`` it was given. A leader that learns of the loss some other way -- woken after a
long pause, its lease's deadline long gone -- steps down before it declares any death
(:meth:`Leader.still_leads`, asked by the liveness code). A coordinator that ends without being
deposed records the end in its store (:meth:`Leader.finish`): that session is over, nobody is
to adopt it (:mod:`._session_start`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from .._config import CoordinatorConfig
from .._errors import LeadershipLost, StoreCorrupt, StoreUnavailable
from ..store import SessionState, SessionStore, salt_id
from ..wire import SessionSalt
from ._adopt import Adoption
from ._persist import RETRY_INTERVAL, Persistence
from ._relayconn import RelayConn
from ._roster import Roster
from ._sending import Sender
from ._session_start import StandbyView, choose_start, ended_note
from ._store_gauge import StoreGauge
from .formation import Formation
from .liveness import Liveness

log = logging.getLogger("flodl_trio.coordinator")


class Leader:
    """A coordinator's store, once :meth:`lead` returned.

    Attributes:
        generation: this coordinator's generation (0 until it leads).
        resumed: True when it adopted a session the store held.
        checkpoint: the scheduler's checkpoint (restored on adoption; kept with the session).
        standby: what it waits for while another coordinator leads its store, else None.
    """

    def __init__(self, *, salt: SessionSalt, config: CoordinatorConfig,
                 roster: Roster[RelayConn], sender: Sender, liveness: Liveness,
                 formation: Formation) -> None:
        self._salt = salt
        self._config = config
        self._roster = roster
        self._sender = sender
        self._liveness = liveness
        self._formation = formation
        self._store: SessionStore | None = None
        self._persist: Persistence | None = None
        self._gauge: StoreGauge | None = None
        self._adoption: Adoption | None = None
        self._adopted_formed = False
        self.generation = 0
        self.resumed = False
        self.checkpoint: dict[str, Any] | None = None
        self.deposed: LeadershipLost | None = None
        self.formed_scope = trio.CancelScope()  # the wait for formation
        self.on_deposed: Callable[[], None] = lambda: None
        self._closed = False  # the coordinator shut down (then releases the leadership)
        self._body_scope: trio.CancelScope | None = None
        self.standby: StandbyView | None = None
        liveness.guard_with(self.still_leads)
        sender.guard_with(self.still_leads)

    async def lead(self, store: SessionStore, *, fresh: bool = False,
                   standby: bool = False) -> None:
        """Become ``store``'s leader (a standby blocks here), load its session and adopt it,
        or start a new one (see :func:`choose_start`).

        Raises:
            SessionEnded: it waited for the leadership (or ``standby``) and the session it
                stood by for ended.
            ForeignSession: an unfinished session of another run (salt id or world size).
            StoreCorrupt: the stored state is damaged.
            StoreUnavailable: the store cannot be reached.
            Nothing was loaded and the leadership was released in every case.
        """
        owner = f"coordinator on {socket.gethostname()} pid {os.getpid()}"
        leader = await store.current_leader()
        if leader is not None:
            self.standby = StandbyView(store.description, leader, await _next_generation(store))
        self.generation = await store.acquire(owner=owner)
        self.standby = None
        self._store = store
        try:
            state = await store.load()
            sid = salt_id(self._salt)
            adopted = choose_start(state, salt_id=sid, world_size=self._config.world_size,
                                   source=store.description,
                                   waited=standby or leader is not None, fresh=fresh,
                                   generation=self.generation)
            rate = self._config.store_write_rate
            persist = self._persist = Persistence(store, generation=self.generation,
                                                  salt_id=sid, roster=self._roster,
                                                  on_lost=self.step_down, interval=1 / rate)
            self._gauge = StoreGauge(store, persist, write_rate=rate)
            if adopted is not None:
                self._adopt(adopted, persist, store.description)
            note = ended_note(state, generation=self.generation, fresh=fresh)
            if note is not None:
                log.info("session store %s: %s", store.description, note)
            self._formation.leads(self.generation, adopted=self.resumed)
            log.info("leading session store %s as generation %d (%s)", store.description,
                     self.generation, "adopted its session" if self.resumed else "new session")
            persist.request()  # the new generation's state, at once
        except BaseException:
            self._persist = None  # never started: nothing to finish
            with trio.CancelScope(shield=True):
                await store.release()
            raise

    def _adopt(self, state: SessionState, persist: Persistence, source: str) -> None:
        self.resumed = True
        if state.checkpoint is not None:
            self.keep_checkpoint(dict(state.checkpoint))
            persist.keep_checkpoint(self.checkpoint)
        self._adoption = Adoption(state, roster=self._roster, sender=self._sender,
                                  liveness=self._liveness, config=self._config, source=source)
        self._adoption.install(self.generation)
        # An elastic world formed with its minimum (or more) is formed (issue 37).
        self._adopted_formed = state.formed and self._roster.quorate

    def when_deposed(self, stop: Callable[[], None]) -> None:
        """Call ``stop`` (``open_coordinator``: stop every task) when it steps down."""
        self.on_deposed = stop

    def keep_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The scheduler's checkpoint, kept with the session from the next save on
        (:meth:`flush` saves it)."""
        self.checkpoint = checkpoint

    def standby_fields(self) -> dict[str, object]:
        """What the status documents say while the coordinator waits for its store's
        leadership (``phase`` ``standby``, not ``forming``: nothing forms yet), else nothing."""
        if self.standby is None:
            return {}
        return {"phase": "standby", "standby": self.standby.fields()}

    def tasks(self) -> list[Callable[[], Awaitable[None]]]:
        """The background tasks of a leading coordinator (none without a store). A session
        adopted formed completes formation here: the block is entered at once."""
        tasks: list[Callable[[], Awaitable[None]]] = []
        if self._persist is not None:
            tasks += [self._persist.run, self.keep_leadership]
        if self._gauge is not None:
            tasks.append(self._gauge.watch)
        if self._adoption is not None:
            tasks.append(self._adoption.resume_deadline)
            if self._adopted_formed:
                self._formation.complete()
        return tasks

    async def keep_leadership(self) -> None:
        """Keep the store's leadership; losing it deposes the coordinator."""
        assert self._store is not None
        try:
            await self._store.keep_leadership()
        except LeadershipLost as exc:
            self.step_down(exc)

    async def publish_address(self, addresses: tuple[tuple[str, int], ...]) -> None:
        """Publish where relays can dial this leader (once it accepts connections); a store
        that cannot be written is tried again every ``RETRY_INTERVAL``."""
        assert self._store is not None
        while True:
            try:
                await self._store.publish_address(addresses)
                return
            except LeadershipLost as exc:
                self.step_down(exc)
                return
            except StoreUnavailable as exc:
                if not self.still_leads():
                    return  # woken deposed: it stepped down, nothing to publish or say
                log.warning("session store %s: publishing the address failed, trying again "
                            "in %gs: %s", self._store.description, RETRY_INTERVAL, exc)
                await trio.sleep(RETRY_INTERVAL)

    def cancel_on_step_down(self, scope: trio.CancelScope) -> None:
        """Cancel ``scope`` (the user's block) when the coordinator steps down."""
        self._body_scope = scope
        if self.deposed is not None:
            scope.cancel()

    def still_leads(self) -> bool:
        """Whether the coordinator may still act as the leader (declare a death, apply the
        failure policy). A store that already knows its leadership is lost -- a lease whose
        deadline passed while the process did not run -- makes it step down now, before it
        says anything else; then False."""
        if self.deposed is not None:
            return False
        lost = self._store.lost_leadership() if self._store is not None else None
        if lost is None:
            return True
        self.step_down(lost)
        return False

    def step_down(self, exc: LeadershipLost) -> None:
        """Another coordinator leads the session now: close every relay connection abruptly
        and send nothing more -- no ``Goodbye``, no ``Shutdown``, no broadcast, no record at
        all -- then end the run (``open_coordinator`` raises ``exc``)."""
        if self.deposed is not None or self._closed:
            return
        self.deposed = exc
        log.error("stepping down, without a word to the relays: %s", exc)
        self._roster.begin_shutdown()  # no more deaths, rejoins or connections
        for conn in self._roster.relays:
            conn.abandon(f"the coordinator stepped down: {exc}")
        self._sender.forget_resumes()
        self.formed_scope.cancel()
        if self._body_scope is not None:
            self._body_scope.cancel()
        self.on_deposed()

    async def finish(self, outcome: str) -> None:
        """The coordinator is ending without being deposed (its cohort was shut down): record
        the end in the store (the end marker, with ``outcome``) so that nobody adopts the
        session, waiting at most ``shutdown_grace`` for the write. Nothing without a store."""
        persist = self._persist
        if persist is None or self.deposed is not None or self._closed:
            await trio.lowlevel.checkpoint()
            return
        persist.mark_ended(outcome, time.time())
        grace = self._config.shutdown_grace
        assert self._store is not None
        with trio.move_on_after(grace) as scope:
            try:
                await persist.flush()
                return
            except (LeadershipLost, StoreUnavailable) as exc:
                problem = str(exc)
        if scope.cancelled_caught:
            problem = f"no write succeeded within shutdown_grace={grace:g}s"
        log.warning("session store %s: expected to record that the session ended (%s), but "
                    "%s; a coordinator that leads the store next adopts it",
                    self._store.description, outcome, problem)

    def close(self) -> None:
        """The coordinator shut down: its leadership may end now (it releases it) without a
        step-down, and nothing more is saved."""
        self._closed = True
        if self._persist is not None:
            self._persist.close()

    def changed(self, relay: RelayConn | None) -> None:
        """The roster changed (``relay``'s part of it): save the session (coalesced); settle
        the resumes."""
        if self._persist is not None:
            self._persist.request()
        if self._adoption is not None and relay is not None:
            self._adoption.check(relay)

    @property
    def durable(self) -> bool:
        """It saves the session to a store (and has not shut down)."""
        return self._persist is not None and not self._closed

    async def flush(self, *, durable: bool = True) -> None:
        """Return once the session as it is now is durable (at once without a store); with
        ``durable=False``, at once: it is written with the next paced write.

        Raises:
            LeadershipLost: the coordinator was deposed before it was.
            StoreUnavailable: the coordinator has shut down (nothing more is saved).
        """
        if self._persist is None:
            await trio.lowlevel.checkpoint()
            return
        self._persist.keep_checkpoint(self.checkpoint)
        if durable:
            await self._persist.flush()
        else:
            self._persist.check_writable()
            self._persist.request()
            await trio.lowlevel.checkpoint()

    def store_status(self) -> dict[str, Any] | None:
        """The ``store`` section of the status document (None without a store)."""
        return None if self._gauge is None else self._gauge.status()


async def _next_generation(store: SessionStore) -> int | None:
    """The generation a standby would lead as if it won now (for the status page); None when
    the stored state cannot be read (the error comes again, in full, once it leads)."""
    try:
        state = await store.load()
    except (StoreCorrupt, StoreUnavailable):
        return None
    return 1 if state is None else state.generation + 1
