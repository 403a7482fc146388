"""Session salt, truncated HMAC and key derivation (SPEC §2.1, §2.5)."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import string
from typing import Final

from .._errors import ConfigError
from ._salt_file import read_salt_file, write_salt_file

SALT_LEN: Final = 16
MAC_LEN: Final = 8
_HEX_DIGITS: Final = frozenset(string.hexdigits)


class SessionSalt:
    """The 16 random bytes shared by every process of one training run.

    It keys every MAC of the run: a process with another salt fails at its first handshake.
    """

    __slots__ = ("_bytes",)

    def __init__(self, b: bytes) -> None:
        if not isinstance(b, bytes | bytearray | memoryview):
            raise ConfigError(f"SessionSalt: expected {SALT_LEN} bytes, got {type(b).__name__}")
        raw = bytes(b)
        if len(raw) != SALT_LEN:
            raise ConfigError(f"SessionSalt: expected exactly {SALT_LEN} bytes, got {len(raw)}")
        self._bytes = raw

    @classmethod
    def generate(cls) -> SessionSalt:
        """A fresh salt from :func:`secrets.token_bytes`."""
        return cls(secrets.token_bytes(SALT_LEN))

    @classmethod
    def from_hex(cls, s: str) -> SessionSalt:
        """Parse 32 hex chars (either case, surrounding whitespace ignored).

        Raises:
            ConfigError: wrong length or a non-hex character; the message names which.
        """
        if not isinstance(s, str):
            raise ConfigError(f"salt hex: expected a string, got {type(s).__name__}")
        text = s.strip()
        if len(text) != 2 * SALT_LEN:
            raise ConfigError(
                f"salt hex: expected {2 * SALT_LEN} hex characters, got {len(text)}"
            )
        for i, ch in enumerate(text):
            if ch not in _HEX_DIGITS:
                raise ConfigError(
                    f"salt hex: expected only hex digits [0-9a-fA-F], got {ch!r} at position {i}"
                )
        return cls(bytes.fromhex(text))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, create: bool = False) -> SessionSalt:
        """Read the salt that :meth:`save` (or ``flodl-trio salt FILE``) wrote at ``path``:
        32 hex characters (surrounding whitespace ignored) in a file that only its owner may
        read or write (mode 0600).

        Args:
            create: when there is no file at ``path``, generate a salt and :meth:`save` it
                there first. A program that keeps its salt this way finds the same one when it
                is restarted, so its coordinator adopts its own session from its store.

        Raises:
            ConfigError: no file (without ``create``); a file that cannot be read, that its
                group or other users may read or write, or that does not hold 32 hex
                characters; the message names the file.
        """
        try:
            text = read_salt_file(path)
        except FileNotFoundError:
            if not create:
                raise ConfigError(f"salt file {str(path)!r}: expected a salt file, found "
                                  "none (SessionSalt.from_file(path, create=True) or "
                                  "`flodl-trio salt FILE` makes one)") from None
            salt = cls.generate()
            try:
                salt.save(path)
                return salt
            except ConfigError:
                if not os.path.exists(path):
                    raise
            text = read_salt_file(path)  # another process saved one first: use that one
        try:
            return cls.from_hex(text)
        except ConfigError as exc:
            raise ConfigError(f"salt file {str(path)!r}: {exc}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the salt to a new file at ``path`` (its hex and a newline, mode 0600,
        durably), for :meth:`from_file`. An existing file is never overwritten: a running
        session may be using the salt it holds.

        Raises:
            ConfigError: something exists at ``path``, or it cannot be written; the message
                names it.
        """
        try:
            write_salt_file(path, self.hex())
        except FileExistsError:
            raise ConfigError(f"salt file {str(path)!r}: expected no file there, got an "
                              "existing one (a salt is never overwritten: a running session "
                              "may use it)") from None

    def hex(self) -> str:
        """32 lowercase hex characters."""
        return self._bytes.hex()

    def __bytes__(self) -> bytes:
        return self._bytes

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SessionSalt):
            return NotImplemented
        return hmac.compare_digest(self._bytes, bytes(other))

    def __hash__(self) -> int:
        return hash(self._bytes)

    def __repr__(self) -> str:
        # Never print the secret itself: reprs end up in logs.
        return f"SessionSalt(<{SALT_LEN} bytes, fingerprint {fingerprint(self._bytes)}>)"


