"""What every ``flodl-trio`` command shares: exit codes, argument parsing helpers, the salt,
signals, and one-line error messages for operating-system failures.

Kept apart from :mod:`flodl_trio.cli` so that the demo and the command bodies import it without
importing the CLI entry point (no import cycle).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import tempfile
import warnings
from collections.abc import AsyncIterator, Callable

import trio

from .._errors import (
    ConfigError,
    UsageError as UsageError,  # re-exported: the CLI modules import it here
)
from ..wire import SessionSalt
from ..wire._salt_file import read_salt_file

SALT_ENV = "FLODL_SALT_HEX"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_SIGINT, EXIT_SIGTERM = 128 + signal.SIGINT, 128 + signal.SIGTERM  # 130, 143: shell custom


class CommandFailed(Exception):
    """The command ran and did not do what it was asked (exit code 1); the message is one line."""


class Terminated(BaseException):
    """SIGTERM in a command that runs outside Trio (the demo, plot): stop like Ctrl-C does."""


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def os_error_text(exc: OSError) -> str:
    """``strerror`` (or the message) without the ``[Errno N]`` prefix, for one-line errors."""
    return exc.strerror or str(exc)


def parse_address(text: str, *, what: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` → (host, port).

    >>> parse_address("127.0.0.1:7000", what="--listen")
    ('127.0.0.1', 7000)
    >>> parse_address("[::1]:7000", what="--listen")
    ('::1', 7000)
    """
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"{what}: expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def liveness_seconds(value: float) -> float:
    """``--coord-liveness-timeout``'s value, checked (relay and rank alike).

    >>> liveness_seconds(0)
    Traceback (most recent call last):
        ...
    flodl_trio._errors.UsageError: --coord-liveness-timeout: expected seconds > 0, got 0
    """
    if not value > 0:
        raise UsageError(f"--coord-liveness-timeout: expected seconds > 0, got {value!r}")
    return value


def world_size_arg(text: str) -> int | str:
    """argparse's ``type`` for the coordinator's ``--world-size``: ``N`` as an int (as every
    other command's), anything else as given for :func:`parse_world_range` to judge."""
    return int(text) if text.strip().isdigit() else text


def parse_world_range(given: str | int) -> tuple[int, int]:
    """The coordinator's ``--world-size``: ``N`` (a fixed world, N:N) or ``MIN:MAX``.

    >>> parse_world_range("4"), parse_world_range("2:6")
    ((4, 4), (2, 6))
    >>> parse_world_range("5:3")
    Traceback (most recent call last):
        ...
    flodl_trio._errors.UsageError: --world-size: expected N or MIN:MAX with 1 <= MIN <= MAX, \
got '5:3' (MIN 5 is above MAX 3)
    """
    text = str(given)
    low, sep, high = text.strip().partition(":")
    expected = "--world-size: expected N or MIN:MAX with 1 <= MIN <= MAX, got"
    if not low.isdigit() or (sep and not high.isdigit()):
        raise UsageError(f"{expected} {text!r}")
    least, most = int(low), int(high) if sep else int(low)
    if least < 1 or most < 1:
        raise UsageError(f"{expected} {text!r} (a world of 0 ranks cannot run)")
    if least > most:
        raise UsageError(f"{expected} {text!r} (MIN {least} is above MAX {most})")
    return least, most


def parse_model_sigs(items: list[str]) -> dict[str, bytes]:
    """``["encoder=00ff"]`` → {"encoder": b"\\x00\\xff"}.

    >>> parse_model_sigs(["encoder=00ff"])
    {'encoder': b'\\x00\\xff'}
    """
    out: dict[str, bytes] = {}
    for item in items:
        name, sep, digest = item.partition("=")
        try:
            value = bytes.fromhex(digest)
        except ValueError:
            value = b""
        if not sep or not name or not value:
            raise UsageError(f"--model-sig: expected NAME=HEX (a hex digest), got {item!r}")
        out[name] = value
    return out


def parse_ranks(text: str) -> list[int]:
    """``0-3,8`` → [0, 1, 2, 3, 8].

    >>> parse_ranks("0-3,8")
    [0, 1, 2, 3, 8]
    """
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise UsageError(f"--ranks: expected a list like 0-3,8, got {text!r}")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise UsageError(f"--ranks: range {part!r} runs backwards")
        out.extend(range(a, b + 1))
    if not out:
        raise UsageError(f"--ranks: expected at least one rank, got {text!r}")
    return out


