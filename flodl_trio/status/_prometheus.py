"""The coordinator's status document as Prometheus text (exposition format 0.0.4), for
``GET /metrics``.

Written here by hand on purpose: ``prometheus_client`` keeps a process-global default registry,
and two coordinators in one process (tests do this) would collide in it or have to juggle private
registries. Ten gauge lines do not need a library.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

PHASES: Final = ("forming", "running", "shutting_down", "closed")
PROMETHEUS_CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

_STORE_FAMILIES: Final = (
    ("size_bytes", "store_size_bytes", "gauge",
     "Bytes the session store takes (SQLite: database and WAL; etcd: the member's database)."),
    ("writes", "store_writes_total", "counter", "Session states this coordinator wrote."),
    ("revision", "store_revision", "gauge", "etcd's revision (one per write to the cluster)."),
    ("last_write_age_s", "store_last_write_age_seconds", "gauge",
     "Seconds since the session store's last write ended."),
)


def render_prometheus(state: Mapping[str, Any]) -> str:
    """Render a status document in the Prometheus text exposition format 0.0.4.

    Args:
        state: the coordinator's status document; missing keys count as zero or empty.

    Returns:
        The exposition text: every metric is prefixed ``flodl_trio_``; counters end in
        ``_total``; ``flodl_trio_phase{phase=...}`` is one-hot over the phases.
    """
    out = _Exposition(state)
    out.count("world_size", "gauge", "Ranks in the world.", "world_size")
    out.count("ranks_covered", "gauge", "Ranks announced by a joined relay.", "covered")
    out.count("relays", "gauge", "Relays that joined (connected now or not).", "relays")
    relays = state.get("relays") or []
    connected = sum(1 for relay in relays if isinstance(relay, Mapping) and relay.get("connected"))
    out.family("relays_connected", "gauge", "Relays whose connection is up now.", [("", connected)])
    out.count("ranks_live", "gauge", "Ranks alive.", "live")
    out.count("ranks_dead", "gauge", "Ranks declared dead.", "dead")
    out.count("ranks_exited", "gauge", "Ranks exited cleanly.", "exited")
    out.count("lost_broadcasts_total", "counter", "Broadcasts that missed a live rank.",
              "lost_broadcasts")
    out.count("fenced_ranks_total", "counter",
              "Ranks declared dead that were told so and cut off.", "fenced_ranks")
    out.count("relay_write_stalls_total", "counter",
              "Relays lost because they stopped reading (write stall).", "relay_write_stalls")
    out.count("relays_disconnected_total", "counter",
              "Relay connections closed because all their ranks were dead.", "relays_disconnected")
    out.by_reason("rejected_handshakes_total",
                  "Connections rejected before authenticating, by reason.", "rejected_handshakes")
    out.count("pending_handshakes", "gauge", "Connections in formation whose Hello has not "
              "verified yet (max_pending_handshakes).", "pending_handshakes")
    out.by_reason("invalid_frames_total", "Frames from authenticated relays dropped (forged, "
                  "foreign rank, undecodable), by reason.", "invalid_frames")
    uptime = float(state.get("uptime_s") or 0.0)
    out.family("uptime_seconds", "gauge", "Seconds since the coordinator started.", [("", uptime)])
    out.phase(str(state.get("phase", "")))
    out.store(state.get("store"))
    return out.text()


class _Exposition:
    """The families of one exposition, in order, from one status document."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self._state = state
        self._lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str,
               samples: list[tuple[str, float]]) -> None:
        """``# HELP`` and ``# TYPE`` of ``flodl_trio_<name>``, then one line per sample."""
        metric = f"flodl_trio_{name}"
        self._lines.append(f"# HELP {metric} {help_text}")
        self._lines.append(f"# TYPE {metric} {kind}")
        self._lines.extend(f"{metric}{labels} {_number(value)}" for labels, value in samples)

    def count(self, name: str, kind: str, help_text: str, key: str) -> None:
        """One sample: the number (or the size) of the document's ``key``."""
        self.family(name, kind, help_text, [("", _count(self._state.get(key)))])

    def by_reason(self, name: str, help_text: str, key: str) -> None:
        """A counter with one sample per reason of the document's ``key`` (a mapping)."""
        table = self._state.get(key) or {}
        self.family(name, "counter", help_text, [
            (f'{{reason="{_escape_label(str(k))}"}}', _count(v)) for k, v in sorted(table.items())
        ])

    def phase(self, phase: str) -> None:
        """``flodl_trio_phase``, one-hot over :data:`PHASES` (and an unknown one, if so)."""
        phases = [*PHASES, phase] if phase and phase not in PHASES else list(PHASES)
        self.family("phase", "gauge", "The coordinator's phase (one-hot).",
                    [(f'{{phase="{_escape_label(p)}"}}', int(p == phase)) for p in phases])

    def store(self, store: object) -> None:
        """The session store's families, when the coordinator has one (docs/failover.rst)."""
        if not isinstance(store, Mapping):
            return
        kind = f'{{kind="{_escape_label(str(store.get("kind", "")))}"}}'
        for key, name, kind_, help_text in _STORE_FAMILIES:
            if isinstance(store.get(key), int | float):
                self.family(name, kind_, help_text, [(kind, store[key])])

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(int(value))
    number = float(value)
    if math.isnan(number):
        return "NaN"
    if math.isinf(number):
        return "+Inf" if number > 0 else "-Inf"
    return repr(number)


def _count(value: object) -> int:
    if isinstance(value, int | float):
        return int(value)
    if isinstance(value, Mapping | list | tuple | set | frozenset):
        return len(value)
    return 0
