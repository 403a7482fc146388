"""The relay command line, as real processes, when it cannot join: refused by a real coordinator
process, it exits 1 at once with one short line giving the coordinator's reason; with a salt that
differs it exits 1 within about a second with one short line saying so (``--debug``: the full
detail). Before, both re-dialed for connect_timeout (30 s) and ended with a line about the
network, or one of several hundred characters."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import trio

import flodl_trio as ft

from helpers.cli_procs import Proc, one_line

SALT_HEX = "ab" * 16
OTHER_SALT_HEX = "cd" * 16
PATIENCE = 30.0  # real seconds, only a bound: the relays end within about a second


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    out = dict(os.environ, FLODL_SALT_HEX=SALT_HEX)
    out.pop("FLODL_NET_TIMEOUT_SCALE", None)  # the default deadlines: connect_timeout is 30 s
    return out


def ranks_until_their_relays_give_up(relay_addresses: list[str], *, salt_hex: str,
                                     world: int) -> float:
    """Join each relay as rank 0 from this process (a relay dials its coordinator only once its
    ranks are in); once every relay gave up, return the monotonic time the last rank joined."""
    joined: list[float] = []

    async def rank(address: str) -> None:
        host, port = address.rsplit(":", 1)
        with pytest.raises(ft.CoordinatorLost, match="relay 'h' gave up"):
            async with ft.open_rank((host, int(port)), salt=ft.SessionSalt.from_hex(salt_hex),
                                    rank=0, world_size=world) as ep:
                joined.append(time.monotonic())
                async for _ in ep:
                    pass

    async def main() -> None:
        with trio.fail_after(PATIENCE):
            async with trio.open_nursery() as nursery:
                for address in relay_addresses:
                    nursery.start_soon(rank, address)

    trio.run(main)
    return max(joined)


def start_coordinator(procs: list[Proc], env: dict[str, str], world: int) -> tuple[Proc, str]:
    coord = Proc("coordinator", "--listen", "127.0.0.1:0", "--world-size", str(world), env=env)
    procs.append(coord)
    return coord, coord.line_with("coordinator listening on").split()[-1]


def start_relay(procs: list[Proc], env: dict[str, str], coordinator: str, world: int,
                *extra: str) -> tuple[Proc, str]:
    relay = Proc("relay", "--coordinator", coordinator, "--host", "h", "--ranks", "0",
                 "--world-size", str(world), *extra, env=env)
    procs.append(relay)
    return relay, relay.line_with("listening for ranks on").split()[-1]


@pytest.mark.slow
def test_a_relay_refused_by_a_coordinator_process_exits_1_at_once_with_its_reason(
    env: dict[str, str], procs: list[Proc]
) -> None:
    coord, address = start_coordinator(procs, env, world=2)
    relay, rank_address = start_relay(procs, env, address, 3)
    joined = ranks_until_their_relays_give_up([rank_address], salt_hex=SALT_HEX, world=3)
    assert relay.wait() == 1
    took = time.monotonic() - joined
    assert took < 2.0, took  # no re-dial: connect_timeout is 30 s
    assert one_line(relay) == (
        f"flodl-trio: relay h: refused by the coordinator at {address}: world_size mismatch: "
        "the coordinator's world_size is 2, the relay's is 3")
    # The coordinator fails formation as it always did.
    assert coord.wait() == 1
    assert "world_size mismatch" in one_line(coord)


@pytest.mark.slow
def test_a_relay_whose_salt_differs_exits_1_within_seconds_with_one_short_line(
    env: dict[str, str], procs: list[Proc]
) -> None:
    _, address = start_coordinator(procs, env, world=1)
    other = dict(env, FLODL_SALT_HEX=OTHER_SALT_HEX)
    plain, plain_ranks = start_relay(procs, other, address, 1)
    debug, debug_ranks = start_relay(procs, other, address, 1, "--debug")
    joined = ranks_until_their_relays_give_up([plain_ranks, debug_ranks],
                                              salt_hex=OTHER_SALT_HEX, world=1)
    assert plain.wait() == 1
    took = time.monotonic() - joined
    assert took < 3.0, took  # three Challenges 0.5 s apart, not connect_timeout (30 s)
    line = one_line(plain)
    assert line == (f"flodl-trio: relay h: the session salt differs from the coordinator's at "
                    f"{address}, or that is not a coordinator of this session (--debug for "
                    "detail)")
    assert len(line) < 200
    # --debug after the command: the traceback, with the last attempt's failure in full.
    assert debug.wait() == 1
    detail = "\n".join(debug.err)
    assert "Traceback" in detail and "WrongSession" in detail
    assert "Challenge did not verify with our salt" in detail
