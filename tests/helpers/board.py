"""The coordinator's roster and board without a network: relay connections as plain data, a
large world with some deaths, and a rank's epoch metrics."""

from __future__ import annotations

from typing import Any

import attrs

from flodl_trio import wire
from flodl_trio.coordinator._board import Board
from flodl_trio.coordinator._roster import Roster


@attrs.frozen(eq=False)
class FakeRelay:
    """What the roster and the board read of a relay connection."""

    host: str
    ranks: tuple[int, ...]
    peer: str = "10.0.0.1:4000"
    alive: bool = True
    model_sigs: dict[str, bytes] = attrs.Factory(dict)
    rank_set: frozenset[int] = attrs.field(
        init=False, default=attrs.Factory(lambda self: frozenset(self.ranks), takes_self=True))


def metrics(rank: int, epoch: int, samples: int, epoch_ms: float) -> wire.Metrics:
    """Rank ``rank``'s report of ``epoch`` (its loss is ``0.5 + rank``)."""
    return wire.Metrics(rank=rank, epoch=epoch, avg_loss=0.5 + rank, batches_processed=1,
                        epoch_ms=epoch_ms, samples_processed=samples, share_complete_ms=1.0,
                        compute_only_ms=1.0, data_starve_ms=0.0, scalars={})


def big_world(world: int = 16384, per_relay: int = 8) -> tuple[Roster[Any], Board]:
    """A running world of ``per_relay`` ranks a relay (``host-0`` ...), every rank at step 7,
    ranks 9, 10 and 1000-1299 dead, rank 20 exited."""
    roster: Roster[Any] = Roster(world)
    board = Board(world)
    for i in range(world // per_relay):
        host = f"host-{i}"
        relay = FakeRelay(host, tuple(range(i * per_relay, (i + 1) * per_relay)),
                          peer=f"127.0.0.1:{40000 + len(host)}")
        roster.register(relay, 0.0)
        roster.confirm(relay)
    roster.start_running(0.0)
    for r in range(world):
        board.on_message(wire.Heartbeat(rank=r, step_count=7))
    for r in (9, 10, *range(1000, 1300)):
        roster.mark_dead(r, f"rank {r} went silent")
    roster.mark_exited(20)
    return roster, board
