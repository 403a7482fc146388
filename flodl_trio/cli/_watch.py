"""``flodl-trio status --watch``: a one-screen view of a coordinator, refreshed in place.

Each refresh is one ``/state.json`` request; the view shows the phase, the epoch in progress,
each host with its ranks alive, dead and exited, the dead ranks' reasons (the first few) and the
lost broadcasts; in an elastic world its range and size now, and one line printed above the
view for each host that joined, began to drain or had ranks retired since the last refresh
(:func:`changes`). It ends on SIGINT / SIGTERM (exit 130 / 143, as every command) or when the
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
    draining = _ints(state.get("draining"))
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
        link = ("draining" if draining.intersection(ranks) else "connected"
                if relay.get("connected", True) else "gone")
        table.add_row(str(relay.get("host", "?")), str(relay.get("peer", "?")), link,
                      str(sum(r in live for r in ranks)), str(sum(r in dead for r in ranks)),
                      str(sum(r in exited for r in ranks)), _ranks_text(ranks))
    lines: list[RenderableType] = [head]
    world = state.get("world")
    if isinstance(world, dict) and world.get("min") != world.get("max"):
        # An elastic world (issue 37): its range, its size now, and who left it for good.
        retired = _ints(state.get("retired"))
        lines.append(Text(_world_text(state) + (f", retired {_ranks_text(sorted(retired))}"
                                                if retired else "")))
    lines += [table,
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
    before = state
    with Live(render(state, where=where, interval=interval), console=console,
              auto_refresh=False, transient=False) as view:
        while True:  # until the coordinator goes away, or a signal cancels it
            await trio.sleep(interval)
            try:
                state = await fetch_state(address, timeout=timeout)
            except FlodlError as exc:
                gone = exc
                break
            for line in changes(before, state):
                view.console.print(f"{time.strftime('%H:%M:%S')} {line}", soft_wrap=True,
                                   highlight=False, markup=False)
            before = state
            view.update(render(state, where=where, interval=interval), refresh=True)
    if not console.is_terminal:
        console.line()  # the last view, printed once at the end, has no newline of its own
    console.print(gone_line(state, where, gone, time.monotonic() - started), soft_wrap=True,
                  highlight=False, markup=False)
    return 0


def _world_text(state: dict[str, Any]) -> str:
    world = state.get("world")
    if not isinstance(world, dict):
        return f"world {state.get('world_size', '?')}"
    return f"world {world.get('current', '?')} of {world.get('min', '?')}..{world.get('max', '?')}"


def _hosts(state: dict[str, Any]) -> dict[int, str]:
    return {r: str(relay.get("host", "?")) for relay in state.get("relays") or []
            if isinstance(relay, dict) for r in relay.get("ranks") or [] if isinstance(r, int)}


def _counts(value: object) -> dict[str, int]:
    if not isinstance(value, dict):
        return {}
    return {str(k): v for k, v in value.items() if isinstance(v, int)}


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """One line per host for each membership change between two status documents: ranks that
    joined the running cohort (their ``joins`` count moved), hosts that said they drain
    (``drains_total`` moved: said even when the drain ended between the two), ranks retired
    (with the reason); nothing for a coordinator that does not say (older)."""
    hosts, lines = _hosts(after), []
    world = _world_text(after)
    was, now = _counts(before.get("joins")), _counts(after.get("joins"))
    joined = sorted(int(r) for r, n in now.items() if n > was.get(r, 0) and r.isdigit())
    for host, ranks in _by_host(joined, hosts).items():
        lines.append(f"{host} joined: rank(s) {_ranks_text(ranks)} in the cohort; {world}")
    drains = [d for d in after.get("drains") or [] if isinstance(d, dict)]
    told = after.get("drains_total", 0), before.get("drains_total", 0)
    new = told[0] - told[1] if all(isinstance(n, int) for n in told) else 0
    for drain in drains[len(drains) - min(new, len(drains)):] if new > 0 else []:
        ranks = [r for r in drain.get("ranks") or [] if isinstance(r, int)]
        lines.append(f"{drain.get('host', '?')} draining ({drain.get('reason', '?')}): rank(s) "
                     f"{_ranks_text(ranks)} finish their current sync and exit")
    old = {(e.get("rank"), e.get("reason")) for e in before.get("retirements") or []
           if isinstance(e, dict)}
    fresh: dict[tuple[str, str], list[int]] = {}
    for entry in after.get("retirements") or []:
        if isinstance(entry, dict) and isinstance(entry.get("rank"), int) and (
                (entry["rank"], entry.get("reason")) not in old or entry["rank"] in joined):
            key = (str(entry.get("host") or "?"), str(entry.get("reason", "?")))
            fresh.setdefault(key, []).append(entry["rank"])
    for (host, reason), ranks in fresh.items():
        lines.append(f"{host}: rank(s) {_ranks_text(ranks)} retired ({reason}); {world}")
    return lines


def _by_host(ranks: list[int], hosts: dict[int, str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for r in ranks:
        out.setdefault(hosts.get(r, "?"), []).append(r)
    return out


def gone_line(state: dict[str, Any], where: str, exc: BaseException, seconds: float) -> str:
    """The one line that ends a watch: the coordinator stopped answering, and how it was last."""
    refused = any(isinstance(c, ConnectionRefusedError) for c in causes(exc))
    why = "connection refused" if refused else shorten(str(exc).partition(": ")[2], 80)
    epoch = state.get("epoch")
    return (f"coordinator {where} went away ({why}) after {seconds:.0f} s of watching; last "
            f"seen: phase {state.get('phase', '?')}, epoch {'-' if epoch is None else epoch}, "
            f"{len(_ints(state.get('live')))} alive, {len(state.get('dead') or [])} dead")
