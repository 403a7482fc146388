"""A relay given the coordinators' session store (``StoreDialer``): while the store names no
leader its join says what it waits for and until when (``relay.waiting``, the ranks' notices),
then joins the leader it publishes; a published host name that does not resolve is not retried
(issue 34)."""

from __future__ import annotations

import socket
import time

import pytest
import trio

import flodl_trio as ft
from flodl_trio.net._transport import dial
from flodl_trio.relay import StoreDialer
from flodl_trio.store import MemoryStore
from flodl_trio.testing import MemoryNetwork

from helpers import start_host, wait_until
from helpers.frozen import publish_once_leading


async def test_a_join_through_a_store_without_a_leader_says_what_it_waits_for_until_it_leads(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork
) -> None:
    net = memory_network
    salt = ft.SessionSalt.generate()
    store = MemoryStore(name="run1")

    async def connect(host: str, port: int) -> trio.abc.Stream:
        return await net.connect(host)

    async with trio.open_nursery() as nursery:
        host = await start_host(nursery, net, "host-a", [0], salt=salt, world=1,
                                target=StoreDialer(store.clone(), connect=connect))
        relay = host.relay
        assert relay is not None
        await wait_until(lambda: relay.waiting is not None, limit=5)
        dialing_since = trio.current_time()
        assert relay.waiting is not None
        what, until = relay.waiting
        assert what == "no coordinator published at memory:run1 yet"
        assert until == pytest.approx(time.time() + relay.config.connect_timeout, abs=2)
        await trio.sleep(10)
        assert relay.waiting is not None and relay.waiting[0] == what  # said once, kept

        async def lead() -> None:
            async with ft.open_coordinator(net.listener("coord-1"), salt=salt, store=store,
                                           config=ft.CoordinatorConfig(world_size=1)):
                await host.ranks[0].ended.wait()

        nursery.start_soon(lead)
        await publish_once_leading(store, ("coord-1", 1))  # as a coordinator on TCP does
        await relay.wait_connected()
        assert relay.waiting is None and relay.generation == 1
        assert trio.current_time() - dialing_since < 12
        host.ranks[0].leave()
        await wait_until(lambda: host.all_done, limit=30)


def skip_unless_the_resolver_refuses_invalid_names() -> None:
    try:
        socket.getaddrinfo("coordinator.invalid", None)
    except socket.gaierror as exc:
        if exc.errno == socket.EAI_AGAIN:
            pytest.skip("this machine's resolver does not refuse coordinator.invalid at once")


async def test_a_published_host_that_does_not_resolve_is_not_retried() -> None:
    skip_unless_the_resolver_refuses_invalid_names()
    store = MemoryStore(name="run1")
    await store.acquire(owner="test")
    await store.publish_address([("coordinator.invalid", 7000)])
    started = trio.current_time()
    with pytest.raises(ft.HandshakeError) as caught:
        await dial(StoreDialer(store.clone()), connect_timeout=30, what="relay 'h'")
    assert trio.current_time() - started < 5  # not connect_timeout
    assert str(caught.value).startswith(
        "relay 'h': cannot resolve 'coordinator.invalid' (")
    assert str(caught.value).endswith(
        "), the address the coordinator published at memory:run1; a name that does not "
        "resolve is not retried")


async def test_riding_a_loss_out_a_name_that_does_not_resolve_is_retried() -> None:
    # A relay re-dialing the coordinator it had reached (Resume) keeps trying for its grace:
    # a new leader's DNS record may be catching up.
    skip_unless_the_resolver_refuses_invalid_names()
    with pytest.raises(ft.HandshakeError, match=r"got none after [2-9] attempt\(s\); last error: "
                       r"gaierror"):
        await dial(("coordinator.invalid", 7000), connect_timeout=1.2, what="relay 'h'",
                   retry_unresolvable=True)
