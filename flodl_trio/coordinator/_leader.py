"""The coordinator's side of its session store (SPEC §4.7): leadership, the saved session and
the adoption of a running one.

:meth:`Leader.lead` makes the coordinator the store's leader (a standby blocks in ``acquire``),
loads what the store holds and either adopts it (:mod:`._adopt`) or starts a fresh session; a
state of another session is refused whole. From then on every roster change is saved by one
coalescing writer (:mod:`._persist`), the leadership is kept alive in the background, and its
loss (``LeadershipLost``, from the store or from a fenced save) deposes the coordinator through
the ``step_down`` it was given.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from .._config import CoordinatorConfig
from .._errors import LeadershipLost, StoreCorrupt, StoreUnavailable
from ..store import SessionStore, salt_id
from ..wire import SessionSalt
from ._adopt import Adoption
from ._persist import RETRY_INTERVAL, Persistence, adoption_problem
from ._relayconn import RelayConn
from ._roster import Roster
from ._sending import Sender
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

    async def lead(self, store: SessionStore) -> None:
        """Become ``store``'s leader (a standby blocks here), load its session and adopt it,
        or start a fresh one.

        Raises:
            StoreCorrupt: the stored state is damaged, or is another session's (salt id or
                world size); nothing was loaded and the leadership was released.
            StoreUnavailable: the store cannot be reached.
        """
        owner = f"coordinator on {socket.gethostname()} pid {os.getpid()}"
        self.generation = await store.acquire(owner=owner)
        self._store = store
        try:
            state = await store.load()
            sid = salt_id(self._salt)
            if state is not None:
                problem = adoption_problem(state, salt_id=sid,
                                           world_size=self._config.world_size,
                                           source=store.description)
                if problem is not None:
                    raise StoreCorrupt(problem)
            rate = self._config.store_write_rate
            persist = self._persist = Persistence(store, generation=self.generation,
                                                  salt_id=sid, roster=self._roster,
                                                  on_lost=self.step_down, interval=1 / rate)
            self._gauge = StoreGauge(store, persist, write_rate=rate)
            if state is not None:
                self.resumed = True
                if state.checkpoint is not None:
                    self.checkpoint = persist.checkpoint = dict(state.checkpoint)
                self._adoption = Adoption(state, roster=self._roster, sender=self._sender,
                                          liveness=self._liveness, config=self._config,
                                          source=store.description)
                self._adoption.install(self.generation)
                self._formation.adopting = True
                self._adopted_formed = state.formed and self._roster.complete
            self._formation.generation = self.generation
            log.info("leading session store %s as generation %d (%s)", store.description,
                     self.generation, "adopted its session" if self.resumed else "fresh run")
            persist.request()  # the new generation's state, at once
        except BaseException:
            with trio.CancelScope(shield=True):
                await store.release()
            raise

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
                log.warning("session store %s: publishing the address failed, trying again "
                            "in %gs: %s", self._store.description, RETRY_INTERVAL, exc)
                await trio.sleep(RETRY_INTERVAL)

    def cancel_on_step_down(self, scope: trio.CancelScope) -> None:
        """Cancel ``scope`` (the user's block) when the coordinator steps down."""
        self._body_scope = scope
        if self.deposed is not None:
            scope.cancel()

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
        self._sender.resumes.set()
        self.formed_scope.cancel()
        if self._body_scope is not None:
            self._body_scope.cancel()
        self.on_deposed()

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
        self._persist.checkpoint = self.checkpoint
        if durable:
            await self._persist.flush()
        else:
            self._persist.check_writable()
            self._persist.request()
            await trio.lowlevel.checkpoint()

    def store_status(self) -> dict[str, Any] | None:
        """The ``store`` section of the status document (None without a store)."""
        return None if self._gauge is None else self._gauge.status()
