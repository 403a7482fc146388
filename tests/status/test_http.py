"""The status leg answers HTTP/1.1 (state.json, healthz, metrics): one bounded response each."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from flodl_trio._errors import ConfigError, FlodlError
from flodl_trio.port_mux import open_port_mux
from flodl_trio.status import (
    PROMETHEUS_CONTENT_TYPE,
    fetch_state,
    render_prometheus,
    serve_status,
)
from flodl_trio.testing import MemoryNetwork

from helpers.http import get, parse_response, read_to_eof
from helpers.streams import receive_until

WEIRD_REASON = 'bad "mac"\\from\nscanner'


def make_state(phase: str = "running") -> dict[str, Any]:
    return {
        "phase": phase,
        "world_size": 4,
        "covered": 4,
        "relays": [
            {"host": "host-a", "ranks": [0, 1, 2], "peer": ["127.0.0.1", 40001],
             "connected": True},
            {"host": "host-b", "ranks": [3], "peer": ["127.0.0.1", 40002], "connected": False},
        ],
        "live": [0, 1, 3],
        "dead": [{"rank": 2, "reason": "heartbeat stale (>30s)"}],
        "exited": [],
        "lost_broadcasts": 2,
        "rejected_handshakes": {"unknown_magic": 3, WEIRD_REASON: 1},
        "uptime_s": 12.5,
    }


@asynccontextmanager
async def status_server(
    state: dict[str, Any], *, request_timeout: float = 5.0
) -> AsyncIterator[tuple[str, int]]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with open_port_mux(listeners, peek_timeout=5.0) as mux, trio.open_nursery() as nursery:
        await nursery.start(
            lambda task_status: serve_status(
                mux.status, lambda: state, request_timeout=request_timeout, task_status=task_status
            )
        )
        yield ("127.0.0.1", port)
        await mux.aclose()  # serve_status returns once its listener is closed


async def exchange(
    address: tuple[str, int], raw_request: bytes
) -> tuple[int, dict[str, str], bytes]:
    with trio.fail_after(5):
        async with await trio.open_tcp_stream(*address) as client:
            await client.send_all(raw_request)
            return parse_response(await read_to_eof(client))


async def read_until(stream: trio.abc.ReceiveStream, marker: bytes) -> bytes:
    return await receive_until(stream, lambda data: marker in data)


async def test_state_json_is_the_state_document() -> None:
    state = make_state()
    async with status_server(state) as address:
        status, headers, body = await exchange(address, get("/state.json"))
    assert status == 200
    assert headers["content-type"] == "application/json"
    assert json.loads(body) == state


async def test_metrics_parse_as_prometheus_with_the_expected_values() -> None:
    async with status_server(make_state()) as address:
        status, headers, body = await exchange(address, get("/metrics"))
    assert status == 200
    assert headers["content-type"] == PROMETHEUS_CONTENT_TYPE
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }
    assert samples[("flodl_trio_world_size", ())] == 4
    assert samples[("flodl_trio_ranks_covered", ())] == 4
    assert samples[("flodl_trio_relays", ())] == 2
    assert samples[("flodl_trio_relays_connected", ())] == 1
    assert samples[("flodl_trio_ranks_live", ())] == 3
    assert samples[("flodl_trio_ranks_dead", ())] == 1
    assert samples[("flodl_trio_ranks_exited", ())] == 0
    assert samples[("flodl_trio_lost_broadcasts_total", ())] == 2
    assert samples[("flodl_trio_rejected_handshakes_total", (("reason", "unknown_magic"),))] == 3
    assert samples[("flodl_trio_rejected_handshakes_total", (("reason", WEIRD_REASON),))] == 1
    assert samples[("flodl_trio_uptime_seconds", ())] == 12.5
    phases = {dict(k[1])["phase"]: v for k, v in samples.items() if k[0] == "flodl_trio_phase"}
    assert phases == {"forming": 0, "running": 1, "shutting_down": 0, "closed": 0}
    kinds = {f.name: f.type for f in text_string_to_metric_families(body.decode())}
    assert kinds["flodl_trio_lost_broadcasts"] == "counter"
    assert kinds["flodl_trio_rejected_handshakes"] == "counter"


def test_render_prometheus_tolerates_an_empty_document() -> None:
    families = list(text_string_to_metric_families(render_prometheus({})))
    assert {f.name for f in families} >= {"flodl_trio_world_size", "flodl_trio_phase"}


@pytest.mark.parametrize(
    ("phase", "expected"),
    [("running", 200), ("forming", 503), ("shutting_down", 503), ("closed", 503)],
)
async def test_healthz_is_200_only_while_running(phase: str, expected: int) -> None:
    async with status_server(make_state(phase)) as address:
        status, _, body = await exchange(address, get("/healthz"))
    assert status == expected
    assert body == (b"ok\n" if expected == 200 else f"{phase}\n".encode())


async def test_unknown_paths_wrong_methods_and_garbage_get_404_405_400() -> None:
    async with status_server(make_state()) as address:
        assert (await exchange(address, get("/nope")))[0] == 404
        assert (await exchange(address, get("/state.json?pretty=1")))[0] == 200
        status, headers, _ = await exchange(address, get("/state.json", method="POST"))
        assert (status, headers["allow"]) == (405, "GET, HEAD")
        post = b"POST /metrics HTTP/1.1\r\nHost: coord\r\nContent-Length: 5\r\n\r\nhello"
        assert (await exchange(address, post))[0] == 405  # answered without reading the body
        status, _, _ = await exchange(address, b"GET \x00\x01 not http\r\n\r\n")
        assert status == 400
        # The server survived all of that.
        assert (await exchange(address, get("/healthz")))[0] == 200


async def test_head_answers_like_get_without_the_body() -> None:
    state = make_state()
    async with status_server(state) as address:
        for path in ("/state.json", "/metrics", "/healthz"):
            _, get_headers, get_body = await exchange(address, get(path))
            with trio.fail_after(5):
                async with await trio.open_tcp_stream(*address) as client:
                    await client.send_all(get(path, method="HEAD"))
                    raw = await read_to_eof(client)
            head, _, rest = raw.partition(b"\r\n\r\n")
            assert rest == b"", raw  # no body at all
            lines = head.decode().split("\r\n")
            assert lines[0] == "HTTP/1.1 200 OK", lines
            headers = dict(line.lower().split(": ", 1) for line in lines[1:])
            assert headers["content-length"] == str(len(get_body)) == get_headers["content-length"]
            assert headers["content-type"] == get_headers["content-type"].lower()


@pytest.mark.parametrize("method", ["PUT", "OPTIONS", "DELETE", "PATCH", "TRACE", "POST"])
async def test_every_other_method_gets_405_naming_the_allowed_ones(method: str) -> None:
    async with status_server(make_state()) as address:
        status, headers, body = await exchange(address, get("/state.json", method=method))
    assert (status, headers["allow"]) == (405, "GET, HEAD")
    assert body == f"method {method} not allowed: GET or HEAD\n".encode()


async def test_a_1mb_header_gets_431_while_other_requests_are_still_served() -> None:
    huge = b"GET /state.json HTTP/1.1\r\nHost: coord\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n"
    async with status_server(make_state()) as address, trio.open_nursery() as nursery:
        client = await trio.open_tcp_stream(*address)

        async def upload() -> None:
            try:
                await client.send_all(huge)
            except trio.BrokenResourceError:  # the server closed before taking all of it
                pass

        nursery.start_soon(upload)
        assert (await exchange(address, get("/healthz")))[0] == 200
        with trio.fail_after(5):
            status, _, _ = parse_response(await read_to_eof(client))
        assert status == 431
        nursery.cancel_scope.cancel()
        await client.aclose()


async def test_431_is_sent_before_the_whole_header_was_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork(buffer_size=65536)
    huge = b"GET /metrics HTTP/1.1\r\nHost: coord\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n"
    async with trio.open_nursery() as nursery, net.listener("status") as listener:
        await nursery.start(
            lambda task_status: serve_status(
                listener, make_state, request_timeout=10.0, task_status=task_status
            )
        )
        client = await net.connect("status")

        async def upload() -> None:
            try:
                await client.send_all(huge)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

        nursery.start_soon(upload)
        first = await client.receive_some()
        assert first.startswith(b"HTTP/1.1 431 ")
        # At most a few buffers' worth reached the server: it answered from 16 KiB of header.
        assert net.connections[0].bytes_to_server < 200_000
        nursery.cancel_scope.cancel()
        await client.aclose()


async def test_silent_and_slow_clients_are_dropped_at_request_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork()
    async with trio.open_nursery() as nursery, net.listener("status") as listener:
        await nursery.start(
            lambda task_status: serve_status(
                listener, make_state, request_timeout=3.0, task_status=task_status
            )
        )
        start = trio.current_time()
        silent = await net.connect("status")
        slow = await net.connect("status")
        await slow.send_all(b"GET /state.json HTTP/1.1\r\n")  # and never the end of the head
        assert await silent.receive_some() == b""
        assert await slow.receive_some() == b""
        assert trio.current_time() - start == pytest.approx(3.0)
        await silent.aclose()
        await slow.aclose()
        await listener.aclose()  # serve_status returns, the nursery exits
    net.assert_all_closed()


async def test_a_failing_state_fn_gets_500_and_the_server_goes_on() -> None:
    net = MemoryNetwork()

    def broken() -> dict[str, Any]:
        raise RuntimeError("state exploded")

    async with trio.open_nursery() as nursery, net.listener("status") as listener:
        await nursery.start(
            lambda task_status: serve_status(
                listener, broken, request_timeout=3.0, task_status=task_status
            )
        )
        for _ in range(2):
            client = await net.connect("status")
            await client.send_all(get("/state.json"))
            assert parse_response(await read_to_eof(client))[0] == 500
            await client.aclose()
        await listener.aclose()


async def test_fetch_state_round_trips_through_the_port_mux() -> None:
    state = make_state()
    async with status_server(state) as address:
        assert await fetch_state(address, timeout=5.0) == state
        assert await fetch_state(f"127.0.0.1:{address[1]}", timeout=5.0) == state


async def test_fetch_state_errors_name_the_address_and_the_problem() -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with open_port_mux(listeners, peek_timeout=5.0, legs=()):  # nobody serves status
        with pytest.raises(FlodlError, match=rf"127\.0\.0\.1:{port}.*closed before"):
            await fetch_state(("127.0.0.1", port), timeout=5.0)
    refused = rf"connection refused: is a coordinator running at 127\.0\.0\.1:{port}\?"
    with pytest.raises(FlodlError, match=refused):
        await fetch_state(("127.0.0.1", port), timeout=5.0)
    with pytest.raises(ConfigError, match="expected HOST:PORT"):
        await fetch_state("no-port-here", timeout=5.0)


async def test_fetch_state_reports_a_non_200_and_a_deadline() -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with open_port_mux(listeners, peek_timeout=5.0) as mux:
        # The status leg queues the connection but nobody answers: the client's deadline fires.
        with pytest.raises(FlodlError, match=r"no complete response within 0\.3s"):
            await fetch_state(("127.0.0.1", port), timeout=0.3)
        stale = await mux.status.accept()
        await stale.aclose()

        async def answer_404() -> None:
            server = await mux.status.accept()
            await read_until(server, b"\r\n\r\n")
            await server.send_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 5\r\n\r\nnope\n")
            await server.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer_404)
            with pytest.raises(FlodlError, match=r"expected 200 from /state.json, got 404 'nope'"):
                await fetch_state(("127.0.0.1", port), timeout=5.0)


@pytest.mark.slow
@pytest.mark.parametrize("state", [
    make_state(),
    {"phase": "running", "relays": [{"host": "host-a"}, "junk"], "dead": [{}]},  # other version
], ids=["full", "partial"])
async def test_the_status_command_prints_any_status_document_it_gets(state: dict[str, Any]
                                                                    ) -> None:
    async with status_server(state) as (host, port):
        done = await trio.run_process([sys.executable, "-m", "flodl_trio", "status",
                                       f"{host}:{port}"], capture_stdout=True,
                                      capture_stderr=True, check=False)
    assert (done.returncode, done.stderr) == (0, b"")
    out = done.stdout.decode()
    assert out.startswith(f"phase running  world {state.get('world_size')}")
    assert "relay host-a" in out and "dead rank " in out
