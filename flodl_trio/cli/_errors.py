"""The one line a ``flodl-trio`` command prints when it fails: the cause a person can act on
first, under :data:`MAX_LINE` characters; ``--debug`` shows the whole message and the traceback.

>>> shorten("a: b; c", 200)
'a: b; c'
>>> shorten("first part; " + "x" * 300, 60)
'first part ... (--debug for the full message)'
>>> shorten("a failure; dead ranks [0, 1] (no live rank is left); why: " + "x" * 100, 80)
'a failure; dead ranks [0, 1] ... (--debug for the full message)'
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator

from ..wire._handshake import WRONG_SALT_HINT

MAX_LINE = 200
_MORE = " ... (--debug for the full message)"
RANK_REJECTED = "expected a handshake ack"  # a rank's HandshakeError: its relay closed each try
NOBODY_CAME = "hosts joined: none; rejected connections: none"  # a coordinator's FormationTimeout
RELAY_SAID = "; the relay said: "  # how a rank's CoordinatorLost quotes its relay's last notice

# The peer each network command dials, and the option that names it.
PEERS = {"status": ("coordinator", "address"), "relay": ("coordinator", "coordinator"),
         "rank": ("relay", "relay")}


def causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, its causes and contexts, and the leaves of every exception group among them."""
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending and len(seen) < 64:  # bounded: chains are short, groups are small
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
        for linked in (current.__cause__, current.__context__):
            if linked is not None:
                pending.append(linked)


def network_cause(exc: BaseException, *, peer: str, address: str) -> str | None:
    """What a person can do about a failed dial to ``address``, or None if it was not one."""
    found = list(causes(exc))
    if any(isinstance(c, ConnectionRefusedError) for c in found):
        return f"connection refused: is a {peer} running at {address}?"
    for cause in found:
        if isinstance(cause, socket.gaierror):
            why = cause.strerror or str(cause)
            if why.startswith("cannot resolve "):  # it names the host itself (a published one)
                return f"{why}: check the {peer} address"
            if "://" in address or "," in address:  # a store, a list: which name is unknown
                return f"cannot resolve a name of {address} ({why}): check the {peer} address"
            host = address.rpartition(":")[0]
            return f"cannot resolve {host!r} ({why}): check the {peer} address"
    for cause in found:
        if isinstance(cause, OSError) and cause.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return f"no route to {address} ({cause.strerror}): check the {peer} address"
    return None


def shorten(text: str, limit: int) -> str:
    """``text`` if it is under ``limit`` characters, else its leading ``;``-separated clauses,
    a clause without the parenthesis it did not finish, or its start up to a whole word, and a
    pointer to ``--debug``.

    >>> shorten("word " * 30, 60)
    'word word word word ... (--debug for the full message)'
    """
    text = " ".join(text.split())  # one line, whatever the message held
    if len(text) < limit:  # under the limit, as the module says (a 200-character line was not)
        return text
    room = limit - 1 - len(_MORE)
    head = text[:room]
    cut = max(head.rfind("; "), head.rfind(" ("))
    if cut <= room // 3:  # no clause to end on: at least a whole word
        cut = head.rfind(" ")
    if cut > room // 3:
        head = head[:cut]
    return head.rstrip(" ;,:") + _MORE


def error_line(exc: BaseException, *, command: str, who: str, address: str | None,
               default: str | None = None) -> str:
    """The whole stderr line for a failed command (without the trailing newline).

    Args:
        exc: what ended the command.
        command: the subcommand (``"status"``).
        who: the process, as its messages name it (``"rank 3"``, ``"relay host-a"``).
        address: the peer address the command dials (None: it dials none).
        default: the line when the failure is not a failed dial (None: the error's type and
            message).
    """
    if address is not None and command in PEERS:
        hint = network_cause(exc, peer=PEERS[command][0], address=address)
        if hint is not None:
            return shorten(f"flodl-trio: {who}: {hint}", MAX_LINE)
    if default is None:
        text = str(exc)
        if command == "rank" and address is not None and RANK_REJECTED in text:
            text = (f"{who}: the relay at {address} closed every handshake: is this rank one of "
                    "its --ranks, and do --world-size and the salt match its own? (its log says "
                    "which)")
        if command == "coordinator" and WRONG_SALT_HINT in text:
            # The salt is the thing to check: its clause goes before the hosts that joined.
            rejected = text[text.rfind("rejected connections: "):]
            text = f"{text.partition('; ')[0]}; {rejected}"
        if command == "coordinator" and NOBODY_CAME in text:  # nothing reached it at all
            text = (f"{text.partition('; ')[0]}: no relay dialed in; start each relay with "
                    "--coordinator set to an address of 'relays can dial'")
        _, said_sep, said = text.partition(RELAY_SAID)
        if said_sep and command == "rank":  # why the relay gave up is the cause to act on
            text = f"{who}: the relay said: {said}"
        default = f"flodl-trio: {type(exc).__name__}: {text}"
    return shorten(default, MAX_LINE)
