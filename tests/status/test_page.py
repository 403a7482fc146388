"""The live status page on the status port: ``/`` (one self-contained page, strict CSP),
``/board.json`` and ``/events`` (Server-Sent Events: one document per tick for all viewers, slow
viewers dropped, a cap on viewers, the port's request limits, a bounded stream life)."""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import h11
import trio
import trio.testing

from flodl_trio.status import serve_status
from flodl_trio.testing import MemoryNetwork, MemoryStream, open_local_cluster

from helpers.http import get, parse_response, read_to_eof


class Board:
    """A board_fn that counts its calls; ``pad`` makes each document that many bytes bigger."""

    def __init__(self, pad: int = 0) -> None:
        self.calls = 0
        self.pad = "x" * pad
        self.phase = "running"

    def __call__(self) -> dict[str, Any]:
        self.calls += 1
        return {"phase": self.phase, "n": self.calls, "pad": self.pad}


@asynccontextmanager
async def page_server(board: Board | None, net: MemoryNetwork, **kwargs: Any
                      ) -> AsyncIterator[None]:
    kwargs.setdefault("request_timeout", 3.0)
    async with trio.open_nursery() as nursery, net.listener("status") as listener:
        await nursery.start(lambda task_status: serve_status(
            listener, lambda: {"phase": "running"}, board_fn=board, task_status=task_status,
            **kwargs))
        yield
        nursery.cancel_scope.cancel()


class Viewer:
    """An ``/events`` client: the response head, then one decoded document per message."""

    def __init__(self, stream: MemoryStream) -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.CLIENT)
        self.status = 0
        self.buffer = b""
        self.ended = False
        self.clean_end = False

    @classmethod
    async def connect(cls, net: MemoryNetwork) -> Viewer:
        viewer = cls(await net.connect("status"))
        await viewer.stream.send_all(get("/events"))
        return viewer

    async def next_event(self) -> dict[str, Any] | None:
        """The next ``data:`` document, or None once the stream ended."""
        for _ in range(10_000):  # bounded; each round consumes bytes or ends
            if b"\n\n" in self.buffer:
                block, _, self.buffer = self.buffer.partition(b"\n\n")
                for line in block.split(b"\n"):
                    if line.startswith(b"data: "):
                        document: dict[str, Any] = json.loads(line[6:])
                        return document
                continue  # a retry: field
            if self.ended:
                return None
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError:  # closed mid-body: the server went away
                self.ended = True
                continue
            if event is h11.NEED_DATA:
                self.conn.receive_data(await self.stream.receive_some())
            elif isinstance(event, h11.Response):
                self.status = event.status_code
                self.headers = {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                self.buffer += event.data
            else:  # EndOfMessage or ConnectionClosed
                self.ended = True
                self.clean_end = isinstance(event, h11.EndOfMessage)
        raise AssertionError("no event in 10,000 rounds")


async def test_the_page_is_self_contained_and_its_csp_allows_only_its_own_script() -> None:
    net = MemoryNetwork()
    async with page_server(Board(), net):
        client = await net.connect("status")
        await client.send_all(get("/"))
        status, headers, body = parse_response(await read_to_eof(client))
    assert status == 200 and headers["content-type"] == "text/html; charset=utf-8"
    html = body.decode()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)  # no CDN, no link out
    (script,) = re.findall(r"<script>(.*?)</script>", html, re.DOTALL)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    policy = headers["content-security-policy"]
    assert f"script-src 'sha256-{digest}'" in policy
    assert "default-src 'none'" in policy and "img-src data:" in policy
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script  # user text only ever goes through textContent
    assert "<main id=\"board\">" in html and "dataset.phase = doc.phase" in script


async def test_without_a_board_fn_the_page_routes_are_404() -> None:
    net = MemoryNetwork()
    async with page_server(None, net):
        for path in ("/", "/board.json", "/events"):
            client = await net.connect("status")
            await client.send_all(get(path))
            assert parse_response(await read_to_eof(client))[0] == 404


async def test_events_build_one_document_per_tick_whatever_the_number_of_viewers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net, board = MemoryNetwork(), Board()
    async with page_server(board, net, board_tick=1.0):
        viewers = [await Viewer.connect(net) for _ in range(4)]
        seen: list[list[int]] = [[] for _ in viewers]
        for _ in range(5):
            for i, viewer in enumerate(viewers):
                document = await viewer.next_event()
                assert document is not None
                seen[i].append(document["n"])
        assert all(v.status == 200 for v in viewers)
        assert viewers[0].headers["content-type"].startswith("text/event-stream")
        assert board.calls <= 6  # one per tick, not one per viewer and tick (20)
        assert seen[1][-1] == seen[0][-1] and document["viewers"] == 4


