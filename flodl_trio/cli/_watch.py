"""``flodl-trio status --watch``: a one-screen view of a coordinator, refreshed in place.

Each refresh is one ``/state.json`` request; the view shows the phase, the epoch in progress,
each host with its ranks alive, dead and exited, the dead ranks' reasons (the first few) and the
lost broadcasts. It ends on SIGINT / SIGTERM (exit 130 / 143, as every command) or when the
coordinator goes away: exit 0 with one line saying how it was last seen (from here, a run that
ended and a coordinator that crashed look alike; the last phase seen tells them apart when a
refresh caught the shutdown).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Final

import trio
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from .._errors import FlodlError
from ..status import fetch_state
from ._common import UsageError
from ._errors import causes, shorten

MIN_INTERVAL: Final = 0.2
MAX_INTERVAL: Final = 60.0
DEAD_SHOWN: Final = 5  # reasons listed; the rest are counted, so the view stays one screen


def check_interval(interval: float) -> float:
    """``--interval`` within [MIN_INTERVAL, MAX_INTERVAL] seconds, else a usage error."""
    if not MIN_INTERVAL <= interval <= MAX_INTERVAL:
        raise UsageError(f"--interval: expected seconds in [{MIN_INTERVAL:g}, {MAX_INTERVAL:g}], "
                         f"got {interval:g}")
    return interval


def _ints(value: object) -> set[int]:
    return {v for v in value if isinstance(v, int)} if isinstance(value, list) else set()


def render(state: dict[str, Any], *, where: str, interval: float) -> Group:
    """The view of one status document (fields missing from it show as ``?``)."""
    live = _ints(state.get("live"))
    exited = _ints(state.get("exited"))
    dead_entries = [d for d in state.get("dead") or [] if isinstance(d, dict)]
    dead = {d.get("rank") for d in dead_entries}
    epoch = state.get("epoch")
    head = Text(f"coordinator {where}  phase {state.get('phase', '?')}  epoch "
                f"{'-' if epoch is None else epoch}  covered {state.get('covered', '?')}/"
                f"{state.get('world_size', '?')}  uptime {state.get('uptime_s', '?')} s")
    table = Table("host", "peer", "link", "alive", "dead", "exited", "ranks", box=None,
                  pad_edge=False)
    for relay in state.get("relays") or []:
        if not isinstance(relay, dict):
            continue
        ranks = [r for r in relay.get("ranks") or [] if isinstance(r, int)]
        link = "connected" if relay.get("connected", True) else "gone"
        table.add_row(str(relay.get("host", "?")), str(relay.get("peer", "?")), link,
                      str(sum(r in live for r in ranks)), str(sum(r in dead for r in ranks)),
                      str(sum(r in exited for r in ranks)), _ranks_text(ranks))
    world = state.get("world")
    if isinstance(world, dict) and world.get("min") != world.get("max"):
        # An elastic world (issue 37): its range, its size now, and who left it for good.
        retired = _ints(state.get("retired"))
        head.append(f"  world {world.get('min', '?')}:{world.get('max', '?')} now "
                    f"{world.get('current', '?')}" + (f", retired {_ranks_text(sorted(retired))}"
                                                      if retired else ""))
    lines: list[RenderableType] = [head, table,
             Text(f"ranks alive {len(live)}  dead {len(dead)}  exited {len(exited)}  lost "
                  f"broadcasts {state.get('lost_broadcasts', '?')}")]
    for entry in dead_entries[:DEAD_SHOWN]:
        lines.append(Text(f"  dead rank {entry.get('rank', '?')}: {entry.get('reason', '?')}"))
    if len(dead_entries) > DEAD_SHOWN:
        lines.append(Text(f"  ... and {len(dead_entries) - DEAD_SHOWN} more dead ranks"))
    lines.append(Text(f"every {interval:g} s; Ctrl-C to stop", style="dim"))
    return Group(*lines)


def _ranks_text(ranks: list[int]) -> str:
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


# Each request's own deadline is fetch_state's ``timeout`` (it names it in its error), so it is a
# parameter here too.
async def watch(address: tuple[str, int], where: str, *, interval: float,
                timeout: float,  # noqa: ASYNC109
                console: Console | None = None) -> int:
    """Refresh the view every ``interval`` seconds until the coordinator goes away.

    Returns:
        0 once the coordinator stopped answering (after one line saying so).

    Raises:
        FlodlError: the first request failed (nothing to watch: the plain status error).
    """
    console = console if console is not None else Console(file=sys.stdout)
    state = await fetch_state(address, timeout=timeout)  # its error is the plain status error
    started = time.monotonic()
    with Live(render(state, where=where, interval=interval), console=console,
              auto_refresh=False, transient=False) as view:
        while True:  # until the coordinator goes away, or a signal cancels it
            await trio.sleep(interval)
            try:
                state = await fetch_state(address, timeout=timeout)
            except FlodlError as exc:
                gone = exc
                break
            view.update(render(state, where=where, interval=interval), refresh=True)
    if not console.is_terminal:
        console.line()  # the last view, printed once at the end, has no newline of its own
    console.print(gone_line(state, where, gone, time.monotonic() - started), soft_wrap=True,
                  highlight=False, markup=False)
    return 0


def gone_line(state: dict[str, Any], where: str, exc: BaseException, seconds: float) -> str:
    """The one line that ends a watch: the coordinator stopped answering, and how it was last."""
    refused = any(isinstance(c, ConnectionRefusedError) for c in causes(exc))
    why = "connection refused" if refused else shorten(str(exc).partition(": ")[2], 80)
    epoch = state.get("epoch")
    return (f"coordinator {where} went away ({why}) after {seconds:.0f} s of watching; last "
            f"seen: phase {state.get('phase', '?')}, epoch {'-' if epoch is None else epoch}, "
            f"{len(_ints(state.get('live')))} alive, {len(state.get('dead') or [])} dead")
