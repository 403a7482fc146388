"""The checks of ``open_relay``'s arguments, and the rank port it binds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import trio

from .._errors import ConfigError
from ..wire import MAX_MODEL_SIG_DIGEST, MAX_MODEL_SIG_NAME, MAX_MODEL_SIGS, SessionSalt

RankListen = None | int | trio.abc.Listener[Any] | Sequence[trio.abc.Listener[Any]]

def check_model_sigs(host: str, sigs: Mapping[str, bytes] | None) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    if sigs is None:
        return out
    if len(sigs) > MAX_MODEL_SIGS:
        raise ConfigError(f"open_relay({host!r}): expected at most {MAX_MODEL_SIGS} model "
                          f"signatures, got {len(sigs)}")
    for name, digest in sigs.items():
        if not isinstance(name, str) or not 1 <= len(name.encode("utf-8")) <= MAX_MODEL_SIG_NAME:
            raise ConfigError(f"open_relay({host!r}): expected model signature names of 1-"
                              f"{MAX_MODEL_SIG_NAME} UTF-8 bytes, got {name!r}")
        if not isinstance(digest, bytes) or not 1 <= len(digest) <= MAX_MODEL_SIG_DIGEST:
            raise ConfigError(f"open_relay({host!r}): model signature {name!r}: expected 1-"
                              f"{MAX_MODEL_SIG_DIGEST} bytes, got {digest!r:.40}")
        out[name] = digest
    return out


def check_relay_args(host: str, ranks: Sequence[int], world_size: int, *, salt: object,
                     model_sigs: Mapping[str, bytes] | None,
                     ) -> tuple[tuple[int, ...], dict[str, bytes]]:
    """``open_relay``'s arguments checked: its ranks (ascending) and its model signatures.

    Raises:
        ConfigError: the first argument that is not valid, named.
    """
    ordered = check_ranks(host, ranks, world_size)
    sigs = check_model_sigs(host, model_sigs)
    if not isinstance(salt, SessionSalt):
        raise ConfigError(f"open_relay: expected a SessionSalt, got {type(salt).__name__}")
    return ordered, sigs


def check_ranks(host: str, ranks: Sequence[int], world_size: int) -> tuple[int, ...]:
    if not isinstance(host, str) or not 1 <= len(host.encode("utf-8")) <= 255:
        raise ConfigError(f"open_relay: expected host to be 1-255 UTF-8 bytes, got {host!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        raise ConfigError(f"open_relay({host!r}): expected world_size > 0, got {world_size!r}")
    out = sorted(ranks)
    if not out:
        raise ConfigError(f"open_relay({host!r}): expected at least one rank, got none")
    for r in out:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size:
            raise ConfigError(f"open_relay({host!r}): rank {r!r} is outside [0, {world_size})")
    if len(set(out)) != len(out):
        raise ConfigError(f"open_relay({host!r}): ranks contain duplicates: {list(ranks)}")
    return tuple(out)


async def rank_listeners(rank_listen: RankListen) -> list[trio.abc.Listener[Any]]:
    if rank_listen is None or (isinstance(rank_listen, int) and not isinstance(rank_listen, bool)):
        port = 0 if rank_listen is None else rank_listen
        return list(await trio.open_tcp_listeners(port, host="127.0.0.1"))
    if isinstance(rank_listen, trio.abc.Listener):
        return [rank_listen]
    if isinstance(rank_listen, Sequence) and all(
            isinstance(x, trio.abc.Listener) for x in rank_listen):
        return list(rank_listen)
    raise ConfigError(f"open_relay: expected rank_listen None, a port or Listener(s), got "
                      f"{rank_listen!r}")


def bound_address(listeners: Sequence[trio.abc.Listener[Any]]) -> tuple[str, int] | None:
    """``(host, port)`` of the first listener when it is a TCP socket the relay bound; None for
    listeners it was given (a ``MemoryNetwork``'s)."""
    sock = getattr(listeners[0], "socket", None)
    if sock is None:
        return None
    name = sock.getsockname()
    return str(name[0]), int(name[1])
