"""What :class:`~flodl_trio.store.EtcdStore` needs besides its key prefix: the endpoints (plain
HTTP or TLS), TLS files and an etcd user (from keyword arguments, a store URL's query or
environment variables), and the shortest lease TTL that rides out an etcd leader election.

>>> min_ttl(endpoints=3, request_timeout=0.5, election_timeout=1.0)
5
>>> min_ttl(endpoints=3, request_timeout=0.5, election_timeout=0.5)
3
>>> min_ttl(endpoints=1, request_timeout=0.5, election_timeout=1.0)
1
"""

from __future__ import annotations

import math
import ssl
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from .._errors import ConfigError

# Environment variables a store URL falls back on (never the password itself on a command line).
ENV = {"ca": "FLODL_ETCD_CA", "cert": "FLODL_ETCD_CERT", "key": "FLODL_ETCD_KEY",
       "user": "FLODL_ETCD_USER", "password_file": "FLODL_ETCD_PASSWORD_FILE"}
PASSWORD_ENV = "FLODL_ETCD_PASSWORD"
TLS_KEYS = ("ca", "cert", "key")
NUMBERS = ("ttl", "election_timeout", "request_timeout")
QUERY_KEYS = (*ENV, *NUMBERS)
# What a renewal needs once etcd has a leader again: two round trips (lease keepalive, leader key
# read) and the scheduling around them, on a loaded machine.
RENEWAL_SLACK = 0.1


def step_down_margin(ttl: float) -> float:
    """How much earlier than its lease a leader steps down: time to stop acting (closing its
    connections) before a standby can win."""
    return min(0.1 * ttl, 0.25)


