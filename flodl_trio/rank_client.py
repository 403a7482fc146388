"""A synchronous rank endpoint for workers that are not Trio programs (issue 16).

:class:`RankClient` runs :func:`~flodl_trio.open_rank` on a thread of its own, inside a Trio run
of its own, so an ordinary training script (PyTorch, NumPy, anything that blocks) gets the
control channel without writing a thread bridge. Heartbeats come from that thread: a worker that
blocks in a long computation keeps its rank alive.

    with RankClient(relay_address, salt=salt, rank=2, world_size=4) as rc:
        for msg in rc:                     # ends after Shutdown / ShutdownWithSave
            ...
            rc.send(Batch(...))

How the two sides meet: calls go into the endpoint's Trio run through
:func:`trio.from_thread.run` with the run's token (no polling); one task of that run (the pump)
is the endpoint's only reader and hands messages to the consumer through a bounded memory channel,
so an endpoint error is seen by the pump the moment it happens, kept, and raised in the caller's
thread at its next call (``recv``, ``send``, ``close``), never lost.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from types import TracebackType

import trio

from . import _timeouts as T
from ._config import RankConfig
from ._errors import ConfigError, FlodlError
from .net._transport import DialTarget
from .rank import RankEndpoint, open_rank
from .wire import ControlMsg, Exiting, Metrics, SessionSalt, TimingMsg, control_label

__all__ = ["RankClient"]

# The pump may run this far ahead of the consumer; past it, the endpoint's own inbox applies
# its backpressure (and suspends its liveness watchdog), exactly as for a Trio user.
_HANDOFF_SIZE = 64


class _Abandon(Exception):
    """Leave the endpoint without ``Exiting``: the caller left with an exception, or it failed."""


class RankClient:
    """One rank's control channel for a synchronous worker.

    Args:
        relay: the host relay's ``rank_address`` ``(host, port)``, or an async callable returning
            a stream (called inside the client's own Trio run).
        salt: the run's :class:`~flodl_trio.SessionSalt`.
        rank: this rank's global rank (< ``world_size``).
        world_size: the run's world size.
        config: the endpoint's deadlines and heartbeat cadence (:class:`~flodl_trio.RankConfig`).
        close_timeout: seconds :meth:`close` waits for the goodbye and the thread; default
            ``shutdown_grace`` (5 s, scaled by ``FLODL_NET_TIMEOUT_SCALE``).

    The endpoint is connected by :meth:`open` (or entering the ``with`` block), which waits at
    most ``connect_timeout + handshake_timeout`` of the config. Thread-safe for one consumer
    (``recv`` / iteration) and any number of senders.

    Raises:
        ConfigError: an invalid argument (checked before any thread starts).
    """

    def __init__(self, relay: DialTarget, *, salt: SessionSalt, rank: int, world_size: int,
                 config: RankConfig | None = None, close_timeout: float | None = None) -> None:
        for name, value in (("rank", rank), ("world_size", world_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"RankClient: expected {name} to be an integer >= 0, got "
                                  f"{value!r}")
        if rank >= world_size:
            raise ConfigError(f"RankClient: expected rank < world_size, got rank {rank} with "
                              f"world_size {world_size}")
        if not isinstance(salt, SessionSalt):
            raise ConfigError(f"RankClient: expected a SessionSalt, got {type(salt).__name__}")
        if close_timeout is None:
            close_timeout = T.scaled(T.SHUTDOWN_GRACE)
        if (isinstance(close_timeout, bool) or not isinstance(close_timeout, int | float)
                or math.isnan(close_timeout) or close_timeout <= 0):
            raise ConfigError(f"RankClient: expected close_timeout > 0 seconds, got "
                              f"{close_timeout!r}")
        self.rank = rank
        self.world_size = world_size
        self.config = config if config is not None else RankConfig()
        self.close_timeout = float(close_timeout)
        self._relay = relay
        self._salt = salt
        self._lock = threading.Lock()
        self._connected = threading.Event()  # set once connected, or once the thread ended
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._endpoint: RankEndpoint | None = None
        self._handoff: trio.MemoryReceiveChannel[ControlMsg] | None = None
        self._stop: trio.Event | None = None
        self._cancel: trio.CancelScope | None = None
        self._abandon = False
        self._error: BaseException | None = None
        self._error_raised = False
        self._closed = False

    # ------------------------------------------------------------------ public API

    @property
    def step_count(self) -> int:
        """The step count reported in every automatic ``Heartbeat``; the worker updates it."""
        return self._endpoint.step_count if self._endpoint is not None else 0

    @step_count.setter
    def step_count(self, value: int) -> None:
        # One attribute store, read by the heartbeat task: atomic under the GIL.
        if self._endpoint is not None:
            self._endpoint.step_count = value

    @property
    def dead_peers(self) -> frozenset[int]:
        """Ranks the coordinator declared dead (every other rank once it is lost)."""
        return self._endpoint.dead_peers if self._endpoint is not None else frozenset()

    @property
    def error(self) -> BaseException | None:
        """The endpoint's error, if it ended with one (also raised at the next call)."""
        with self._lock:
            return self._error

    def open(self) -> RankClient:
        """Start the endpoint thread and wait until the rank is connected to its relay.

        Returns:
            self.

        Raises:
            HandshakeError: no accepted handshake within ``connect_timeout``.
            FlodlError: the thread did not report within its deadline.
            ConfigError: the client was already opened.
        """
        with self._lock:
            if self._thread is not None:
                raise ConfigError(f"RankClient rank {self.rank}: open() called twice")
            self._thread = threading.Thread(target=self._thread_main,
                                            name=f"flodl-rank-{self.rank}", daemon=True)
        self._thread.start()
        # The endpoint's own deadlines end the attempt first; this only guards against a wedge.
        limit = self.config.connect_timeout + self.config.handshake_timeout + self.close_timeout
        if not self._connected.wait(None if math.isinf(limit) else limit):
            self._abort()
            raise FlodlError(f"RankClient rank {self.rank}: expected the endpoint to connect "
                             f"within {limit:g}s, it did not report")
        with self._lock:
            if self._endpoint is None:
                error = self._error
                self._error_raised = True
        if self._endpoint is None:
            self._thread.join(self.close_timeout)
            assert error is not None
            raise error
        return self

    def recv(self, timeout: float | None = None) -> ControlMsg | None:
        """The next control message (``CoordHeartbeat`` is absorbed by the endpoint).

        Args:
            timeout: seconds to wait; ``None`` waits until a message or an error arrives.

        Returns:
            the message, or ``None`` if ``timeout`` passed first.

        Raises:
            CoordinatorLost: the coordinator is gone (and any other error the endpoint ended
                with, e.g. a fencing error), at this and every later call.
            trio.EndOfChannel: the endpoint ended cleanly (``Shutdown`` was delivered earlier).
            trio.ClosedResourceError: the client was closed.
        """
        if timeout is not None and (math.isnan(timeout) or timeout < 0):
            raise ConfigError(f"RankClient.recv: expected timeout >= 0 or None, got {timeout!r}")
        token, handoff = self._ready_for("recv")
        try:
            return trio.from_thread.run(_receive, handoff, timeout, trio_token=token)
        except (trio.EndOfChannel, trio.ClosedResourceError, trio.RunFinishedError,
                trio.Cancelled):
            pass
        self._raise_error()
        if self._closed:
            raise trio.ClosedResourceError(f"RankClient rank {self.rank} is closed")
        raise trio.EndOfChannel(f"RankClient rank {self.rank}: the endpoint ended "
                                "(Shutdown was delivered)")

    def __iter__(self) -> Iterator[ControlMsg]:
        """Yield control messages until the endpoint ends cleanly; errors are raised."""
        while True:
            try:
                msg = self.recv()
            except trio.EndOfChannel:
                return
            if msg is not None:
                yield msg

    def send(self, msg: TimingMsg | Metrics) -> None:
        """Send a TimingMsg or Metrics to the coordinator (from any thread).

        Raises:
            ConfigError: ``msg`` is not a TimingMsg or Metrics.
            CoordinatorLost: the endpoint already ended with this error (or any other).
            SendError: the link is gone or the write stalled.
            trio.ClosedResourceError: the client was closed.
        """
        if not isinstance(msg, TimingMsg | Metrics):
            raise ConfigError(f"RankClient rank {self.rank}: send expects a TimingMsg or "
                              f"Metrics, got {control_label(msg)}")
        if isinstance(msg, Exiting):
            raise ConfigError(f"RankClient rank {self.rank}: Exiting is sent by close()")
        token, _ = self._ready_for("send")
        assert self._endpoint is not None
        try:
            trio.from_thread.run(self._endpoint.send, msg, trio_token=token)
        except (trio.RunFinishedError, trio.Cancelled):
            self._raise_error()
            raise trio.ClosedResourceError(f"RankClient rank {self.rank}: the endpoint ended "
                                           f"before {control_label(msg)} was sent") from None
        except FlodlError:
            self._raise_error()  # the reason the link went away beats "link closed"
            raise

    def close(self) -> None:
        """Say ``Exiting`` (best effort), stop the thread and join it within ``close_timeout``.

        Idempotent. Raises the endpoint's error if the caller has not seen it yet (so that an
        error that happened after the last call is never lost).

        Raises:
            FlodlError: the thread did not finish within ``close_timeout``; or the endpoint's
                unseen error.
        """
        self._finish(abandon=False)

    def __enter__(self) -> RankClient:
        return self.open()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None:
            self._finish(abandon=False)
        else:
            # Like open_rank: leaving with an exception does not say Exiting; the caller's
            # exception is the one that propagates.
            try:
                self._finish(abandon=True)
            except FlodlError:
                pass

    # ------------------------------------------------------------------ caller side

    def _ready_for(self, what: str) -> tuple[trio.lowlevel.TrioToken,
                                             trio.MemoryReceiveChannel[ControlMsg]]:
        if self._closed:
            raise trio.ClosedResourceError(f"RankClient rank {self.rank}: {what} after close()")
        token, handoff = self._token, self._handoff
        if token is None or handoff is None or self._endpoint is None:
            raise ConfigError(f"RankClient rank {self.rank}: {what} before open() (use it as a "
                              "context manager)")
        self._raise_error()
        return token, handoff

    def _raise_error(self) -> None:
        with self._lock:
            error = self._error
            if error is not None:
                self._error_raised = True
        if error is not None:
            raise error

    def _finish(self, *, abandon: bool) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._abandon = abandon
            thread, token, stop = self._thread, self._token, self._stop
        if thread is None:
            return
        if token is not None and stop is not None:
            try:
                trio.from_thread.run_sync(stop.set, trio_token=token)
            except trio.RunFinishedError:
                pass
        thread.join(self.close_timeout)
        if thread.is_alive():
            self._abort()
            raise FlodlError(f"RankClient rank {self.rank}: expected the endpoint thread to "
                             f"finish within close_timeout={self.close_timeout:g}s; it is still "
                             "running (cancelled)")
        with self._lock:
            unseen = None if self._error_raised else self._error
            self._error_raised = True
        if unseen is not None and not isinstance(unseen, _Abandon):
            raise unseen

    def _abort(self) -> None:
        """Cancel the endpoint's run outright (no goodbye); used when a deadline passed."""
        token, scope = self._token, self._cancel
        if token is not None and scope is not None:
            try:
                trio.from_thread.run_sync(scope.cancel, trio_token=token)
            except trio.RunFinishedError:
                pass

    # ------------------------------------------------------------------ the endpoint's thread

    def _record(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error

    def _thread_main(self) -> None:
        try:
            trio.run(self._run)
        except BaseException as exc:  # handed to the caller's thread
            self._record(exc)
        finally:
            self._connected.set()

    async def _run(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        with trio.CancelScope() as cancel:
            self._cancel = cancel
            try:
                async with open_rank(self._relay, salt=self._salt, rank=self.rank,
                                     world_size=self.world_size, config=self.config) as ep:
                    await self._serve(ep)
            except _Abandon:
                pass
            except (FlodlError, OSError) as exc:
                self._record(exc)

    async def _serve(self, ep: RankEndpoint) -> None:
        assert self._stop is not None
        send, receive = trio.open_memory_channel[ControlMsg](_HANDOFF_SIZE)
        async with trio.open_nursery() as nursery:
            self._handoff = receive
            self._endpoint = ep
            nursery.start_soon(self._pump, ep, send)
            self._connected.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()
        with self._lock:
            abandon = self._abandon or self._error is not None
        if abandon:
            raise _Abandon

    async def _pump(self, ep: RankEndpoint, send: trio.MemorySendChannel[ControlMsg]) -> None:
        """The endpoint's only reader: messages to the consumer, its error to ``_record``."""
        assert self._stop is not None
        async with send:
            try:
                async for msg in ep:
                    await send.send(msg)
            except FlodlError as exc:
                self._record(exc)
                self._stop.set()  # the endpoint is over; leave without a goodbye


async def _receive(handoff: trio.MemoryReceiveChannel[ControlMsg],
                   wait_s: float | None) -> ControlMsg | None:
    # A message already waiting is returned even for a zero timeout (receive() checks for
    # cancellation first, so move_on_after(0) alone would never deliver it).
    try:
        return handoff.receive_nowait()
    except trio.WouldBlock:
        pass
    with trio.move_on_after(math.inf if wait_s is None else wait_s):
        return await handoff.receive()
    return None
