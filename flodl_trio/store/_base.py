"""The session-store interface (SPEC §4.7) and :class:`MemoryStore`, its in-process
implementation for tests and for one process that restarts its coordinator.

A store does four things for a coordinator: it makes it the one leader (``acquire``, which
returns a new, strictly greater generation: the fencing token), keeps that leadership alive and
says when it is lost (``keep_leadership``), persists the :class:`SessionState` fenced by
generation (``save`` fails once a newer generation took over), and publishes the leader's
address for relays to re-resolve (``publish_address`` / ``resolve_address``). It also says how
much room it takes (``usage``, :class:`StoreUsage`), for the status document and ``/metrics``.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence

import attrs
import trio

from .._errors import LeadershipLost
from ._state import SessionState


class SessionStore(abc.ABC):
    """Where a coordinator keeps its session so that another coordinator can adopt it.

    Attributes:
        description: how the store is named on the command line and in errors
            (``"sqlite:/var/run/flodl.db"``, ``"etcd://127.0.0.1:2379/flodl/run1"``).
    """

    description: str

    @abc.abstractmethod
    async def acquire(self, *, owner: str) -> int:
        """Become the store's one leader; return this leader's generation, strictly greater
        than every generation before it (it is recorded before this returns).

        Blocks while another live leader holds the store (a standby waits here), with no
        deadline of its own: run it under the caller's ``move_on_after`` / ``fail_after``.

        Args:
            owner: who is asking (host and pid), recorded for operators and errors.

        Raises:
            StoreUnavailable: the store cannot be reached at all (names the endpoint or path).
        """

    @abc.abstractmethod
    async def current_leader(self) -> str | None:
        """Who leads the store right now (the ``owner`` its leader gave :meth:`acquire`), or
        None when nobody does; it never waits for the leadership and never takes it. A
        command line uses it to refuse, at once, a second coordinator that was not started as
        a standby.

        Raises:
            StoreUnavailable: the store cannot be reached at all (names the endpoint or path).
        """

    @abc.abstractmethod
    async def keep_leadership(self, *, task_status: trio.TaskStatus[None]
                              = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the leadership acquired by :meth:`acquire` alive (lease renewals) for as long
        as it runs; start it in the coordinator's nursery.

        Raises:
            LeadershipLost: the leadership ended (lease expired, store unreachable for longer
                than the lease, a newer generation). Never returns otherwise.
        """

    def lost_leadership(self) -> LeadershipLost | None:
        """What this handle already knows, without asking the store, about losing the
        leadership: a :class:`LeadershipLost` when it knows it no longer leads (its lease's
        deadline passed before a renewal, as after a long ``SIGSTOP``), else None.

        Synchronous and cheap: a coordinator asks it before it declares a death or applies its
        failure policy, so that a leader that wakes up deposed steps down first and says
        nothing else. A store whose leadership cannot lapse while its process lives (an
        ``flock``) always answers None; ``keep_leadership`` still watches it.
        """
        return None

    @abc.abstractmethod
    async def load(self) -> SessionState | None:
        """The last saved state, or None for a store that never held one.

        Raises:
            StoreCorrupt: what is stored is damaged or not a flodl-trio state.
            StoreUnavailable: the store cannot be read.
        """

    @abc.abstractmethod
    async def save(self, state: SessionState) -> None:
        """Persist ``state`` (durably: after this returns, a new leader loads it), fenced on
        ``state.generation``: the write is refused if a newer generation exists.

        Raises:
            LeadershipLost: a newer generation took over; nothing was written.
            StoreUnavailable: the store cannot be written.
        """

    @abc.abstractmethod
    async def publish_address(self, addresses: Sequence[tuple[str, int]]) -> None:
        """Record where relays can dial this leader (fenced like :meth:`save`)."""

    @abc.abstractmethod
    async def resolve_address(self) -> tuple[tuple[str, int], ...]:
        """Where the current leader said relays can dial it (empty while there is none)."""

    @abc.abstractmethod
    async def release(self) -> None:
        """Give the leadership up at once (a graceful end), so a standby need not wait for a
        lease to expire. Idempotent; never raises for an unreachable store."""

    async def aclose(self) -> None:
        """Release and free any resource (connections, files). Idempotent."""
        await self.release()

    async def usage(self) -> StoreUsage:
        """How much room the store takes now (the coordinator asks every few seconds, for its
        status document and ``/metrics``). A store that cannot say returns a usage without a
        size; this default does.

        Raises:
            StoreUnavailable: the store cannot be reached.
        """
        await trio.lowlevel.checkpoint()
        return StoreUsage(kind=self.description.partition(":")[0])


@attrs.frozen
class StoreUsage:
    """How much room a store takes, as :meth:`SessionStore.usage` found it.

    Attributes:
        kind: ``"sqlite"``, ``"etcd"``, ``"memory"`` (the scheme of its description).
        size_bytes: what it takes on disk or in memory (SQLite: the database file and its
            write-ahead log; etcd: the member's database, ``dbSize``, which is what its quota
            counts), or None when the store cannot say.
        revision: etcd's revision (one per write to the cluster, anyone's); a count of writes
            for a memory store; None for SQLite.
        detail: store-specific sizes and facts (``wal_bytes``, ``db_size_in_use``, ...).
        problems: what the store reports an operator should act on (etcd's alarms, such as
            ``NOSPACE``); empty when all is well.
    """

    kind: str
    size_bytes: int | None = None
    revision: int | None = None
    detail: Mapping[str, int] = attrs.field(factory=dict)
    problems: tuple[str, ...] = ()


