"""The demo's watch loop: the story as the timeline grows, and the faults it was asked for
(SIGKILL a relay, start it again, SIGKILL the coordinator), each due that long after formation
on the story's clock and told with the time it happened and how long after formation that was:
the demo notices formation up to a poll late, so the requested delay is a lower bound, and the
line says the true one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from ..cli._common import CommandFailed
from ._cluster import Cluster
from ._story import Story

RUN_DEADLINE_S = 120.0
POLL_S = 0.1


def _print(line: str) -> None:
    print(line, flush=True)


class Director:
    """Watches one demo run and acts on its schedule of faults.

    Attributes:
        story: the narrator, on the first coordinator's clock.
        killed: hosts whose relay was SIGKILLed.
        killed_coordinator: whether the coordinator was SIGKILLed.
    """

    def __init__(self, args: argparse.Namespace, cluster: Cluster,
                 kills: dict[str, float], restarts: dict[str, float], *,
                 added: dict[str, float] | None = None,
                 drains: dict[str, float] | None = None) -> None:
        self.args, self.cluster = args, cluster
        self.kills, self.restarts = kills, dict(restarts)
        self.added, self.drains = dict(added or {}), dict(drains or {})  # still to do
        self.story = Story(cluster.timeline, args.epochs, anchors=cluster.listening_at)
        self.killed: set[str] = set()
        self.killed_coordinator = False
        self._killed_at: dict[str, float] = {}  # host -> time.monotonic() of its SIGKILL
        self.say: Callable[[str], None] = _print

    def _say_at(self, monotonic: float, text: str) -> None:
        self.say(f"{Story.stamp(self.story.clock_ms(monotonic))}  {text}")

    def _since_formation(self, monotonic: float) -> float | None:
        formed = self.story.formed_at_ms
        return None if formed is None else (self.story.clock_ms(monotonic) - formed) / 1000.0

    def _catch_up(self) -> None:
        for line in self.story.poll():  # what happened before the fault is told before it
            self.say(line)

    def act(self) -> None:
        """Every fault that is due now."""
        since = self._since_formation(time.monotonic())
        if since is None:
            return
        due = self.args.kill_coordinator
        if due is not None and not self.killed_coordinator and since >= due:
            self._kill_coordinator()
        for host, when in self.kills.items():
            if host not in self.killed and since >= when:
                self._kill_relay(host)
        for host, when in list(self.restarts.items()):
            killed_at = self._killed_at.get(host)
            if killed_at is not None and time.monotonic() - killed_at >= when:
                del self.restarts[host]
                self._restart(host, killed_at)
        for host, when in list(self.added.items()):
            if since >= when:
                del self.added[host]
                self._add(host)
        for host, when in list(self.drains.items()):
            if since >= when:
                del self.drains[host]
                self._drain(host)

    def _add(self, host: str) -> None:
        self._catch_up()
        at = time.monotonic()
        ranks = self.cluster.add_host(host)
        self._say_at(at, f"started host {host} with ranks {ranks} "
                         f"{self._since_formation(at):.2f} s after formation: it joins the "
                         "running cohort")

    def _drain(self, host: str) -> None:
        self._catch_up()
        self.cluster.relays[host].terminate()  # SIGTERM: a relay that joined drains
        at = time.monotonic()
        self._say_at(at, f"SIGTERMed relay {host} (ranks {self.cluster.layout[host]}) "
                         f"{self._since_formation(at):.2f} s after formation: it drains")

    def _kill_relay(self, host: str) -> None:
        self._catch_up()
        self.cluster.relays[host].kill()  # SIGKILL: no goodbye, the OS closes its sockets
        at = time.monotonic()
        self.killed.add(host)
        self._killed_at[host] = at
        self._say_at(at, f"SIGKILLed relay {host} (ranks {self.cluster.layout[host]}) "
                         f"{self._since_formation(at):.2f} s after formation")

    def _restart(self, host: str, killed_at: float) -> None:
        at = time.monotonic()
        self.cluster.restarted.add(host)
        self.cluster.start_host(host, again=True)
        self._say_at(at, f"restarted relay {host} and its ranks {self.cluster.layout[host]} "
                         f"{at - killed_at:.2f} s after the kill")

    def _kill_coordinator(self) -> None:
        self._catch_up()
        epoch = max(self.story.epoch, 0) + 1
        cluster = self.cluster
        pid = cluster.kill_coordinator()
        at = time.monotonic()
        self.killed_coordinator = True
        self._say_at(at, f"SIGKILLed the coordinator (pid {pid}) "
                         f"{self._since_formation(at):.2f} s after formation, in epoch "
                         f"{epoch}/{self.args.epochs}")
        cluster.start_coordinator(cluster.address)
        assert cluster.coord is not None
        self._say_at(cluster.listening_at[-1], f"started a coordinator again on "
                     f"{cluster.address} (pid {cluster.coord.pid}) with {cluster.store}")

    def finished(self) -> bool:
        """The run is over: the coordinator exited, or (``--linger``) it wrote its summary
        and now keeps the page up."""
        coord = self.cluster.coord
        assert coord is not None
        if coord.poll() is not None:
            return True
        return bool(self.args.linger) and summary_written(self.cluster)

    def watch(self, table: Callable[[Director], Any]) -> None:
        """Tell the story and act until the run is over (the live ``table`` on a terminal)."""
        live_ui = not self.args.no_live and sys.stdout.isatty()
        deadline = time.monotonic() + RUN_DEADLINE_S
        live_cm: Any = contextlib.nullcontext()
        if live_ui:
            from rich.live import Live

            live_cm = Live(table(self), refresh_per_second=8)
        last_status = ""
        with live_cm as live:
            self.say = live.console.print if live_ui else _print
            while True:
                self._catch_up()
                if self.finished():
                    break
                if time.monotonic() > deadline:
                    raise CommandFailed(f"demo: the run did not finish within "
                                        f"{RUN_DEADLINE_S:g}s")
                if any(p.poll() == 2 for p in self.cluster.children()):
                    raise CommandFailed("demo: a relay or rank process rejected its command "
                                        "line (exit 2)")
                self.act()
                if live_ui:
                    live.update(table(self))
                else:
                    status = self.story.status_line(self.cluster.world)
                    if status != last_status and self.story.formed_ms is None:
                        self.say(status)
                    last_status = status
                time.sleep(POLL_S)
            self._catch_up()
            self._not_done()

    def _not_done(self) -> None:
        if self.args.kill_coordinator is not None and not self.killed_coordinator:
            self.say(f"  the coordinator was not killed: the run ended before its kill was "
                     f"due ({self.args.kill_coordinator:g}s after formation)")
        for host, when in self.restarts.items():  # not yet started when the run ended
            self.say(f"  {host} was not restarted: the run ended before its restart was due "
                     f"({when:g}s after the kill)")
        for host, when in self.added.items():
            self.say(f"  {host} was not added: the run ended before it was due ({when:g}s "
                     "after formation)")
        for host, when in self.drains.items():
            self.say(f"  {host} was not drained: the run ended before it was due ({when:g}s "
                     "after formation)")


def summary_written(cluster: Cluster) -> bool:
    """The coordinator's ``--summary-file`` is there, whole (JSON that parses)."""
    try:
        return bool(json.loads(cluster.summary.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return False
