"""``open_tcp``, the relay's and the rank's dial of a numeric address: a connection the kernel
makes within ``connect`` is used at once; a refusal is the OSError trio's dial raises."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import sys

import pytest
import trio

from flodl_trio.net._transport import open_tcp


async def test_a_loopback_dial_is_connected_nodelay_and_carries_bytes() -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    async with listener:
        stream = await open_tcp("127.0.0.1", port)
        async with stream, await listener.accept() as server:
            assert stream.socket.getpeername() == ("127.0.0.1", port)
            assert stream.socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            await stream.send_all(b"hello")
            assert await server.receive_some(5) == b"hello"


async def test_a_port_nobody_listens_on_is_refused_with_its_address() -> None:
    with socket.socket() as probe:  # a port that was free a moment ago, now closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(OSError) as info:
        await open_tcp("127.0.0.1", port)
    assert info.value.errno == errno.ECONNREFUSED
    assert f"('127.0.0.1', {port})" in str(info.value)


async def test_a_cancelled_dial_raises_cancelled_before_connecting() -> None:
    with trio.CancelScope() as scope:
        scope.cancel()
        await open_tcp("127.0.0.1", 9)
        pytest.fail("the dial went on under a cancelled scope")
    assert scope.cancelled_caught


SCOPED_DIAL = """
import socket, trio
from flodl_trio.net._transport import open_tcp

async def main():
    listener = trio.socket.socket(socket.AF_INET6)
    await listener.bind(("fe80::1%lo", 0))
    listener.listen(1)
    stream = await open_tcp("fe80::1%lo", listener.getsockname()[1])
    print("connected", stream.socket.getpeername()[0])

trio.run(main)
"""


def test_a_scoped_link_local_address_is_dialed_with_its_scope() -> None:
    # In a network namespace of its own (loopback with fe80::1): the scope id ("%lo") is
    # only in the resolved address; dialed as a (host, port) pair the kernel said EINVAL.
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs root, unshare and iproute2 for a network namespace of its own")
    script = ("ip link set lo up && ip addr add fe80::1/64 dev lo nodad && "
              f'exec "{sys.executable}" -c "$0"')
    done = subprocess.run(["unshare", "-n", "sh", "-c", script, SCOPED_DIAL],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "connected fe80::1"
