"""A headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``):
no WebDriver, no Playwright, no port. Used by tests/status/test_page.py and
scripts/board_screenshot.py.

    async with open_chromium("http://127.0.0.1:PORT/") as page:
        states = await page.evaluate("[...document.querySelectorAll('[data-rank]')].length")
        png = await page.screenshot()

Chromium reads NUL-terminated JSON commands on fd 3 and writes replies and events on fd 4; the
child gets them through ``bash -c 'exec chromium ... 3<&R 4>&W'``. Every wait is bounded by the
caller's deadline; the browser is closed (then killed) when the block ends.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

CHROMIUM = "/usr/bin/chromium"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--remote-debugging-pipe")


def available() -> bool:
    return os.access(CHROMIUM, os.X_OK)


class ChromiumError(Exception):
    """The browser answered a command with an error, or went away."""


class Page:
    """One page target of a Chromium, attached over the pipe."""

    def __init__(self, send: trio.lowlevel.FdStream, receive: trio.lowlevel.FdStream) -> None:
        self._send, self._receive = send, receive
        self._buffer = b""
        self._next_id = 0
        self.session: str | None = None

    async def command(self, method: str, params: dict[str, Any] | None = None, *,
                      session: bool = True) -> dict[str, Any]:
        """Send one command and return its ``result`` (events in between are skipped)."""
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session and self.session is not None:
            msg["sessionId"] = self.session
        await self._send.send_all(json.dumps(msg).encode() + b"\0")
        while True:
            while b"\0" not in self._buffer:
                chunk = await self._receive.receive_some(1 << 16)
                if not chunk:
                    raise ChromiumError(f"chromium closed its pipe while {method} was pending")
                self._buffer += chunk
            raw, _, self._buffer = self._buffer.partition(b"\0")
            reply = json.loads(raw)
            if reply.get("id") == msg["id"]:
                if "error" in reply:
                    raise ChromiumError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply.get("result", {})
                return result

    async def close(self) -> None:
        await trio.aclose_forcefully(self._send)
        await trio.aclose_forcefully(self._receive)

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-serialisable)."""
        result = await self.command("Runtime.evaluate",
                                    {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise ChromiumError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def screenshot(self, width: int, height: int) -> bytes:
        await self.command("Emulation.setDeviceMetricsOverride", {
            "width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        result = await self.command("Page.captureScreenshot", {"format": "png"})
        return base64.b64decode(result["data"])


def _high_pipe() -> tuple[int, int]:
    """A pipe on fds >= 10, so the child's ``3<&R 4>&W`` never overwrites one of them."""
    fds = []
    for fd in os.pipe():
        fds.append(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10))
        os.close(fd)
    return fds[0], fds[1]


@asynccontextmanager
async def open_chromium(url: str) -> AsyncIterator[Page]:
    """Start a headless Chromium on ``url`` (fresh profile in a temp dir) and attach to it."""
    profile = tempfile.mkdtemp(prefix="flodl-chromium-")
    cmd_r, cmd_w = _high_pipe()
    resp_r, resp_w = _high_pipe()
    try:
        argv = ["/bin/bash", "-c",
                f'exec "$0" "$@" 3<&{cmd_r} 4>&{resp_w} {cmd_r}<&- {resp_w}>&-',
                CHROMIUM, *FLAGS, f"--user-data-dir={profile}", url]
        proc = await trio.lowlevel.open_process(
            argv, pass_fds=(cmd_r, resp_w), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(cmd_r)
        os.close(resp_w)
        cmd_r = resp_w = -1
        page = Page(trio.lowlevel.FdStream(cmd_w), trio.lowlevel.FdStream(resp_r))
        cmd_w = resp_r = -1  # owned by the FdStreams now
        try:
            targets = await page.command("Target.getTargets")
            ids = [t["targetId"] for t in targets["targetInfos"] if t["type"] == "page"]
            if not ids:
                raise ChromiumError(f"no page target to attach to: {targets}")
            attached = await page.command("Target.attachToTarget",
                                          {"targetId": ids[0], "flatten": True})
            page.session = attached["sessionId"]
            yield page
        finally:
            with trio.move_on_after(3) as cleanup:
                cleanup.shield = True
                try:
                    await page.command("Browser.close", session=False)
                except (ChromiumError, trio.BrokenResourceError, OSError):
                    pass
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                with trio.CancelScope(shield=True):
                    await proc.wait()
            await page.close()
    finally:
        for fd in (cmd_r, cmd_w, resp_r, resp_w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(profile, ignore_errors=True)
