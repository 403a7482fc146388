"""Raw peers: the handshakes driven through the library's own sans-IO machines, then only what
the test says (a relay's, a rank's and the coordinator's end)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import trio

import flodl_trio as ft

COORD = "coordinator"  # the coordinator's name on a MemoryNetwork


async def read_one_record(stream: trio.abc.ReceiveStream, opener: Any) -> Any:
    """The next record from ``stream``, or None at EOF."""
    while True:
        rec = opener.next_record()
        if rec is not None:
            return rec
        data = await stream.receive_some(65536)
        if not data:
            return None
        opener.push(data)


@attrs.define(eq=False)
class RawRelay:
    """An upstream connection whose relay side is driven by the test."""

    stream: trio.abc.Stream
    sealer: Any
    opener: Any
    acked: bool
    refused: str | None = None


async def raw_relay_handshake(
    stream: trio.abc.Stream, salt: ft.SessionSalt, host: str, ranks: Sequence[int], *,
    world_size: int, model_sigs: dict[str, bytes] | None = None,
) -> RawRelay:
    """Run the relay's end with Hello{host, world_size, model_sigs, ranks} exactly as given
    (duplicates, unsorted and empty lists included); ``acked`` says whether the join was
    confirmed (HelloAck, Ready, welcome), else the coordinator refused it (``refused``, its
    reason) or closed it (EOF)."""
    from flodl_trio import wire
    from flodl_trio.net._handshake_io import run_handshake

    machine = wire.RelayHandshake(salt, host=host, ranks=tuple(ranks), world_size=world_size,
                                  model_sigs=model_sigs, coordinator=COORD)
    try:
        done = await run_handshake(stream, machine)
    except ft.WireError as exc:
        assert "closed" in str(exc), exc  # an EOF, never anything else
        return RawRelay(stream, machine.sealer, machine.opener, acked=False)
    if isinstance(done, wire.RefusalReceived):
        return RawRelay(stream, machine.sealer, machine.opener, acked=False,
                        refused=done.reason)
    assert isinstance(done, wire.Established)
    return RawRelay(stream, done.sealer, done.opener, acked=True)



async def drain_and_close(stream: trio.abc.Stream, *, limit: float = 30) -> bool:
    """Read (and drop) what a raw peer's stream receives until its end or ``limit``, then
    close; whether it ended (EOF, or closed by the peer) before ``limit``."""
    ended = False
    with trio.move_on_after(limit):
        try:
            while await stream.receive_some(65536):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        ended = True
    await trio.aclose_forcefully(stream)
    return ended


async def raw_rank_accept(stream: trio.abc.Stream, salt: ft.SessionSalt, *, world_size: int,
                          ranks: Sequence[int], host: str = "fake-relay") -> int:
    """Run the relay's end of one rank handshake (SPEC §2.3, FT/2: through the rank's first
    frame and the relay's notice) with the library's own machine; returns the rank."""
    from flodl_trio import wire
    from flodl_trio.net._handshake_io import run_handshake

    machine = wire.RankAcceptHandshake(salt, world_size=world_size, host=host,
                                       ranks=frozenset(ranks), peer="test")
    hello = await run_handshake(stream, machine)
    assert isinstance(hello, wire.RankHelloReceived)
    machine.accept()
    done = await run_handshake(stream, machine)
    assert isinstance(done, wire.RankConfirmed)
    return done.rank


@attrs.define(eq=False)
class RawCoordinatorSide:
    """The coordinator end of one upstream connection, driven by the test."""

    stream: trio.abc.Stream
    sealer: Any
    opener: Any
    hello: Any


async def raw_coordinator_accept(
    listener: trio.abc.Listener[Any], salt: ft.SessionSalt
) -> RawCoordinatorSide:
    """Accept one relay and complete the coordinator side of the upstream handshake."""
    from flodl_trio import wire
    from flodl_trio.net._handshake_io import run_handshake

    stream = await listener.accept()
    machine = wire.CoordinatorHandshake(salt, peer="test")
    received = await run_handshake(stream, machine)
    assert isinstance(received, wire.HelloReceived)
    machine.accept()
    done = await run_handshake(stream, machine)
    assert isinstance(done, wire.Established)
    return RawCoordinatorSide(stream, done.sealer, done.opener, received.hello)



class RawRank:
    """A rank client built from the wire API alone: hello, ack, then only what the test says.

    It records every control message that arrives (``CoordHeartbeat`` included, which a real
    endpoint absorbs) and, while ``beating``, sends ``Heartbeat`` every ``interval`` seconds.
    """

    def __init__(self, *, rank: int, salt: ft.SessionSalt, stream: trio.abc.Stream,
                 interval: float | None, leftover: bytes = b"") -> None:
        self.rank = rank
        self.leftover = leftover
        self.salt = salt
        self.stream = stream
        self.interval = interval
        self.beating = interval is not None
        self.received: list[Any] = []
        self.eof = trio.Event()
        self.last_sent: float | None = None
        self._lock = trio.Lock()

    @classmethod
    async def connect(cls, dialer: Any, *, salt: ft.SessionSalt, rank: int, world_size: int,
                      interval: float | None = 1.0) -> RawRank:
        from flodl_trio.net._handshake_io import run_handshake

        stream = await dialer()
        machine = ft.wire.RankDialHandshake(salt, rank=rank, world_size=world_size, relay="test")
        confirmed = await run_handshake(stream, machine)
        assert isinstance(confirmed, ft.wire.RankConfirmed)
        return cls(rank=rank, salt=salt, stream=stream, interval=interval,
                   leftover=confirmed.leftover)

    def go_silent(self) -> float:
        """Stop heartbeating (its process froze: the link stays open, nothing more is sent);
        returns when it sent its last frame."""
        self.beating = False
        return self.last_heartbeat()

    def last_heartbeat(self) -> float:
        """When it sent its last frame (it has sent one)."""
        assert self.last_sent is not None
        return self.last_sent

    def count(self, kind: type[Any]) -> int:
        return sum(isinstance(m, kind) for m in self.received)

    def labels(self, *, heartbeats: bool = False) -> list[str]:
        # The relay's own RelayWaiting notices (its FT/2 handshake answer) are not the
        # coordinator's words.
        return [type(m).__name__ for m in self.received
                if not isinstance(m, ft.wire.RelayWaiting)
                and (heartbeats or not isinstance(m, ft.wire.CoordHeartbeat))]

    async def send(self, msg: Any) -> None:
        blob = ft.wire.len_frame(ft.wire.encode_frame(self.salt, msg))
        async with self._lock:
            await self.stream.send_all(blob)
        self.last_sent = trio.current_time()

    async def run(self) -> None:
        """Read until EOF (then close), heartbeating meanwhile."""
        try:
            async with trio.open_nursery() as nursery:
                if self.interval is not None:
                    nursery.start_soon(self._heartbeats, self.interval)
                await self._read()
                nursery.cancel_scope.cancel()
        finally:
            self.eof.set()
            await trio.aclose_forcefully(self.stream)

    async def _read(self) -> None:
        decoder = ft.wire.LenFrameDecoder(max_len=ft.wire.MAX_LEN_FRAME)
        data: bytes | bytearray = self.leftover  # what the relay sent right behind its ack
        while True:
            if not data:
                try:
                    data = await self.stream.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
                if not data:
                    return
            blobs, data = decoder.feed(data), b""
            for blob in blobs:
                frame = ft.wire.decode_frame(self.salt, blob)
                self.received.append(ft.wire.frame_message(frame))

    async def _heartbeats(self, interval: float) -> None:
        while True:
            await trio.sleep(interval)
            if self.beating:
                try:
                    await self.send(ft.wire.Heartbeat(rank=self.rank, step_count=0))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return


