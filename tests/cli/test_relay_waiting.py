"""What ``flodl-trio relay`` says while it cannot dial yet (issue 34, item 5), as real processes:
a store that names no leader is one line at once -- what it waits for and until when -- and what
its ranks are told; a coordinator name that does not resolve ends the relay at once, in one
line, before any rank connects."""

from __future__ import annotations

import re
import socket
import time
from typing import Any

import pytest

from helpers.cli_procs import Proc, one_line

pytestmark = pytest.mark.slow


def test_a_store_with_no_leader_is_one_line_at_once_and_the_ranks_hear_what_is_awaited(
        env: dict[str, str], procs: list[Proc], etcd: Any) -> None:
    store = f"etcd://{etcd.endpoint}/flodl/nobody"
    relay = Proc("relay", "--coordinator", store, "--host", "h0", "--ranks", "0",
                 "--world-size", "1", env=env)
    procs.append(relay)
    rank_address = relay.line_with("listening for ranks on").rsplit(" ", 1)[-1]
    rank = Proc("rank", "--relay", rank_address, "--rank", "0", "--world-size", "1", env=env)
    procs.append(rank)
    started = time.time()
    line = relay.line_with("retrying until")
    said_after = time.time() - started
    match = re.fullmatch(rf"relay 'h0': no coordinator published at {re.escape(store)} yet; "
                         r"retrying until (\d\d):(\d\d):(\d\d) \(connect_timeout 30 s\)", line)
    assert match, line
    assert said_after < 10, said_after  # at once: a rank's start-up, not connect_timeout
    until = time.localtime(started + 30)
    shown = [int(part) for part in match.groups()]
    then = until.tm_hour * 3600 + until.tm_min * 60 + until.tm_sec
    assert abs((shown[0] * 3600 + shown[1] * 60 + shown[2]) - then) % 86400 <= 10, line
    time.sleep(1.5)  # a notice or two reaches the rank
    relay.popen.kill()  # the rank then ends quoting the relay's last notice
    assert rank.wait() == 1
    assert one_line(rank) == (f"flodl-trio: CoordinatorLost: rank 0: the relay said: relay "
                              f"'h0' has all its "
                              f"local ranks and is waiting: no coordinator published at "
                              f"{store} yet")


def _refusal(name: str) -> str | None:
    """Why the resolver says at once that ``name`` does not exist; None when it does not say
    that (a machine without DNS may answer EAI_AGAIN, which the relay retries)."""
    try:
        socket.getaddrinfo(name, None)
    except socket.gaierror as exc:
        return exc.strerror if exc.errno != socket.EAI_AGAIN else None
    return None


@pytest.mark.parametrize("coordinator", ["coordinator.invalid:7000",
                                         "127.0.0.1:7000,coordinator.invalid:7000",
                                         "etcd://coordinator.invalid:2379/flodl/run1"])
def test_a_coordinator_name_that_does_not_resolve_ends_the_relay_at_once(
        env: dict[str, str], procs: list[Proc], coordinator: str) -> None:
    why = _refusal("coordinator.invalid")
    if why is None:
        pytest.skip("this machine's resolver does not refuse coordinator.invalid at once")
    started = time.monotonic()
    relay = Proc("relay", "--coordinator", coordinator, "--host", "h0", "--ranks", "0",
                 "--world-size", "1", env=env)
    procs.append(relay)
    assert relay.wait() == 1  # no rank ever connected: it did not wait for one
    assert time.monotonic() - started < 15
    assert one_line(relay) == (f"flodl-trio: relay h0: cannot resolve 'coordinator.invalid' "
                               f"({why}), named by --coordinator {coordinator}: check the "
                               "address")
    assert relay.out == []  # it never listened for ranks
