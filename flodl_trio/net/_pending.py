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
from collections.abc import Iterator
from contextlib import contextmanager

import trio

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


class PendingHandshakes:
    """The cancel scopes of the connections still authenticating, oldest first.

    The acceptor awaits :meth:`room` before each ``accept`` and calls :meth:`admit` for each
    connection it accepted; the connection's handler runs its handshake in :meth:`slot`.

    Attributes:
        limit: the most that may be pending at once.
        min_age: seconds a connection is pending before it may be shed.
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
        # Insertion order is age order: token -> (cancel scope, admitted at).
        self._scopes: dict[int, tuple[trio.CancelScope, float]] = {}
        self._next = 0
        # Admitted by the acceptor, their handler not in its slot yet (it starts a bit later).
        self._admitted = 0
        self._changed: trio.Event | None = None  # set when a slot is taken or freed

    def __len__(self) -> int:
        return len(self._scopes) + self._admitted

    async def room(self) -> None:
        """Return once one more connection may be admitted without shedding one younger than
        ``min_age``: a slot is free, or the oldest pending connection is stale (the next
        :meth:`admit` sheds it). With room it returns without a checkpoint: the ``accept``
        that follows is one, and one more pass through the scheduler per connection is a
        measurable part of a formation of thousands."""
        waited = False
        while len(self) >= self.limit:  # each round ends at a change or a deadline
            stale_at = math.inf
            if self._scopes:
                _, admitted = next(iter(self._scopes.values()))
                stale_at = admitted + self.min_age
                if trio.current_time() >= stale_at:
                    return
            if not waited:
                waited = True
                self.waits += 1
            if self._changed is None:
                self._changed = trio.Event()
            with trio.move_on_at(stale_at):
                await self._changed.wait()

    def admit(self) -> None:
        """Count a connection the acceptor just accepted (its handler takes the slot); beyond
        ``limit``, shed the oldest pending one (after :meth:`room`: a stale one)."""
        self._admitted += 1
        self._shed_beyond(self.limit)

    def _shed_beyond(self, most: int) -> None:
        while self._scopes and len(self) > most:
            oldest = next(iter(self._scopes))
            self._scopes.pop(oldest)[0].cancel()
            self.shed += 1

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    @contextmanager
    def slot(self) -> Iterator[trio.CancelScope]:
        """Take the slot of one connection (the one :meth:`admit` counted, if any); its
        handshake runs inside the yielded scope, which is cancelled when it is shed."""
        if self._admitted:
            self._admitted -= 1
        else:  # not counted by an acceptor: make room now
            self._shed_beyond(self.limit - 1)
        token = self._next
        self._next += 1
        scope = trio.CancelScope()
        admitted = trio.current_time()
        self._scopes[token] = (scope, admitted)
        self.peak = max(self.peak, len(self))
        self._wake()  # an acceptor waiting may now find the oldest's age
        try:
            yield scope
        finally:
            if self._scopes.pop(token, None) is not None:  # not shed
                self.max_age = max(self.max_age, trio.current_time() - admitted)
                self._wake()
