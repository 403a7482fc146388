"""How formation ends (SPEC §4.2), and the rejected handshakes it counts on the way.

Formation completes once every rank is covered by a relay whose ``Ready`` verified (an elastic
world, issue 37: once its minimum is, and no relay joined for ``join_window`` seconds), or fails:
an authenticated contradiction, ``strict_formation`` and a pre-auth reject, ``abort``, or
``formation_timeout``. Each failure's message says how many ranks were covered, which hosts
joined and which connections were rejected, by reason. Both the handshakes
(:mod:`.formation`) and admission (:mod:`._admit`) report here; neither calls the other back.
"""

from __future__ import annotations

import logging

import trio

from .._config import CoordinatorConfig
from .._errors import FormationAborted, FormationError, FormationTimeout
from ..events import FormationComplete, FormationFailed, HandshakeRejected
from ..net._ratelimit import JunkReport
from ..timeline import Timeline
from ._relayconn import RelayConn
from ._roster import Roster
from .liveness import Liveness

log = logging.getLogger("flodl_trio.coordinator")


class FormationOutcome:
    """Formation's end and its rejects.

    Attributes:
        failure: why formation failed (set once), else None.
    """

    def __init__(self, *, roster: Roster[RelayConn], liveness: Liveness,
                 config: CoordinatorConfig, timeline: Timeline) -> None:
        self._roster = roster
        self._liveness = liveness
        self._config = config
        self._timeline = timeline
        self._settled = trio.Event()
        self._started = 0.0
        self.failure: FormationError | None = None
        # An elastic world's join window: when a relay last joined, and a wake-up for the watch.
        self._last_join = 0.0
        self._moved = trio.Event()

    def reject(self, peer: str, category: str, detail: str, *, wrong_salt: bool = False
               ) -> None:
        """Count a connection that failed before authenticating, or a relay refused after.

        Never fatal unless ``strict_formation`` (FT/2): a count limit let anyone who can reach
        the port kill formation with 1,100 magic-and-close connections. Only a rate-limited few
        become a log line and a ``HandshakeRejected`` event, so junk cannot evict real events.
        ``wrong_salt``: it looks like a relay whose salt differs; its line is a WARNING (the
        command line shows those) and the formation error counts them.
        """
        report = self._roster.reject(category, detail, trio.current_time(),
                                     wrong_salt=wrong_salt)
        if report is not None:
            self._record(peer, category, report,
                         level=logging.WARNING if wrong_salt else logging.INFO)
        if self._roster.forming and self._config.strict_formation:
            self.fail(FormationError(self._roster.coverage_text(
                f"strict formation: handshake from {peer} rejected ({category}: {detail})")))

    def _record(self, peer: str, category: str, report: JunkReport, *,
                level: int = logging.INFO) -> None:
        log.log(level, "handshake rejected (%s): %s", category or "summary", report.text())
        reason = f"{category}: {report.text()}" if category else report.text()
        self._timeline.event(HandshakeRejected(peer=peer, reason=reason))

    def report_rejects_tail(self) -> None:
        """At the end of formation, one summary of the rejects that were not reported."""
        report = self._roster.rejects_tail(trio.current_time())
        if report is not None:
            self._record("(several)", "", report)

    def fail(self, exc: FormationError) -> None:
        """Formation fails with ``exc`` (the first failure only, and only while forming)."""
        if self.failure is None and self._roster.forming:
            self.failure = exc
            self._settled.set()

    def complete(self) -> None:
        """Every rank is covered (an elastic world: enough of them): the cohort runs from now."""
        now = trio.current_time()
        self._roster.start_running(now)
        elapsed = (now - self._started) * 1000.0
        relays = len(self._roster.relays)
        world = self._roster.current_world
        self._timeline.event(FormationComplete(
            relays=relays, world_size=world, elapsed_ms=round(elapsed, 3)))
        log.info("formation complete: %d ranks over %d relays in %.1f ms", world, relays,
                 elapsed)
        self._settled.set()
        self._liveness.wake()
        self._liveness.formed()
        self.report_rejects_tail()

    def moved(self, *, joined: bool) -> None:
        """Formation's membership moved: a relay registered or was confirmed (``joined``: the
        join window starts again), or one was dropped; the join window's watch looks again."""
        if joined:
            self._last_join = trio.current_time()
        self._moved.set()

    async def watch_join_window(self) -> None:
        """An elastic world (issue 37): complete formation once the minimum is covered, no
        relay waits for its ``Ready``, and none joined for ``join_window`` seconds (torchrun's
        last call). The maximum completes it at once, as a fixed world's every rank does."""
        window = self._config.join_window
        while self._roster.forming and self.failure is None:
            self._moved = trio.Event()
            if self._roster.quorate:
                due = self._last_join + window
                if trio.current_time() >= due:
                    log.info("join window: %gs without a relay joining; forming with %d of "
                             "%d..%d ranks", window, self._roster.current_world,
                             self._roster.min_world, self._roster.world_size)
                    self.complete()
                    return
                with trio.move_on_at(due):
                    await self._moved.wait()
            else:
                await self._moved.wait()

    def start_clock(self) -> None:
        """Formation's deadline and elapsed time count from now."""
        self._started = trio.current_time()

    async def wait(self) -> None:
        """Return once every rank is covered.

        Raises:
            FormationTimeout / FormationAborted / FormationError: the c/W text says why.
        """
        timeout = self._config.formation_timeout
        with trio.move_on_at(self._started + timeout):
            await self._settled.wait()
        failure = self.failure
        # A coordinator woken deposed after its deadline says nothing: it steps down.
        if failure is None and self._roster.forming and self._liveness.leads():
            failure = FormationTimeout(self._roster.coverage_text(
                f"formation timed out after {timeout:g}s"))
        if failure is not None:
            self.report_rejects_tail()
            self.failure = failure
            self._timeline.event(FormationFailed(reason=str(failure),
                                                 covered=len(self._roster.covered)))
            log.error("%s", failure)
            raise failure

    async def watch_abort(self, abort: trio.Event) -> None:
        """Fail formation (``FormationAborted``) once ``abort`` is set, if it still runs."""
        await abort.wait()
        if self._roster.forming:
            self.fail(FormationAborted(self._roster.coverage_text("formation aborted")))
