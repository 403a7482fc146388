""":class:`SqliteStore`: the embedded session store, one SQLite file (SPEC §4.7), for a
coordinator restarted on the same machine (or a standby process beside it).

The database is in WAL mode with ``synchronous=FULL`` (a commit is on disk when it returns);
its ``application_id`` marks it as flodl-trio's, so another application's SQLite file or random
bytes are refused (:class:`~flodl_trio.StoreCorrupt`) instead of being written into. Leadership
is an exclusive ``flock`` on ``PATH.lock``: the kernel drops it when the leader's process dies,
so a standby polling it takes over at once. The generation counter is in the database, bumped
in the same transaction that records the new leader; every write is a transaction that first
checks the stored generation. Every blocking call runs in a worker thread.

The write-ahead log is checkpointed into the database every ``WAL_LIMIT`` bytes and cut back to
``WAL_LIMIT`` (issue 34; SQLite's defaults let it reach about 4 MiB and stay that size).
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import trio

from .._errors import ConfigError, LeadershipLost, StoreCorrupt, StoreUnavailable
from ._base import SessionStore, StoreUsage
from ._state import SessionState

APPLICATION_ID = 0x464C5354  # "FLST": PRAGMA application_id of a flodl-trio store
SCHEMA_VERSION = 1
WAL_LIMIT = 1 << 20  # bytes of write-ahead log before a checkpoint, and what it is cut back to
_T = TypeVar("_T")


class SqliteStore(SessionStore):
    """The session store in one SQLite file, leadership by ``flock`` on ``PATH.lock``.

    Args:
        path: the database file (created when missing; its directory must exist).
        check_interval: how often :meth:`keep_leadership` checks that the stored generation
            is still this leader's (a file replaced or deleted under it), in seconds.
        poll_interval: how often a standby in :meth:`acquire` tries the lock, in seconds.
    """

    def __init__(self, path: str | os.PathLike[str], *, check_interval: float = 1.0,
                 poll_interval: float = 0.05) -> None:
        if not check_interval > 0 or not poll_interval > 0:
            raise ConfigError(f"sqlite store {path}: expected check_interval and poll_interval "
                              f"> 0, got {check_interval!r} and {poll_interval!r}")
        self.path = Path(path)
        self.lock_path = Path(f"{self.path}.lock")
        self.description = f"sqlite:{self.path}"
        self.check_interval = check_interval
        self.poll_interval = poll_interval
        self._db: sqlite3.Connection | None = None
        self._db_ino: int | None = None
        self._lock_fd: int | None = None
        self._generation: int | None = None
        self._mutex = trio.Lock()  # one connection: one statement sequence at a time

    @property
    def generation(self) -> int | None:
        """This handle's generation while it leads, else None."""
        return self._generation

    # -- SessionStore -------------------------------------------------------------------------

    async def acquire(self, *, owner: str) -> int:
        await self._run(lambda db: None)  # open and check the database before waiting
        fd = await self._lock(owner)
        try:
            generation = await self._run(lambda db: self._bump(db, owner))
        except BaseException:
            self._unlock(fd)
            raise
        self._lock_fd, self._generation = fd, generation
        return generation

    async def current_leader(self) -> str | None:
        await self._run(lambda db: None)  # a damaged or foreign file is refused here too
        return await trio.to_thread.run_sync(self._leader_owner)

    async def keep_leadership(self, *, task_status: trio.TaskStatus[None]
                              = trio.TASK_STATUS_IGNORED) -> None:
        if self._generation is None:
            raise LeadershipLost(f"store {self.description}: keep_leadership before acquire "
                                 f"(this handle does not lead)")
        task_status.started()
        while True:
            if self._generation is None:
                raise LeadershipLost(f"store {self.description}: the leadership was released "
                                     f"(release or aclose) while keep_leadership ran")
            problem = await self._run(self._leadership_problem)
            if problem is not None:
                generation, self._generation = self._generation, None
                raise LeadershipLost(f"store {self.description}: expected to lead as "
                                     f"generation {generation}, but {problem}; stepping down")
            await trio.sleep(self.check_interval)

    async def load(self) -> SessionState | None:
        def read(db: sqlite3.Connection) -> object:
            _stored_generation(db, self.description)  # a damaged counter is a damaged store
            return _get(db, "state")

        data = await self._run(read)
        if data is None:
            return None
        if not isinstance(data, bytes):
            raise StoreCorrupt(f"session state at {self.description}: expected bytes, got "
                               f"{type(data).__name__}; refusing it (nothing was loaded)")
        return SessionState.decode(data, source=self.description)

    async def save(self, state: SessionState) -> None:
        data = state.encode()
        await self._run(lambda db: self._fenced(db, state.generation, "save", "state", data))

    async def publish_address(self, addresses: Sequence[tuple[str, int]]) -> None:
        generation = self._generation
        if generation is None:
            raise LeadershipLost(f"store {self.description}: publish_address refused: this "
                                 f"handle does not lead (no acquire, or it stepped down)")
        text = json.dumps([[str(h), int(p)] for h, p in addresses])
        await self._run(lambda db: self._fenced(db, generation, "publish_address",
                                                "addresses", text))

    async def resolve_address(self) -> tuple[tuple[str, int], ...]:
        if not await trio.to_thread.run_sync(self._someone_leads):
            return ()
        text = await self._run(lambda db: _get(db, "addresses"))
        if text is None:
            return ()
        try:
            return tuple((str(h), int(p)) for h, p in json.loads(str(text)))
        except (ValueError, TypeError):
            raise StoreCorrupt(f"leader address at {self.description}: expected JSON "
                               f"[[host, port], ...], got {str(text)[:80]!r}") from None

    async def release(self) -> None:
        generation, self._generation = self._generation, None
        fd, self._lock_fd = self._lock_fd, None
        if fd is None:
            return
        with trio.CancelScope(shield=True):
            if generation is not None and self._db is not None:
                try:
                    await self._run(lambda db: self._clear_addresses(db, generation))
                except (sqlite3.Error, OSError, StoreUnavailable, StoreCorrupt):
                    pass  # the next leader clears them anyway
            self._unlock(fd)

    async def aclose(self) -> None:
        await self.release()
        db, self._db = self._db, None
        if db is not None:
            async with self._mutex:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(db.close)

    async def usage(self) -> StoreUsage:
        """The database file and its write-ahead log, in bytes (``detail``: ``db_bytes``,
        ``wal_bytes``)."""
        paths = {"db_bytes": self.path, "wal_bytes": Path(f"{self.path}-wal")}
        detail = {name: await trio.to_thread.run_sync(self._size, path)
                  for name, path in paths.items()}
        return StoreUsage(kind="sqlite", size_bytes=sum(detail.values()), detail=detail)

    def _size(self, path: Path) -> int:
        try:
            return os.stat(path).st_size
        except FileNotFoundError:
            return 0  # no log between two connections
        except OSError as exc:
            raise StoreUnavailable(f"store {self.description}: cannot stat {path}: "
                                   f"{exc.strerror}") from None

    # -- the lock -----------------------------------------------------------------------------

    async def _lock(self, owner: str) -> int:
        """Poll the exclusive flock of ``PATH.lock`` (non-blocking, so a cancel is clean; the
        file system calls run in worker threads)."""
        while True:
            fd = await trio.to_thread.run_sync(self._open_lock)
            try:
                # the kernel offers no event for "lock released": poll it
                while not await trio.to_thread.run_sync(_try_flock, fd):  # noqa: ASYNC110
                    await trio.sleep(self.poll_interval)
                if await trio.to_thread.run_sync(self._claim, fd, owner):
                    return fd
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # the lock file was replaced while we waited: lock the new one

    def _open_lock(self) -> int:
        try:
            return os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StoreUnavailable(f"store {self.description}: cannot open the lock file "
                                   f"{self.lock_path}: {exc.strerror}") from None

    def _claim(self, fd: int, owner: str) -> bool:
        """Whether the locked file is still the one at ``PATH.lock``; if so, write the owner
        into it (for operators)."""
        if not _same_file(fd, self.lock_path):
            return False
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{owner}\n".encode(), 0)
        return True

    def _unlock(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _leader_owner(self) -> str | None:
        """The owner the leader wrote into the lock file, if some process holds its flock."""
        if not self._someone_leads():
            return None
        try:
            text = self.lock_path.read_text(encoding="utf-8", errors="replace").strip()
        except OSError:
            text = ""
        # Empty for the instant between the leader's flock and its write of the owner.
        return text or f"another process (it holds {self.lock_path})"

    def _someone_leads(self) -> bool:
        """Whether some process holds the leader's flock (a shared probe that fails)."""
        try:
            fd = os.open(self.lock_path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StoreUnavailable(f"store {self.description}: cannot open the lock file "
                                   f"{self.lock_path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing drops the probe's shared lock
        return False

    # -- the database (these run in worker threads) -------------------------------------------

    async def _run(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        async with self._mutex:
            return await trio.to_thread.run_sync(self._call, fn)

    def _call(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        try:
            if self._db is None:
                self._db = self._open()
            return fn(self._db)
        except sqlite3.OperationalError as exc:
            raise StoreUnavailable(f"store {self.description}: cannot use {self.path}: "
                                   f"{exc}") from None
        except sqlite3.DatabaseError as exc:
            raise StoreCorrupt(f"store {self.description}: expected a flodl-trio store at "
                               f"{self.path}, but SQLite says: {exc}; refusing it") from None

    def _open(self) -> sqlite3.Connection:
        try:
            db = sqlite3.connect(self.path, timeout=10.0, isolation_level=None,
                                 check_same_thread=False)
        except sqlite3.OperationalError as exc:
            raise StoreUnavailable(f"store {self.description}: cannot open {self.path}: "
                                   f"{exc}") from None
        try:
            self._check_or_create(db)
            mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StoreUnavailable(f"store {self.description}: expected WAL journal mode "
                                       f"on {self.path}, SQLite set {mode!r}")
            db.execute("PRAGMA synchronous=FULL")
            page = int(db.execute("PRAGMA page_size").fetchone()[0])
            db.execute(f"PRAGMA wal_autocheckpoint = {max(1, WAL_LIMIT // page)}")
            db.execute(f"PRAGMA journal_size_limit = {WAL_LIMIT}")
            self._db_ino = os.stat(self.path).st_ino
        except BaseException:
            db.close()
            raise
        return db

    def _check_or_create(self, db: sqlite3.Connection) -> None:
        app_id = db.execute("PRAGMA application_id").fetchone()[0]
        tables = {row[0] for row in db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'")}
        if app_id == 0 and not tables:
            db.execute("BEGIN IMMEDIATE")  # two processes creating it: one does
            try:
                if db.execute("PRAGMA application_id").fetchone()[0] == 0:
                    db.execute("CREATE TABLE IF NOT EXISTS flodl_store "
                               "(key TEXT PRIMARY KEY, value BLOB NOT NULL)")
                    db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                db.execute("COMMIT")
            except BaseException:
                db.rollback()
                raise
            app_id = db.execute("PRAGMA application_id").fetchone()[0]
            tables = {"flodl_store"}
        if app_id != APPLICATION_ID:
            raise StoreCorrupt(f"store {self.description}: expected a flodl-trio store at "
                               f"{self.path}, got an SQLite database of another application "
                               f"(application_id {app_id:#x}, tables "
                               f"{sorted(tables)[:5]}); refusing it")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version != SCHEMA_VERSION or "flodl_store" not in tables:
            raise StoreCorrupt(f"store {self.description}: expected a flodl-trio store of "
                               f"schema {SCHEMA_VERSION} at {self.path}, got schema {version} "
                               f"with tables {sorted(tables)[:5]}; refusing it")

    def _bump(self, db: sqlite3.Connection, owner: str) -> int:
        with _transaction(db):
            generation = _stored_generation(db, self.description) + 1
            _put(db, "generation", generation)
            _put(db, "owner", owner)
            db.execute("DELETE FROM flodl_store WHERE key = 'addresses'")
        return generation

    def _fenced(self, db: sqlite3.Connection, generation: int, what: str, key: str,
                value: bytes | str) -> None:
        with _transaction(db):
            stored = _stored_generation(db, self.description)
            if self._generation != generation or stored != generation:
                mine = "not leading" if self._generation is None else \
                    f"leading as generation {self._generation}"
                raise LeadershipLost(f"store {self.description}: {what} as generation "
                                     f"{generation} refused: the stored generation is {stored} "
                                     f"(this handle is {mine})")
            _put(db, key, value)

    def _clear_addresses(self, db: sqlite3.Connection, generation: int) -> None:
        with _transaction(db):
            if _stored_generation(db, self.description) == generation:
                db.execute("DELETE FROM flodl_store WHERE key = 'addresses'")

    def _leadership_problem(self, db: sqlite3.Connection) -> str | None:
        try:
            if os.stat(self.path).st_ino != self._db_ino:
                return f"{self.path} was replaced"
        except FileNotFoundError:
            return f"{self.path} was deleted"
        fd = self._lock_fd
        if fd is None or not _same_file(fd, self.lock_path):
            return f"the lock file {self.lock_path} was deleted or replaced"
        stored = _stored_generation(db, self.description)
        if stored != self._generation:
            return f"the stored generation is now {stored}"
        return None


class _transaction:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (rolled back on any exception)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        if kind is None:
            self.db.execute("COMMIT")
        else:
            self.db.rollback()


def _get(db: sqlite3.Connection, key: str) -> object:
    row = db.execute("SELECT value FROM flodl_store WHERE key = ?", (key,)).fetchone()
    return None if row is None else row[0]


def _put(db: sqlite3.Connection, key: str, value: object) -> None:
    db.execute("INSERT INTO flodl_store (key, value) VALUES (?, ?) "
               "ON CONFLICT (key) DO UPDATE SET value = excluded.value", (key, value))


def _stored_generation(db: sqlite3.Connection, where: str) -> int:
    value = _get(db, "generation")
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise StoreCorrupt(f"store {where}: expected the generation to be an unsigned integer, "
                           f"got {value!r}; refusing it")
    return value


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        mine, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)
