"""The Sync scheduler seen from the ranks: what a rank reports (a batch, an epoch's metrics), and
a whole run of ranks that answer every ``StartEpoch`` with the metrics of their whole plan."""

from __future__ import annotations

from typing import Any

import trio

import flodl_trio as ft
from flodl_trio.local_cluster import layout, open_local_cluster
from flodl_trio.scheduler import RunSummary, SyncScheduler
from flodl_trio.testing import MemoryNetwork
from flodl_trio.wire import Batch, ControlMsg, Metrics, StartEpoch


def batch(rank: int, step: int = 1) -> Batch:
    """Rank ``rank``'s report of one batch (its step count ``step``)."""
    return Batch(rank=rank, batch_ms=1.0, data_ms=0.0, step_count=step, param_norm=None,
                 batch_loss=1.0)


def metrics_for(rank: int, plan_epoch_: int, samples: int, *, avg_loss: float = 1.0,
                scalars: dict[str, tuple[float, int]] | None = None,
                epoch_ms: float = 100.0) -> Metrics:
    """Rank ``rank``'s report of plan epoch ``plan_epoch_``: ``samples`` processed."""
    return Metrics(rank=rank, epoch=plan_epoch_, avg_loss=avg_loss, batches_processed=1,
                   epoch_ms=epoch_ms, samples_processed=samples, share_complete_ms=epoch_ms,
                   compute_only_ms=epoch_ms / 2, data_starve_ms=1.0,
                   scalars=scalars if scalars is not None else {"loss": (avg_loss, 1)})


async def answer_with_metrics(ep: ft.RankEndpoint, seen: list[ControlMsg],
                              loss: float = 1.0) -> None:
    """A minimal rank: every StartEpoch is answered with a Metrics for the whole plan."""
    async for msg in ep:
        seen.append(msg)
        if isinstance(msg, StartEpoch):
            await ep.send(metrics_for(ep.rank, msg.plan.epoch, msg.plan.partition_size,
                                      avg_loss=loss, scalars={"loss": (loss * 2, 2)}))


async def run_answering(net: MemoryNetwork, losses: dict[int, float],
                        **kw: Any) -> tuple[RunSummary, dict[int, list[ControlMsg]]]:
    """A whole run over one rank per host, each answering every StartEpoch with a ``Metrics``
    for its whole plan at its loss; the summary and what each rank received."""
    seen: dict[int, list[ControlMsg]] = {rank: [] for rank in losses}
    async with open_local_cluster(layout(len(losses), 1), network=net) as c:
        async with trio.open_nursery() as nursery:
            for rank, ep in sorted(c.ranks.items()):
                nursery.start_soon(answer_with_metrics, ep, seen[rank], losses[rank])
            summary = await SyncScheduler(c.coord, **kw).run()
    return summary, seen
