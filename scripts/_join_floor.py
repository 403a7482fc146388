"""What one relay's join costs at the least, for the formation benchmarks (issue 38).

Two floors, both with the library's own sans-IO handshake machines (FT/2: magic, Challenge,
Hello, HelloAck, Ready, welcome; every record authenticated):

- ``machine_cpu_us``: the machines alone, bytes handed from one to the other in memory (no
  socket, no event loop): the CPU of the protocol's crypto and codec per join, each side.
  No IO shape can cost less.
- ``selectors_formation``: a coordinator of nothing but a ``selectors`` loop (no Trio, no task
  or cancel scope per connection, no roster or admission) that accepts the load relays'
  connections and drives each one's ``CoordinatorHandshake`` to ``Established``, accepting
  every Hello. The relays are ``_wireload`` load processes (their own ``selectors`` loop
  around ``RelayHandshake``). What it measures is what three round trips of that protocol
  cost on real loopback sockets with the least Python around them: formation's wall time
  and the coordinator side's CPU per join.
- ``library_coordinator_formation``: the library's own coordinator against the same load
  relays: formation with the relays' side near its floor, so what it shows beyond the floor's
  is the coordinator's (its process's CPU per join is serial: one process admits every relay).
"""

from __future__ import annotations

import selectors
import socket
import time
from typing import Any

import _wireload as load
import trio

import flodl_trio as ft
from flodl_trio import wire


def machine_cpu_us(joins: int = 2000, ranks_per_relay: int = 1) -> dict[str, float]:
    """Median over 3 rounds of ``joins`` handshakes: each side's CPU per join (µs), the
    machine's construction included (one per connection on either side)."""
    salt = ft.SessionSalt.generate()
    ranks = tuple(range(ranks_per_relay))
    rounds = [[0.0, 0.0] for _ in range(3)]  # coordinator s, relay s
    for spent in rounds:
        for i in range(joins):
            _one_join(salt, f"h{i}", ranks, spent)
    coord_us = sorted(r[0] for r in rounds)[1] * 1e6 / joins
    relay_us = sorted(r[1] for r in rounds)[1] * 1e6 / joins
    return {"coord_us": coord_us, "relay_us": relay_us}


def _one_join(salt: ft.SessionSalt, host: str, ranks: tuple[int, ...],
              spent: list[float]) -> None:
    """One FT/2 join between two machines in memory; each side's CPU added to ``spent``."""
    clock = time.thread_time
    t0 = clock()
    relay = wire.RelayHandshake(salt, host=host, ranks=ranks, world_size=65536, coordinator="c")
    t1 = clock()
    coord = wire.CoordinatorHandshake(salt, peer="p")
    spent[0] += clock() - t1
    spent[1] += t1 - t0

    def turn(side: int, machine: Any, data: bytes, expected: type | None = None) -> bytes:
        t = clock()
        if data:
            machine.receive_data(data)
        event = machine.next_event()
        if expected is not None:
            assert isinstance(event, expected), event
        if isinstance(event, wire.HelloReceived):
            machine.accept()
        out: bytes = machine.data_to_send()
        spent[side] += clock() - t
        return out

    out = turn(1, relay, b"", wire.NeedData)  # the magic
    out = turn(0, coord, out)  # the Challenge
    out = turn(1, relay, out)  # the Hello
    out = turn(0, coord, out, wire.HelloReceived)  # HelloAck
    out = turn(1, relay, out)  # Ready
    out = turn(0, coord, out, wire.Established)  # the welcome
    turn(1, relay, out, wire.Established)


class _Conn:
    __slots__ = ("machine", "out", "sock")

    def __init__(self, sock: socket.socket, machine: wire.CoordinatorHandshake) -> None:
        self.sock = sock
        self.machine = machine
        self.out = b""


def _serve(listener: socket.socket, salt: ft.SessionSalt, relays: int,
           patience: float) -> dict[str, float]:
    """Accept ``relays`` connections and drive each to ``Established`` (this thread's CPU and
    the moment the last one was established); the sockets are closed at the end."""
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, None)
    conns: list[socket.socket] = []
    done = 0
    done_t = 0.0
    cpu0 = time.thread_time()
    deadline = time.monotonic() + patience

    def step(conn: _Conn, data: bytes) -> None:
        nonlocal done, done_t
        machine = conn.machine
        machine.receive_data(data)
        event = machine.next_event()
        if isinstance(event, wire.HelloReceived):
            machine.accept()
        elif isinstance(event, wire.Established):
            done += 1
            done_t = time.monotonic()
            sel.unregister(conn.sock)
        conn.out += machine.data_to_send()
        if conn.out:
            sent = conn.sock.send(conn.out)  # a few hundred bytes: all of it on loopback
            conn.out = conn.out[sent:]

    try:
        while done < relays:
            if time.monotonic() > deadline:
                raise TimeoutError(f"join floor: {done}/{relays} relays established within "
                                   f"{patience:g} s")
            for key, _ in sel.select(timeout=1.0):
                if key.data is None:
                    while True:
                        try:
                            sock, _addr = listener.accept()
                        except BlockingIOError:
                            break
                        sock.setblocking(False)
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        conns.append(sock)
                        sel.register(sock, selectors.EVENT_READ,
                                     _Conn(sock, wire.CoordinatorHandshake(salt, peer="load")))
                    continue
                conn: _Conn = key.data
                data = conn.sock.recv(65536)
                if not data:
                    raise ConnectionError("join floor: a load relay closed mid-handshake")
                step(conn, data)
        return {"done_t": done_t, "cpu_s": time.thread_time() - cpu0}
    finally:
        sel.close()
        for sock in conns:
            sock.close()


async def selectors_formation(relays: int, per_relay: int, procs: int) -> dict[str, Any]:
    """One formation of ``relays`` load relays against the selectors coordinator: ``ms``
    (the load processes' release to the last ``Established``), the coordinator side's CPU
    per join (``coord_us``) and the load processes' (``relay_us``)."""
    salt = ft.SessionSalt.generate()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4096)
    listener.setblocking(False)
    address = listener.getsockname()[:2]
    loads = await load.start_load(address, salt, world=relays * per_relay, relays=relays,
                                  per_relay=per_relay, procs=procs)
    try:
        result: dict[str, Any] = {}

        async def serve() -> None:
            result.update(await trio.to_thread.run_sync(_serve, listener, salt, relays, 60.0))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            await trio.sleep(0.05)  # the thread is in its select loop
            answers = await load.all_command(loads, "dial")
    finally:
        listener.close()
        await load.stop_all(loads)
    go = min(a["go_t"] for a in answers)
    return {"ms": (result["done_t"] - go) * 1000, "coord_us": result["cpu_s"] * 1e6 / relays,
            "relay_us": load.dial_cpu_us(answers)}


async def library_coordinator_formation(relays: int, per_relay: int, procs: int
                                        ) -> dict[str, Any]:
    """One formation of ``relays`` load relays against the library's coordinator
    (``open_coordinator``): ``ms`` (the first dial to formation complete), the coordinator
    process's CPU per join (``coord_us``) and the load processes' (``relay_us``)."""
    cfg = ft.CoordinatorConfig(world_size=relays * per_relay, formation_timeout=120,
                               handshake_timeout=60, shutdown_grace=10)
    async with load.coordinator_under_load(cfg, relays=relays, per_relay=per_relay,
                                           procs=procs, frame="liveness") as cluster:
        return {"ms": cluster.formation_s * 1000,
                "coord_us": cluster.formation_cpu_s * 1e6 / relays,
                "relay_us": load.dial_cpu_us(cluster.dialed)}
