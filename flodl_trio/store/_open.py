"""``open_store(url)``: a session store from its command-line form."""

from __future__ import annotations

import os
from collections.abc import Mapping

from .._errors import ConfigError
from ._base import MemoryStore, SessionStore
from ._etcd import EtcdStore
from ._etcd_config import store_url_args
from ._sqlite import SqliteStore

ACCEPTED = ("sqlite:PATH", "etcd://HOST:PORT[,HOST:PORT...]/PREFIX[?OPTIONS]",
            "etcds://HOST:PORT[,HOST:PORT...]/PREFIX[?OPTIONS]", "memory:[NAME]")


def open_store(url: str, *, ttl: float | None = None, connect_timeout: float = 5.0,
               env: Mapping[str, str] | None = None) -> SessionStore:
    """The store that ``url`` names (no network IO happens until the store is used).

    - ``sqlite:PATH``: a :class:`SqliteStore` on ``PATH`` (relative or absolute);
    - ``etcd://HOST:PORT[,HOST:PORT...]/PREFIX``: an :class:`EtcdStore` on those endpoints,
      keys under ``PREFIX``, with ``ttl`` and ``connect_timeout``; ``etcds://`` for TLS. Options
      after ``?`` (``NAME=VALUE&...``): ``ca``, ``cert``, ``key`` (TLS files), ``user``,
      ``password_file``, ``ttl``, ``election_timeout``, ``request_timeout``; the ones not given
      come from ``$FLODL_ETCD_CA``, ``$FLODL_ETCD_CERT``, ``$FLODL_ETCD_KEY``,
      ``$FLODL_ETCD_USER``, ``$FLODL_ETCD_PASSWORD_FILE`` or ``$FLODL_ETCD_PASSWORD``. A
      password is never part of the URL (every ``ps`` would show it);
    - ``memory:`` or ``memory:NAME``: a fresh :class:`MemoryStore` (this process only).

    Args:
        url: the store's command-line form.
        ttl: an etcd store's lease TTL, unless the URL says (None: :class:`EtcdStore`'s).
        connect_timeout: an etcd store's bound of each call.
        env: where the ``FLODL_ETCD_*`` variables are read (None: ``os.environ``).

    Raises:
        ConfigError: any other form or option (the message quotes it and lists the accepted
            forms); a TLS or password file that cannot be read.
    """
    def bad(why: str) -> ConfigError:
        return ConfigError(f"store {_shown(url)!r}: {why}; expected one of "
                           f"{', '.join(ACCEPTED)}")

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
    if scheme in ("etcd", "etcds"):
        try:
            endpoints, prefix, options = store_url_args(
                scheme, rest, env=os.environ if env is None else env, ttl=ttl)
            return EtcdStore(endpoints, prefix, connect_timeout=connect_timeout, **options)
        except ConfigError as exc:
            raise bad(str(exc)) from None
    raise bad(f"unknown scheme {scheme!r}")


def _shown(url: str) -> str:
    """``url`` as an error quotes it: without its query (its file paths would push the reason
    out of a one-line error) and without a ``user:password@`` (that would leak into logs)."""
    scheme, sep, rest = url.partition("?")[0].partition("://")
    authority, slash, path = rest.partition("/")
    if sep and "@" in authority:
        authority = "***@" + authority.rpartition("@")[2]
    return scheme + sep + authority + slash + path
