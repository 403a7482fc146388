"""Small value types the coordinator hands to its users."""

from __future__ import annotations

import attrs


@attrs.frozen
class RelayInfo:
    """A relay that joined: its host name, the global ranks it carries, its peer address."""

    host: str
    ranks: tuple[int, ...]
    peer: str


@attrs.frozen
class BroadcastResult:
    """Outcome of a best-effort broadcast: who got it, and why the others did not."""

    delivered: frozenset[int]
    failed: dict[int, str] = attrs.field(factory=dict, hash=False)

    @property
    def ok(self) -> bool:
        return not self.failed
