"""What the coordinator keeps for the status page: each rank's latest dashboard pushes (bounded,
SVGs sanitised, text clipped), step counts, epoch summaries; and the page's document, one row per
relay once the world is large."""

from __future__ import annotations

import json

import trio

from flodl_trio import RankEndpoint, wire
from flodl_trio.coordinator._board import MAX_HARDWARE_CHARS, MAX_PUSHING_RANKS, Board
from flodl_trio.coordinator._boardview import RELAY_COLUMNS, board_document, page_phase
from flodl_trio.testing import MemoryNetwork, open_local_cluster, wait_until

from helpers.board import big_world, metrics

SVG_NS = 'xmlns="http://www.w3.org/2000/svg"'


async def push_everything(ep: RankEndpoint) -> None:
    r = ep.rank
    await ep.send(wire.DashboardRegister(rank=r, port=8000 + r))
    await ep.send(wire.DashboardSetSvg(rank=r, svg=f"<svg {SVG_NS}><circle r='1'/></svg>",
                                       label="old"))
    latest = (f"<svg {SVG_NS} onload='alert(1)'><script>alert(2)</script>"
              f"<rect width='{r + 1}'/></svg>" if r != 3 else "<svg><unclosed>")
    await ep.send(wire.DashboardSetSvg(rank=r, svg=latest, label=f"loss of rank {r}"))
    await ep.send(wire.DashboardSetMetadata(rank=r, json='{"lr": 0.1, "note": "<b>bold</b>"}'))
    await ep.send(wire.DashboardSetHardware(rank=r, summary="GPU " * 500))
    await ep.send(wire.Heartbeat(rank=r, step_count=10 + r))
    await ep.send(metrics(r, 0, samples=100, epoch_ms=250.0 * (1 + r % 2)))
    await ep.send(metrics(r, 0, samples=100, epoch_ms=1.0))  # a second report is not counted
    async for _ in ep:  # until the coordinator's Shutdown
        pass


async def test_the_coordinator_keeps_each_ranks_latest_pushes_steps_and_epochs_for_the_page(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork,
) -> None:
    async with open_local_cluster({"host-a": [0, 1], "host-b": [2, 3]}, network=memory_network,
                                  rank_main=push_everything) as c:
        coord = c.coord
        await wait_until(lambda: len(coord.board()["epochs"]) == 1 and
                         coord.board()["epochs"][0]["ranks"] == 4, limit=10)
        pushes = {p.rank: p for p in coord.dashboard}
        assert sorted(pushes) == [0, 1, 2, 3]
        for r in (0, 1, 2):
            # The latest SVG, without its script or onload.
            assert pushes[r].svg == (f'<svg xmlns="http://www.w3.org/2000/svg">'
                                     f'<rect width="{r + 1}"></rect></svg>')
            assert pushes[r].svg_label == f"loss of rank {r}" and pushes[r].port == 8000 + r
            assert pushes[r].metadata == '{"lr": 0.1, "note": "<b>bold</b>"}'  # text, as sent
            assert pushes[r].hardware is not None
            assert pushes[r].hardware.startswith("GPU GPU ") and "more chars" in pushes[r].hardware
            assert len(pushes[r].hardware) < MAX_HARDWARE_CHARS + 30
        assert pushes[3].svg is None and pushes[3].svg_error is not None
        assert pushes[3].svg_error.startswith("rank 3: SVG is not well-formed XML")
        document = coord.board()
        assert document["phase"] == "running" and document["formed"] is True
        relays = sorted(document["relays"], key=lambda relay: relay["host"])  # join order
        assert [(relay["host"], [row[:3] for row in relay["ranks"]]) for relay in relays] == [
            ("host-a", [[0, "alive", 10], [1, "alive", 11]]),
            ("host-b", [[2, "alive", 12], [3, "alive", 13]])]
        (epoch,) = document["epochs"]
        assert epoch == {"epoch": 0, "ranks": 4, "samples": 400, "avg_loss": 2.0,
                         "epoch_ms": 500, "samples_per_s": 800, "samples_covered": None,
                         "samples_total": None, "exactly_once": None, "gaps": None,
                         "overlaps": None}  # no scheduler: no accounting of the samples
        assert document["throughput"] == 800.0
        json.dumps(document)  # JSON as it is


def test_pushes_are_kept_for_the_ranks_that_pushed_last_and_the_rest_counted() -> None:
    board = Board(world_size=1000)
    for r in range(MAX_PUSHING_RANKS + 44):
        board.on_message(wire.DashboardSetMetadata(rank=r, json="{}"))
    assert [p.rank for p in board.pushes()] == list(range(44, MAX_PUSHING_RANKS + 44))
    board.on_message(wire.DashboardSetHardware(rank=0, summary="cpu"))  # back: 44 forgotten
    kept = [p.rank for p in board.pushes()]
    assert kept[0] == 0 and 44 not in kept and len(kept) == MAX_PUSHING_RANKS
    assert board.forgotten_pushers == 45
    board.on_message(wire.DashboardSetSvg(rank=45, svg="x" * 70_000))
    (push,) = [p for p in board.pushes() if p.rank == 45]
    assert push.svg is None and push.svg_error == (
        "rank 45: SVG of 70000 chars: expected at most 65536 bytes")


def test_a_16384_rank_world_is_one_row_of_counts_per_relay_and_the_last_deaths() -> None:
    roster, board = big_world()
    document = board_document(roster, board, now=2.5, failed=False, extras={})
    assert document["detail"] == "relays" and len(document["relays"]) == 2048
    rows = [dict(zip(RELAY_COLUMNS, row, strict=True)) for row in document["relays"]]
    assert rows[1] == {"host": "host-1", "peer": "127.0.0.1:40006", "connected": True, "n": 8,
                       "alive": 6, "dead": 2, "exited": 0, "waiting": 0, "steps_min": 7,
                       "steps_max": 7, "age_max": 2.5, "retired": 0, "draining": 0}
    assert (rows[2]["alive"], rows[2]["exited"]) == (7, 1)
    assert document["counts"] == {"alive": 16384 - 303, "joined": 0, "draining": 0, "dead": 302,
                                  "exited": 1, "retired": 0, "waiting": 0}
    assert document["deaths_total"] == 302 and len(document["deaths"]) == 200
    assert document["deaths"][-1] == {"rank": 1299, "host": "host-162",
                                      "reason": "rank 1299 went silent"}
    assert len(json.dumps(document, separators=(",", ":"))) < 200_000


def test_the_page_phase_says_failed_and_shutting_down_in_the_pages_words() -> None:
    assert page_phase("forming", False) == "forming"
    assert page_phase("running", False) == "running"
    assert page_phase("shutting_down", False) == "shutting-down"
    assert page_phase("closed", False) == "finished"  # coordinator --linger shows it
    assert page_phase("running", True) == "failed"
    assert page_phase("forming", True) == "failed"
