"""EtcdStore on a real 3-member etcd (scripts/_etcd.py EtcdCluster) losing one member with its
quorum intact: the leader keeps its leadership when the etcd leader member is SIGKILLed or the
first-listed follower is SIGSTOPped (renewals and saves fail over within the TTL), and a save
that a frozen member applies late cannot bring an old state back."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import trio

from flodl_trio import LeadershipLost
from flodl_trio.store import EtcdStore

from helpers.scripts import load_script
from helpers.store import Flag, state

etcd_helper = load_script("_etcd")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(etcd_helper.etcd_binary() is None,
                                 reason="etcd is not installed (apt-get install etcd-server)")]
ELECTION = 0.5  # the test members' --election-timeout
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with etcd_helper.EtcdCluster(tmp_path_factory.mktemp("etcd3")) as three:
        yield three


def listed_first(cluster: Any, index: int) -> list[str]:
    """The members' endpoints with member ``index`` first (the one a store starts with)."""
    order = [index, *(i for i in range(len(cluster.members)) if i != index)]
    return [cluster.members[i].endpoint for i in order]


async def lead_through(cluster: Any, victim: int, ttl: float, hurt: Any, heal: Any) -> float:
    """Lead through ``hurt(victim)`` done just before a renewal is due (the worst moment), for
    a whole TTL after it; return how long a save took right after. Fails if the leadership was
    lost."""
    store = EtcdStore(listed_first(cluster, victim), f"flodl/fo{next(_prefixes)}", ttl=ttl,
                      election_timeout=ELECTION, connect_timeout=3)
    probe = EtcdStore(listed_first(cluster, victim)[::-1], store.prefix, ttl=ttl,
                      election_timeout=ELECTION)
    gen = await store.acquire(owner="coordinator a")
    lost = Flag()

    async def keep(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await store.keep_leadership(task_status=task_status)
        except LeadershipLost as exc:
            lost.set(str(exc))

    try:
        async with trio.open_nursery() as nursery:
            started = trio.current_time()  # its first renewal is now, the next ttl/3 later
            await nursery.start(keep)
            await trio.sleep_until(started + ttl / 3 - 0.05)
            hurt(victim)
            await trio.sleep(ttl)
            assert not lost, lost.value
            before = trio.current_time()
            await store.save(state(gen, failures=7))
            took = trio.current_time() - before
            assert store.generation == gen
            assert await probe.current_leader() == "coordinator a"
            assert await probe.load() == state(gen, failures=7)
            nursery.cancel_scope.cancel()
    finally:
        heal(victim)
        for handle in (store, probe):
            await handle.aclose()
    return took


@pytest.mark.parametrize("ttl", [3, 5])
async def test_the_leader_keeps_its_leadership_when_the_etcd_leader_member_is_killed(
        cluster: Any, ttl: float) -> None:
    took = await lead_through(cluster, cluster.leader(), ttl, cluster.kill_member,
                              cluster.start_member)
    print(f"etcd leader member SIGKILLed (TTL {ttl} s): leadership kept; a save then took "
          f"{took:.2f} s")


@pytest.mark.parametrize("ttl", [3, 4])
async def test_the_leader_keeps_its_leadership_when_the_first_listed_follower_freezes(
        cluster: Any, ttl: float) -> None:
    follower = (cluster.leader() + 1) % len(cluster.members)
    took = await lead_through(cluster, follower, ttl, cluster.pause, cluster.resume)
    print(f"first-listed etcd follower SIGSTOPped (TTL {ttl} s): leadership kept; a save then "
          f"took {took:.2f} s")
    assert took < 1.0  # the frozen member was given up on: saves go to the one that answers


class HoldingProxy:
    """A loopback TCP proxy to one etcd member that, once :meth:`hold` is called, keeps what
    clients send (as a frozen member's socket buffer would) and forwards it, over a connection
    it keeps open so that etcd serves it whole, only on :meth:`release`: a request its client
    gave up on, applied late."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.holding = False
        self.released = trio.Event()
        self.answered = trio.Event()  # etcd answered a request that was held
        self.endpoint = ""

    def hold(self) -> None:
        self.holding = True

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.endpoint = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        task_status.started()
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        upstream = await trio.open_tcp_stream(*self.target)
        held = []

        async def down() -> None:
            while data := await upstream.receive_some(65536):
                if held:
                    self.answered.set()
                try:
                    await client.send_all(data)
                except trio.BrokenResourceError:
                    pass  # the client gave up: etcd's answer goes nowhere

        async with upstream, trio.open_nursery() as nursery:
            nursery.start_soon(down)
            while True:
                try:
                    data = await client.receive_some(65536)
                except trio.BrokenResourceError:
                    data = b""
                if not data:
                    break
                if self.holding:
                    held.append(data)
                    await self.released.wait()
                await upstream.send_all(data)
            if held:
                with trio.move_on_after(5):  # etcd's answer to what was held, then close
                    await self.answered.wait()
            nursery.cancel_scope.cancel()


async def test_a_save_a_frozen_member_applies_late_cannot_bring_an_old_state_back(
        cluster: Any) -> None:
    proxy = HoldingProxy(cluster.members[0].endpoint)
    async with trio.open_nursery() as nursery:
        await nursery.start(proxy.serve)
        endpoints = [proxy.endpoint, cluster.members[1].endpoint]
        store = EtcdStore(endpoints, f"flodl/fo{next(_prefixes)}", election_timeout=ELECTION,
                          request_timeout=0.3)
        gen = await store.acquire(owner="a")  # through the proxy: it answers, so far
        await store.save(state(gen, failures=1))
        proxy.hold()  # the member freezes with our next request in its socket buffer
        with trio.fail_after(3):
            await store.save(state(gen, failures=2))  # given up on there after 0.3 s: next one
        await store.save(state(gen, failures=3))
        proxy.released.set()  # the member wakes and applies the "failures=2" put
        with trio.fail_after(5):
            await proxy.answered.wait()
        loaded = await store.load()
        assert loaded is not None and loaded.failures == 3, loaded
        await store.aclose()
        nursery.cancel_scope.cancel()