@attrs.define
class _Shared:
    """What a :class:`MemoryStore` and its clones share: one simulated store."""

    generation: int = 0
    leader: int | None = None  # the generation holding the leadership, if any
    owner: str = ""  # who holds it (as given to acquire)
    state: bytes | None = None
    addresses: tuple[tuple[str, int], ...] = ()
    changed: trio.Event = attrs.field(factory=trio.Event)
    revision: int = 0  # writes so far (a save, an address, a leadership), as etcd counts them

    def write_state(self, data: bytes) -> None:
        self.state = data
        self.revision += 1

    def overwrite_state(self, data: bytes) -> None:
        """Hold ``data`` as the state, not counted as a write (a test's corruption)."""
        self.state = data

    def lead(self, owner: str) -> int:
        """``owner`` takes the leadership as the next generation, which is returned."""
        self.generation += 1
        self.leader = self.generation
        self.owner = owner
        self.poke()
        return self.generation

    def publish(self, addresses: tuple[tuple[str, int], ...]) -> None:
        """The leader's addresses are ``addresses`` from now on."""
        self.addresses = addresses
        self.poke()

    def poke(self) -> None:
        self.revision += 1
        self.changed.set()
        self.changed = trio.Event()

    def drop_leader(self, *, tell: bool) -> None:
        """The leadership ended (a lease ran out); ``tell`` wakes whoever waits on a change
        (standbys, and the leader's ``keep_leadership``)."""
        self.leader = None
        if tell:
            self.poke()


class MemoryStore(SessionStore):
    """A store that lives in this process's memory: a coordinator restarted in the same Trio
    run adopts the session, as with a file store. :meth:`clone` gives a second handle on the
    same store (a standby). States are stored encoded, so loading checks them like a file.
    """

    def __init__(self, *, name: str = "memory", shared: _Shared | None = None) -> None:
        self.description = f"memory:{name}"
        self._name = name
        self._shared = shared if shared is not None else _Shared()
        self._generation: int | None = None
        self._lapsed = False

    def clone(self) -> MemoryStore:
        """Another handle on the same store (another coordinator's view of it)."""
        return MemoryStore(name=self._name, shared=self._shared)

    def expire(self) -> None:
        """Drop the current leadership, as a lease that expired would (for tests)."""
        self._shared.drop_leader(tell=True)

    def lapse(self) -> None:
        """This handle's lease ran out without it noticing yet, as a leader's does while its
        process is paused: the store has no leader any more and :meth:`lost_leadership` says
        so, but :meth:`keep_leadership` wakes only with the next change of the store (for
        tests of a leader that wakes up deposed)."""
        self._lapsed = True
        self._shared.drop_leader(tell=False)

    def lost_leadership(self) -> LeadershipLost | None:
        if self._generation is None:
            return None  # not leading at all: nothing was lost
        if self._lapsed or self._shared.leader != self._generation:
            return LeadershipLost(f"store {self.description}: expected to lead as generation "
                                  f"{self._generation}, but its lease ran out (the leader is "
                                  f"now {self._shared.leader}); stepping down")
        return None

    async def acquire(self, *, owner: str) -> int:
        shared = self._shared
        while shared.leader is not None:
            await shared.changed.wait()
        self._generation = shared.lead(owner)
        self._lapsed = False
        return self._generation

    async def current_leader(self) -> str | None:
        await trio.lowlevel.checkpoint()
        return self._shared.owner if self._shared.leader is not None else None

    async def keep_leadership(self, *, task_status: trio.TaskStatus[None]
                              = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while self._shared.leader == self._generation and self._generation is not None:
            await self._shared.changed.wait()
        raise LeadershipLost(f"store {self.description}: expected to lead as generation "
                             f"{self._generation}, but the leadership is now "
                             f"{self._shared.leader} (latest {self._shared.generation})")

    def _fence(self, generation: int, what: str) -> None:
        if generation != self._shared.generation or self._shared.leader != generation:
            raise LeadershipLost(f"store {self.description}: {what} as generation "
                                 f"{generation} refused: the latest generation is "
                                 f"{self._shared.generation}, leader "
                                 f"{self._shared.leader}")

    async def load(self) -> SessionState | None:
        await trio.lowlevel.checkpoint()
        data = self._shared.state
        return None if data is None else SessionState.decode(data, source=self.description)

    async def save(self, state: SessionState) -> None:
        await trio.lowlevel.checkpoint()
        self._fence(state.generation, "save")
        self._shared.write_state(state.encode())

    def corrupt(self, data: bytes) -> None:
        """Store raw bytes as the state (for tests of :class:`StoreCorrupt`)."""
        self._shared.overwrite_state(data)

    async def publish_address(self, addresses: Sequence[tuple[str, int]]) -> None:
        await trio.lowlevel.checkpoint()
        if self._generation is None:
            raise LeadershipLost(f"store {self.description}: publish_address refused: this "
                                 f"handle does not lead (no acquire, or it released)")
        self._fence(self._generation, "publish_address")
        self._shared.publish(tuple(addresses))

    async def resolve_address(self) -> tuple[tuple[str, int], ...]:
        await trio.lowlevel.checkpoint()
        return self._shared.addresses if self._shared.leader is not None else ()

    async def release(self) -> None:
        await trio.lowlevel.checkpoint()
        if self._generation is not None and self._shared.leader == self._generation:
            self._shared.drop_leader(tell=True)
        self._generation = None

    async def usage(self) -> StoreUsage:
        await trio.lowlevel.checkpoint()
        shared = self._shared
        return StoreUsage(kind="memory", size_bytes=len(shared.state or b""),
                          revision=shared.revision)
