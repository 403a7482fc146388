"""Session stores (SPEC §4.7): where a coordinator keeps its session so that a restarted or
standby coordinator adopts the running cohort instead of ending the run."""

from ._base import MemoryStore, SessionStore
from ._state import SessionState, salt_id

__all__ = ["MemoryStore", "SessionState", "SessionStore", "salt_id"]
