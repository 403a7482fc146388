"""A minimal ``/events`` viewer in a process of its own (for bench_scale.py --viewer): it reads
the stream for a while and prints one JSON line: messages, bytes, the last document's size and
the seconds from connecting to the first document.

    python scripts/_sse_viewer.py 127.0.0.1:PORT SECONDS
"""

from __future__ import annotations

import json
import socket
import sys
import time


def main() -> int:
    host, _, port = sys.argv[1].rpartition(":")
    seconds = float(sys.argv[2])
    messages = received = last = 0
    first: float | None = None
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=seconds + 5) as sock:
        sock.sendall(b"GET /events HTTP/1.1\r\nHost: bench\r\nAccept: text/event-stream\r\n\r\n")
        deadline = time.monotonic() + seconds
        pending = b""
        while time.monotonic() < deadline:
            chunk = sock.recv(1 << 20)
            if not chunk:
                break
            received += len(chunk)
            pending += chunk
            while b"\n\n" in pending:  # chunk framing lines are counted in the size; fine here
                block, _, pending = pending.partition(b"\n\n")
                if b"data: " in block:
                    messages += 1
                    first = first if first is not None else time.monotonic() - start
                    last = len(block)
    print(json.dumps({"messages": messages, "bytes": received, "last_bytes": last,
                      "first_s": first}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
