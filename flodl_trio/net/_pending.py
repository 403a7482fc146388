"""A bound on unauthenticated connections (SPEC §4.2, FT/2): the oldest is shed for a new one.

Used twice by a coordinator that binds its own port: by the port mux for connections whose
channel magic has not arrived, and by formation for those whose Hello has not verified. Each
such connection holds a socket, a task and (in formation) up to a Hello ceiling of bytes; nothing
limited them (4,000 dialers holding partial Hellos took a coordinator to 1.1 GB). At most
``limit`` may be pending at once; admitting one more cancels the *oldest*. Oldest, not newest:
refusing newcomers would let anyone who opens ``limit`` silent connections (and re-opens them as
they time out) keep every relay out, while a genuine relay, whose handshake takes one round trip,
completes long before it becomes the oldest of ``limit``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import trio


class PendingHandshakes:
    """The cancel scopes of the connections still authenticating, oldest first.

    Attributes:
        limit: the most that may be pending at once.
        shed: how many were cancelled to admit a newer one.
        peak: the most that were pending at once.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.shed = 0
        self.peak = 0
        self._scopes: dict[int, trio.CancelScope] = {}  # insertion order is age order
        self._next = 0

    def __len__(self) -> int:
        return len(self._scopes)

    @contextmanager
    def slot(self) -> Iterator[trio.CancelScope]:
        """Admit one connection; its handshake runs inside the yielded scope, which is
        cancelled if it becomes the oldest of more than ``limit``."""
        while len(self._scopes) >= self.limit:
            oldest = next(iter(self._scopes))
            self._scopes.pop(oldest).cancel()
            self.shed += 1
        token = self._next
        self._next += 1
        scope = trio.CancelScope()
        self._scopes[token] = scope
        self.peak = max(self.peak, len(self._scopes))
        try:
            yield scope
        finally:
            self._scopes.pop(token, None)
