"""The status page as a real browser renders it: a headless Chromium (Debian's ``chromium``)
watches a 4-rank cluster of real processes (the ``flodl-trio coordinator`` CLI and two relay
processes on loopback); one relay is SIGKILLed and the page shows its ranks dead within 3 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

import flodl_trio as ft
from flodl_trio.coordinator._board import Board
from flodl_trio.coordinator._boardview import board_document
from flodl_trio.coordinator._roster import Roster
from flodl_trio.status import serve_status

from helpers.board import FakeRelay, big_world, metrics
from helpers.scripts import load_script, start_relay_processes

_chromium = load_script("_chromium")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _chromium.available(),
                       reason="needs /usr/bin/chromium (scripts/test installs it as root)"),
]

RANKS_JS = """JSON.stringify({
  phase: document.getElementById('board')?.dataset.phase ?? null,
  ranks: [...document.querySelectorAll('[data-rank]')].map(e => [
    Number(e.dataset.rank), e.dataset.state, e.closest('[data-host]').dataset.host]),
  deaths: [...document.querySelectorAll('[data-dead-rank]')].map(e => e.textContent),
})"""


async def _coordinator_process(tmp: Path, salt: ft.SessionSalt) -> tuple[trio.Process, int]:
    port_file = tmp / "port"
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "flodl_trio", "coordinator", "--listen", "127.0.0.1:0",
         "--world-size", "4", "--formation-timeout", "20", "--port-file", str(port_file)],
        env={**os.environ, "FLODL_SALT_HEX": salt.hex()},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):  # bounded by the caller's deadline too
        text = port_file.read_text() if port_file.exists() else ""
        if text.endswith("\n"):  # HOST:PORT, complete
            return proc, int(text.strip().rpartition(":")[2])
        await trio.sleep(0.05)
    raise AssertionError("the coordinator never wrote its port file")


async def _read(page: object) -> dict[str, object]:
    return json.loads(await page.evaluate(RANKS_JS))  # type: ignore[attr-defined,no-any-return]


async def test_chromium_shows_the_ranks_of_a_sigkilled_relay_dead_within_3s(
    tmp_path: Path,
) -> None:
    salt = ft.SessionSalt.generate()
    coordinator, port = await _coordinator_process(tmp_path, salt)
    children = []
    try:
        with trio.fail_after(40):
            async with trio.open_nursery() as nursery:
                await start_relay_processes(nursery, ("127.0.0.1", port), salt, children)
                for child in children:
                    await child.wait_lines(lambda s: s.startswith("relay ") and
                                           " connected " in s)
                async with _chromium.open_chromium(f"http://127.0.0.1:{port}/") as page:
                    seen: dict[str, object] = {}
                    for _ in range(300):  # until the first live document is rendered
                        seen = await _read(page)
                        if seen["phase"] == "running" and len(seen["ranks"]) == 4:  # type: ignore[arg-type]
                            break
                        await trio.sleep(0.05)
                    assert sorted(seen["ranks"]) == [  # type: ignore[type-var]
                        [0, "alive", "host-a"], [1, "alive", "host-a"],
                        [2, "alive", "host-b"], [3, "alive", "host-b"]]

                    killed_at = time.monotonic()
                    children[0].proc.kill()
                    for _ in range(100):  # 100 x 50 ms: the 3 s budget, and then some
                        seen = await _read(page)
                        if [r for r, state, _ in seen["ranks"] if state == "dead"]:  # type: ignore[attr-defined]
                            break
                        await trio.sleep(0.05)
                    elapsed = time.monotonic() - killed_at
                    print(f"page showed the deaths {elapsed:.3f}s after SIGKILL")
                    assert sorted(seen["ranks"]) == [  # type: ignore[type-var]
                        [0, "dead", "host-a"], [1, "dead", "host-a"],
                        [2, "alive", "host-b"], [3, "alive", "host-b"]], seen
                    assert elapsed < 3.0, f"the page showed the deaths after {elapsed:.2f}s"
                    assert seen["phase"] == "running"
                    deaths = seen["deaths"]
                    assert len(deaths) == 2 and all("(host-a)" in d for d in deaths)  # type: ignore[arg-type,attr-defined]
                coordinator.send_signal(signal.SIGTERM)
                await coordinator.wait()
                await children[1].proc.wait()
    finally:
        for proc in [coordinator, *(c.proc for c in children)]:
            if proc.returncode is None:
                proc.kill()
                with trio.CancelScope(shield=True):
                    await proc.wait()


def extras(*, formation_s: float) -> dict[str, Any]:
    return {"uptime_s": 3.0, "formation_s": formation_s, "formed": True, "lost_broadcasts": 0}


@asynccontextmanager
async def board_in_chromium(board_fn: Callable[[], dict[str, Any]],
                            rendered_js: str) -> AsyncIterator[Any]:
    """A status leg on a free loopback port serving ``board_fn``'s document, and a Chromium page
    on it once ``rendered_js`` is truthy there (the first document is rendered); 30 s at most."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    with trio.fail_after(30):
        async with listeners[0], trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: serve_status(
                listeners[0], lambda: {}, request_timeout=5.0, task_status=task_status,
                board_fn=board_fn))
            async with _chromium.open_chromium(f"http://127.0.0.1:{port}/") as page:
                for _ in range(400):  # until the first document is rendered
                    if await page.evaluate(rendered_js):
                        break
                    await trio.sleep(0.05)
                yield page
            nursery.cancel_scope.cancel()


