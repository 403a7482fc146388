"""What the status page shows beyond membership: each rank's step count, the latest dashboard
pushes per rank (bounded), and a per-epoch summary of the ``Metrics`` ranks reported.

Plain data, no trio, no IO: the readers call :meth:`Board.on_message`
for every frame they deliver, so it is a dictionary lookup on the hot path; the expensive work
(sanitising an SVG) happens when the page's document is built, once per SVG pushed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final

import attrs

from .._errors import SvgRejected
from ..status._svg import MAX_SVG_BYTES, sanitize_svg
from ..wire import (
    Batch,
    DashboardRegister,
    DashboardSetHardware,
    DashboardSetMetadata,
    DashboardSetSvg,
    Heartbeat,
    Metrics,
    SyncAck,
    TimingMsg,
)

# Ranks whose pushes are kept; past it the rank that pushed least recently is forgotten. With
# every field at its cap this is ~17 MB in the worst case, whatever the world size.
MAX_PUSHING_RANKS: Final = 256
MAX_METADATA_CHARS: Final = 2048
MAX_HARDWARE_CHARS: Final = 512
MAX_LABEL_CHARS: Final = 128
EPOCHS_KEPT: Final = 32
# The messages that carry a rank's step count.
_STEPPING: Final = frozenset({Heartbeat, Batch, SyncAck})


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"… ({len(text) - limit} more chars)"


@attrs.define
class DashboardPush:
    """The latest of what one rank pushed through the dashboard messages.

    Attributes:
        rank: the sender.
        port: the port of its own dashboard (``DashboardRegister``), or None.
        svg: its latest SVG, sanitised (:func:`flodl_trio.sanitize_svg`), or None.
        svg_label: that SVG's label, or None.
        svg_error: why its latest SVG is not shown (too large, not well-formed...), or None.
        metadata: its latest metadata (JSON text, clipped), shown as text, or None.
        hardware: its latest hardware summary (clipped), shown as text, or None.
        pushes: how many dashboard messages it sent.
    """

    rank: int
    port: int | None = None
    svg: str | None = None
    svg_label: str | None = None
    svg_error: str | None = None
    metadata: str | None = None
    hardware: str | None = None
    pushes: int = 0
    _raw_svg: str | None = attrs.field(default=None, repr=False, alias="_raw_svg")

    def receive_svg(self, svg: str, label: str | None) -> None:
        """Keep ``svg`` raw until the next :meth:`settle` (a rank pushing faster than the page
        is built costs nothing more than this assignment)."""
        if len(svg) > MAX_SVG_BYTES:  # not even kept raw: a char is at least one byte
            self._raw_svg, self.svg = None, None
            self.svg_error = (f"rank {self.rank}: SVG of {len(svg)} chars: expected at most "
                              f"{MAX_SVG_BYTES} bytes")
        else:
            self._raw_svg = svg
        self.svg_label = None if label is None else _clip(label, MAX_LABEL_CHARS)

    def settle(self) -> None:
        """Sanitise the SVG pushed since the last call (once per push, not per viewer)."""
        raw, self._raw_svg = self._raw_svg, None
        if raw is None:
            return
        try:
            self.svg, self.svg_error = sanitize_svg(raw), None
        except SvgRejected as exc:
            self.svg, self.svg_error = None, f"rank {self.rank}: {exc}"

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "port": self.port, "svg": self.svg, "label": self.svg_label,
                "svg_error": self.svg_error, "metadata": self.metadata,
                "hardware": self.hardware, "pushes": self.pushes}


def readable(value: float) -> float | int:
    """``value`` to three significant figures, a whole number from 100 up: what a person
    reads (``790.096`` ms is ``790``, ``12.345`` samples/s ``12.3``).

    >>> readable(790.096), readable(306.235), readable(12.345), readable(0.012345)
    (790, 306, 12.3, 0.0123)
    """
    if abs(value) >= 100:
        return round(value)
    return float(f"{value:.3g}")


@attrs.define
class EpochSummary:
    """What the ranks' ``Metrics`` for one epoch add up to (as reported; the scheduler's own
    accounting, which samples were covered, is :attr:`flodl_trio.Scheduler.coverage`).

    Attributes:
        epoch: the epoch.
        ranks: the ranks that reported it (a rank that died before its report is not one).
        samples: samples they reported processed.
        loss_sum: sum of their ``avg_loss`` (the mean is ``loss_sum / len(ranks)``).
        epoch_ms: the longest ``epoch_ms`` reported.
    """

    epoch: int
    ranks: set[int] = attrs.field(factory=set)
    samples: int = 0
    loss_sum: float = 0.0
    epoch_ms: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        n = len(self.ranks)
        seconds = self.epoch_ms / 1000.0
        return {
            "epoch": self.epoch, "ranks": n, "samples": self.samples,
            "avg_loss": self.loss_sum / n if n else None,
            "epoch_ms": readable(self.epoch_ms),
            "samples_per_s": readable(self.samples / seconds) if seconds > 0 else None,
        }


class Board:
    """Steps, dashboard pushes and epoch summaries, bounded whatever the ranks send."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.steps: dict[int, int] = {}
        self._pushes: OrderedDict[int, DashboardPush] = OrderedDict()
        self.forgotten_pushers = 0
        self._epochs: OrderedDict[int, EpochSummary] = OrderedDict()
        self._on: dict[type, Callable[[Any], None]] = {
            DashboardRegister: self._register, DashboardSetSvg: self._svg,
            DashboardSetMetadata: self._metadata, DashboardSetHardware: self._hardware,
            Metrics: self.on_metrics,
        }

    def on_message(self, msg: TimingMsg | Metrics) -> None:
        """A TIMING or METRICS message from a rank its relay carries (checked by the reader);
        one dictionary lookup for the messages the page does not show."""
        kind = type(msg)
        if kind in _STEPPING:  # most frames: keep this path to one lookup and one store
            self.steps[msg.rank] = msg.step_count  # type: ignore[union-attr]
            return
        handler = self._on.get(kind)
        if handler is not None:
            handler(msg)

    def on_metrics(self, msg: Metrics) -> None:
        epoch = int(msg.epoch)
        summary = self._epochs.get(epoch)
        if summary is None:
            summary = self._epochs[epoch] = EpochSummary(epoch)
            while len(self._epochs) > EPOCHS_KEPT:
                self._epochs.popitem(last=False)
        rank = int(msg.rank)
        if rank in summary.ranks:
            return  # one report per rank and epoch counts
        summary.ranks.add(rank)
        summary.samples += int(msg.samples_processed)
        summary.loss_sum += float(msg.avg_loss)
        summary.epoch_ms = max(summary.epoch_ms, float(msg.epoch_ms))

    def pushes(self) -> list[DashboardPush]:
        """The kept pushes, by rank, their latest SVG sanitised."""
        out = []
        for rank in sorted(self._pushes):
            push = self._pushes[rank]
            push.settle()
            out.append(push)
        return out

    def epochs(self) -> list[dict[str, Any]]:
        """The last :data:`EPOCHS_KEPT` epochs reported, oldest first."""
        return [s.to_dict() for s in self._epochs.values()]

    # ------------------------------------------------------------------ handlers

    def _push(self, rank: int) -> DashboardPush:
        push = self._pushes.get(rank)
        if push is None:
            push = self._pushes[rank] = DashboardPush(rank)
            if len(self._pushes) > MAX_PUSHING_RANKS:
                self._pushes.popitem(last=False)
                self.forgotten_pushers += 1
        else:
            self._pushes.move_to_end(rank)
        push.pushes += 1
        return push

    def _register(self, msg: DashboardRegister) -> None:
        self._push(int(msg.rank)).port = int(msg.port)

    def _svg(self, msg: DashboardSetSvg) -> None:
        self._push(int(msg.rank)).receive_svg(msg.svg, msg.label)

    def _metadata(self, msg: DashboardSetMetadata) -> None:
        self._push(int(msg.rank)).metadata = _clip(msg.json, MAX_METADATA_CHARS)

    def _hardware(self, msg: DashboardSetHardware) -> None:
        self._push(int(msg.rank)).hardware = _clip(msg.summary, MAX_HARDWARE_CHARS)
