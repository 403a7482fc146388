"""The stream a routed connection becomes: the bytes a peek consumed, replayed, then the socket.

:func:`~flodl_trio.port_mux.open_port_mux` reads each connection's channel magic before it knows
where the connection goes; :class:`PrefixedStream` gives those bytes back, so code behind a leg
reads exactly what it would have read from a direct listener. Re-exported by
:mod:`flodl_trio.port_mux`, where users find it.
"""

from __future__ import annotations

import operator

import trio

__all__ = ["PeerAddress", "PrefixedStream", "remote_address_of"]

PeerAddress = tuple[str, int] | str


def remote_address_of(stream: trio.abc.Stream) -> PeerAddress | None:
    # getpeername() returns the numeric address; nothing here may resolve names (SPEC §2.1).
    if isinstance(stream, trio.SocketStream):
        try:
            peer = stream.socket.getpeername()
        except OSError:  # the peer already reset the connection
            return None
    else:
        peer = getattr(stream, "remote_address", None)
    if isinstance(peer, tuple) and len(peer) >= 2:
        return (str(peer[0]), int(peer[1]))
    return peer if isinstance(peer, str) else None


class PrefixedStream(trio.abc.HalfCloseableStream):
    """A stream that first replays ``prefix``, then reads from ``transport_stream``.

    ``send_eof`` works when the transport is a :class:`trio.abc.HalfCloseableStream` (TCP and the
    in-memory network are) and raises :class:`trio.BrokenResourceError` otherwise.

    Attributes:
        transport_stream: the underlying stream; all sends go straight to it.
        remote_address: the peer's numeric ``(host, port)`` (or a path), None when unknown.
    """

    def __init__(
        self,
        transport_stream: trio.abc.Stream,
        prefix: bytes,
        *,
        remote_address: PeerAddress | None = None,
    ) -> None:
        self.transport_stream = transport_stream
        self.remote_address = remote_address
        self._prefix = bytes(prefix)
        self._receiving = False
        self._closed = False

    @property
    def replaying(self) -> bool:
        """Some of the peeked bytes have not been read back yet."""
        return bool(self._prefix)

    def take_replay(self) -> bytes:
        """The peeked bytes not read back yet, which no read returns after this (for a caller
        that reads the socket itself from here on)."""
        data, self._prefix = self._prefix, b""
        return data

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("this routed stream was closed")

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Write ``data`` to the transport stream (see :meth:`trio.abc.SendStream.send_all`)."""
        self._check_open()
        await self.transport_stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        """Delegate to the transport stream."""
        self._check_open()
        await self.transport_stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        """Half-close the transport stream.

        Raises:
            trio.BrokenResourceError: the transport stream cannot half-close.
        """
        self._check_open()
        if not isinstance(self.transport_stream, trio.abc.HalfCloseableStream):
            await trio.lowlevel.checkpoint()
            raise trio.BrokenResourceError(
                f"{type(self.transport_stream).__name__} does not support send_eof"
            )
        await self.transport_stream.send_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        """Return replayed prefix bytes while any are left, then the transport's bytes.

        Args:
            max_bytes: the most bytes to return; None means no particular limit.

        Raises:
            ValueError: ``max_bytes`` is less than 1.
            trio.BusyResourceError: another task is already receiving on this stream.
            trio.ClosedResourceError: this stream was closed.
        """
        if max_bytes is not None:
            max_bytes = operator.index(max_bytes)
            if max_bytes < 1:
                raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this stream")
        self._check_open()
        self._receiving = True
        try:
            if self._prefix:
                await trio.lowlevel.checkpoint()
                count = len(self._prefix) if max_bytes is None else max_bytes
                chunk, self._prefix = self._prefix[:count], self._prefix[count:]
                return chunk
            return await self.transport_stream.receive_some(max_bytes)
        finally:
            self._receiving = False

    async def aclose(self) -> None:
        """Close the transport stream (idempotent)."""
        self._closed = True
        self._prefix = b""
        await self.transport_stream.aclose()

    def __repr__(self) -> str:
        return f"<PrefixedStream from {self.remote_address!r} over {self.transport_stream!r}>"

