"""Simulated ranks (SPEC §11): they answer the control vocabulary like a flodl worker, no GPU.

A :class:`SimulatedRank` drives one :class:`~flodl_trio.RankEndpoint`. One task reads commands,
another processes batches, so ``SyncNow``, ``Checkpoint`` and the rest are answered while a batch
is in flight. Work is a queue of ranges: the ``StartEpoch`` plan, then each ``ExtendPartition`` in
arrival order; each range is processed in batches of ``batch_size`` (the last one of a range may be
short, two ranges never share a batch), which is what the scheduler assumes when it computes a
dead rank's remainder. A ``StartEpoch`` identical to the plan in progress and an
``ExtendPartition`` already received in the epoch are ignored (a scheduler that resumed a run
repeats them), and a ``SyncAck`` counts exactly the ``Batch`` frames sent before it (its step
count is the number of batches done), which is how a resumed scheduler learns where the rank is.
Each batch sleeps ``batch_ms * (1 +- jitter)`` on the Trio clock (so
``MockClock`` runs it in no real time), then sends a ``Batch`` and bumps ``endpoint.step_count``.
Whenever the queue runs dry the rank sends a cumulative ``Metrics`` for the epoch (again after each
extension it finishes).
"""

from __future__ import annotations

import logging
import math
import random
from collections import deque
from typing import Literal, TypeVar

import attrs
import trio

from . import wire
from ._errors import ConfigError, CoordinatorLost, SendError
from .rank import RankEndpoint

__all__ = ["SimRecord", "SimulatedCrash", "SimulatedRank"]

log = logging.getLogger("flodl_trio.sim")

_M = TypeVar("_M", bound=wire.ControlMsg)


class SimulatedCrash(Exception):
    """Raised out of :meth:`SimulatedRank.run` by ``fail_mode="crash"`` after the n-th batch."""


@attrs.define
class SimRecord:
    """What one simulated rank did (its :attr:`SimulatedRank.record`, live during the run).

    Attributes:
        rank: the rank.
        processed: one ``(epoch, offset, size)`` per batch it reported, in order.
        synced: the batches of ``processed`` that a ``SyncAck`` it sent covered, in order: those
            whose updates survive it if it dies.
        batches: batches reported (all epochs).
        syncs: ``SyncNow`` messages answered.
        received: every control message delivered to it, in order.
        failed: the rank stopped because of ``fail_after_batches``.
    """

    rank: int
    processed: list[tuple[int, int, int]] = attrs.Factory(list)
    synced: list[tuple[int, int, int]] = attrs.Factory(list)
    batches: int = 0
    syncs: int = 0
    received: list[wire.ControlMsg] = attrs.Factory(list)
    failed: bool = False

    def samples(self, epoch: int) -> list[int]:
        """Every sample index it processed in ``epoch``, in order (duplicates kept)."""
        return [i for e, off, size in self.processed if e == epoch for i in range(off, off + size)]

    def synced_samples(self, epoch: int) -> list[int]:
        """Every sample index of ``epoch`` a ``SyncAck`` covered, in order (duplicates kept)."""
        return [i for e, off, size in self.synced if e == epoch for i in range(off, off + size)]

    def of_type(self, cls: type[_M]) -> list[_M]:
        """The received messages of one class, in order."""
        return [m for m in self.received if isinstance(m, cls)]

    def note_batch(self, epoch: int, offset: int, size: int) -> None:
        """One more batch reported: ``size`` samples of ``epoch`` from ``offset``."""
        self.processed.append((epoch, offset, size))
        self.batches += 1

    def note_sync(self) -> None:
        """One more ``SyncNow`` answered: its ``SyncAck`` covers every batch reported so far."""
        self.syncs += 1
        self.synced.extend(self.processed[len(self.synced):])

    def note_failure(self) -> None:
        """The rank stopped because of ``fail_after_batches`` (or another ``fail_*``)."""
        self.failed = True


