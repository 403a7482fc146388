"""This machine's interface addresses, found without DNS, and the addresses a peer can dial.

A listener bound to a wildcard (``0.0.0.0``, ``::``) reports that wildcard as its address, which no
remote relay can dial. :func:`dialable_addresses` replaces each wildcard with the machine's
interface addresses of that family (non-loopback first, loopback last). Interfaces come from the
kernel (Linux: ``SIOCGIFADDR`` per interface and ``/proc/net/if_inet6``); elsewhere, from the
source address the routing table picks for a UDP socket that is connected but never sends. No
name is ever resolved.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
_IF_INET6 = Path("/proc/net/if_inet6")
# Documentation addresses (RFC 5737 / RFC 3849): connecting a UDP socket to one only asks the
# routing table which source address it would use; nothing is sent.
_PROBES = ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1"))


def _ipv4_by_ioctl() -> list[str]:
    found: list[str] = []
    try:
        import fcntl  # POSIX only

        names = [name for _, name in socket.if_nameindex()]
    except (ImportError, OSError):
        return found
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in names:
            request = struct.pack("256s", name.encode()[:15])
            with contextlib.suppress(OSError):  # an interface without an IPv4 address
                answer = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
                found.append(socket.inet_ntoa(answer[20:24]))
    return found


def _ipv6_from_proc() -> list[str]:
    try:
        lines = _IF_INET6.read_text(encoding="ascii").splitlines()
    except OSError:
        return []
    found: list[str] = []
    for line in lines:
        fields = line.split()
        if fields and len(fields[0]) == 32:
            found.append(str(ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    return found


def _by_route(family: int, probe: str) -> list[str]:
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((probe, 9))
            return [str(sock.getsockname()[0])]
    except OSError:  # no route of that family
        return []


def interface_addresses() -> list[str]:
    """Every IPv4 and IPv6 address of this machine's interfaces (loopback included)."""
    # SIOCGIFADDR's number and /proc/net/if_inet6 are Linux's; elsewhere, the routing table.
    found = _ipv4_by_ioctl() + _ipv6_from_proc() if sys.platform == "linux" else []
    if not found:
        for family, probe in _PROBES:
            found += _by_route(family, probe)
    return found


def _usable(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(text.split("%")[0])
    except ValueError:
        return None
    # A link-local IPv6 address needs a scope id a remote peer cannot know; never published.
    if ip.is_unspecified or ip.is_multicast or (ip.version == 6 and ip.is_link_local):
        return None
    return ip


def dialable_addresses(bound: Sequence[tuple[str, int]],
                       interfaces: Iterable[str]) -> tuple[tuple[str, int], ...]:
    """The addresses peers can dial for listeners bound to ``bound``.

    A wildcard becomes every usable interface address of its family on the same port, the
    machine's other addresses first and loopback last; a specific address stays as it is.

    >>> dialable_addresses([("0.0.0.0", 7000)], ["127.0.0.1", "10.1.2.3", "fe80::1", "::1"])
    (('10.1.2.3', 7000), ('127.0.0.1', 7000))
    >>> dialable_addresses([("127.0.0.1", 7000)], ["10.1.2.3"])
    (('127.0.0.1', 7000),)
    """
    usable = [ip for ip in (_usable(text) for text in interfaces) if ip is not None]
    out: list[tuple[str, int]] = []
    for host, port in bound:
        try:
            ip = ipaddress.ip_address(host.split("%")[0])
        except ValueError:
            ip = None
        if ip is None or not ip.is_unspecified:
            candidates = [(host, port)]
        else:
            family = [u for u in usable if u.version == ip.version]
            loopback = {u: None for u in family if u.is_loopback}
            if not loopback:  # the kernel did not say: the family's loopback always answers
                loopback = {ipaddress.ip_address("127.0.0.1" if ip.version == 4 else "::1"): None}
            ordered = [u for u in dict.fromkeys(family) if not u.is_loopback] + list(loopback)
            candidates = [(str(u), port) for u in ordered]
        out.extend(c for c in candidates if c not in out)
    non_loopback = [a for a in out if not _is_loopback(a[0])]
    return tuple(non_loopback + [a for a in out if _is_loopback(a[0])])


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return host == "localhost"