def load_salt(args: argparse.Namespace, *, long_running: bool) -> SessionSalt:
    """The salt from --salt-file, $FLODL_SALT_HEX or --salt-hex (which shows in ``ps``).

    Raises:
        UsageError: no salt given, or the salt file cannot be read, may be read by others than
            its owner (not mode 0600) or does not hold 32 hex characters.
        ConfigError: the salt from the environment or --salt-hex is not 32 hex characters.
    """
    if getattr(args, "salt_file", None):
        try:
            text = read_salt_file(args.salt_file, what="--salt-file")
        except FileNotFoundError as exc:
            raise UsageError(f"--salt-file {args.salt_file!r}: {os_error_text(exc)}") from None
        except ConfigError as exc:  # unreadable, readable by others, not text: it says which
            raise UsageError(str(exc)) from None
        try:
            return SessionSalt.from_hex(text)
        except ConfigError as exc:
            raise UsageError(f"--salt-file {args.salt_file!r}: {exc}") from None
    if getattr(args, "salt_hex", None):
        if long_running:
            warnings.warn(
                "--salt-hex puts the session secret on the command line, where `ps` shows it to "
                f"every user; prefer --salt-file or ${SALT_ENV}",
                stacklevel=1,
            )
        return SessionSalt.from_hex(args.salt_hex)
    env = os.environ.get(SALT_ENV)
    if env:
        return SessionSalt.from_hex(env)
    raise UsageError(f"no session salt: pass --salt-file FILE or set ${SALT_ENV} "
                     "(`flodl-trio salt` prints a fresh one)")


def check_writable(path: str, *, what: str) -> None:
    """Fail now, in one line, rather than after formation, if ``path`` cannot be appended to."""
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise UsageError(f"{what} {path!r}: {os_error_text(exc)}") from None


def check_replaceable(path: str, *, what: str) -> None:
    """Fail now, in one line, if a file cannot be written at ``path`` by
    :func:`replace_text` (its directory must take a new file); nothing is left behind."""
    if os.path.isdir(path):
        raise UsageError(f"{what} {path!r}: expected a file, got a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".flodl-", dir=os.path.dirname(path) or ".")
    except OSError as exc:
        raise UsageError(f"{what} {path!r}: {os_error_text(exc)}") from None
    os.close(fd)
    os.unlink(probe)


def _replace_sync(path: str, text: str) -> None:
    directory = os.path.dirname(path) or "."
    fd, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temporary, 0o644)  # mkstemp's 0600 would hide a summary from its readers
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


async def replace_text(path: str, text: str, *, what: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a temporary file renamed over it): a
    process killed meanwhile leaves the previous file, or none, never an empty one."""
    try:
        await trio.to_thread.run_sync(_replace_sync, path, text)
    except OSError as exc:
        raise CommandFailed(f"{what} {path!r}: {os_error_text(exc)}") from None


class SignalStop:
    """SIGINT / SIGTERM → a graceful stop: cancel one scope, remember which signal it was.

    Make it from a receiver opened before anything the signal should stop gracefully (a signal
    arriving early is then queued, not lost): ``with trio.open_signal_receiver(*STOP_SIGNALS) as
    signals: stop = SignalStop(signals)``; then run :meth:`watch` in the nursery to cancel.
    """

    def __init__(self, signals: AsyncIterator[int]) -> None:
        self.signum: int | None = None
        self._signals = signals
        self._divert: Callable[[int], bool] | None = None

    def divert(self, handler: Callable[[int], bool] | None) -> None:
        """Offer each signal to ``handler`` first: when it returns True the signal was
        handled (a relay's first SIGTERM drains it) and the watch goes on."""
        self._divert = handler

    async def watch(self, scope: trio.CancelScope) -> None:
        async for signum in self._signals:
            if self._divert is not None and self._divert(signum):
                continue
            self.signum = signum
            scope.cancel()
            return

    @property
    def exit_code(self) -> int:
        assert self.signum is not None
        return 128 + self.signum

    def describe(self) -> str:
        assert self.signum is not None
        return signal_name(self.signum)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
