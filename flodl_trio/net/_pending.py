"""A bound on unauthenticated connections (SPEC §4.2, FT/2): shed only the stale, queue the fresh.

Used twice by a coordinator that binds its own port: by the port mux for connections whose
channel magic has not arrived, and by formation for those whose Hello has not verified. Each
such connection holds a socket, a task and (in formation) up to a Hello ceiling of bytes; nothing
limited them (4,000 dialers holding partial Hellos took a coordinator to 1.1 GB). At most
``limit`` may be pending at once.

When all ``limit`` slots are taken, the acceptor waits (:meth:`PendingHandshakes.room`): it
stops calling ``accept``, so the kernel's listen backlog (or the port mux's leg queue) holds the
dialers, until a slot frees or the *oldest* pending connection has been pending ``min_age``
seconds; that one is then shed (cancelled) to admit the next. Oldest, not newest: refusing
newcomers would let anyone who opens ``limit`` silent connections (and re-opens them as they
time out) keep every relay out; with the oldest shed once it is stale, such an attacker holds
each slot for ``min_age`` at most, and a genuine relay, whose handshake takes one round trip,
completes long before it is that old. Not sooner than ``min_age``: a burst of thousands of
honest relays that are merely waiting for the coordinator's CPU would otherwise be shed
mid-handshake and re-dial (83 re-dials at 16,384 ranks, 1,423 at 65,536, before this rule).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import trio

from ._keepalive import socket_of

try:  # POSIX only: elsewhere a connection's age alone decides
    import fcntl
    import termios
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]
    termios = None  # type: ignore[assignment]

# The youngest pending connection that may be shed, as a fraction of its stage's deadline, and
# at most this many seconds. A relay's handshake takes one round trip once admitted; in a burst
# of 8,192 relays on a loaded 2-core machine the slowest took well under this (bench_scale.py
# reports it as "pending max ms"). An attacker's silent connection holds a slot no longer, so
# ``limit`` of them delay the relays queued behind them by this much per ``limit``.
MIN_AGE_FRACTION = 1 / 20
MIN_AGE_CAP = 0.15


def min_shed_age(deadline: float) -> float:
    """The age (seconds) before which a pending connection is never shed, for a stage whose
    own deadline (``handshake_timeout``, ``peek_timeout``) is ``deadline``:
    ``min(0.15, deadline / 20)``.

    >>> min_shed_age(10.0), min_shed_age(5.0), min_shed_age(1.0)
    (0.15, 0.15, 0.05)
    """
    return min(MIN_AGE_CAP, deadline * MIN_AGE_FRACTION)


# How many of the oldest stale connections room() probes for unread bytes before it waits.
_PROBES = 32


def unread_probe(stream: Any) -> Callable[[], bool] | None:
    """A check of whether the kernel holds bytes of ``stream``'s peer that nobody read yet
    (``FIONREAD``), for the TCP socket under ``stream`` and its wrappers; None without one.

    Bytes waiting mean the peer answered and the coordinator is the one behind: such a
    connection is not shed however long it has been pending."""
    sock = socket_of(stream)
    if sock is None or fcntl is None or termios is None:
        return None
    fileno = sock.fileno

    def unread() -> bool:
        fd = fileno()
        if fd < 0:  # closed: nothing more will arrive
            return False
        try:
            count = fcntl.ioctl(fd, termios.FIONREAD, _FIONREAD_BUF)
        except OSError:
            return False
        return bool(_INT.unpack(count)[0] > 0)

    return unread


_INT = struct.Struct("i")
_FIONREAD_BUF = bytes(_INT.size)


class PendingSlot:
    """One pending connection's place in :class:`PendingHandshakes`.

    Attributes:
        scope: the cancel scope its handshake runs in; cancelled when it is shed.
        on_shed: called instead, when given (a handshake without a task of its own).
        since: when its peer's turn began (its slot was taken, or :meth:`touch`).
        entered: when its slot was taken.
    """

    __slots__ = ("_owner", "entered", "on_shed", "scope", "since", "token", "unread")

    def __init__(self, owner: PendingHandshakes, token: int, now: float,
                 unread: Callable[[], bool] | None,
                 on_shed: Callable[[], None] | None = None, deadline: float = math.inf) -> None:
        self._owner = owner
        self.token = token
        self.scope = trio.CancelScope(deadline=deadline)
        self.on_shed = on_shed
        self.since = now
        self.entered = now
        self.unread = unread

    def touch(self) -> None:
        """The peer's turn starts now (the coordinator just wrote to it, the Challenge): its
        age counts from here, not from the time the coordinator took to get to it."""
        self._owner.touch(self)

    def turn_began(self, now: float) -> None:
        """Its peer's turn began at ``now`` (:meth:`PendingHandshakes.touch` moved it last)."""
        self.since = now


