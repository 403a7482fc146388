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
    rounds: list[tuple[float, float]] = []
    clock = time.thread_time
    for _ in range(3):
        coord_s = relay_s = 0.0
        for i in range(joins):
            t0 = clock()
            relay = wire.RelayHandshake(salt, host=f"h{i}", ranks=ranks, world_size=65536,
                                        coordinator="c")
            out = relay.data_to_send()
            t1 = clock()
            coord = wire.CoordinatorHandshake(salt, peer="p")
            coord.receive_data(out)
            coord.next_event()
            out = coord.data_to_send()
            t2 = clock()
            relay.receive_data(out)
            relay.next_event()
            out = relay.data_to_send()
            t3 = clock()
            coord.receive_data(out)
            assert isinstance(coord.next_event(), wire.HelloReceived)
            coord.accept()
            out = coord.data_to_send()
            t4 = clock()
            relay.receive_data(out)
            relay.next_event()
            out = relay.data_to_send()
            t5 = clock()
            coord.receive_data(out)
            assert isinstance(coord.next_event(), wire.Established)
            out = coord.data_to_send()
            t6 = clock()
            relay.receive_data(out)
            assert isinstance(relay.next_event(), wire.Established)
            t7 = clock()
            coord_s += (t2 - t1) + (t4 - t3) + (t6 - t5)
            relay_s += (t1 - t0) + (t3 - t2) + (t5 - t4) + (t7 - t6)
        rounds.append((coord_s * 1e6 / joins, relay_s * 1e6 / joins))
    rounds.sort()
    coord_us = sorted(r[0] for r in rounds)[1]
    relay_us = sorted(r[1] for r in rounds)[1]
    return {"coord_us": coord_us, "relay_us": relay_us}


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
