"""``open_store(url)``: a session store from its command-line form."""

from __future__ import annotations

from .._errors import ConfigError
from ._base import MemoryStore, SessionStore
from ._etcd import EtcdStore
from ._sqlite import SqliteStore

ACCEPTED = ("sqlite:PATH", "etcd://HOST:PORT[,HOST:PORT...]/PREFIX", "memory:[NAME]")


def open_store(url: str, *, ttl: float = 2.0, connect_timeout: float = 5.0) -> SessionStore:
    """The store that ``url`` names (no IO happens until the store is used).

    - ``sqlite:PATH``: a :class:`SqliteStore` on ``PATH`` (relative or absolute);
    - ``etcd://HOST:PORT[,HOST:PORT...]/PREFIX``: an :class:`EtcdStore` on those endpoints,
      keys under ``PREFIX``, with ``ttl`` and ``connect_timeout``;
    - ``memory:`` or ``memory:NAME``: a fresh :class:`MemoryStore` (this process only).

    Raises:
        ConfigError: any other form (the message quotes it and lists the accepted forms).
    """
    def bad(why: str) -> ConfigError:
        return ConfigError(f"store {url!r}: {why}; expected one of {', '.join(ACCEPTED)}")

    scheme, sep, rest = url.partition(":")
    if not sep:
        raise bad("no scheme")
    if scheme == "sqlite":
        path = rest.removeprefix("//") if rest.startswith("///") else rest
        if not path:
            raise bad("no path after 'sqlite:'")
        return SqliteStore(path)
    if scheme == "memory":
        return MemoryStore(name=rest or "memory")
    if scheme == "etcd":
        if not rest.startswith("//"):
            raise bad("expected '//' after 'etcd:'")
        hosts, slash, prefix = rest[2:].partition("/")
        if not hosts or not slash or not prefix.strip("/"):
            raise bad("expected endpoints then '/PREFIX'")
        try:
            return EtcdStore(hosts, prefix, ttl=ttl, connect_timeout=connect_timeout)
        except ConfigError as exc:
            raise bad(str(exc)) from None
    raise bad(f"unknown scheme {scheme!r}")
