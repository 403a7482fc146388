"""The Sync scheduler's lock-step rounds (the *Sync* rule of :mod:`flodl_trio.scheduler`): which
live ranks still owe a ``Batch`` or a ``SyncAck`` since the last ``SyncNow``, how many batches
each took, the global step and the count of syncs. It counts; the scheduler sends.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ._parts import Share


class Lockstep:
    """The sync rounds of one run (its counts go on from a checkpoint's after a resume).

    Args:
        global_step: the last ``SetGlobalStep`` value so far.
        syncs: ``SyncNow`` broadcasts so far.
    """

    def __init__(self, *, global_step: int = 0, syncs: int = 0) -> None:
        self._global_step = global_step
        self._syncs = syncs
        self._awaiting_batch: set[int] = set()
        self._awaiting_ack: set[int] = set()
        self._steps: dict[int, int] = {}  # batches since the last sync, per rank
        self._credit: dict[int, int] = {}  # anchoring: rank -> batches the checkpoint credits

    @property
    def global_step(self) -> int:
        return self._global_step

    @property
    def syncs(self) -> int:
        return self._syncs

    @property
    def all_stepped(self) -> bool:
        """Every rank expected to has reported a ``Batch`` since the last sync."""
        return not self._awaiting_batch

    @property
    def all_acked(self) -> bool:
        """Every rank the last ``SyncNow`` went to acknowledged it (or left)."""
        return not self._awaiting_ack

    def stepped(self, ranks: Iterable[int]) -> list[int]:
        """Those of ``ranks`` that took a batch since the last sync, in their order."""
        return [r for r in ranks if self._steps.get(r, 0) > 0]

    def start(self, ranks: Iterable[int]) -> None:
        """The first epoch: each of ``ranks`` owes a ``Batch`` before the first sync."""
        self._awaiting_batch = set(ranks)
        self._steps = dict.fromkeys(self._awaiting_batch, 0)

    def join(self, rank: int) -> None:
        """``rank`` takes part from now on (it came back): it owes a ``Batch`` too."""
        self._awaiting_batch.add(rank)
        self._steps[rank] = 0

    def forget(self, rank: int) -> None:
        """``rank`` left: it owes nothing, and no anchoring credit is kept for it."""
        self._awaiting_batch.discard(rank)
        self._awaiting_ack.discard(rank)
        self._credit.pop(rank, None)

    def on_batch(self, rank: int) -> None:
        self._steps[rank] = self._steps.get(rank, 0) + 1
        self._awaiting_batch.discard(rank)

    def on_ack(self, rank: int) -> None:
        self._awaiting_ack.discard(rank)

    def open_sync(self, participants: Sequence[int]) -> int:
        """A ``SyncNow`` goes out: the global step moves on by the fewest batches one of
        ``participants`` took (the steps every replica took); the new global step."""
        self._syncs += 1
        self._global_step += min(self._steps.get(r, 0) for r in participants)
        return self._global_step

    def expect_acks(self, live: Iterable[int]) -> None:
        """After a ``SyncNow``: each of ``live`` owes its ``SyncAck`` and its next ``Batch``."""
        self._awaiting_ack = set(live)
        self._awaiting_batch = set(self._awaiting_ack)
        self._steps = dict.fromkeys(self._awaiting_ack, 0)

    def open_anchor(self, credit: Mapping[int, int]) -> None:
        """The anchoring ``SyncNow`` goes out (a resume) to the ranks of ``credit`` (rank ->
        batches the checkpoint credits it with); it counts as a sync, the global step waits."""
        self._credit = dict(credit)
        self._syncs += 1
        self._awaiting_ack = set(self._credit)

    def close_anchor(self, shares: Mapping[int, Share], survivors: Sequence[int]) -> int:
        """Every anchoring ``SyncAck`` is in: the global step moves on by the fewest batches a
        surviving rank did since the checkpoint; the new global step."""
        credit, self._credit = self._credit, {}
        self._global_step += min((shares[r].batches - credit[r] for r in survivors
                                  if r in credit), default=0)
        return self._global_step

    def restart(self, survivors: Iterable[int]) -> None:
        """After the anchor: each survivor owes a ``Batch`` before the next sync."""
        self._steps = dict.fromkeys(survivors, 0)
        self._awaiting_batch = set(self._steps)
