"""Test helpers for coordinators with a session store (issue 22): a MemoryStore, its salt, raw
relays driven by the test (join with Hello, or resume with Resume) that record what they receive,
and coordinators that come and go on the store."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import attrs
import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.net._handshake_io import run_handshake
from flodl_trio.store import MemoryStore, SessionState
from flodl_trio.testing import EventLog, MemoryNetwork

from helpers.raw import RawRelay

SIGS = {"model": bytes(range(32))}
ROSTER = (("host-a", (0, 1)), ("host-b", (2, 3)))


def config(**overrides: Any) -> ft.CoordinatorConfig:
    fields: dict[str, Any] = dict(world_size=4, formation_timeout=60, heartbeat_interval=3600,
                                  heartbeat_timeout=3600, resume_timeout=30)
    fields.update(overrides)
    return ft.CoordinatorConfig(**fields)


@attrs.define(eq=False)
class Counted:
    """A raw relay after its join: the bytes and the messages it received (``"Name"``, or
    ``"Name(rank)"`` for DeclareDead / DeclareAlive), until EOF."""

    raw: RawRelay
    salt: ft.SessionSalt
    generation: int | None = None  # the coordinator's Generation, None if it sent none
    received: int = 0
    messages: list[str] = attrs.Factory(list)
    eof: trio.Event = attrs.Factory(trio.Event)

    async def read(self) -> None:
        opener = self.raw.opener
        try:
            while data := await self.raw.stream.receive_some(65536):
                self.received += len(data)
                opener.push(data)
                while (rec := opener.next_record()) is not None:
                    self.messages.append(_label(self.salt, rec))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        self.eof.set()
        await trio.aclose_forcefully(self.raw.stream)


def _label(salt: ft.SessionSalt, rec: Any) -> str:
    if rec.kind == wire.RecordKind.CONTROL:
        return type(wire.decode_relay(rec.payload)).__name__
    frame = rec.payload
    if rec.kind == wire.RecordKind.FANOUT:
        _, frame = wire.decode_fanout(rec.payload)
    msg = wire.frame_message(wire.decode_frame(salt, frame))
    name = type(msg).__name__
    return f"{name}({msg.rank})" if isinstance(msg, wire.DeclareDead | wire.DeclareAlive) else name


@attrs.define(eq=False)
class Cluster:
    """One store and its session salt; coordinators come and go on it."""

    net: MemoryNetwork
    nursery: trio.Nursery
    salt: ft.SessionSalt = attrs.Factory(ft.SessionSalt.generate)
    store: MemoryStore = attrs.Factory(MemoryStore)
    relays: dict[str, Counted] = attrs.Factory(dict)

    async def dial(self, where: str, host: str, ranks: tuple[int, ...], *,
                   generation: int | None = None) -> Counted:
        """One relay's handshake over the memory network (see :meth:`handshake`)."""
        return await self.handshake(await self.net.connect(where), where, host, ranks,
                                    generation=generation)

    async def handshake(self, stream: trio.abc.Stream, where: str, host: str,
                        ranks: tuple[int, ...], *, generation: int | None = None) -> Counted:
        """One relay's handshake on ``stream``: a join (Hello), or with ``generation`` a
        resume (Resume); a relay that joined keeps reading until EOF."""
        machine = wire.RelayHandshake(self.salt, host=host, ranks=ranks, world_size=4,
                                      model_sigs=SIGS, coordinator=where,
                                      generation=generation)
        try:
            done = await run_handshake(stream, machine)
        except ft.FlodlError as exc:  # closed, or a deposed coordinator
            await trio.aclose_forcefully(stream)
            raw = RawRelay(stream, machine.sealer, machine.opener, acked=False,
                           refused=f"failed: {exc}")
            self.relays[host] = Counted(raw, self.salt)
            return self.relays[host]
        if isinstance(done, wire.RefusalReceived):
            await trio.aclose_forcefully(stream)
            raw = RawRelay(stream, machine.sealer, machine.opener, acked=False,
                           refused=done.reason)
            self.relays[host] = Counted(raw, self.salt)
            return self.relays[host]
        assert isinstance(done, wire.Established)
        counted = Counted(RawRelay(stream, done.sealer, done.opener, acked=True), self.salt,
                          generation=done.generation)
        counted.messages += [_label(self.salt, rec) for rec in done.records]
        self.nursery.start_soon(counted.read)
        self.relays[host] = counted
        return counted

    @asynccontextmanager
    async def coordinator(self, where: str, *, store: MemoryStore | None = None,
                          form: bool = True, timeline: EventLog | None = None,
                          fresh: bool = False, standby: bool = False,
                          **overrides: Any) -> AsyncIterator[Any]:
        """A coordinator listening at ``where``; with ``form``, the raw relays of ROSTER
        dial it (a fresh run's formation)."""
        if form:
            async def formation() -> None:
                for host, ranks in ROSTER:
                    await self.dial(where, host, ranks)
            self.nursery.start_soon(formation)
        async with ft.open_coordinator(
            self.net.listener(where), salt=self.salt, config=config(**overrides),
            store=self.store if store is None else store,
            timeline=timeline if timeline is not None else EventLog(), fresh=fresh,
            standby=standby,
        ) as coord:
            yield coord

    def adopting(self, **overrides: Any) -> AbstractAsyncContextManager[Any]:
        """The next coordinator (``coord-2``, on another handle of the store) after a crashed
        first run: it adopts the session, and nobody forms (the relays resume or rejoin)."""
        return self.coordinator("coord-2", store=self.store.clone(), form=False, **overrides)

    async def lose_rank_1(self, coord: Any) -> None:
        """A ``crashed_first_run`` body: rank 1 declared dead (``oom``), and stored so."""
        await coord.declare_dead(1, "oom")
        await until_stored(self.store, lambda state: set(state.dead) == {1})

    async def crashed_first_run(self, body: Callable[[Any], Any] | None = None,
                                **overrides: Any) -> None:
        """A first coordinator (its config: :func:`config` with ``overrides``) forms, runs
        ``body``, and is gone as a crashed one is: its lease runs out, it steps down without a
        word to its relays and without recording an end (a coordinator that ends any other way
        ends its session: nothing to adopt)."""
        await crash(self.coordinator("coord-1", **overrides), body, self.store)


