"""How each fault kind of scripts/_nemesis_faults.py is injected into the cluster, and healed.

An action takes the cluster, the fault's history entry (it adds the target it chose: a
coordinator slot and its PID, etcd members, a host and its ranks), the target the scheduler
claimed for it and its draw; it injects the fault and returns the coroutine function that heals
it. Parts a fault keeps down are ``held`` meanwhile, so that the supervisor does not restart them
under it; the heal restarts them. The elastic kinds drain a host (SIGTERM to its relay: its ranks
leave after their sync and are retired) and start it again, or start the spare host and drain it
when the fault heals.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from _nemesis_cluster import Cluster

from flodl_trio.chaos import FaultPlan

Heal = Callable[[], Awaitable[None]]
Action = Callable[[Cluster, dict[str, Any], str, float], Awaitable[Heal]]


async def _coord_kill(cluster: Cluster, entry: dict[str, Any], _: str, draw: float) -> Heal:
    leader = cluster.leader_slot() or "coord-a"
    other = "coord-b" if leader == "coord-a" else "coord-a"
    slot = leader if draw < 0.75 else other
    cluster.hold(slot)
    proc = cluster.coords[slot]
    entry.update(target=slot, pid=proc.pid, leader=slot == leader)
    proc.kill()

    async def heal() -> None:
        cluster.release(slot)
        if not cluster.finished.is_set():
            cluster.record("restart", target=slot, cause="coord-kill healed")
            cluster.start_coordinator(slot, standby=True)

    return heal


async def _coord_stop(cluster: Cluster, entry: dict[str, Any], _: str, draw: float) -> Heal:
    slot = cluster.leader_slot() or "coord-a"
    proc = cluster.coords[slot]
    cluster.hold(slot)
    entry.update(target=slot, pid=proc.pid, generation=cluster.leader_generation)
    proc.signal(signal.SIGSTOP)

    async def heal() -> None:
        proc.signal(signal.SIGCONT)
        cluster.release(slot)

    return heal


async def _etcd_kill(cluster: Cluster, entry: dict[str, Any], _: str, draw: float) -> Heal:
    leader = await trio.to_thread.run_sync(lambda: _etcd_leader(cluster))
    n = len(cluster.etcd.members)
    index = leader if (draw < 0.5 and leader is not None) else int(draw * 997) % n
    return await _kill_members(cluster, entry, [index], leader)


async def _etcd_quorum(cluster: Cluster, entry: dict[str, Any], _: str, draw: float) -> Heal:
    leader = await trio.to_thread.run_sync(lambda: _etcd_leader(cluster))
    n = len(cluster.etcd.members)
    first = leader if leader is not None else 0
    second = (first + 1 + int(draw * (n - 1))) % n
    return await _kill_members(cluster, entry, [first, second], leader)


def _etcd_leader(cluster: Cluster) -> int | None:
    try:
        return cluster.etcd.leader(timeout=2.0)
    except RuntimeError:
        return None


async def _kill_members(cluster: Cluster, entry: dict[str, Any], indexes: list[int],
                        leader: int | None) -> Heal:
    members = cluster.etcd.members
    entry.update(target=",".join(members[i].name for i in indexes),
                 etcd_leader=None if leader is None else members[leader].name)
    for i in indexes:
        pid = members[i].pid
        if pid is not None:
            signal_pid(pid, signal.SIGKILL)
        cluster.etcd.stop_member(i)  # reaps it

    async def heal() -> None:
        for i in indexes:
            cluster.etcd.start_member(i, wait=False)

    return heal


def signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


async def _relay_kill(cluster: Cluster, entry: dict[str, Any], host: str, _: float) -> Heal:
    cluster.hold(host)
    entry.update(target=host, ranks=cluster.layout.ranks_of(host))
    cluster.relays[host].kill()
    return _host_heal(cluster, host, "relay-kill")


def _host_heal(cluster: Cluster, host: str, cause: str) -> Heal:
    async def heal() -> None:
        cluster.release(host)
        if not cluster.finished.is_set() and not cluster.host_whole(host):
            cluster.record("restart", target=host, cause=f"{cause} healed")
            cluster.start_host(host)

    return heal


async def _relay_stop(cluster: Cluster, entry: dict[str, Any], host: str, _: float) -> Heal:
    relay = cluster.relays[host]
    entry.update(target=host, ranks=cluster.layout.ranks_of(host))
    relay.signal(signal.SIGSTOP)

    async def heal() -> None:
        relay.signal(signal.SIGCONT)

    return heal


def _set_link(cluster: Cluster, host: str, plan: FaultPlan, *, live: bool) -> None:
    for proxy in cluster.proxies[host]:
        proxy.plan(plan)
        if live:
            for conn in proxy.connections:
                if not conn.closed:
                    proxy.plan(plan, connection=conn.index)


STALL_RATE = 1.0  # bytes per second a stalled link still passes (no frame completes in time)


async def _link_stall(cluster: Cluster, entry: dict[str, Any], host: str, _: float) -> Heal:
    # The chaos proxy drips 1 byte a second both ways, one byte per sleep, and reads the plan
    # again before each byte: the link stalls at the next byte and flows again within a second
    # of the heal. (A delay was held by a pump already waiting for its next read when the plan
    # changed: a stall came back up to its whole length later, after the heal.)
    cluster.hold(host)
    entry.update(target=host, ranks=cluster.layout.ranks_of(host))
    _set_link(cluster, host, FaultPlan().drip(STALL_RATE, "both"), live=True)

    async def heal() -> None:
        _set_link(cluster, host, FaultPlan(), live=True)
        await trio.sleep(1 / STALL_RATE)  # the byte each pump may still be sleeping on
        await _host_heal(cluster, host, entry["kind"])()

    return heal


async def _link_cut(cluster: Cluster, entry: dict[str, Any], host: str, _: float) -> Heal:
    cluster.hold(host)
    entry.update(target=host, ranks=cluster.layout.ranks_of(host))
    _set_link(cluster, host, FaultPlan().reset(), live=False)
    for proxy in cluster.proxies[host]:
        await proxy.reset_all()

    async def heal() -> None:
        _set_link(cluster, host, FaultPlan(), live=False)
        await _host_heal(cluster, host, entry["kind"])()

    return heal


async def _rank_kill(cluster: Cluster, entry: dict[str, Any], host: str, draw: float) -> Heal:
    # A rank started again alone cannot reach its relay, which closed its rank port once it
    # joined (a rank's "waking up" is elastic membership's, not yet there): the heal starts
    # its whole host again, as an operator would, and the host's other rank dies of that
    # restart (docs/recovery.rst, "Where the docs are silent").
    ranks = cluster.layout.ranks_of(host)
    rank = ranks[int(draw * 1009) % len(ranks)]
    cluster.hold(host)
    entry.update(target=f"rank {rank}", host=host, ranks=[rank])
    cluster.ranks[rank].kill()
    return _host_heal(cluster, host, "rank-kill")


JOIN_WAIT_S = 30.0   # a spare's relay joins within this of its start (processes import, handshake)
DRAIN_WAIT_S = 30.0  # a drained host's processes exit within this (one sync of its ranks; a
#                      takeover in progress meanwhile: resume_timeout and the lease), counted
#                      again from each change of leader during the drain: its ranks leave after
#                      their next sync, and no sync comes while leaders follow each other (seed
#                      14: three takeovers in 25 s, the drain killed as overdue)
DRAIN_WAIT_MAX_S = 3 * DRAIN_WAIT_S  # the bound, however many leaders follow each other


async def _host_drain(cluster: Cluster, entry: dict[str, Any], host: str, _: float) -> Heal:
    cluster.hold(host)
    entry.update(target=host, ranks=cluster.layout.ranks_of(host))
    cluster.relays[host].signal(signal.SIGTERM)

    async def heal() -> None:
        await drained(cluster, host, entry)
        cluster.release(host)
        if not cluster.finished.is_set():
            # its ranks were retired: started again, they join the running cohort anew (no
            # process of it is left to kill, so no death may follow from this start)
            cluster.record("host_start", target=host, cause="host-drain healed")
            cluster.start_host(host)

    return heal


async def _host_join(cluster: Cluster, entry: dict[str, Any], spare: str, _: float) -> Heal:
    entry.update(target=spare, ranks=cluster.layout.ranks_of(spare))
    cluster.record("host_start", target=spare, cause="host-join")
    cluster.release(spare)  # while it is in, the supervisor restarts it as any host
    cluster.start_host(spare)

    async def heal() -> None:
        # SIGTERM drains a relay that joined; one that has not would stop at once. Until it
        # joined the spare stays the supervisor's, restarted as any host: a relay whose first
        # join fell in a coordinator failover gives up at connect_timeout and exits 1 (seed 2:
        # held from the heal's start, that exit was never followed by a restart).
        with trio.move_on_after(JOIN_WAIT_S):
            while not cluster.finished.is_set() and not cluster.host_recovered(spare):  # noqa: ASYNC110 - read from the leader's page
                await trio.sleep(0.2)
        cluster.hold(spare)
        if cluster.finished.is_set():
            return  # its processes end with the run
        cluster.record("drain", target=spare, cause="host-join healed")
        cluster.relays[spare].signal(signal.SIGTERM)
        await drained(cluster, spare, entry)

    return heal


async def drained(cluster: Cluster, host: str, entry: dict[str, Any]) -> None:
    """Wait for every process of a host sent SIGTERM to exit, ``DRAIN_WAIT_S`` from the SIGTERM
    or from the last change of leader since (at most ``DRAIN_WAIT_MAX_S``); one still running
    then is recorded (``drain_overdue``) and killed: the checker finds the ranks' deaths, if
    any, unexplained."""
    start = trio.current_time()
    deadline, leader = start + DRAIN_WAIT_S, cluster.leader_generation
    with trio.move_on_at(start + DRAIN_WAIT_MAX_S):
        while not cluster.host_gone(host) and trio.current_time() < deadline:
            if cluster.leader_generation != leader:  # a takeover: counted again from here
                leader = cluster.leader_generation
                deadline = trio.current_time() + DRAIN_WAIT_S
            await trio.sleep(0.1)
    if not cluster.host_gone(host) and not cluster.finished.is_set():
        cluster.record("drain_overdue", index=entry["index"], target=host,
                       running=[p.name for p in cluster.host_procs(host) if p.running],
                       seconds=round(trio.current_time() - start, 1))
        cluster.kill_host(host)


ACTIONS: dict[str, Action] = {
    "coord-kill": _coord_kill, "coord-stop": _coord_stop, "coord-stop-long": _coord_stop,
    "etcd-kill": _etcd_kill, "etcd-quorum": _etcd_quorum, "relay-kill": _relay_kill,
    "relay-stop": _relay_stop, "link-stall": _link_stall, "link-stall-long": _link_stall,
    "link-stall-past-grace": _link_stall, "link-cut": _link_cut,
    "link-cut-past-grace": _link_cut, "rank-kill": _rank_kill, "host-drain": _host_drain,
    "host-join": _host_join,
}