async def test_chromium_renders_16384_ranks_as_2048_relay_lines_and_pushes_as_inert_text(
) -> None:
    roster, board = big_world()
    board.on_message(ft.wire.DashboardSetSvg(
        rank=5, label="<i>loss</i>", svg='<svg xmlns="http://www.w3.org/2000/svg" width="40" '
        'height="20" onload="document.title=1"><rect width="40" height="20" fill="red"/></svg>'))
    board.on_message(ft.wire.DashboardSetMetadata(rank=5, json='{"note": "<b>bold</b>"}'))
    board.on_message(ft.wire.DashboardSetHardware(rank=5, summary="<img src=x onerror=alert(1)>"))
    async with board_in_chromium(lambda: board_document(
            roster, board, now=3.0, failed=False, extras=extras(formation_s=1.5)),
            "document.querySelectorAll('.relay').length") as page:
        seen = json.loads(await page.evaluate("""JSON.stringify({
          relays: document.querySelectorAll('section.relay').length,
          ranks: document.querySelectorAll('[data-rank]').length,
          dead: document.querySelectorAll('section.relay[data-state=dead]').length,
          img: document.querySelector('figure[data-push-rank="5"] img')?.naturalWidth,
          caption: document.querySelector('figure figcaption').textContent,
          metadata: document.querySelector('figure pre.metadata').textContent,
          injected: document.querySelectorAll(
            'figure b, figure i, img:not([src^="data:image/svg+xml"])').length,
          title: document.title,
        })"""))
    assert seen["relays"] == 2048 and seen["ranks"] == 0
    assert seen["dead"] == 39  # host-1 (ranks 9, 10) and the 38 relays of ranks 1000..1299
    assert seen["img"] == 40  # the sanitised SVG rendered, as an image
    assert seen["caption"] == "rank 5 · <i>loss</i>"  # text, not markup
    assert seen["metadata"] == '{"note": "<b>bold</b>"}'
    assert seen["injected"] == 0 and seen["title"] == "flodl-trio status"


