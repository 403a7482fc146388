"""Session stores (SPEC §4.7): where a coordinator keeps its session so that a restarted or
standby coordinator adopts the running cohort instead of ending the run."""

from ._base import MemoryStore, SessionStore, StoreUsage
from ._etcd import EtcdStore
from ._open import open_store
from ._sqlite import SqliteStore
from ._state import SessionState, salt_id

__all__ = ["EtcdStore", "MemoryStore", "SessionState", "SessionStore", "SqliteStore",
           "StoreUsage", "open_store", "salt_id"]