async def crash(opened: Any, body: Callable[[Any], Any] | None, store: MemoryStore) -> None:
    """Run the coordinator ``opened`` (an ``open_coordinator`` context), ``body`` in its block,
    then lose its lease: it steps down (``LeadershipLost``), leaving its session to adopt."""
    try:
        async with opened as coord:
            if body is not None:
                await body(coord)
            store.expire()
            await trio.sleep_forever()
    except ft.LeadershipLost:
        pass


@asynccontextmanager
async def cluster(net: MemoryNetwork, store: MemoryStore | None = None
                  ) -> AsyncIterator[Cluster]:
    async with trio.open_nursery() as nursery:
        c = Cluster(net, nursery) if store is None else Cluster(net, nursery, store=store)
        yield c
        nursery.cancel_scope.cancel()


async def stored(store: MemoryStore) -> SessionState:
    """What the store holds now, read through another handle (as the next coordinator)."""
    state = await store.clone().load()
    assert state is not None
    return state


async def until_stored(store: MemoryStore, check: Callable[[SessionState], bool]) -> None:
    """Return once the store holds a state that passes ``check`` (polled, bounded: a change
    that can wait is written within ``1 / store_write_rate``, 1 s by default)."""
    state = None
    for _ in range(300):
        state = await store.clone().load()
        if state is not None and check(state):
            return
        await trio.sleep(0.01)
    raise AssertionError(f"never stored; the store holds {state}")
