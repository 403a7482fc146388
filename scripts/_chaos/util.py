"""Helpers of the fault suite: handshake byte maps, hosts that record, one-fault clusters.

Self-contained (no import of the tests' helpers), so ``pytest tests/chaos`` and
``scripts/chaos_sweep.py`` both work on their own. Everything here is built from the public API
plus :mod:`flodl_trio.wire`, :mod:`flodl_trio.chaos` and :mod:`flodl_trio.testing`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import attrs
import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.testing import EventLog, MemoryNetwork, wait_until

from .streams import plain_dialer

COORD = "coordinator"
NONCE = bytes(16)  # CBOR lengths do not depend on the nonce's value, only on its length


# ------------------------------------------------------------------ the bytes of the handshakes


@attrs.frozen
class UpstreamHandshake:
    """Byte lengths of the relay ↔ coordinator handshake of one relay (SPEC §2.6)."""

    magic: int
    hello: int
    ready: int
    challenge: int
    hello_ack: int
    welcome: int  # the coordinator's first record after Ready (not part of the cut range)

    @property
    def up(self) -> int:
        """relay → coordinator: control magic, the sealed Hello, then the sealed Ready."""
        return self.magic + self.hello + self.ready

    @property
    def down(self) -> int:
        """coordinator → relay: the sealed Challenge, then the sealed HelloAck (the welcome
        that follows is the first record of the run, sent once the join was counted)."""
        return self.challenge + self.hello_ack


def upstream_handshake(host: str, ranks: Sequence[int], world_size: int = 3
                       ) -> UpstreamHandshake:
    """The handshake's lengths, computed from the wire constants and the CBOR encoder."""

    def record(msg: Any) -> int:
        return wire.RECORD_HEADER_LEN + len(wire.encode(msg))

    return UpstreamHandshake(
        magic=len(wire.CHANNEL_MAGIC_CONTROL),
        hello=record(wire.Hello(host=host, world_size=world_size, model_sigs={},
                                ranks=tuple(ranks), nonce=NONCE)),
        ready=record(wire.Ready()),
        challenge=record(wire.Challenge(NONCE)),
        hello_ack=record(wire.HelloAck(NONCE)),
        welcome=wire.RECORD_HEADER_LEN + len(wire.encode_fanout(
            ranks, wire.encode_frame(wire.SessionSalt(NONCE), wire.CoordHeartbeat()))),
    )


def rank_heartbeat_len(rank: int) -> int:
    """The rank's first frame (FT/2: a Heartbeat sent at once after the ack), length-framed."""
    return len(wire.len_frame(wire.encode_frame(wire.SessionSalt(NONCE),
                                                wire.Heartbeat(rank=rank, step_count=0))))


# ------------------------------------------------------------------ events with mock time





# ------------------------------------------------------------------ hosts that record


@attrs.define(eq=False)
class Host:
    """One relay and its ranks running as tasks; what each rank received and how it all ended.

    ``rank_outcome[r]`` is ``"ended"`` (clean end of iteration after Shutdown), a
    ``CoordinatorLost`` or another exception; ``relay_exit`` is the ``RelayExit`` or the
    exception ``open_relay`` raised.
    """

    name: str
    ranks: tuple[int, ...]
    received: dict[int, list[Any]] = attrs.Factory(dict)
    rank_outcome: dict[int, Any] = attrs.Factory(dict)
    relay_exit: Any = None
    relay: ft.Relay | None = None
    done: trio.Event = attrs.Factory(trio.Event)
    ranks_done: dict[int, trio.Event] = attrs.Factory(dict)
    cancel: trio.CancelScope = attrs.Factory(trio.CancelScope)

    def steps(self, rank: int) -> list[int]:
        """The ``SetGlobalStep`` values rank received, in arrival order."""
        return [int(m.global_step) for m in self.received.get(rank, [])
                if isinstance(m, wire.SetGlobalStep)]

    @property
    def finished(self) -> bool:
        return self.done.is_set() and all(e.is_set() for e in self.ranks_done.values())


async def _run_rank(host: Host, rank: int, dial: Any, *, salt: ft.SessionSalt, world: int,
                    config: ft.RankConfig | None, delay: float) -> None:
    done = host.ranks_done[rank]
    try:
        if delay:
            await trio.sleep(delay)
        async with ft.open_rank(dial, salt=salt, rank=rank, world_size=world,
                                config=config) as ep:
            inbox = host.received.setdefault(rank, [])
            try:
                async for msg in ep:
                    inbox.append(msg)
            except ft.CoordinatorLost as exc:
                host.rank_outcome[rank] = exc
            else:
                host.rank_outcome[rank] = "ended"
    except ft.FlodlError as exc:  # recorded: the test asserts on it
        host.rank_outcome[rank] = exc
    finally:
        done.set()


