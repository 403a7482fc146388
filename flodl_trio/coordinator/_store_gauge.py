"""What a coordinator shows of its session store (issue 34): the ``store`` section of its status
document (``/state.json``) and, from it, the ``flodl_trio_store_*`` lines of ``/metrics``.

The store's size comes from :meth:`SessionStore.usage`, which does IO (a ``stat``, an etcd
request), while the status document is built synchronously per request; so one task asks every
``USAGE_INTERVAL`` seconds and the document shows the latest answer. What the store reports an
operator must act on (etcd's ``NOSPACE`` alarm) is logged as a warning once when it appears, the
first time at start-up.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import trio

from .._errors import StoreCorrupt, StoreUnavailable
from ..store import SessionStore, StoreUsage
from ._persist import Persistence

log = logging.getLogger("flodl_trio.coordinator.store")

USAGE_INTERVAL = 5.0  # a cadence: how often the store's size is asked for
USAGE_TIMEOUT = 5.0  # a bound: one answer may take this long before it is skipped


class StoreGauge:
    """The latest :class:`StoreUsage` of ``store`` and the writer's counts, as a document.

    Attributes:
        usage: the last answer of ``store.usage()``, None before the first.
    """

    def __init__(self, store: SessionStore, persist: Persistence, *, write_rate: float) -> None:
        self._store = store
        self._persist = persist
        self._write_rate = write_rate
        self._problems: tuple[str, ...] = ()
        self.usage: StoreUsage | None = None

    async def watch(self) -> None:
        """Ask for the store's usage now and every ``USAGE_INTERVAL`` (runs in the
        coordinator's nursery until it is cancelled)."""
        while True:
            await self.refresh()
            await trio.sleep(USAGE_INTERVAL)

    async def refresh(self) -> None:
        """Ask once, bounded by ``USAGE_TIMEOUT``; a store that does not answer keeps the last
        answer (the writer is what reports an unwritable store)."""
        usage = None
        with trio.move_on_after(USAGE_TIMEOUT):
            try:
                usage = await self._store.usage()
            except (StoreUnavailable, StoreCorrupt) as exc:
                log.debug("session store %s: no usage: %s", self._store.description, exc)
        if usage is None:
            return
        fresh = [p for p in usage.problems if p not in self._problems]
        if fresh:
            log.warning("session store %s reports: %s (docs/failover.rst, \"How often the "
                        "store is written\")", self._store.description, "; ".join(fresh))
        self._problems = usage.problems
        self.usage = usage

    def status(self) -> dict[str, Any]:
        """The ``store`` section of the status document."""
        usage, persist = self.usage, self._persist
        last = persist.last_write
        return {
            "kind": usage.kind if usage else self._store.description.partition(":")[0],
            "description": self._store.description,
            "generation": persist.generation,
            "size_bytes": usage.size_bytes if usage else None,
            "revision": usage.revision if usage else None,
            "writes": persist.saves,
            "last_write_age_s": None if last is None else round(trio.current_time() - last, 3),
            "write_rate": self._write_rate if math.isfinite(self._write_rate) else None,
            "problems": list(usage.problems) if usage else [],
            "detail": dict(usage.detail) if usage else {},
        }