def min_ttl(*, endpoints: int, request_timeout: float, election_timeout: float) -> int:
    """The shortest lease TTL (whole seconds, as etcd grants them) with which a leader renewing
    through ``endpoints`` endpoints keeps its leadership while etcd elects a new leader.

    The worst case: etcd loses its leader just before a renewal is due (``ttl / 3`` after the
    last good one). Requests stall until the other members elect one (up to two election
    timeouts: raft's timer is randomised between one and two), a renewal may then first try a
    lost member (``request_timeout`` each, at most a minority of the members listed), and it
    must succeed before the leader's deadline (the TTL less :func:`step_down_margin`). With one
    endpoint there is nothing to fail over to and nothing is enforced (1).
    """
    if endpoints < 2:
        return 1
    lost = max(1, (endpoints - 1) // 2)  # a minority: with more lost, etcd itself stops
    need = 2 * election_timeout + lost * request_timeout + RENEWAL_SLACK
    # ttl - ttl/3 - step_down_margin(ttl) >= need, margin 0.1 ttl below 2.5 s, 0.25 s above
    ttl = need / (2 / 3 - 0.1)
    if ttl >= 2.5:
        ttl = 1.5 * (need + 0.25)
    return max(1, math.ceil(ttl - 1e-9))


def lease_ttl(ttl: float | None, *, endpoints: int, connect_timeout: float,
              request_timeout: float, election_timeout: float) -> tuple[float, int]:
    """The TTL a store asks for (``ttl``, or 2 s or :func:`min_ttl` if longer) and that minimum.

    Raises:
        ConfigError: a value not above 0, or (several endpoints) a ``ttl`` below the minimum,
            naming both.
    """
    for name, value in (("ttl", 1.0 if ttl is None else ttl),
                        ("connect_timeout", connect_timeout),
                        ("request_timeout", request_timeout),
                        ("election_timeout", election_timeout)):
        if not value > 0:
            raise ConfigError(f"etcd store: expected {name} > 0, got {value!r}")
    least = min_ttl(endpoints=endpoints, request_timeout=request_timeout,
                    election_timeout=election_timeout)
    if ttl is None:
        return float(max(2, least)), least
    if endpoints > 1 and math.ceil(ttl) < least:  # etcd grants whole seconds
        raise ConfigError(
            f"etcd store: expected a ttl of at least {least} s, got {ttl:g} s: a shorter lease "
            f"cannot ride out an etcd leader election (election_timeout {election_timeout:g} s)"
            f" plus a lost member (request_timeout {request_timeout:g} s) across {endpoints} "
            f"endpoints; raise ttl, or give the cluster's own --election-timeout as "
            f"election_timeout if it is shorter")
    return ttl, least


@attrs.frozen
class EtcdAccess:
    """How the transport reaches a secured etcd.

    Attributes:
        ssl_context: TLS for every endpoint (None: plain HTTP).
        user: the etcd user to authenticate as (None: no authentication).
        password: its password (never shown in a repr).
        client_cert: whether a client certificate was given (for the errors' advice).
    """

    ssl_context: ssl.SSLContext | None = None
    user: str | None = None
    password: str | None = attrs.field(default=None, repr=False)
    client_cert: bool = False


def parse_endpoints(endpoints: str | Sequence[str | tuple[str, int]],
                    ) -> tuple[list[tuple[str, int]], bool]:
    """``"HOST:PORT,..."`` or a list of ``HOST:PORT``, ``http://HOST:PORT``,
    ``https://HOST:PORT`` or ``(host, port)`` -> the (host, port) pairs and whether they are TLS
    (all or none of them)."""
    items = [e for e in endpoints.split(",") if e.strip()] if isinstance(endpoints, str) \
        else list(endpoints)
    parsed: list[tuple[str, int]] = []
    schemes = set()
    for item in items:
        if isinstance(item, str):
            scheme, host, port = _parse_endpoint(item)
            schemes.add(scheme)
            parsed.append((host, port))
        else:
            parsed.append((str(item[0]), int(item[1])))
    if schemes == {"http", "https"}:
        raise ConfigError(f"etcd endpoints {endpoints!r}: expected all https:// or none, got "
                          f"both http:// and https://")
    return parsed, "https" in schemes


def _parse_endpoint(text: str) -> tuple[str, str, int]:
    spec = text.strip()
    scheme = "http"
    for known in ("http", "https"):
        if spec.startswith(f"{known}://"):
            scheme, spec = known, spec[len(known) + 3:].rstrip("/")
    if "://" in spec:
        raise ConfigError(f"etcd endpoint {text!r}: expected HOST:PORT, http://HOST:PORT or "
                          f"https://HOST:PORT")
    host, sep, port = spec.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"etcd endpoint {text!r}: expected HOST:PORT with a port in 1..65535")
    return scheme, host, int(port)


def make_access(*, tls: bool, ca_file: str | None = None, cert_file: str | None = None,
                key_file: str | None = None, user: str | None = None,
                password: str | None = None, password_file: str | None = None) -> EtcdAccess:
    """Check the TLS and user options together and load them (the CA, the client certificate and
    the password file are read now: a missing or unreadable one is a ConfigError at once)."""
    files = {"ca_file": ca_file, "cert_file": cert_file, "key_file": key_file}
    given = [name for name, value in files.items() if value]
    if given and not tls:
        raise ConfigError(f"etcd store: {'/'.join(given)} given for plain-HTTP endpoints: write "
                          f"them as https://HOST:PORT (etcds:// in a store URL) to use TLS")
    if key_file and not cert_file:
        raise ConfigError("etcd store: key_file given without cert_file (the client certificate "
                          "it belongs to)")
    if password is not None and password_file:
        raise ConfigError("etcd store: expected password or password_file, got both")
    if password_file:
        password = _read_password(password_file)
    if user is not None and not user:
        raise ConfigError("etcd store: expected a non-empty user name, got ''")
    if (user is None) != (password is None):
        raise ConfigError("etcd store: expected a user and its password together, got "
                          + ("a user without a password (password_file, or "
                             f"${ENV['password_file']})" if user else "a password without a "
                             "user"))
    context = _ssl_context(ca_file, cert_file, key_file) if tls else None
    return EtcdAccess(ssl_context=context, user=user, password=password,
                      client_cert=bool(cert_file))


