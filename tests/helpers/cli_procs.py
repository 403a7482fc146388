"""Command-line children for the tests that run ``flodl-trio`` as real processes: :class:`Proc`
collects a child's output lines, :func:`one_line` checks its one error line, :func:`coordinator`
and :func:`two_hosts` start a coordinator on a store, two relays and their ranks. The ``env``
and ``procs`` fixtures that go with them are in tests/conftest.py."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

CLI = [sys.executable, "-m", "flodl_trio"]
PATIENCE = 30.0  # real seconds for a child to print a line or exit; each takes ~1 s alone


class Proc:
    """A CLI child whose stdout and stderr lines are collected by two reader threads."""

    def __init__(self, *args: str, env: dict[str, str]) -> None:
        self.popen = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                      text=True, env=env)
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._collect, args=(stream, lines), daemon=True)
                         for stream, lines in ((self.popen.stdout, self.out),
                                               (self.popen.stderr, self.err))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _collect(stream: object, lines: list[str]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            lines.append(line.rstrip("\n"))

    def line_with(self, text: str) -> str:
        deadline = time.monotonic() + PATIENCE
        while time.monotonic() < deadline:
            for line in list(self.out):
                if text in line:
                    return line
            if self.popen.poll() is not None and not any(r.is_alive() for r in self._readers):
                break
            time.sleep(0.05)
        raise AssertionError(f"no line with {text!r}: out={self.out} err={self.err}")

    def wait(self) -> int:
        code = self.popen.wait(timeout=PATIENCE)
        for reader in self._readers:
            reader.join(timeout=5)
        return code

    def signal(self, signum: int) -> None:
        self.popen.send_signal(signum)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=PATIENCE)
        for reader in self._readers:
            reader.join(timeout=5)
        for stream in (self.popen.stdout, self.popen.stderr):
            if stream is not None:
                stream.close()


def one_line(proc: Proc) -> str:
    """The one error line (log records at WARNING may precede it; a traceback may not)."""
    assert not any("Traceback" in line for line in proc.err), proc.err
    lines = [ln for ln in proc.err if ln.startswith("flodl-trio")]
    assert len(lines) == 1, proc.err
    assert len(lines[0]) < 200, lines[0]  # the cause to act on, not the whole story
    return lines[0]


def two_hosts(env: dict[str, str], procs: list[Proc], coordinator: str, *, batch_ms: int = 10,
              relay_env: dict[str, str] | None = None) -> tuple[list[Proc], list[Proc]]:
    """Two relays (hosts ``h0`` and ``h1``, one rank each of a world of 2) dialing
    ``coordinator`` (an address or a store's URL), and their ranks: ``(relays, ranks)``."""
    relays = []
    for rank in (0, 1):
        relay = Proc("relay", "--coordinator", coordinator, "--host", f"h{rank}", "--ranks",
                     str(rank), "--world-size", "2", env=relay_env or env)
        procs.append(relay)
        relays.append(relay)
    ranks = []
    for rank, relay in enumerate(relays):
        address = relay.line_with("listening for ranks on").rsplit(" ", 1)[-1]
        ranks.append(Proc("rank", "--relay", address, "--rank", str(rank), "--world-size", "2",
                          "--batch-ms", str(batch_ms), env=env))
        procs.append(ranks[-1])
    return relays, ranks


def coordinator(env: dict[str, str], procs: list[Proc], store: str, *args: str,
                listen: str = "127.0.0.1:0") -> Proc:
    """A coordinator of a world of 2 on ``store``, listening on ``listen`` (a free port unless
    told), started among ``procs``."""
    proc = Proc("coordinator", "--listen", listen, "--world-size", "2", "--store", store, *args,
                env=env)
    procs.append(proc)
    return proc


def failure_line(procs: list[Proc], *args: str, env: dict[str, str], code: int) -> str:
    """``flodl-trio ARGS`` (one of ``procs``) exits ``code``: its one error line."""
    proc = Proc(*args, env=env)
    procs.append(proc)
    assert proc.wait() == code, (proc.out, proc.err)
    return one_line(proc)
