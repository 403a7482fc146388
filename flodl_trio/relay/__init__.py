"""The host relay (SPEC §5): terminates its local ranks' handshakes on loopback and carries all
their frames over one sealed upstream connection to the coordinator.

Re-exports only; the code lives in its private modules.
"""

from ._args import RankListen as RankListen
from ._leader import StoreDialer
from ._link import RelayExit
from ._open import (
    WRONG_SALT_ATTEMPTS as WRONG_SALT_ATTEMPTS,
    Relay,
    open_relay,
)

__all__ = [
    "Relay",
    "RelayExit",
    "StoreDialer",
    "open_relay",
]