def _read_password(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"etcd store: cannot read password_file {path!r}: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
    password = text.rstrip("\r\n")  # the newline an editor or `echo` adds is not part of it
    if not password:
        raise ConfigError(f"etcd store: password_file {path!r} is empty")
    return password


def _ssl_context(ca_file: str | None, cert_file: str | None,
                 key_file: str | None) -> ssl.SSLContext:
    try:
        context = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"etcd store: cannot load the CA bundle ca_file {ca_file!r}: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
    if cert_file:
        try:
            context.load_cert_chain(cert_file, key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"etcd store: cannot load the client certificate cert_file "
                              f"{cert_file!r} with key_file {key_file!r}: "
                              f"{getattr(exc, 'strerror', None) or exc}") from None
    return context


def store_url_args(scheme: str, rest: str, *, env: Mapping[str, str],
                   ttl: float | None) -> tuple[list[str], str, dict[str, Any]]:
    """``etcd://`` or ``etcds://`` store URL (what follows ``scheme:``) -> endpoints, prefix and
    :class:`EtcdStore` keyword arguments, the query's options first, then the environment's.

    Raises:
        ConfigError: no ``//``, no prefix, an unknown or repeated query option, a password in
            the URL, TLS options for a plain ``etcd://`` URL.
    """
    if not rest.startswith("//"):
        raise ConfigError(f"expected '//' after '{scheme}:'")
    location, _, query = rest[2:].partition("?")
    hosts, slash, prefix = location.partition("/")
    if "@" in hosts:
        raise ConfigError(f"a user or password in the URL shows in `ps`: use ?user= and "
                          f"?password_file= or ${ENV['user']} and ${ENV['password_file']} or "
                          f"${PASSWORD_ENV}")
    if not hosts or not slash or not prefix.strip("/"):
        raise ConfigError("expected endpoints then '/PREFIX'")
    options = _query(query)
    tls = scheme == "etcds"
    kwargs: dict[str, Any] = {"ttl": ttl}
    for name in NUMBERS:
        if name in options:
            kwargs[name] = _number(name, options[name])
    for name, variable in ENV.items():
        value = options.get(name) or env.get(variable) or None
        if value and name in TLS_KEYS and not tls:
            source = f"?{name}=" if name in options else f"${variable}"
            raise ConfigError(f"{source} is for TLS, but {scheme}:// is plain HTTP: use etcds:// "
                              f"for a TLS etcd" + ("" if name in options else
                                                   f" (or unset {variable})"))
        kwargs[{"ca": "ca_file", "cert": "cert_file", "key": "key_file"}.get(name, name)] = value
    if not kwargs["password_file"] and env.get(PASSWORD_ENV):
        kwargs["password"] = env[PASSWORD_ENV]
    scheme_prefix = "https://" if tls else ""
    return [scheme_prefix + h for h in hosts.split(",") if h.strip()], prefix, kwargs


def _query(query: str) -> dict[str, str]:
    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ConfigError(f"expected NAME=VALUE&... after '?', got {query!r}") from None
    options: dict[str, str] = {}
    for name, value in pairs:
        if name == "password":
            raise ConfigError(f"a password in the URL shows in `ps`: use ?password_file= or "
                              f"${ENV['password_file']} or ${PASSWORD_ENV}")
        if name not in QUERY_KEYS:
            raise ConfigError(f"unknown option {name!r} after '?'; expected "
                              f"{', '.join(QUERY_KEYS)}")
        if name in options:
            raise ConfigError(f"option {name!r} given twice after '?'")
        options[name] = value
    return options


def _number(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise ConfigError(f"?{name}= expected seconds > 0, got {text!r}")
    return value
