"""The status page's epochs agree with the command line: a rank dies mid-epoch, the epoch's
row on ``/board.json`` says its samples were covered exactly once (the scheduler's accounting,
which the CLI prints), names the ranks that reported as what they are, and its numbers are
rounded for reading; the page says so when nothing was pushed to its dashboard."""

from __future__ import annotations

import json
from typing import Any

import trio

from flodl_trio import Coordinator
from flodl_trio.coordinator._board import readable
from flodl_trio.events import Note
from flodl_trio.local_cluster import layout
from flodl_trio.scheduler import SyncScheduler
from flodl_trio.status import serve_status
from flodl_trio.testing import MemoryNetwork

from helpers.http import get, parse_response, read_to_eof
from helpers.sims import sim_cluster


async def board_json(net: MemoryNetwork, coord: Coordinator) -> dict[str, Any]:
    """``GET /board.json`` from the status responder the coordinator's TCP port runs (served
    here on an in-memory listener, so that the run stays in virtual time)."""
    async with trio.open_nursery() as nursery, net.listener("status") as listener:
        await nursery.start(lambda task_status: serve_status(
            listener, coord.state, request_timeout=5.0, board_fn=coord.board,
            task_status=task_status))
        stream = await net.connect("status")
        await stream.send_all(get("/board.json"))
        status, _, body = parse_response(await read_to_eof(stream))
        await stream.aclose()
        nursery.cancel_scope.cancel()
    assert status == 200
    document: dict[str, Any] = json.loads(body)
    return document


async def test_the_epoch_a_rank_died_in_is_covered_exactly_once_on_the_page_as_in_the_cli(
        autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork) -> None:
    def sims(rank: int) -> dict[str, Any]:
        kw: dict[str, Any] = {"batch_size": 4, "batch_ms": 10.0, "seed": rank}
        if rank == 1:
            kw["fail_after_batches"] = 3  # dies in epoch 1, before its Metrics
        return kw

    async with sim_cluster(memory_network, layout(1, 3), sims) as c:
        scheduler = SyncScheduler(c.coord, total_samples=60, batch_size=4, num_epochs=2)
        with trio.fail_after(600):
            await scheduler.run()
        document = await board_json(memory_network, c.coord)
    first, second = document["epochs"]
    cli = scheduler.coverage[0]  # what `flodl-trio coordinator` prints as "60/60 samples covered"
    assert (cli.total - cli.gaps, cli.total, cli.exactly_once) == (60, 60, True)
    assert {k: first[k] for k in ("epoch", "ranks", "samples_covered", "samples_total",
                                  "exactly_once", "gaps", "overlaps")} == {
        "epoch": 0, "ranks": 2, "samples_covered": 60, "samples_total": 60,
        "exactly_once": True, "gaps": 0, "overlaps": 0}
    assert "coverage" not in first  # the share of ranks that reported is "ranks", of world_size
    assert document["world_size"] == 3 and second["ranks"] == 2
    assert second["samples_covered"] == 60 and second["exactly_once"] is True
    for row in document["epochs"]:
        for key in ("epoch_ms", "samples_per_s"):
            assert row[key] == readable(row[key]), (key, row[key])
    assert document["throughput"] == second["samples_per_s"]
    # The scheduler itself records its accounting (the CLI used to, for the demo only).
    noted = [ev.fields["epoch"] for ev in c.coord.timeline.events(Note)
             if isinstance(ev, Note) and ev.what == "epoch_covered"]
    assert noted == [0, 1]
    assert document["dashboard"] == []


def test_readable_numbers_keep_three_figures_and_whole_numbers_from_100() -> None:
    assert [readable(x) for x in (790.096, 306.235, 99.95, 12.345, 0.5, 0.0)] == [
        790, 306, 100.0, 12.3, 0.5, 0.0]
