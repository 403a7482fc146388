"""The Sync scheduler's checkpoint: what it saves through ``Coordinator.save_checkpoint`` and how
a new scheduler reads it back (issue 22).

The map is CBOR-encodable (str keys; ints, bools, lists, maps) and small: the position of the run,
not its history. It says which epoch is current, each planned rank's share of it (plan and
extensions, in order), how many of its batches the rank synced, its step count when the epoch
began, and what a rank that left is credited for. Epochs before the current one are done and are
never re-run; the current one goes on from what was synced.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from .._errors import ConfigError, StoreCorrupt
from ._epoch_math import Range, processed_ranges
from ._parts import Share

FORMAT = "flodl-trio.sync-scheduler/1"


@attrs.frozen
class Resumption:
    """A checkpoint read back: where the run was.

    Attributes:
        epoch: the current epoch (``num_epochs`` once the last one closed).
        epochs_completed: epochs closed before it.
        global_step: the last ``SetGlobalStep`` value.
        syncs: ``SyncNow`` broadcasts so far.
        shares: rank -> its share of ``epoch`` (empty between two epochs: the epoch has not
            been dispatched yet).
        last_steps: rank -> the highest step count it reported.
        losses: the ``avg_loss`` of each epoch closed before (index: the epoch; None where no
            rank's ``Metrics`` arrived); empty in a checkpoint written before it was kept.
    """

    epoch: int
    epochs_completed: int
    global_step: int
    syncs: int
    shares: dict[int, Share]
    last_steps: dict[int, int]
    losses: tuple[float | None, ...] = ()


def checkpoint_map(*, total_samples: int, batch_size: int, num_epochs: int, epoch: int,
                   epochs_completed: int, global_step: int, syncs: int,
                   shares: Mapping[int, Share], last_steps: Mapping[int, int],
                   losses: Sequence[float | None] = ()) -> dict[str, Any]:
    """The checkpoint of a scheduler at this point (``shares``: the current epoch's, or none
    between two epochs; ``losses``: each closed epoch's ``avg_loss``, so that the scheduler
    that resumes reports the whole run's)."""
    entries = []
    synced_samples = 0
    for rank in sorted(shares):
        share = shares[rank]
        credited = share.earlier + (
            share.done if share.done is not None
            else processed_ranges(share.ranges, share.synced, batch_size))
        synced_samples += sum(size for _, size in credited)
        entry: dict[str, Any] = {
            "rank": rank, "ranges": [[o, s] for o, s in share.ranges],
            "synced": share.synced, "start_step": share.start_step,
            "extended": share.extended}
        if share.done is not None:
            entry["done"] = [[o, s] for o, s in share.done]
        if share.earlier:
            entry["earlier"] = [[o, s] for o, s in share.earlier]
        entries.append(entry)
    return {
        "format": FORMAT, "total_samples": total_samples, "batch_size": batch_size,
        "num_epochs": num_epochs, "epoch": epoch, "epochs_completed": epochs_completed,
        "global_step": global_step, "syncs": syncs,
        "samples_done": epochs_completed * total_samples + synced_samples,
        "shares": entries,
        "last_steps": [[rank, step] for rank, step in sorted(last_steps.items())],
        "losses": list(losses),
    }


def read_checkpoint(data: Mapping[str, Any], *, total_samples: int, batch_size: int,
                    num_epochs: int) -> Resumption:
    """Read a checkpoint back for a scheduler with these settings.

    Raises:
        StoreCorrupt: it is not a Sync scheduler checkpoint, or a field is missing or malformed.
        ConfigError: it belongs to a run with other settings (data set size, batch size, epochs).
    """
    def bad(what: str) -> StoreCorrupt:
        return StoreCorrupt(f"SyncScheduler: the coordinator's checkpoint cannot be resumed "
                            f"from: expected {what}")

    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, Mapping) else type(data).__name__
        raise bad(f"format {FORMAT!r}, got {got!r}")
    ints = {}
    for key in ("total_samples", "batch_size", "num_epochs", "epoch", "epochs_completed",
                "global_step", "syncs"):
        ints[key] = _count(data.get(key), key, bad)
    mine = {"total_samples": total_samples, "batch_size": batch_size, "num_epochs": num_epochs}
    differ = {k: (ints[k], v) for k, v in mine.items() if ints[k] != v}
    if differ:
        said = ", ".join(f"{k}={theirs} (this scheduler: {ours})"
                         for k, (theirs, ours) in differ.items())
        raise ConfigError(f"SyncScheduler: the coordinator's checkpoint is of a run with {said}; "
                          f"a scheduler resumes only a run with the same settings")
    if not ints["epochs_completed"] <= ints["epoch"] <= num_epochs:
        raise bad(f"epochs_completed <= epoch <= {num_epochs}, got "
                  f"{ints['epochs_completed']} and {ints['epoch']}")
    raw = data.get("shares")
    if not isinstance(raw, list):
        raise bad(f"a list of shares, got {type(raw).__name__}")
    shares: dict[int, Share] = {}
    for entry in raw:
        rank, share = _share(entry, bad)
        if rank in shares:
            raise bad(f"one share per rank with ranges and an 'extended' flag (rank {rank})")
        shares[rank] = share
    steps = data.get("last_steps")
    if not isinstance(steps, list):
        raise bad(f"a list of [rank, step] as last_steps, got {steps!r}")
    last_steps = dict(_ranges(steps, "last_steps", bad))
    losses = data.get("losses", [])  # absent from a checkpoint of an earlier version
    if not isinstance(losses, list) or not all(
            loss is None or (isinstance(loss, int | float) and not isinstance(loss, bool))
            for loss in losses):
        raise bad(f"a list of numbers (or null) as losses, got {losses!r:.80}")
    return Resumption(epoch=ints["epoch"], epochs_completed=ints["epochs_completed"],
                      global_step=ints["global_step"], syncs=ints["syncs"], shares=shares,
                      last_steps=last_steps,
                      losses=tuple(None if x is None else float(x) for x in losses))


def _share(entry: object, bad: Any) -> tuple[int, Share]:
    """One share of a checkpoint: its rank and the share."""
    if not isinstance(entry, Mapping):
        raise bad(f"a map per share, got {type(entry).__name__}")
    rank = _count(entry.get("rank"), "share rank", bad)
    ranges = _ranges(entry.get("ranges"), f"ranges of rank {rank}", bad)
    done = (None if entry.get("done") is None
            else _ranges(entry.get("done"), f"done of rank {rank}", bad))
    earlier = ([] if entry.get("earlier") is None
               else _ranges(entry.get("earlier"), f"earlier of rank {rank}", bad))
    extended = entry.get("extended")
    if not isinstance(extended, bool) or not ranges:
        raise bad(f"one share per rank with ranges and an 'extended' flag (rank {rank})")
    return rank, Share(ranges, synced=_count(entry.get("synced"), "synced", bad),
                       start_step=_count(entry.get("start_step"), "start_step", bad),
                       anchored=done is not None, extended=extended, done=done,
                       earlier=earlier)


def _count(value: object, what: str, bad: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad(f"{what} to be an integer >= 0, got {value!r}")
    return value


def _ranges(value: object, what: str, bad: Any) -> list[Range]:
    """A list of integer pairs ([offset, size], or [rank, step])."""
    if not isinstance(value, list):
        raise bad(f"{what} to be a list of pairs, got {value!r}")
    out: list[Range] = []
    for item in value:
        if not isinstance(item, list | tuple) or len(item) != 2:
            raise bad(f"{what} to be a list of pairs, got {item!r}")
        out.append((_count(item[0], what, bad), _count(item[1], what, bad)))
    return out
