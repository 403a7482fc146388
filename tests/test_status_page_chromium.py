"""The status page as a real browser renders it: a headless Chromium (Debian's ``chromium``)
watches a 4-rank cluster of real processes (the ``flodl-trio coordinator`` CLI and two relay
processes on loopback); one relay is SIGKILLed and the page shows its ranks dead within 3 s.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import trio

import flodl_trio as ft

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_chromium = _load("_chromium")
_relay_proc = _load("_relay_proc")

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
    import json
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
                for host, ranks in (("host-a", [0, 1]), ("host-b", [2, 3])):
                    children.append(await _relay_proc.RelayProcess.start(
                        nursery, coordinator=("127.0.0.1", port), salt=salt, host=host,
                        ranks=ranks, world_size=4))
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
