"""The rank endpoint (SPEC §6): the rank side of the control channel.

It dials its host relay, completes the 24/16-byte handshake, then: iterating it yields the
coordinator's ControlMsgs (``CoordHeartbeat`` is absorbed), ``send`` writes TimingMsg/Metrics, a
task sends ``Heartbeat`` every ``heartbeat_interval`` whatever the user code does, and a watchdog
raises ``CoordinatorLost`` when the coordinator goes silent for ``coord_liveness_timeout``. A rank
the coordinator declared dead is told so (``Fenced``) and ends with ``RankEvicted``, a
``CoordinatorLost`` that carries the coordinator's reason.

With ``RankConfig.rejoin_when_fenced`` (issue 37) a fenced rank does not end: it waits on its
link for its relay to join again with it (``fenced`` says why meanwhile, and its own sends are
dropped, its heartbeats aside), and goes on once the relay says ``Readmitted``, which the user's
loop gets: the work done since the last acknowledged sync is void. If the relay closes the link
instead, it ends with ``RankEvicted`` as without the setting.

With a durable coordinator (issue 22) the relay rides out its loss: the user's loop gets the
relay's ``CoordinatorReconnecting`` then ``CoordinatorResumed`` (both reset the liveness clock,
like every verified frame, and the relay keeps it fed in between); ``reconnecting`` says why
while the coordinator is away.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from ._config import RankConfig
from ._errors import (
    ConfigError,
    CoordinatorLost,
    RankEvicted,
    SendError,
    WireError,
)
from ._lifecycle import open_lifecycle
from ._timeouts import clock_time_in
from .net._keepalive import KeepAlive
from .net._ratelimit import JunkCounter
from .net._socket_io import Reader, next_event, plain_socket, run_handshake_on, write_now
from .net._transport import (
    STREAM_GONE,
    DialTarget,
    StreamWriter,
    dial_and_handshake,
    format_address,
)
from .wire import (
    ControlMsg,
    CoordHeartbeat,
    CoordinatorReconnecting,
    CoordinatorResumed,
    DeclareAlive,
    DeclareDead,
    Drain,
    EndOfStream,
    Exiting,
    Fenced,
    FrameCodec,
    Heartbeat,
    Invalid,
    Metrics,
    RankConfirmed,
    RankDialHandshake,
    RankSession,
    Readmitted,
    RelayWaiting,
    SessionSalt,
    Shutdown,
    ShutdownWithSave,
    TimingMsg,
    control_label,
)

log = logging.getLogger("flodl_trio.rank")

INBOX_SIZE = 1024


class RankEndpoint:
    """One rank's control channel, as yielded by :func:`open_rank`.

    Attributes:
        rank: this rank's global rank.
        world_size: the world size it announced.
        step_count: reported in every automatic ``Heartbeat``; user code updates it.
        dead_peers: ranks the coordinator declared dead (every other rank once the coordinator
            is lost).
        draining: why this rank's host leaves the run, once its relay said so (a ``Drain``,
            issue 37): finish the current sync, then leave the block; else None.
        fenced: with ``rejoin_when_fenced``, why the coordinator declared this rank dead,
            while it waits for its relay to bring it back; else None.
        readmissions: how many times it came back after being fenced (``Readmitted``; its
            ``step_count`` is then 0 again).
        dropped_while_fenced: frames the user sent while it was fenced (dropped).
    """

    def __init__(self, *, rank: int, world_size: int, salt: SessionSalt, stream: trio.abc.Stream,
                 config: RankConfig, relay: str, leftover: bytes = b"",
                 reader: Reader | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.step_count = 0
        self.config = config
        self.dead_peers: frozenset[int] = frozenset()
        self.draining: str | None = None
        self.fenced: str | None = None
        self.readmissions = 0
        self.dropped_while_fenced = 0
        # Fenced, until the user took Readmitted: the user's sends are dropped (work from
        # before the fence must not reach the coordinator once the relay forwards again).
        self._muted = False
        self._relay = relay
        self._session = RankSession(FrameCodec(salt), rank=rank, relay=relay)
        self._stream = stream
        self._reader = reader if reader is not None else Reader(stream)
        self._socket = plain_socket(stream)  # for direct writes while the writer is idle
        self._writer = StreamWriter(stream, write_stall_timeout=config.write_stall_timeout)
        self._inbox_send, self._inbox = trio.open_memory_channel[ControlMsg](INBOX_SIZE)
        self._ended = False
        self._lost: str | None = None
        self._evicted: str | None = None  # the coordinator's reason, once it fenced us
        self._last_inbound = trio.current_time()
        self._paused = False
        self._wake = trio.Event()
        self._leaving = False
        self._reader_done = trio.Event()
        # The relay's last RelayWaiting notice, while no coordinator frame came after it.
        self._relay_said: str | None = None
        self._dropped = JunkCounter()
        self._leftover = leftover  # what the relay sent right behind its ack
        self._reconnecting: str | None = None

    @property
    def reconnecting(self) -> str | None:
        """While the relay rides out a lost durable coordinator, what it said
        (``CoordinatorReconnecting``); None once it resumed (``CoordinatorResumed``) or if it
        never had to."""
        return self._reconnecting

    @property
    def coordinator_lost(self) -> str | None:
        """Why the coordinator is considered lost, or None."""
        return self._lost

    def __aiter__(self) -> RankEndpoint:
        return self

    async def __anext__(self) -> ControlMsg:
        if self._ended:
            raise StopAsyncIteration
        try:
            msg = await self._inbox.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            self._ended = True
            said = "" if self._relay_said is None else f"; the relay said: {self._relay_said}"
            if self._evicted is not None:
                raise RankEvicted(f"rank {self.rank} (via relay {self._relay}): "
                                  f"{self._lost}{said}", self._evicted) from None
            if self._lost is not None:
                raise CoordinatorLost(f"rank {self.rank} (via relay {self._relay}): "
                                      f"{self._lost}{said}") from None
            raise StopAsyncIteration from None
        if isinstance(msg, Shutdown | ShutdownWithSave):
            self._ended = True
        elif isinstance(msg, Readmitted):
            self._muted = False  # the user has it: what it sends from now on is new work
        return msg

    async def receive(self) -> ControlMsg:
        """The next control message (same as one step of ``async for``).

        Raises:
            RankEvicted: the coordinator declared this rank dead (the message says why).
            CoordinatorLost: the coordinator is gone.
            trio.EndOfChannel: iteration ended cleanly after ``Shutdown``.
        """
        try:
            return await self.__anext__()
        except StopAsyncIteration:
            raise trio.EndOfChannel from None

    async def send(self, msg: TimingMsg | Metrics) -> None:
        """Send a TimingMsg or Metrics to the coordinator.

        Raises:
            ConfigError: ``msg`` is not a TimingMsg or Metrics.
            SendError: the link is gone or the write stalled.
        """
        if not isinstance(msg, TimingMsg | Metrics):
            raise ConfigError(f"rank {self.rank}: send expects a TimingMsg or Metrics, got "
                              f"{control_label(msg)}")
        if self._lost is not None:
            raise SendError(f"rank {self.rank}: cannot send {control_label(msg)}: coordinator "
                            f"lost ({self._lost})")
        if self._muted and type(msg) is not Heartbeat:
            self.dropped_while_fenced += 1
            await trio.lowlevel.checkpoint()
            return
        blob = self._session.send(msg)
        try:
            if self._socket is not None and self._writer.idle:
                # The writer is idle: hand the frame to the kernel now (one system call, no
                # lock, cancel scope or task switch), as the relay does towards its ranks.
                written = write_now(self._socket, blob)
                if written == len(blob):
                    await trio.lowlevel.checkpoint()
                    return
                if written:
                    # The rest goes through the writer (nothing wrote since: no checkpoint),
                    # never abandoned half-way: a cut frame would corrupt the link.
                    with trio.CancelScope(shield=True):
                        await self._writer.send(blob[written:])
                    return
            await self._writer.send(blob)
        except trio.TooSlowError:
            self._set_lost(f"write stall: no progress for {self.config.write_stall_timeout:g}s")
            raise SendError(f"rank {self.rank}: sending {control_label(msg)} to relay "
                            f"{self._relay} stalled") from None
        except STREAM_GONE as exc:
            raise SendError(f"rank {self.rank}: sending {control_label(msg)} to relay "
                            f"{self._relay}: link closed ({type(exc).__name__})") from None

    def _evict(self, reason: str) -> None:
        """The coordinator declared us dead (SPEC §4.5 fencing): end with ``RankEvicted``, or,
        with ``rejoin_when_fenced``, wait for the relay to bring us back (issue 37)."""
        if self._lost is None and not self._session.shutdown_seen:
            self._evicted = reason
            log.warning("rank %d: declared dead by the coordinator: %s", self.rank, reason)
            if self.config.rejoin_when_fenced:
                self.fenced = reason
                self._muted = True
                log.warning("rank %d: waiting for relay %s to bring it back "
                            "(rejoin_when_fenced)", self.rank, self._relay)
                return
        self._set_lost(f"the coordinator declared rank {self.rank} dead ({reason}) and cut it "
                       "off")

    def _set_lost(self, reason: str) -> None:
        if self.fenced is not None:  # it waited to come back; its relay never brought it
            reason = (f"the coordinator declared rank {self.rank} dead ({self.fenced}) and cut "
                      "it off")
        if self._lost is None and not self._session.shutdown_seen and not self._leaving:
            self._lost = reason
            self.dead_peers = frozenset(r for r in range(self.world_size) if r != self.rank)
            log.warning("rank %d: coordinator lost: %s", self.rank, reason)
        self._inbox_send.close()

    async def run_reader(self) -> None:
        try:
            await self._read_until_end()
        finally:
            self._reader_done.set()

    async def _read_until_end(self) -> None:
        session = self._session
        if self._leftover:
            session.receive_data(self._leftover)
            self._leftover = b""
        try:
            while not isinstance(event := await next_event(self._reader, session),
                                 EndOfStream):
                if type(event) is Invalid and event.category == "invalid frame":
                    self._drop(event.category, event.detail)  # it did not verify
                    continue
                self._last_inbound = trio.current_time()  # it verified: a sign of life
                if type(event) is Invalid:
                    self._drop(event.category, event.detail)
                else:
                    await self._on_message(event)
        except STREAM_GONE as exc:
            self._set_lost(session.close(f"link to relay {self._relay} lost "
                                         f"({type(exc).__name__})"))
            return
        if event.clean:
            self._inbox_send.close()
        else:
            self._set_lost(event.reason)

    def _drop(self, category: str, detail: str) -> None:
        # Counted, and only a rate-limited few logged: one WARNING per forged frame let any
        # peer with the salt turn a frame flood into a log flood.
        report = self._dropped.add(category, detail, trio.current_time())
        if report is not None:
            log.warning("rank %d: frame dropped: %s", self.rank, report.text())

    @property
    def dropped_frames(self) -> dict[str, int]:
        """Inbound frames dropped (failed MAC, undecodable, wrong kind), by reason."""
        return self._dropped.by_reason()

    async def _on_message(self, msg: ControlMsg) -> None:
        if isinstance(msg, CoordHeartbeat):
            self._relay_said = None
            return
        if isinstance(msg, RelayWaiting):
            # The relay has not joined yet and says why; it kept our liveness clock alive above,
            # and an error from here on quotes it (the coordinator may never have been dialed).
            self._relay_said = msg.detail
            return
        self._relay_said = None
        if isinstance(msg, CoordinatorReconnecting):
            self._reconnecting = msg.detail
        elif isinstance(msg, CoordinatorResumed):
            self._reconnecting = None
        if isinstance(msg, Fenced):
            self._evict(msg.reason)
            return
        if isinstance(msg, Readmitted):
            if self.fenced is None:
                return  # not fenced: nothing to come back from
            log.warning("rank %d: back in the run (its relay %s joined again; it was declared "
                        "dead: %s)", self.rank, self._relay, self.fenced)
            self.fenced = self._evicted = None
            self.readmissions += 1
            self.step_count = 0  # the scheduler takes a rank that came back for a new process
        if isinstance(msg, DeclareDead):
            self.dead_peers = self.dead_peers | {int(msg.rank)}
        elif isinstance(msg, DeclareAlive):
            self.dead_peers = self.dead_peers - {int(msg.rank)}
        elif isinstance(msg, Drain):  # its host leaves: finish the current sync and exit
            self.draining = msg.reason
        try:
            self._inbox_send.send_nowait(msg)
            return
        except trio.WouldBlock:
            pass
        except STREAM_GONE:
            return
        # The user is not iterating; time we spend waiting here is not the coordinator's silence.
        self._paused = True
        try:
            await self._inbox_send.send(msg)
        except STREAM_GONE:
            pass
        finally:
            self._paused = False
            self._last_inbound = trio.current_time()
            self._wake.set()

    async def run_watchdog(self) -> None:
        timeout = self.config.coord_liveness_timeout
        while self._lost is None and not self._session.shutdown_seen:
            due = self._last_inbound + timeout
            if trio.current_time() >= due and not self._paused:
                self._set_lost(f"no frame from the coordinator within coord_liveness_timeout="
                               f"{timeout:g}s")
                await trio.aclose_forcefully(self._stream)
                return
            self._wake = trio.Event()
            # While the reader waits on the user (inbox full) the deadline is suspended: waking at
            # a deadline already past would spin without blocking until the user iterates.
            with trio.move_on_at(math.inf if self._paused else due):
                await self._wake.wait()

    async def run_heartbeats(self) -> None:
        while True:
            await trio.sleep(self.config.heartbeat_interval)
            if self._lost is not None:
                return
            try:
                await self.send(Heartbeat(rank=self.rank, step_count=self.step_count))
            except SendError:
                return

    async def say_goodbye(self) -> None:
        """Best-effort ``Exiting``, then a half-close and a short drain so it is not reset away."""
        if self._lost is not None:
            return
        self._leaving = True
        with trio.move_on_after(min(2.0, self.config.write_stall_timeout)):
            try:
                await self.send(Exiting(rank=self.rank))
                await self._writer.send_eof()
                await self._reader_done.wait()  # the relay read it all and closed its side
            except (SendError, trio.TooSlowError, *STREAM_GONE):
                pass


async def _connect(target: DialTarget, salt: SessionSalt, rank: int, world_size: int,
                   config: RankConfig) -> tuple[trio.abc.Stream, Reader, bytes]:
    where = format_address(target) if not callable(target) else "the relay"

    async def handshake(stream: trio.abc.Stream) -> tuple[trio.abc.Stream, Reader, bytes]:
        machine = RankDialHandshake(salt, rank=rank, world_size=world_size, relay=where)
        reader = Reader(stream, drained=True)  # we speak first: nothing to read before
        with trio.fail_after(config.handshake_timeout):
            confirmed = await run_handshake_on(stream, reader, machine)
        assert isinstance(confirmed, RankConfirmed)
        return stream, reader, confirmed.leftover

    def waiting(exc: OSError, deadline: float) -> None:
        # Said at once: a rank started before its relay retried in silence for connect_timeout.
        why = (os.strerror(exc.errno) if exc.errno else str(exc) or type(exc).__name__).lower()
        log.warning("rank %d: no relay at %s yet (%s); retrying %s until %s (connect_timeout "
                    "%g s)", rank, where, why, where,
                    clock_time_in(deadline - trio.current_time()), config.connect_timeout)

    # A HandshakeError (the relay answered, and said no) is final; a relay that is not up yet,
    # or dropped the attempt, is retried.
    return await dial_and_handshake(
        target, handshake, connect_timeout=config.connect_timeout, what=f"rank {rank}",
        peer=f"relay {where}",
        expected="a handshake ack (a relay closes connections whose salt, world_size or rank it "
        "rejects: check its log)",
        retry_on=(WireError, trio.TooSlowError, *STREAM_GONE),
        keepalive=KeepAlive.within(config.coord_liveness_timeout,
                                   write_stall=config.write_stall_timeout),
        on_waiting=waiting,
    )


@asynccontextmanager
async def open_rank(
    relay: DialTarget,
    *,
    salt: SessionSalt,
    rank: int,
    world_size: int,
    config: RankConfig | None = None,
) -> AsyncIterator[RankEndpoint]:
    """Connect one rank to its host relay.

    Args:
        relay: the relay's ``rank_address`` ``(host, port)``, or an async callable returning a
            stream.
        salt: the run's :class:`SessionSalt`.
        rank: this rank's global rank (< world_size).
        world_size: the run's world size.
        config: deadlines and heartbeat cadence (:class:`RankConfig`).

    Raises:
        ConfigError: ``rank >= world_size`` and other invalid arguments, before dialing.
        HandshakeError: no accepted handshake within ``connect_timeout``.
    """
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"open_rank: expected {name} to be an integer >= 0, got {value!r}")
    if rank >= world_size:
        raise ConfigError(f"open_rank: expected rank < world_size, got rank {rank} with "
                          f"world_size {world_size}")
    if not isinstance(salt, SessionSalt):
        raise ConfigError(f"open_rank: expected a SessionSalt, got {type(salt).__name__}")
    cfg = config if config is not None else RankConfig()
    stream, reader, leftover = await _connect(relay, salt, rank, world_size, cfg)
    where = format_address(relay) if not callable(relay) else "in-process"
    ep = RankEndpoint(rank=rank, world_size=world_size, salt=salt, stream=stream, config=cfg,
                      relay=where, leftover=leftover, reader=reader)
    async with open_lifecycle(f"rank {rank}", failure=lambda: None) as life:
        life.nursery.start_soon(ep.run_reader)
        life.nursery.start_soon(ep.run_watchdog)
        life.nursery.start_soon(ep.run_heartbeats)
        try:
            with life.body():
                yield ep
            with trio.CancelScope(shield=True):
                await ep.say_goodbye()
        finally:
            life.stop_tasks()  # first: the reader must not report the close as a lost link
            # Shielded: under an outside cancellation an unshielded close raised Cancelled at
            # its first checkpoint and left the stream open.
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)
