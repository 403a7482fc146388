"""The session salt in a file (``SessionSalt.from_file`` / ``SessionSalt.save``, ``flodl-trio
--salt-file``): 32 hex characters and a newline, in a file only its owner may read or write.

The salt is the run's secret: whoever reads it can forge every frame of the run. So a file that
its group or other users may read or write (any of the mode bits 0o077) is refused, as ssh
refuses such a private key, and a salt is saved with mode 0600, never over an existing file (a
running session may be using it). The file appears whole or not at all: it is written under a
temporary name and then linked to its own, so a process reading it while another saves it never
reads half a salt.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from .._errors import ConfigError

MAX_SALT_FILE = 4096  # bytes read at most: a salt file is 33 bytes


def read_salt_file(path: str | os.PathLike[str], *, what: str = "salt file") -> str:
    """The text of the salt file at ``path`` (not yet parsed as hex).

    Args:
        what: how messages name the file (``"--salt-file"`` on the command line).

    Raises:
        FileNotFoundError: there is no file at ``path``.
        ConfigError: it cannot be read, is not a regular file, its group or other users may
            read or write it, or it is not text; the message names the file.
    """
    name = f"{what} {str(path)!r}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ConfigError(f"{name}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{name}: expected a regular file holding the salt, got "
                              f"{_kind(info.st_mode)}")
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o077:
            raise ConfigError(f"{name}: expected mode 0600 (chmod 600 it: only its owner may "
                              f"read the run's secret), got {mode:04o}")
        data = os.read(fd, MAX_SALT_FILE)
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{name}: expected 32 hex characters as text, got bytes that are "
                          "not UTF-8") from None


def write_salt_file(path: str | os.PathLike[str], text: str) -> None:
    """Create ``path`` holding ``text`` and a newline, mode 0600, durably; never overwrite.

    Raises:
        FileExistsError: a file (or anything) already exists at ``path``.
        ConfigError: it cannot be written (a missing directory, no permission); the message
            names the file.
    """
    target = Path(path)
    temporary = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ConfigError(f"salt file {str(path)!r}: cannot create it: "
                          f"{exc.strerror or exc}") from None
    try:
        os.fchmod(fd, 0o600)  # whatever the umask took away or left
        os.write(fd, f"{text}\n".encode())
        os.fsync(fd)
        os.close(fd)
        fd = -1
        # A link never replaces an existing file, and the salt appears whole at its name.
        os.link(temporary, target)
    except FileExistsError:
        raise
    except OSError as exc:
        raise ConfigError(f"salt file {str(path)!r}: cannot write it: "
                          f"{exc.strerror or exc}") from None
    finally:
        if fd >= 0:
            os.close(fd)
        temporary.unlink(missing_ok=True)
    _sync_directory(target.parent)


def _sync_directory(directory: Path) -> None:
    """Make the new name durable too (a crash right after saving must not lose the salt)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return  # the salt itself is on disk; only its name may not be
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a pipe"
    return "a special file"
