"""A coordinator bound to a wildcard publishes addresses a peer can dial: the machine's interface
addresses and loopback, never ``0.0.0.0`` or ``::``; a specific bind publishes itself. Only
loopback is bound and dialed here."""

from __future__ import annotations

import ipaddress

import pytest
import trio

import flodl_trio as ft
from flodl_trio.cli import main
from flodl_trio.net._interfaces import dialable_addresses, interface_addresses


async def test_a_specific_bind_publishes_exactly_that_address_and_it_answers() -> None:
    async with await ft.bind_coordinator(("127.0.0.1", 0)) as bound:
        assert bound.addresses_for_peers() == (bound.address,)
        stream = await trio.open_tcp_stream(*bound.addresses_for_peers()[0])
        await stream.aclose()


async def test_a_wildcard_bind_publishes_this_machines_addresses_with_loopback_last() -> None:
    # What bind_coordinator(("0.0.0.0", 0)) returns, without opening a wildcard socket here:
    # the addresses the OS reported, and the machine's real interfaces.
    async with await ft.bind_coordinator(("127.0.0.1", 0)) as loopback:
        port = loopback.address[1]
        bound = ft.CoordinatorBind([], [("0.0.0.0", port)])
        published = bound.addresses_for_peers()
        assert published[-1] == ("127.0.0.1", port)
        assert all(p == port and h != "0.0.0.0" for h, p in published)
        assert {h for h, _ in published} <= set(interface_addresses()) | {"127.0.0.1"}
        assert all(ipaddress.ip_address(h).version == 4 for h, _ in published)
        assert not any(ipaddress.ip_address(h).is_loopback for h, _ in published[:-1])
        stream = await trio.open_tcp_stream(*published[-1])  # loopback only
        await stream.aclose()
    both = ft.CoordinatorBind([], [("0.0.0.0", 7), ("::", 7)]).addresses_for_peers()
    assert ("127.0.0.1", 7) in both and not any(h in ("0.0.0.0", "::") for h, _ in both)


def test_both_families_skip_link_local_and_duplicates_and_keep_specific_binds() -> None:
    interfaces = ["127.0.0.1", "10.0.0.5", "10.0.0.5", "fe80::1%eth0", "fe80::2", "fd00::7",
                  "::1", "not-an-address"]
    assert dialable_addresses([("0.0.0.0", 7), ("::", 7)], interfaces) == (
        ("10.0.0.5", 7), ("fd00::7", 7), ("127.0.0.1", 7), ("::1", 7))
    assert dialable_addresses([("10.0.0.5", 7)], interfaces) == (("10.0.0.5", 7),)
    # No interface list at all (an unusual kernel): loopback still answers a wildcard bind.
    assert dialable_addresses([("0.0.0.0", 7)], []) == (("127.0.0.1", 7),)


def test_the_coordinator_cli_prints_the_addresses_relays_can_dial(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLODL_SALT_HEX", "ab" * 16)
    main(["coordinator", "--listen", "127.0.0.1:0", "--world-size", "1",
          "--formation-timeout", "0.2"])
    out = capsys.readouterr().out.splitlines()
    port = out[0].rsplit(":", 1)[1]
    assert out[0] == f"coordinator listening on 127.0.0.1:{port}"
    assert out[1] == f"relays can dial: 127.0.0.1:{port}"