class SimulatedRank:
    """A flodl-like worker over one rank endpoint.

    Args:
        endpoint: the rank's open :class:`~flodl_trio.RankEndpoint`.
        batch_size: samples per batch (> 0); required, the plan says only how many samples.
        batch_ms: simulated compute time per batch, in ms (>= 0). Give ranks different values
            for a heterogeneous cohort.
        jitter: each batch takes ``batch_ms * uniform(1 - jitter, 1 + jitter)`` (0 <= jitter < 1).
        fail_after_batches: fail right after sending this many batches (0: before the first).
        fail_mode: what failing means. ``"crash"``: :meth:`run` raises :class:`SimulatedCrash`;
            let it leave the ``open_rank`` block, which closes the link without ``Exiting`` (the
            relay reports ``RankExit``, the coordinator declares the rank dead at once).
            ``"hang"``: the rank stops sending and stops answering, and :meth:`run` waits until
            it is cancelled; the endpoint's own heartbeats go on, so for a rank that the
            coordinator must find silent, open its endpoint with a ``heartbeat_interval`` longer
            than the coordinator's ``heartbeat_timeout``.
        fail_checkpoint: answer every ``Checkpoint`` addressed to it with an error.
        fail_on_new_nccl_id: fail (as ``fail_mode`` says) at the n-th ``RequestNewNcclId`` it
            receives (1: the first), instead of answering ``NewNcclIdGenerated``.
        fail_after_syncs: fail (as ``fail_mode`` says) right after sending its n-th ``SyncAck``.
        seed: seed of the jitter's random generator.

    Raises:
        ConfigError: an invalid argument.
    """

    def __init__(self, endpoint: RankEndpoint, *, batch_size: int, batch_ms: float,
                 jitter: float = 0.0, fail_after_batches: int | None = None,
                 fail_mode: Literal["crash", "hang"] = "crash", fail_checkpoint: bool = False,
                 fail_on_new_nccl_id: int | None = None, fail_after_syncs: int | None = None,
                 seed: int | None = None) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"SimulatedRank: expected batch_size >= 1, got {batch_size!r}")
        if not isinstance(batch_ms, int | float) or not math.isfinite(batch_ms) or batch_ms < 0:
            raise ConfigError(f"SimulatedRank: expected batch_ms >= 0, got {batch_ms!r}")
        if not isinstance(jitter, int | float) or not 0 <= jitter < 1:
            raise ConfigError(f"SimulatedRank: expected 0 <= jitter < 1, got {jitter!r}")
        if fail_after_batches is not None and (
                isinstance(fail_after_batches, bool) or not isinstance(fail_after_batches, int)
                or fail_after_batches < 0):
            raise ConfigError(f"SimulatedRank: expected fail_after_batches >= 0 or None, got "
                              f"{fail_after_batches!r}")
        for name, value in (("fail_on_new_nccl_id", fail_on_new_nccl_id),
                            ("fail_after_syncs", fail_after_syncs)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ConfigError(f"SimulatedRank: expected {name} >= 1 or None, got {value!r}")
        if fail_mode not in ("crash", "hang"):
            raise ConfigError(f"SimulatedRank: expected fail_mode 'crash' or 'hang', got "
                              f"{fail_mode!r}")
        self.endpoint = endpoint
        self.rank = endpoint.rank
        self.record = SimRecord(rank=endpoint.rank)
        self.role: int | None = None
        self.group: tuple[int, int, bytes] | None = None  # (new_rank, new_world_size, uid)
        self._batch_size = batch_size
        self._batch_ms = float(batch_ms)
        self._jitter = float(jitter)
        self._fail_after = fail_after_batches
        self._fail_mode = fail_mode
        self._fail_checkpoint = fail_checkpoint
        self._fail_on_new_nccl_id = fail_on_new_nccl_id
        self._fail_after_syncs = fail_after_syncs
        self._send_lock = trio.Lock()  # a SyncAck counts exactly the Batch frames before it
        self._plan: tuple[int, int, int] | None = None  # (epoch, offset, size) in progress
        self._extensions: set[tuple[int, int]] = set()  # received in the current epoch
        self._random = random.Random(seed)
        self._queue: deque[tuple[int, int]] = deque()
        self._epoch: int | None = None
        self._generation = 0  # bumped by StartEpoch: a batch in flight from before is void
        self._epoch_started = 0.0
        self._epoch_batches = 0
        self._epoch_samples = 0
        self._loss_sum = 0.0
        self._compute_ms = 0.0
        self._global_step = 0
        self._steps_since_global = 0
        self._throttled = False
        self._wake = trio.Event()
        self._failure: BaseException | None = None
        self._reader_scope = trio.CancelScope()
        self._leaving = False  # its host drains: it stops at its next SyncAck (issue 37)

    async def run(self) -> SimRecord:
        """Serve commands until ``Shutdown`` / ``ShutdownWithSave``, or until its host drains
        (``Drain``): then it answers its next ``SyncNow`` and returns (at once with nothing
        unsynced), so that leaving the endpoint's block sends ``Exiting``.

        Returns:
            the :class:`SimRecord`.

        Raises:
            SimulatedCrash: ``fail_mode="crash"`` reached ``fail_after_batches``.
            CoordinatorLost, SendError: the coordinator or the link went away.
        """
        if self._fail_after == 0:
            await self._fail()
        async with trio.open_nursery() as nursery:
            if self._failure is None and not self.record.failed:
                nursery.start_soon(self._work, nursery.cancel_scope)
                with self._reader_scope:
                    try:
                        await self._read_commands()
                    except (CoordinatorLost, SendError) as exc:
                        self._failure = exc
            nursery.cancel_scope.cancel()
        if self._failure is not None:
            raise self._failure
        if self.record.failed:  # hang: silent until someone cancels us
            await trio.sleep_forever()
        return self.record

    async def _fail(self) -> None:
        self.record.note_failure()
        log.info("rank %d: simulated %s after %d batches", self.rank, self._fail_mode,
                 self.record.batches)
        if self._fail_mode == "crash":
            self._failure = SimulatedCrash(f"rank {self.rank}: simulated crash after "
                                           f"{self.record.batches} batches")
        self._reader_scope.cancel()
        await trio.lowlevel.checkpoint()

    # ------------------------------------------------------------------ commands

    async def _read_commands(self) -> None:
        async for msg in self.endpoint:
            self.record.received.append(msg)
            if isinstance(msg, wire.Shutdown | wire.ShutdownWithSave):
                return
            if isinstance(msg, wire.CoordinatorReconnecting | wire.CoordinatorResumed):
                continue  # the relay's news about the coordinator: nothing to simulate
            if isinstance(msg, wire.Readmitted):
                await self._readmitted()
                continue
            if isinstance(msg, wire.Drain):
                # Its host leaves: it finishes its current sync (nothing is lost that a SyncAck
                # covered), or leaves at once when no batch of it is unsynced.
                async with self._send_lock:
                    self._leaving = True
                    if len(self.record.synced) == len(self.record.processed):
                        return
                continue
            if not isinstance(msg, wire.Throttle) and self._throttled:
                self._throttled = False
                self._wake.set()
            await self._on_command(msg)

    async def _on_command(self, msg: wire.ControlMsg) -> None:
        if isinstance(msg, wire.StartEpoch):
            self._start_epoch(msg)
        elif isinstance(msg, wire.ExtendPartition):
            self._extend(msg)
        elif isinstance(msg, wire.SyncNow):
            await self._answer_sync()
        elif isinstance(msg, wire.SetGlobalStep):
            self._global_step = int(msg.global_step)
            self._steps_since_global = 0
        elif isinstance(msg, wire.Throttle):
            self._throttled = True
        elif isinstance(msg, wire.SetEpochCallbackRole):
            self.role = int(msg.rank)
        elif isinstance(msg, wire.RequestNewNcclId):
            await self._answer_new_nccl_id()
        elif isinstance(msg, wire.NewNcclSession):
            self.group = (int(msg.new_rank), int(msg.new_world_size), bytes(msg.uid))
        elif isinstance(msg, wire.Checkpoint) and msg.target_rank == self.rank:
            error = "simulated checkpoint failure" if self._fail_checkpoint else None
            await self.endpoint.send(wire.CheckpointResult(
                rank=self.rank, version=msg.version, elapsed_ms=0.0, error=error))
        elif isinstance(msg, wire.ExecuteEvalCallback) and msg.target_rank == self.rank:
            await self.endpoint.send(wire.EvalResult(
                rank=self.rank, schedule_id=msg.schedule_id, epoch=msg.epoch,
                metric=self._loss(), elapsed_ms=0.0))

    def _start_epoch(self, msg: wire.StartEpoch) -> None:
        """The epoch's plan replaces the work queued (a repeat of the plan in progress is
        ignored: a resumed scheduler sends it again)."""
        plan = msg.plan
        key = (int(plan.epoch), int(plan.partition_offset), int(plan.partition_size))
        if key == self._plan:
            log.debug("rank %d: StartEpoch repeats the plan in progress; ignored", self.rank)
            return
        self._plan, self._extensions = key, set()
        if self._queue:
            log.warning("rank %d: StartEpoch(%d) while %d ranges of epoch %s are unprocessed",
                        self.rank, plan.epoch, len(self._queue), self._epoch)
        self._generation += 1
        self._epoch = int(plan.epoch)
        self._epoch_started = trio.current_time()
        self._epoch_batches = self._epoch_samples = 0
        self._loss_sum = self._compute_ms = 0.0
        self._queue = deque([(int(plan.partition_offset), int(plan.partition_size))])
        self._wake.set()

    async def _readmitted(self) -> None:
        """Its relay brought it back after it was fenced (issue 37): it restarts as a new
        process would. The work it did since its last acknowledged sync was settled without
        it (the coordinator ignored it, or never got it), so it is dropped; its step count
        starts again at 0 (the endpoint's); the next plan gives it work."""
        async with self._send_lock:
            self._generation += 1  # a batch in flight is void
            self._queue.clear()
            self._plan, self._epoch, self._extensions = None, None, set()
            self._throttled = False
            del self.record.processed[len(self.record.synced):]
            self._steps_since_global = 0

    def _extend(self, msg: wire.ExtendPartition) -> None:
        """Queue an extension of the epoch's share (once: a repeat is ignored)."""
        if self._epoch is None:
            log.warning("rank %d: ExtendPartition before any StartEpoch; ignored", self.rank)
            return
        extension = (int(msg.partition_offset), int(msg.partition_size))
        if extension in self._extensions:
            log.debug("rank %d: ExtendPartition %s repeated; ignored", self.rank, extension)
            return
        self._extensions.add(extension)
        self._queue.append(extension)
        self._wake.set()

    async def _answer_sync(self) -> None:
        ep = self.endpoint
        async with self._send_lock:
            self.record.note_sync()
            await ep.send(wire.SyncAck(rank=self.rank, step_count=ep.step_count))
        if self._leaving:  # drained: its last sync is done, it leaves cleanly
            self._reader_scope.cancel()
            return
        if self.record.syncs == self._fail_after_syncs:
            await self._fail()

    async def _answer_new_nccl_id(self) -> None:
        asked = len(self.record.of_type(wire.RequestNewNcclId))
        if asked == self._fail_on_new_nccl_id:
            await self._fail()
            return
        # Where a real rank would name the store it now serves; unique per request.
        uid = f"sim://rank-{self.rank}/{asked}"
        await self.endpoint.send(wire.NewNcclIdGenerated(rank=self.rank, uid=uid.encode()))

    # ------------------------------------------------------------------ batches

    def _loss(self) -> float:
        """A loss that falls as training advances (global step plus local steps since)."""
        return 2.0 / (1.0 + 0.05 * (self._global_step + self._steps_since_global))

    def _batch_seconds(self) -> float:
        factor = 1.0 + self._random.uniform(-self._jitter, self._jitter) if self._jitter else 1.0
        return self._batch_ms * factor / 1000.0

    async def _work(self, stop: trio.CancelScope) -> None:
        try:
            await self._batches()
        except SendError as exc:
            self._failure = exc
            stop.cancel()

    async def _batches(self) -> None:
        ep = self.endpoint
        while True:
            if not self._queue or self._throttled:
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            generation = self._generation
            offset, size = self._queue[0]
            if size == 0:  # an empty share: nothing to batch, the epoch is done at once
                self._queue.popleft()
                await self._maybe_report()
                continue
            n = min(self._batch_size, size)
            seconds = self._batch_seconds()
            await trio.sleep(seconds)
            async with self._send_lock:
                if self._leaving:
                    return  # drained: no batch after its last SyncAck
                if generation != self._generation or self._epoch is None:
                    continue  # StartEpoch replaced the work while this batch was in flight
                if n == size:
                    self._queue.popleft()
                else:
                    self._queue[0] = (offset + n, size - n)
                loss = self._loss()
                self._steps_since_global += 1
                self._epoch_batches += 1
                self._epoch_samples += n
                self._loss_sum += loss
                self._compute_ms += seconds * 1000.0
                self.record.note_batch(self._epoch, offset, n)
                ep.step_count += 1
                await ep.send(wire.Batch(rank=self.rank, batch_ms=seconds * 1000.0,
                                         data_ms=0.0, step_count=ep.step_count,
                                         param_norm=None, batch_loss=loss))
            if self._fail_after is not None and self.record.batches >= self._fail_after:
                await self._fail()
                return
            await self._maybe_report()

    async def _maybe_report(self) -> None:
        if self._queue or self._epoch is None:
            return
        epoch_ms = (trio.current_time() - self._epoch_started) * 1000.0
        await self.endpoint.send(wire.Metrics(
            rank=self.rank, epoch=self._epoch,
            avg_loss=self._loss_sum / self._epoch_batches if self._epoch_batches else 0.0,
            batches_processed=self._epoch_batches, epoch_ms=epoch_ms,
            samples_processed=self._epoch_samples, share_complete_ms=epoch_ms,
            compute_only_ms=self._compute_ms, data_starve_ms=0.0,
            scalars={"loss": (self._loss_sum, self._epoch_batches)},
        ))
