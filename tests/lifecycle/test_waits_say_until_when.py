"""Nothing waits in silence: a rank dialing a relay that is not there and a relay waiting for its
ranks each say at once what they wait for and until when (real processes); a coordinator whose
rejected handshakes look like a relay with another salt says "wrong salt?" in its log line and
in the formation error."""

from __future__ import annotations

import logging
import re
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta

import pytest
import trio

import flodl_trio as ft
from flodl_trio import wire
from flodl_trio.cli._errors import error_line
from flodl_trio.testing import MemoryNetwork

from helpers import COORD, start_host
from helpers.cli_procs import Proc

UNTIL = re.compile(r"until (\d\d:\d\d:\d\d)")


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def seconds_ahead(line: str) -> float:
    """How far in the future the line's ``until HH:MM:SS`` is (wall clock)."""
    found = UNTIL.search(line)
    assert found, line
    now = datetime.now()
    at = datetime.combine(now.date(), datetime.strptime(found[1], "%H:%M:%S").time())
    if at < now - timedelta(hours=12):  # it is past midnight there
        at += timedelta(days=1)
    return (at - now).total_seconds()


def first_err_line(proc: Proc, text: str, *, within: float = 10.0) -> tuple[str, float]:
    started = time.monotonic()
    while time.monotonic() - started < within:
        for line in list(proc.err):
            if text in line:
                return line, time.monotonic() - started
        time.sleep(0.02)
    raise AssertionError(f"no {text!r} on stderr within {within}s: {proc.err}")


@pytest.mark.slow
def test_a_rank_without_its_relay_says_at_once_what_it_retries_until_when(
        env: dict[str, str], procs: list[Proc]) -> None:
    port = closed_port()
    rank = Proc("rank", "--relay", f"127.0.0.1:{port}", "--rank", "0", "--world-size", "1",
                env=env)
    procs.append(rank)
    line, after = first_err_line(rank, "retrying")
    assert f"rank 0: no relay at 127.0.0.1:{port} yet (connection refused); retrying " \
           f"127.0.0.1:{port} until " in line, line
    assert "(connect_timeout 30 s)" in line
    assert 27 < seconds_ahead(line) < 31, line  # the default connect_timeout, from its start
    assert after < 5, f"said after {after:.1f}s"  # at once: the start-up, not the 30 s
    rank.signal(signal.SIGTERM)
    assert rank.wait() == 143


@pytest.mark.slow
def test_a_relay_says_at_once_which_ranks_it_waits_for_where_and_until_when(
        env: dict[str, str], procs: list[Proc]) -> None:
    relay = Proc("relay", "--coordinator", f"127.0.0.1:{closed_port()}", "--host", "h",
                 "--ranks", "0-1", "--world-size", "2", env=env)
    procs.append(relay)
    address = relay.line_with("listening for ranks on").split()[-1]
    line = relay.line_with("waiting for ranks")
    assert line.startswith(f"relay h: waiting for ranks 0-1 on {address} (rank_accept_timeout "
                           "60 s, until "), line
    assert 57 < seconds_ahead(line) < 61, line
    relay.signal(signal.SIGTERM)
    assert relay.wait() == 143


async def formation_failure(coordinator: ft.CoordinatorBind | trio.abc.Listener[trio.abc.Stream],
                            salt: ft.SessionSalt, cfg: ft.CoordinatorConfig,
                            *peers: Callable[[], Awaitable[object]]) -> ft.FormationTimeout:
    """The FormationTimeout of a coordinator that ``peers`` (tasks beside it) dial."""
    failures: list[BaseException] = []
    try:
        async with trio.open_nursery() as nursery:
            for peer in peers:
                nursery.start_soon(peer)
            async with ft.open_coordinator(coordinator, salt=salt, config=cfg):
                pass  # pragma: no cover - it never forms
    except* ft.FormationTimeout as group:  # the nursery's group holds the one error
        failures += group.exceptions
    [failure] = failures
    assert isinstance(failure, ft.FormationTimeout)
    return failure


async def test_a_relay_with_another_salt_is_logged_and_named_in_the_formation_error(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork,
    caplog: pytest.LogCaptureFixture,
) -> None:
    salt, other = ft.SessionSalt.generate(), ft.SessionSalt.generate()
    cfg = ft.CoordinatorConfig(world_size=1, formation_timeout=10)
    caplog.set_level(logging.INFO, logger="flodl_trio.coordinator")

    async def relay_of_another_session() -> None:
        # It cannot verify our Challenge and hangs up, three times (then WrongSession).
        async with trio.open_nursery() as nursery:
            await start_host(nursery, memory_network, "host-a", [0], salt=other, world=1)

    failure = await formation_failure(memory_network.listener(COORD), salt, cfg,
                                      relay_of_another_session)
    text = str(failure)
    assert "rejected connections: eof before hello x3 (3 like a relay with another salt: " \
           "wrong salt?)" in text, text
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
              and r.name == "flodl_trio.coordinator"]
    assert len(warned) == 3 and all(
        "closed the connection after its magic without sending a Hello (a relay whose session "
        "salt differs hangs up on our Challenge: wrong salt?)" in m for m in warned), warned
    # The command line's one line keeps the hint (the hosts that joined give way).
    line = error_line(failure, command="coordinator", who="coordinator", address=None)
    assert line.endswith("rejected connections: eof before hello x3 (3 like a relay with "
                         "another salt: wrong salt?)"), line


async def test_a_hello_that_fails_its_mac_is_logged_as_a_wrong_salt(
    autojump_clock: trio.abc.Clock, memory_network: MemoryNetwork,
    caplog: pytest.LogCaptureFixture,
) -> None:
    salt = ft.SessionSalt.generate()
    cfg = ft.CoordinatorConfig(world_size=1, formation_timeout=5)
    hello = wire.encode(wire.Hello(host="host-x", world_size=1, model_sigs={}, ranks=(0,),
                                   nonce=bytes(16)))
    forged = wire.RecordSealer(bytes(32), wire.RELAY_TO_COORD).seal(
        wire.RecordKind.CONTROL, 0, hello)  # a key that is not this session's

    async def forger() -> None:
        stream = await memory_network.connect(COORD)
        await stream.send_all(wire.CHANNEL_MAGIC_CONTROL)
        assert await stream.receive_some(65536)  # the Challenge
        await stream.send_all(forged)
        assert await stream.receive_some(65536) == b""  # rejected and closed
        await stream.aclose()

    failure = await formation_failure(memory_network.listener(COORD), salt, cfg, forger)
    assert "bad mac x1 (1 like a relay with another salt: wrong salt?)" in str(failure)
    [warned] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned.startswith("handshake rejected (bad mac): Hello from mem:coordinator:1: ")
    assert warned.endswith("(wrong salt?)"), warned
