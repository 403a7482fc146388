"""Counting junk without amplifying it: one helper for every place that sees hostile input.

A port scanner, a relay of another session or a forging peer can make an event happen as fast as
it can send bytes. Each occurrence must stay cheap: it is counted by reason (for ``state()``,
``/metrics`` and error messages), and only a few of them become a log line or a timeline event —
the first ``burst`` at once, then at most one summary per ``interval`` that says how many were
folded into it. Sans-IO (no trio import): the caller passes the current time, so the coordinator's
trio-free bookkeeping and MockClock tests can use it alike.

Example::

    rejects = JunkCounter(burst=5, interval=10.0)
    report = rejects.add("bad mac", f"{peer}: Hello MAC did not verify", now)
    if report is not None:
        log.warning("handshake rejected: %s", report.text())
"""

from __future__ import annotations

from collections import Counter, deque

import attrs

DEFAULT_BURST = 5
DEFAULT_INTERVAL = 10.0
DEFAULT_SAMPLES = 5


@attrs.frozen
class JunkReport:
    """What a caller should log (and record) now.

    Attributes:
        reason: the reason of the occurrence that triggered the report ("" for a flush).
        detail: its description (None for a flush).
        folded: occurrences not reported since the previous report, by reason.
    """

    reason: str
    detail: str | None
    folded: dict[str, int] = attrs.field(factory=dict)

    @property
    def folded_total(self) -> int:
        return sum(self.folded.values())

    def text(self) -> str:
        """One line: the detail, then what was folded into this report."""
        folded = ""
        if self.folded:
            by_reason = ", ".join(f"{r} x{n}" for r, n in sorted(self.folded.items()))
            folded = f"{self.folded_total} more not logged since the last report ({by_reason})"
        if self.detail is None:
            return folded
        return f"{self.detail}; {folded}" if folded else self.detail


class JunkCounter:
    """Counts occurrences by reason and rate-limits their reports (a token bucket).

    Args:
        burst: occurrences reported at once before rate limiting starts (>= 1).
        interval: seconds per further report once the burst is spent (> 0).
        samples: how many recent details :attr:`recent` keeps for error messages.
    """

    def __init__(self, *, burst: int = DEFAULT_BURST, interval: float = DEFAULT_INTERVAL,
                 samples: int = DEFAULT_SAMPLES) -> None:
        if burst < 1 or not interval > 0:
            raise ValueError(f"JunkCounter: expected burst >= 1 and interval > 0, got "
                             f"burst={burst!r}, interval={interval!r}")
        self._burst = burst
        self._interval = interval
        self._tokens = float(burst)
        self._refilled_at: float | None = None
        self._totals: Counter[str] = Counter()
        self._folded: Counter[str] = Counter()
        self._recent: deque[str] = deque(maxlen=samples)
        self.reports = 0

    @property
    def total(self) -> int:
        """Every occurrence counted so far."""
        return sum(self._totals.values())

    def by_reason(self) -> dict[str, int]:
        """Every occurrence counted so far, by reason (a copy)."""
        return dict(self._totals)

    @property
    def recent(self) -> tuple[str, ...]:
        """The details of the last few occurrences, oldest first (bounded)."""
        return tuple(self._recent)

    @property
    def folded_total(self) -> int:
        """Occurrences counted but not yet reported."""
        return sum(self._folded.values())

    def summary(self) -> str:
        """``"bad mac x3, timeout x1"`` (or ``"none"``), for error messages."""
        return ", ".join(f"{r} x{n}" for r, n in sorted(self._totals.items())) or "none"

    def add(self, reason: str, detail: str, now: float) -> JunkReport | None:
        """Count one occurrence; return a report when one is due, else None."""
        self._totals[reason] += 1
        self._recent.append(detail)
        if not self._take_token(now):
            self._folded[reason] += 1
            return None
        return self._report(reason, detail)

    def flush(self, now: float, *, force: bool = False) -> JunkReport | None:
        """A summary of what was folded since the last report, when any was.

        Rate-limited like :meth:`add` unless ``force`` (for the end of a phase: one line).
        """
        if not self._folded or not (self._take_token(now) or force):
            return None
        return self._report("", None)

    def _take_token(self, now: float) -> bool:
        if self._refilled_at is not None:
            elapsed = max(0.0, now - self._refilled_at)
            self._tokens = min(float(self._burst), self._tokens + elapsed / self._interval)
        self._refilled_at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def _report(self, reason: str, detail: str | None) -> JunkReport:
        report = JunkReport(reason=reason, detail=detail, folded=dict(self._folded))
        self._folded.clear()
        self.reports += 1
        return report
