"""Take the documentation's screenshot of the status page (docs/_static/status-page.png) the way
the tests look at it: a headless Chromium on a real cluster over loopback TCP.

Eight ranks on two relays push an SVG, metadata and a hardware summary, heartbeat with step
counts and report two epochs of ``Metrics``; the orchestrator declares one rank dead. Then
Chromium opens ``/`` and captures the page.

    .venv/bin/python scripts/board_screenshot.py [-o docs/_static/status-page.png]
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.testing import open_local_cluster, wait_until

_spec = importlib.util.spec_from_file_location("_chromium",
                                               Path(__file__).with_name("_chromium.py"))
assert _spec is not None and _spec.loader is not None
_chromium = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_chromium)


def loss_curve(rank: int) -> str:
    points = " ".join(f"{x * 12},{int(60 - 50 / (1 + x * (0.4 + rank / 10)))}"
                      for x in range(16))
    return ('<svg xmlns="http://www.w3.org/2000/svg" width="190" height="64">'
            '<rect width="190" height="64" fill="#f4f6fb"/>'
            f'<polyline points="{points}" fill="none" stroke="#3b6fd8" stroke-width="2"/></svg>')


async def rank_main(ep: ft.RankEndpoint) -> None:
    r = ep.rank
    if r in (0, 5):
        await ep.send(wire.DashboardSetSvg(rank=r, svg=loss_curve(r), label="loss"))
        await ep.send(wire.DashboardSetMetadata(rank=r, json='{"model": "resnet18", "lr": 0.1}'))
        await ep.send(wire.DashboardSetHardware(rank=r, summary=f"cpu x8, 31 GB, host-{r // 4}"))
    for epoch in range(2):
        ep.step_count = 120 * (epoch + 1) + r  # what its automatic Heartbeats report
        await ep.send(wire.Heartbeat(rank=r, step_count=ep.step_count))
        await ep.send(wire.Metrics(
            rank=r, epoch=epoch, avg_loss=0.9 / (epoch + 1) + r / 100, batches_processed=30,
            epoch_ms=1500.0 + 40 * r, samples_processed=960, share_complete_ms=1.0,
            compute_only_ms=1.0, data_starve_ms=0.0, scalars={}))
    async for _ in ep:  # until the coordinator's Shutdown
        pass


async def main() -> bytes:
    hosts = {"host-a": [0, 1, 2, 3], "host-b": [4, 5, 6, 7]}
    async with open_local_cluster(hosts, transport="tcp", rank_main=rank_main) as cluster:
        coord = cluster.coord
        await wait_until(lambda: len(coord.board()["epochs"]) == 2, limit=20)
        await coord.declare_dead(6, "its trainer process stopped answering")
        host, port = coord.address
        async with _chromium.open_chromium(f"http://{host}:{port}/") as page:
            for _ in range(100):
                if await page.evaluate("document.querySelectorAll('[data-rank]').length") == 8:
                    break
                await trio.sleep(0.1)
            await trio.sleep(1.2)  # the next tick: the heartbeat ages are fresh
            return bytes(await page.screenshot(980, 690))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-o", "--output", type=Path,
                        default=Path(__file__).resolve().parent.parent / "docs" / "_static"
                        / "status-page.png")
    output = parser.parse_args().output
    png = trio.run(main)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_bytes(png)
    print(f"wrote {output} ({len(png)} bytes)")
