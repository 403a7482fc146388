"""HTTP/1.1 as the status tests speak it: a request's bytes, a whole response read to EOF and
parsed with h11 (one response per connection: the status leg closes after each)."""

from __future__ import annotations

import h11
import trio

from helpers.streams import receive_until


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one whole response (it must say its length and close)."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(raw)
    conn.receive_data(b"")
    response = conn.next_event()
    assert isinstance(response, h11.Response)
    headers = {k.decode(): v.decode() for k, v in response.headers}
    body = bytearray()
    for _ in range(len(raw) + 2):  # every event but the last consumes bytes
        event = conn.next_event()
        if isinstance(event, h11.EndOfMessage):
            break
        assert isinstance(event, h11.Data)
        body += event.data
    assert headers["content-length"] == str(len(body))
    assert headers["connection"] == "close"
    return response.status_code, headers, bytes(body)


async def read_to_eof(stream: trio.abc.ReceiveStream, limit: int = 1 << 20) -> bytes:
    """Everything ``stream`` receives until EOF, or ``limit`` bytes."""
    return await receive_until(stream, lambda _: False, most=limit)


def get(path: str, method: str = "GET") -> bytes:
    """A request for ``path`` (``GET`` unless told), with no body."""
    return f"{method} {path} HTTP/1.1\r\nHost: coord\r\nContent-Length: 0\r\n\r\n".encode()
