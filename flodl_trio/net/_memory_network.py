"""Named in-memory listeners and the dialing between them (:class:`MemoryNetwork`).

The public names are re-exported by :mod:`flodl_trio.testing`, where users find them.
"""

from __future__ import annotations

import errno
from collections import deque

import trio

from .._errors import ConfigError
from ._memory_stream import MemoryConnection, MemoryStream

__all__ = ["MemoryListener", "MemoryNetwork"]


class MemoryListener(trio.abc.Listener[MemoryStream]):
    """A named listener of a :class:`MemoryNetwork`; ``accept`` returns the server end.

    Attributes:
        name: the name clients pass to :meth:`MemoryNetwork.connect`.
    """

    def __init__(self, network: MemoryNetwork, name: str) -> None:
        self.name = name
        self._network = network
        self._backlog: deque[MemoryConnection] = deque()
        self._closed = False
        self._arrived = trio.lowlevel.ParkingLot()

    @property
    def is_open(self) -> bool:
        """Whether :meth:`aclose` has not been called yet."""
        return not self._closed

    def enqueue(self, connection: MemoryConnection) -> None:
        """Queue a dialled connection for :meth:`accept` (:meth:`MemoryNetwork.connect`)."""
        self._backlog.append(connection)
        self._arrived.unpark()

    async def accept(self) -> MemoryStream:
        """Wait for the next queued connection and return its server end.

        Raises:
            trio.ClosedResourceError: the listener is closed (also raised in tasks blocked here
                when it gets closed).
        """
        await trio.lowlevel.checkpoint()
        while True:
            if self._closed:
                raise trio.ClosedResourceError(f"listener mem:{self.name} is closed")
            if self._backlog:
                return self._backlog.popleft().server
            await self._arrived.park()

    async def aclose(self) -> None:
        """Stop listening; connections queued but never accepted are closed (clients see EOF)."""
        if not self._closed:
            self._closed = True
            self._network._forget_listener(self)
            while self._backlog:
                self._backlog.popleft().server.close_now()
            self._arrived.unpark_all()
        await trio.lowlevel.checkpoint()

    def __repr__(self) -> str:
        state = "open" if self.is_open else "closed"
        return f"<MemoryListener mem:{self.name} {state}, {len(self._backlog)} queued>"


class MemoryNetwork:
    """A set of named in-memory listeners and every connection ever made to them.

    Args:
        buffer_size: bytes each direction of a connection buffers before ``send_all`` blocks.

    Raises:
        ConfigError: ``buffer_size`` is not a positive integer.

    Attributes:
        connections: every :class:`MemoryConnection` made, in dial order.
    """

    def __init__(self, *, buffer_size: int = 65536) -> None:
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
            raise ConfigError(f"buffer_size must be a positive int, got {buffer_size!r}")
        self.buffer_size = buffer_size
        self.connections: list[MemoryConnection] = []
        self._listeners: dict[str, MemoryListener] = {}
        self._all_listeners: list[MemoryListener] = []

    def listener(self, name: str) -> MemoryListener:
        """Start listening on ``name``.

        Args:
            name: any non-empty string; it is the address clients dial.

        Returns:
            A :class:`MemoryListener`; use it as an async context manager or close it.

        Raises:
            ConfigError: ``name`` is empty, or another open listener already has it.
        """
        if not isinstance(name, str) or not name:
            raise ConfigError(f"listener name must be a non-empty str, got {name!r}")
        if name in self._listeners:
            raise ConfigError(f"a listener for mem:{name} is already open on this network")
        listener = MemoryListener(self, name)
        self._listeners[name] = listener
        self._all_listeners.append(listener)
        return listener

    def _forget_listener(self, listener: MemoryListener) -> None:
        if self._listeners.get(listener.name) is listener:
            del self._listeners[listener.name]

    async def connect(self, name: str) -> MemoryStream:
        """Dial ``name``; returns as soon as the connection is queued in the listener's backlog.

        Args:
            name: the listener name.

        Returns:
            The client end of the new connection.

        Raises:
            ConnectionRefusedError: no listener is open on ``name`` (an :class:`OSError`, so dial
                retry loops written for TCP work unchanged).
        """
        await trio.lowlevel.checkpoint()
        listener = self._listeners.get(name)
        if listener is None:
            raise ConnectionRefusedError(
                errno.ECONNREFUSED, f"connection refused: no listener on mem:{name}"
            )
        connection = MemoryConnection(name, len(self.connections) + 1, self.buffer_size)
        self.connections.append(connection)
        listener.enqueue(connection)
        return connection.client

    def open_streams(self) -> list[MemoryStream]:
        """Return the stream ends whose owner has called neither ``aclose`` nor ``reset``."""
        return [
            end
            for connection in self.connections
            for end in (connection.client, connection.server)
            if end.is_open
        ]

    def open_listeners(self) -> list[MemoryListener]:
        """Return the listeners not closed yet."""
        return [listener for listener in self._all_listeners if listener.is_open]

    def assert_all_closed(self) -> None:
        """Fail a leak test if any stream end or listener is still open.

        Raises:
            AssertionError: listing every open end and listener.
        """
        leaks: list[str] = [repr(end) for end in self.open_streams()]
        leaks += [repr(listener) for listener in self.open_listeners()]
        if leaks:
            raise AssertionError(f"{len(leaks)} still open: " + ", ".join(leaks))