async def test_a_viewer_that_does_not_read_is_dropped_and_the_others_keep_their_pace(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net, board = MemoryNetwork(buffer_size=8192), Board(pad=20_000)
    # request_timeout (which also bounds one write) far away: the full queue is what drops it.
    async with page_server(board, net, board_tick=1.0, request_timeout=60.0):
        stuck = await net.connect("status")
        await stuck.send_all(get("/events"))  # and never reads a byte
        reader = await Viewer.connect(net)
        arrivals, last = [], None
        for _ in range(8):
            document = await reader.next_event()
            assert document is not None
            arrivals.append(trio.current_time())
            last = document
        assert last is not None and last["dropped_viewers"] == 1 and last["viewers"] == 1
        gaps = [b - a for a, b in itertools.pairwise(arrivals[2:])]
        assert all(abs(gap - 1.0) < 0.01 for gap in gaps)  # the coordinator never waited
        # The dropped viewer's connection is closed: what it can still read ends in EOF.
        with trio.fail_after(5):
            assert len(await read_to_eof(stuck, limit=1 << 22)) < 1 << 22
        await stuck.aclose()


async def test_viewers_past_the_cap_get_503_and_can_still_poll_board_json(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork()
    async with page_server(Board(), net, max_viewers=2):
        watching = [await Viewer.connect(net) for _ in range(2)]
        for viewer in watching:
            assert await viewer.next_event() is not None
        refused = await net.connect("status")
        await refused.send_all(get("/events"))
        status, headers, body = parse_response(await read_to_eof(refused))
        assert status == 503 and headers["retry-after"] == "5"
        assert b"at most 2 /events viewers, 2 are connected; poll /board.json" in body
        poller = await net.connect("status")
        await poller.send_all(get("/board.json"))
        status, headers, body = parse_response(await read_to_eof(poller))
        assert status == 200 and json.loads(body)["phase"] == "running"


async def test_events_head_is_bounded_like_every_request_and_the_stream_by_its_life(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork()
    async with page_server(Board(), net, request_timeout=3.0, stream_seconds=10.0):
        slow = await net.connect("status")
        start = trio.current_time()
        await slow.send_all(b"GET /events HTTP/1.1\r\nHost: x\r\n")  # never the end of the head
        assert await read_to_eof(slow) == b""
        assert abs(trio.current_time() - start - 3.0) < 0.01
        big = await net.connect("status")
        await big.send_all(b"GET /events HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 40_000)
        assert (await read_to_eof(big)).startswith(b"HTTP/1.1 431 ")
        viewer = await Viewer.connect(net)
        start = trio.current_time()
        documents = 0
        while await viewer.next_event() is not None:  # bounded by stream_seconds
            documents += 1
        assert viewer.ended and abs(trio.current_time() - start - 10.0) < 0.01
        assert 9 <= documents <= 11


async def test_an_open_events_stream_does_not_hold_up_the_coordinators_shutdown() -> None:
    with trio.fail_after(20):
        async with open_local_cluster({"host-a": [0, 1]}, transport="tcp") as cluster:
            host, port = cluster.coord.address
            client = await trio.open_tcp_stream(host, port)
            viewer = Viewer(client)  # type: ignore[arg-type]
            await client.send_all(get("/events"))
            document = await viewer.next_event()
            assert document is not None and document["phase"] == "running"
            assert [row[:2] for row in document["relays"][0]["ranks"]] == [
                [0, "alive"], [1, "alive"]]
            left_at = trio.current_time()
        assert trio.current_time() - left_at < 5  # shutdown_grace, not stream_seconds (300 s)
        with trio.fail_after(5):  # its last documents, then the end of the stream
            for _ in range(20):
                if await viewer.next_event() is None:
                    break
        assert viewer.ended
        await client.aclose()


async def test_closing_the_status_listener_ends_every_events_stream_cleanly_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork()
    async with trio.open_nursery() as nursery:
        listener = net.listener("status")
        await nursery.start(lambda task_status: serve_status(
            listener, lambda: {"phase": "running"}, board_fn=Board(), request_timeout=3.0,
            task_status=task_status))
        viewers = [await Viewer.connect(net) for _ in range(2)]
        for viewer in viewers:
            assert await viewer.next_event() is not None
        closed_at = trio.current_time()
        await listener.aclose()
        for viewer in viewers:
            while await viewer.next_event() is not None:  # bounded: the stream ends
                pass
            assert viewer.clean_end  # the end of the body, not a cut connection
            await viewer.stream.aclose()
    assert trio.current_time() - closed_at < 0.01  # not stream_seconds (300 s) later
    net.assert_all_closed()


async def test_the_page_routes_are_read_only_head_answers_and_other_methods_get_405() -> None:
    net = MemoryNetwork()
    async with page_server(Board(), net):
        for path in ("/", "/board.json", "/events"):
            client = await net.connect("status")
            await client.send_all(get(path, "POST"))
            status, headers, _ = parse_response(await read_to_eof(client))
            assert (status, headers["allow"]) == (405, "GET, HEAD")
        client = await net.connect("status")
        await client.send_all(get("/events", "HEAD"))
        raw = await read_to_eof(client)
        assert raw.startswith(b"HTTP/1.1 200 ") and b"text/event-stream" in raw
        assert raw.endswith(b"\r\n\r\n")  # the head only: no stream behind it
