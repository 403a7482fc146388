"""What a relay that has not joined yet tells its connected ranks (issue 12, FT/2).

While a sibling rank is rejected (wrong salt, wrong world size) or the coordinator cannot be
reached, the ranks already connected heard nothing: they died of ``coord_liveness_timeout``
(30 s) long before the relay's own ``rank_accept_timeout`` (60 s) decided, blaming the
coordinator, which had never been dialed. Until it joins, the relay now sends each connected rank
a salt-sealed ``RelayWaiting{host, detail}`` every second (what it waits for, the rank-port
rejects by reason); that keeps the rank's liveness clock running on the relay's deadlines, and a
last notice when the relay gives up becomes part of the rank's ``CoordinatorLost``.
"""

from __future__ import annotations

import trio

from ..net._transport import STREAM_GONE
from ..wire import Drain, FrameCodec, RelayWaiting, SessionSalt
from .ranks import LocalRanks

# Cadence of the notices (not scaled: a rate, not patience), and the bound on one write.
NOTICE_INTERVAL = 1.0
NOTICE_WRITE_LIMIT = 1.0



class RankNotices:
    """Tells the connected local ranks why the relay is still waiting.

    Attributes:
        upstream_status: what phase 2 is doing ("dialing the coordinator at ...").
    """

    def __init__(self, local: LocalRanks, salt: SessionSalt) -> None:
        self._local = local
        self._codec = FrameCodec(salt)
        self.upstream_status = "about to dial the coordinator"

    def drain_frame(self, reason: str) -> bytes:
        """The ``Drain`` frame that tells a local rank its host leaves (issue 37)."""
        return self._codec.encode(Drain(host=self._local.host, reason=reason))

    def status(self, text: str) -> None:
        """What phase 2 is doing now, for the next notice."""
        self.upstream_status = text

    def waiting_for(self) -> str:
        host = self._local.host
        if not self._local.all_in:
            return f"relay {host!r} is waiting for its local ranks: {self._local.waiting_text()}"
        return f"relay {host!r} has all its local ranks and is {self.upstream_status}"

    async def keep_informed(self, stop: trio.Event) -> None:
        """Every ``NOTICE_INTERVAL`` until ``stop`` is set (the relay joined or gave up)."""
        while not stop.is_set():
            await self.tell(self.waiting_for())
            with trio.move_on_after(NOTICE_INTERVAL):
                await stop.wait()

    async def tell(self, detail: str) -> None:
        """Send one notice to every connected rank."""
        frame = self._codec.encode(RelayWaiting(host=self._local.host, detail=detail))
        for link in self._local.links():
            if link.gone:
                continue
            blob = link.session.send(frame)
            # Shielded so a cancellation never leaves half a frame on a rank's stream; bounded,
            # because a rank that does not read must not hold the relay.
            with trio.CancelScope(shield=True,
                                  deadline=trio.current_time() + NOTICE_WRITE_LIMIT) as scope:
                try:
                    await link.writer.send(blob)
                except (trio.TooSlowError, *STREAM_GONE):
                    await trio.aclose_forcefully(link.stream)
            if scope.cancelled_caught:
                await trio.aclose_forcefully(link.stream)