async def test_chromium_shows_samples_covered_as_the_cli_says_them_rounded_numbers_and_no_pushes(
) -> None:
    roster, board = big_world(world=6, per_relay=2)
    for rank in (0, 1, 2, 3):  # ranks 4 and 5 died in the epoch: no Metrics from them
        board.on_message(metrics(rank, 0, samples=60, epoch_ms=790.096))
    covered = [{"epoch": 0, "exactly_once": True, "samples": 240, "total": 240, "gaps": 0,
                "overlaps": 0}]
    async with board_in_chromium(lambda: board_document(
            roster, board, now=3.0, failed=False, extras=extras(formation_s=1.968),
            coverage=covered), "document.querySelectorAll('#epochs tbody tr').length") as page:
        seen = json.loads(await page.evaluate("""JSON.stringify({
          head: [...document.querySelectorAll('#epochs th')].map(e => e.textContent),
          row: [...document.querySelectorAll('#epochs tbody td')].map(e => e.textContent),
          pushes: document.getElementById('pushes').textContent,
          formation: document.getElementById('formation').textContent,
          throughput: [...document.querySelectorAll('#facts div')].map(
            e => e.textContent).find(t => t.startsWith('throughput')),
        })"""))
    assert seen["head"] == ["epoch", "samples covered", "ranks reported", "samples reported",
                            "avg loss", "epoch ms", "samples/s"]
    # 4 of the 6 ranks reported; the scheduler counted every sample once, as the CLI says.
    assert seen["row"] == ["1", "240/240 (exactly once)", "4/6", "240", "2.0000", "790", "304"]
    assert seen["throughput"] == "throughput (samples/s)304"
    assert seen["formation"] == "formed in 1.97 s"
    assert seen["pushes"].startswith("none yet: no rank has sent DashboardRegister")


async def test_chromium_shows_an_elastic_world_5_of_2_to_6_with_its_retired_ranks_apart() -> None:
    roster: Roster[Any] = Roster(6, min_world=2)
    for relay in (FakeRelay("host-a", (0, 1)), FakeRelay("host-b", (2, 3))):
        roster.register(relay, 0.0)
        roster.confirm(relay)
    roster.start_running(1.0)
    roster.rejoin(FakeRelay("host-c", (4, 5)), 2.0)  # grew
    roster.mark_dead(2, "relay 'host-b' lost")
    roster.retire(2, "dead for 5s (retire_after): relay 'host-b' lost")
    board = Board(6)
    async with board_in_chromium(lambda: board_document(
            roster, board, now=3.0, failed=False, extras=extras(formation_s=1.0),
            draining=frozenset({3})), "document.querySelectorAll('.relay').length") as page:
        seen = json.loads(await page.evaluate("""JSON.stringify({
          facts: [...document.querySelectorAll('#facts div')].map(e => e.textContent),
          ranks: [...document.querySelectorAll('[data-rank]')].map(e => [
            Number(e.dataset.rank), e.dataset.state]),
          colours: Object.fromEntries([...document.querySelectorAll('[data-rank]')].map(e => [
            e.dataset.state, getComputedStyle(e).backgroundColor])),
          retired: [...document.querySelectorAll('[data-retired-rank]')].map(e => e.textContent),
          retiredShown: !document.getElementById('retirements').hidden,
          deaths: document.querySelectorAll('[data-dead-rank]').length,
          heads: [...document.querySelectorAll('.relay h3')].map(e => e.textContent),
        })"""))
    assert seen["facts"][:7] == ["world5 of 2..6", "alive5", "dead0", "exited0", "joined2",
                                 "draining1", "retired1"]
    assert sorted(seen["ranks"]) == [[0, "alive"], [1, "alive"], [2, "retired"],
                                     [3, "draining"], [4, "joined"], [5, "joined"]]
    assert len(set(seen["colours"].values())) == 4  # alive, retired, draining, joined: apart
    assert seen["retiredShown"] and seen["deaths"] == 0  # retired is not dead
    assert seen["retired"] == ["rank 2 (host-b): dead for 5s (retire_after): relay 'host-b' lost"]
    assert "host-b 10.0.0.1:4000 · 2 ranks · connected · draining: its host leaves" in seen["heads"]