class PendingHandshakes:
    """The connections still authenticating, in the order their peer's turn began.

    The acceptor awaits :meth:`room` before each ``accept`` and calls :meth:`admit` for each
    connection it accepted; the connection's handler runs its handshake in :meth:`slot`. The
    one shed is the oldest that is *stale*: its peer's turn began ``min_age`` ago or more and
    none of its bytes wait unread (bytes waiting mean the coordinator is the one behind).

    Attributes:
        limit: the most that may be pending at once.
        min_age: seconds a connection's peer may take before it may be shed.
        shed: how many were cancelled to admit a newer one.
        peak: the most that were pending at once.
        waits: how many times the acceptor waited for a slot.
        max_age: the longest a connection was pending before its own handshake step ended
            (shed ones not counted).
    """

    def __init__(self, limit: int, *, min_age: float = 0.0) -> None:
        self.limit = limit
        self.min_age = min_age
        self.shed = 0
        self.peak = 0
        self.waits = 0
        self.max_age = 0.0
        self._slots: dict[int, PendingSlot] = {}  # insertion order is ``since`` order
        self._next = 0
        # Admitted by the acceptor, their handler not in its slot yet (it starts a bit later).
        self._admitted = 0
        self._victim: PendingSlot | None = None  # the stale one room() found for admit()
        self._changed: trio.Event | None = None  # set when a slot is taken or freed

    def __len__(self) -> int:
        return len(self._slots) + self._admitted

    async def room(self) -> None:
        """Return once one more connection may be admitted without shedding one that is not
        stale: a slot is free, or a stale one was found (the next :meth:`admit` sheds it).
        With room it returns without a checkpoint: the ``accept`` that follows is one, and one
        more pass through the scheduler per connection is a measurable part of a formation
        of thousands."""
        waited = False
        while len(self) >= self.limit:  # each round ends at a change or a deadline
            victim, recheck_at = self._stale(trio.current_time())
            if victim is not None:
                self._victim = victim
                return
            if not waited:
                waited = True
                self.waits += 1
            if self._changed is None:
                self._changed = trio.Event()
            with trio.move_on_at(recheck_at):
                await self._changed.wait()

    def has_room(self) -> bool:
        """True while one more connection may be admitted without shedding one."""
        return len(self) < self.limit

    def _stale(self, now: float) -> tuple[PendingSlot | None, float]:
        """The oldest stale slot, else None and when to look again."""
        for probed, slot in enumerate(self._slots.values()):
            stale_at = slot.since + self.min_age
            if stale_at > now:
                return None, stale_at  # the rest are younger
            if probed >= _PROBES:
                break
            if slot.unread is None or not slot.unread():
                return slot, now
        # Every stale one probed has bytes waiting: the coordinator is behind, not the peers;
        # their handlers free or touch their slots as they run.
        return None, now + max(self.min_age, 0.001)

    def admit(self) -> None:
        """Count a connection the acceptor just accepted (its handler takes the slot); beyond
        ``limit``, shed a pending one: the stale one :meth:`room` found, else the oldest."""
        self._admitted += 1
        victim, self._victim = self._victim, None
        if len(self) > self.limit and victim is not None and victim.token in self._slots:
            self._shed(victim)
        self._shed_beyond(self.limit)

    def _shed(self, slot: PendingSlot) -> None:
        del self._slots[slot.token]
        self.shed += 1
        if slot.on_shed is not None:
            slot.on_shed()
        else:
            slot.scope.cancel()

    def _shed_beyond(self, most: int) -> None:
        while self._slots and len(self) > most:
            self._shed(next(iter(self._slots.values())))

    def touch(self, slot: PendingSlot) -> None:
        """``slot``'s peer's turn starts now (see :meth:`PendingSlot.touch`)."""
        if self._slots.pop(slot.token, None) is not None:
            slot.turn_began(trio.current_time())
            self._slots[slot.token] = slot  # now the youngest

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def take(self, *, unread: Callable[[], bool] | None = None,
             on_shed: Callable[[], None] | None = None,
             deadline: float = math.inf) -> PendingSlot:
        """Take the slot of one connection (the one :meth:`admit` counted, if any); give it
        back with :meth:`release`. When it is shed, ``on_shed`` is called (else its ``scope``
        is cancelled).

        Args:
            unread: whether the peer's bytes wait unread (:func:`unread_probe`); None: its age
                alone decides.
            on_shed: what sheds it, for a handshake that runs without a task of its own.
            deadline: the deadline of its ``scope`` (Trio time): one scope for both ends of
                the wait, shed or too slow.
        """
        if self._admitted:
            self._admitted -= 1
        else:  # not counted by an acceptor: make room now
            self._shed_beyond(self.limit - 1)
        token = self._next
        self._next += 1
        slot = PendingSlot(self, token, trio.current_time(), unread, on_shed, deadline)
        self._slots[token] = slot
        self.peak = max(self.peak, len(self))
        self._wake()  # an acceptor waiting may now find the oldest's age
        return slot

    def release(self, slot: PendingSlot) -> None:
        """Give ``slot`` back (its handshake step ended); nothing if it was shed."""
        if self._slots.pop(slot.token, None) is not None:  # not shed
            self.max_age = max(self.max_age, trio.current_time() - slot.entered)
            self._wake()

    @contextmanager
    def slot(self, *, unread: Callable[[], bool] | None = None,
             deadline: float = math.inf) -> Iterator[PendingSlot]:
        """:meth:`take` and :meth:`release` around a handshake that runs inside the yielded
        slot's ``scope``, which is cancelled when it is shed (or at ``deadline``)."""
        slot = self.take(unread=unread, deadline=deadline)
        try:
            yield slot
        finally:
            self.release(slot)
