"""TCP keepalive on every connection the library opens or accepts (SPEC §4.5, issue 13), with
intervals derived from the deadlines. Real loopback sockets: the point is what the OS was told."""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Callable
from functools import partial

import pytest
import trio

import flodl_trio as ft
from flodl_trio.local_cluster import open_local_cluster
from flodl_trio.net import _keepalive as keepalive_mod
from flodl_trio.net._keepalive import KeepAlive
from flodl_trio.net._listen import serve_each

from helpers import needs_ipv6

linux_keepalive = pytest.mark.skipif(
    not (hasattr(socket, "TCP_KEEPIDLE") and os.path.isdir("/proc/self/fd")),
    reason="needs TCP_KEEPIDLE and /proc/self/fd (Linux)",
)


def test_keepalive_finds_a_silent_peer_within_the_deadline() -> None:
    assert KeepAlive.within(30) == KeepAlive(30, idle=15, interval=5, probes=3)
    assert KeepAlive.within(12) == KeepAlive(12, idle=6, interval=2, probes=3)
    ten = KeepAlive.within(10)
    assert (ten.idle, ten.interval) == (7, 1) and ten.idle + 3 * ten.interval == 10
    # The kernel counts whole seconds: short deadlines get the 1 s minimum.
    assert KeepAlive.within(0.5) == KeepAlive(0.5, idle=1, interval=1, probes=3)
    # A disabled deadline keeps SO_KEEPALIVE with the system's own intervals.
    assert KeepAlive.within(math.inf).options() == [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]


def tcp_connections_of_this_process() -> list[socket.socket]:
    """Every connected IPv4/IPv6 TCP socket this process holds (dups; the caller closes)."""
    found: list[socket.socket] = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if any(fd == own.fileno() for own in found):  # a dup made above reused a listed fd
            continue
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            sock.close()
            continue
        try:
            sock.getpeername()
        except OSError:  # a listener, or not connected
            sock.close()
            continue
        found.append(sock)
    return found


def keepalive_of(sock: socket.socket) -> tuple[int, int, int, int, int]:
    return (sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT))


@linux_keepalive
async def test_both_ends_of_every_cluster_connection_have_keepalive_from_their_deadlines() -> None:
    # Distinct deadlines per role, so each socket shows which rule set it.
    coord_config = ft.CoordinatorConfig(world_size=3, heartbeat_timeout=12, write_stall_timeout=7)
    # (The relay's coord_liveness_timeout at most 2/3 of the ranks', as the cluster requires.)
    relay_config = ft.RelayConfig(write_stall_timeout=18, coord_liveness_timeout=16)
    rank_config = ft.RankConfig(coord_liveness_timeout=24, write_stall_timeout=30)
    async with open_local_cluster({"host-a": [0, 1], "host-b": [2]}, transport="tcp",
                                  coord_config=coord_config, relay_config=relay_config,
                                  rank_config=rank_config) as cluster:
        coord_port = cluster.coord.address[1]
        rank_ports = {relay.rank_address[1] for relay in cluster.relays.values()}
        sockets = tcp_connections_of_this_process()
        try:
            seen: dict[str, list[tuple[int, int, int, int, int]]] = {
                "coordinator": [], "relay upstream": [], "relay rank side": [], "rank": []}
            nodelay: dict[str, bool] = {}  # and no Nagle delay on any of them
            for sock in sockets:
                local, peer = sock.getsockname()[1], sock.getpeername()[1]
                role = ("coordinator" if local == coord_port else
                        "relay upstream" if peer == coord_port else
                        "relay rank side" if local in rank_ports else
                        "rank" if peer in rank_ports else None)
                if role is not None:
                    seen[role].append(keepalive_of(sock))
                    nodelay[role] = nodelay.get(role, True) and bool(
                        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        finally:
            for sock in sockets:
                sock.close()
    # TCP_USER_TIMEOUT (ms): twice the longer of the silent-peer deadline and that end's
    # write_stall_timeout, so unacknowledged data (which stops keepalive probing) ends it too.
    assert seen == {
        "coordinator": [(1, 6, 2, 3, 24_000)] * 2,        # heartbeat_timeout 12 (stall 7)
        "relay upstream": [(1, 9, 3, 3, 36_000)] * 2,     # write_stall_timeout 18
        "relay rank side": [(1, 9, 3, 3, 36_000)] * 3,    # write_stall_timeout 18
        "rank": [(1, 12, 4, 3, 60_000)] * 3,              # coord_liveness 24, stall 30
    }
    assert nodelay == dict.fromkeys(seen, True)


async def _accept_three(listener: trio.SocketListener, keepalive: KeepAlive,
                        before_dial: Callable[[], None] = lambda: None,
                        ) -> list[tuple[int, int, int, int, int]]:
    """Accept three loopback connections through ``serve_each``; each one's keepalive as the
    handler saw it."""
    seen: list[tuple[int, int, int, int, int]] = []
    done = trio.Event()

    async def handler(stream: trio.SocketStream) -> None:
        seen.append(keepalive_of(stream.socket))  # type: ignore[arg-type]
        await stream.aclose()
        if len(seen) == 3:
            done.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve_each, listener, handler, what="test",
                                    keepalive=keepalive))
        before_dial()
        host, port = listener.socket.getsockname()[:2]
        for _ in range(3):
            client = await trio.open_tcp_stream(host, port)
            await client.aclose()
        with trio.fail_after(5):
            await done.wait()
        nursery.cancel_scope.cancel()
    return seen


@linux_keepalive
@pytest.mark.parametrize("host", [
    "127.0.0.1",
    pytest.param("::1", marks=needs_ipv6),
])
async def test_a_listener_gives_every_connection_it_accepts_keepalive_without_calls_per_connection(
        monkeypatch: pytest.MonkeyPatch, host: str) -> None:
    # Issue 38: five setsockopt calls per accepted connection became five per listener; the
    # kernel copies the listening socket's options into each connection it accepts.
    calls: list[object] = []
    monkeypatch.setattr(keepalive_mod, "enable_keepalive",
                        lambda *args: calls.append(args) or True)
    listener = (await trio.open_tcp_listeners(0, host=host))[0]
    async with listener:
        seen = await _accept_three(listener, KeepAlive.within(12, write_stall=7))
        assert keepalive_of(listener.socket) == (1, 6, 2, 3, 24_000)  # type: ignore[arg-type]
    assert seen == [(1, 6, 2, 3, 24_000)] * 3
    assert calls == []


@linux_keepalive
async def test_a_kernel_that_does_not_copy_a_listeners_keepalive_gets_it_set_per_connection(
        ) -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]

    def forget() -> None:  # as a kernel that did not copy the listening socket's options
        for option, value in ((socket.TCP_KEEPIDLE, 7200), (socket.TCP_KEEPINTVL, 75),
                              (socket.TCP_KEEPCNT, 9), (socket.TCP_USER_TIMEOUT, 0)):
            listener.socket.setsockopt(socket.IPPROTO_TCP, option, value)
        listener.socket.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 0)

    async with listener:
        seen = await _accept_three(listener, KeepAlive.within(30, write_stall=10), forget)
    assert seen == [(1, 15, 5, 3, 60_000)] * 3