def fingerprint(key: bytes) -> str:
    """A short non-secret identifier of a key, for logs."""
    return hashlib.sha256(b"flodl-trio/fingerprint" + key).hexdigest()[:8]


def mac64(key: bytes, data: bytes) -> bytes:
    """The first 8 bytes of HMAC-SHA256(key, data)."""
    return hmac.digest(key, data, "sha256")[:MAC_LEN]


_BLOCK = 64  # SHA-256's block size
_IPAD = bytes(x ^ 0x36 for x in range(256))
_OPAD = bytes(x ^ 0x5C for x in range(256))


class Mac64:
    """``mac64`` with a fixed key, keyed once.

    HMAC-SHA256 (RFC 2104) from two precomputed SHA-256 states, the key XOR ipad and the key XOR
    opad, as the standard library's own fallback builds it: copying two plain hash states costs
    less than copying OpenSSL's HMAC context, and the tag is on the hot path of every frame and
    record. ``tests/wire/test_records.py`` checks it against ``hmac.digest`` for keys of every
    length class (empty, short, one block, longer than a block).
    """

    __slots__ = ("_inner", "_outer", "key")

    def __init__(self, key: bytes) -> None:
        self.key = bytes(key)
        block = self.key if len(self.key) <= _BLOCK else hashlib.sha256(self.key).digest()
        block = block.ljust(_BLOCK, b"\0")
        self._inner = hashlib.sha256(block.translate(_IPAD))
        self._outer = hashlib.sha256(block.translate(_OPAD))

    def tag(self, *parts: bytes | bytearray) -> bytes:
        inner = self._inner.copy()
        for part in parts:
            inner.update(part)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()[:MAC_LEN]

    def tag2(self, head: bytes | bytearray, payload: bytes | bytearray) -> bytes:
        """``tag(head, payload)`` without the argument tuple (the ControlFrame hot path)."""
        inner = self._inner.copy()
        inner.update(head)
        inner.update(payload)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()[:MAC_LEN]

    def verify(self, tag: bytes | bytearray, *parts: bytes | bytearray) -> bool:
        return hmac.compare_digest(self.tag(*parts), tag)


# Keys whose MAC state many connections share: the session salt (every ControlFrame, and the
# Challenge record of every upstream handshake). A Mac64 is never changed once keyed (``tag``
# copies its states), so one instance serves them all. Bounded: a process rarely holds more
# than one or two salts.
_SHARED_MACS: dict[bytes, Mac64] = {}
_SHARED_MAX = 16


def shared_mac(key: SessionSalt | bytes) -> Mac64:
    """The one ``Mac64`` of ``key`` for this process (keyed once: issue 38, a join costs no
    HMAC key schedule for the salt)."""
    raw = bytes(key)
    mac = _SHARED_MACS.get(raw)
    if mac is None:
        if len(_SHARED_MACS) >= _SHARED_MAX:
            _SHARED_MACS.clear()
        mac = _SHARED_MACS[raw] = Mac64(raw)
    return mac


def mac_of(key: bytes) -> Mac64:
    """``key``'s shared ``Mac64`` when it is a shared key (the salt), else a new one."""
    return _SHARED_MACS.get(key) or Mac64(key)


def key_bytes(key: SessionSalt | bytes) -> bytes:
    return bytes(key)


def hs_key(salt: SessionSalt | bytes, coord_nonce: bytes) -> bytes:
    """Handshake key: HMAC-SHA256(salt, b"flodl-trio/hs/v1" ‖ coord_nonce), 32 bytes."""
    return hmac.digest(bytes(salt), b"flodl-trio/hs/v1" + bytes(coord_nonce), "sha256")


def conn_key(salt: SessionSalt | bytes, coord_nonce: bytes, relay_nonce: bytes) -> bytes:
    """Connection key: HMAC-SHA256(salt, b"flodl-trio/conn/v1" ‖ coord_nonce ‖ relay_nonce)."""
    data = b"flodl-trio/conn/v1" + bytes(coord_nonce) + bytes(relay_nonce)
    return hmac.digest(bytes(salt), data, "sha256")