async def run_host(
    net: MemoryNetwork | None, name: str, ranks: Sequence[int], *, salt: ft.SessionSalt,
    world: int, upstream: Any = None, rank_dialers: dict[int, Any] | None = None,
    relay_config: ft.RelayConfig | None = None, rank_config: ft.RankConfig | None = None,
    rank_delay: float = 0.0, rank_delays: dict[int, float] | None = None,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run relay ``name`` and its ranks until they all end.

    On ``net`` the relay listens on ``relay:<name>`` and dials ``coordinator`` unless
    ``upstream`` says otherwise; with ``net=None`` it listens on loopback TCP and ``upstream``
    must be given. Each rank starts ``rank_delays.get(rank, rank_delay)`` seconds after the
    relay is bound. Started with ``nursery.start``, it reports the :class:`Host` then.
    """
    host = Host(name, tuple(ranks))
    host.ranks_done = {r: trio.Event() for r in ranks}
    if upstream is None:
        assert net is not None, "over TCP, pass upstream=(host, port)"
        upstream = plain_dialer(net, COORD)
    dialers = rank_dialers or {}
    try:
        with host.cancel:
            async with trio.open_nursery() as nursery:
                try:
                    async with ft.open_relay(
                        upstream, salt=salt, host=name, ranks=ranks, world_size=world,
                        rank_listen=None if net is None else net.listener(f"relay:{name}"),
                        config=relay_config,
                    ) as relay:
                        host.relay = relay
                        task_status.started(host)
                        for r in ranks:
                            dial = dialers.get(r) or (
                                relay.rank_address if net is None
                                else plain_dialer(net, f"relay:{name}"))
                            nursery.start_soon(partial(
                                _run_rank, host, r, dial, salt=salt, world=world,
                                config=rank_config,
                                delay=(rank_delays or {}).get(r, rank_delay)))
                        host.relay_exit = await relay.wait_closed()
                except ft.FlodlError as exc:  # recorded: the test asserts on it
                    host.relay_exit = exc
    finally:
        host.done.set()
        for event in host.ranks_done.values():
            event.set()




# ------------------------------------------------------------------ one cluster, one fault


@attrs.define(eq=False)
class Outcome:
    """What one fault scenario ended with; tests assert on it, the sweep tabulates it.

    Attributes:
        scenario: a short name, e.g. ``"upstream cut up@12"``.
        formed: the coordinator's block was entered (every rank covered).
        error: what ``open_coordinator`` raised (a FlodlError), or None.
        dead: rank → reason, as the coordinator had it when its block ended.
        decision: what happened to the faulted connection or relay, in words.
        decision_time: seconds from the fault to that decision (Trio clock), if known.
        leaks: streams, listeners or tasks still open once everything ended.
    """

    scenario: str
    log: EventLog
    hosts: dict[str, Host] = attrs.Factory(dict)
    formed: bool = False
    error: BaseException | None = None
    dead: dict[int, str] = attrs.Factory(dict)
    decision: str = ""
    decision_time: float | None = None
    leaks: list[str] = attrs.Factory(list)
    details: dict[str, Any] = attrs.Factory(dict)

    @property
    def label(self) -> str:
        """The outcome class the sweep counts."""
        if self.error is not None:
            return type(self.error).__name__
        return "formed, ranks dead" if self.dead else "formed"


HostSpec = dict[str, Any]  # keyword arguments of run_host besides net/salt/world


async def run_cluster(
    net: MemoryNetwork, out: Outcome, hosts: dict[str, HostSpec], *,
    config: ft.CoordinatorConfig, salt: ft.SessionSalt, body: Any = None,
    side_tasks: Sequence[Any] = (), teardown: float = 120.0,
) -> None:
    """Coordinator + relays + ranks on ``net``; ``body(coord)`` runs inside the block.

    ``side_tasks`` are ``async fn()`` started next to the hosts (raw attackers and the like).
    Fills ``out`` (formed, error, dead, hosts, leaks); every task has ended when it returns.
    """
    world = config.world_size
    listener = net.listener(COORD)
    async with trio.open_nursery() as nursery:
        for name, spec in hosts.items():
            kwargs = dict(spec)
            host_world = kwargs.pop("world", world)  # a host may disagree, on purpose
            out.hosts[name] = await nursery.start(partial(
                run_host, net, name, kwargs.pop("ranks"), salt=salt, world=host_world,
                **kwargs))
        for task in side_tasks:
            nursery.start_soon(task)
        try:
            async with ft.open_coordinator(listener, salt=salt, config=config,
                                           timeline=out.log) as coord:
                out.formed = True
                out.details["coord"] = coord
                try:
                    if body is not None:
                        await body(coord)
                finally:
                    out.dead = {r: coord.dead_reason(r) or "" for r in sorted(coord.dead_ranks)}
        except ft.FlodlError as exc:
            out.error = exc
        # The coordinator is closed: every peer ends on its own (EOF or its own deadlines).
        with trio.move_on_after(teardown):
            await wait_until(lambda: all(h.finished for h in out.hosts.values()), limit=teardown)
        nursery.cancel_scope.cancel()
    out.leaks = leaks(net)


def leaks(net: MemoryNetwork) -> list[str]:
    """Open stream ends and listeners of ``net`` and flodl tasks still alive in this run."""
    found = [repr(end) for end in net.open_streams()]
    found += [repr(listener) for listener in net.open_listeners()]
    found += [f"task {name}" for name in live_task_names() if name.startswith("flodl_trio.")]
    return found


def live_task_names() -> list[str]:
    """Names of every task alive in this Trio run (a bounded walk of the task tree)."""
    names: list[str] = []
    todo = [trio.lowlevel.current_root_task()]
    while todo and len(names) < 100_000:
        task = todo.pop()
        if task is None:
            continue
        names.append(task.name)
        for nursery in task.child_nurseries:
            todo.extend(nursery.child_tasks)
    return names


def first(log: EventLog, kind: type[Any], predicate: Callable[[Any], bool] = lambda ev: True
          ) -> tuple[float, Any] | None:
    """The first event of ``kind`` satisfying ``predicate``, with its Trio time."""
    for t, ev in log.of(kind):
        if predicate(ev):
            return t, ev
    return None


def category(reason: str) -> str:
    """The category of a HandshakeRejected reason (``"bad mac: ..."`` → ``"bad mac"``)."""
    return reason.split(":", 1)[0]
