"""A relay connection's one close reason, its bounded writer queue, and its one session."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from flodl_trio import WireError, wire
from flodl_trio.coordinator._relayconn import CloseReason, Delivery, RelayConn

KEY = b"k" * 32
CODEC = wire.FrameCodec(wire.SessionSalt(bytes(range(16))))


def make_conn(stream: trio.abc.Stream, *, queue_limit: int = 65536,
              joined: bool = True) -> RelayConn:
    conn = RelayConn(host="h1", ranks=(0, 1), peer="mem:1", stream=stream,
                     sealer=wire.RecordSealer(KEY, wire.COORD_TO_RELAY),
                     opener=wire.RecordOpener(KEY, wire.RELAY_TO_COORD),
                     write_stall_timeout=5.0, index=1, queue_limit=queue_limit)
    if joined:
        conn.open_session(CODEC)
    return conn


async def test_a_relay_whose_queue_fills_is_lost_as_a_stall_and_its_records_fail(
    autojump_clock: trio.abc.Clock,
) -> None:
    send, _recv = trio.testing.lockstep_stream_pair()  # nobody reads the relay's end
    conn = make_conn(send, queue_limit=4)
    lost: list[tuple[str, bool]] = []

    def on_lost(c: RelayConn, cause: str, stalled: bool) -> None:
        lost.append((cause, stalled))
        c.abandon(cause, stalled=stalled)

    conn.on_lost = on_lost
    deliveries = [Delivery(1) for _ in range(6)]
    for i, delivery in enumerate(deliveries):
        conn.submit_frame(0, CODEC.encode(wire.DeclareDead(rank=i)), delivery)
    # The fifth did not fit: it fails at once, and the connection ends as a stall.
    assert deliveries[4].failures[conn].startswith("queue full: 4 records not yet written")
    assert lost == [(deliveries[4].failures[conn], True)]
    assert conn.stalled and not conn.alive and conn.close_reason is not None
    assert conn.close_reason.kind == "stalled"
    assert deliveries[5].failures[conn].startswith("connection lost (queue full")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn.run_writer)
    # What was queued before is settled as lost too, never written after the end.
    assert all(d.done.is_set() and conn in d.failures for d in deliveries)
    assert conn.closed


async def test_the_first_end_is_the_close_reason(autojump_clock: trio.abc.Clock) -> None:
    send, _recv = trio.testing.memory_stream_pair()
    conn = make_conn(send)
    conn.retire("every rank on it was declared dead", grace=1.0)
    assert conn.close_reason == CloseReason("retired", "every rank on it was declared dead")
    assert conn.retired == "every rank on it was declared dead" and conn.lost_reason is None
    # Its end after that (the relay closed, or a write failed) is no second reason.
    assert conn.abandon("connection closed by the relay (EOF)") is False
    assert conn.close_reason.kind == "retired" and not conn.alive
    other = make_conn(trio.testing.memory_stream_pair()[0])
    assert other.abandon("connection reset") is True
    assert other.lost_reason == "connection reset" and other.retired is None
    assert other.abandon("later") is False and other.lost_reason == "connection reset"


async def test_the_coordinator_cannot_send_a_relay_what_only_flows_from_it() -> None:
    send, recv = trio.testing.memory_stream_pair()
    conn = make_conn(send)
    beat = CODEC.encode(wire.Heartbeat(rank=0, step_count=1))
    with pytest.raises(WireError, match="expected one of Goodbye, FenceRank, got RankExit"):
        conn.submit_control(wire.RankExit(rank=0), None)  # type: ignore[arg-type]
    with pytest.raises(WireError, match="expected a ControlMsg frame"):
        conn.submit_frame(0, beat, None)
    with pytest.raises(WireError, match="expected a ControlMsg frame"):
        conn.submit_fanout([0, 1], beat, None)
    with pytest.raises(WireError, match=r"FANOUT record: expected ranks of relay 'h1' "
                       r"\[0, 1\], got \[0, 2\]"):
        conn.submit_fanout([0, 2], CODEC.encode(wire.Shutdown()), None)
    # Nothing was queued or sealed: the relay opens the next record as the first one.
    delivery = Delivery(1)
    conn.submit_fanout([0, 1], CODEC.encode(wire.Shutdown()), delivery)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn.run_writer)
        relay = wire.UpstreamSession(wire.RecordOpener(KEY, wire.COORD_TO_RELAY),
                                     wire.RecordSealer(KEY, wire.RELAY_TO_COORD), host="h1",
                                     ranks=(0, 1))
        await delivery.done.wait()
        relay.receive_data(await recv.receive_some(65536))
        assert relay.next_event() == wire.Deliver((0, 1), wire.len_frame(
            CODEC.encode(wire.Shutdown())))
        assert relay.next_event() is wire.NEED_DATA
        conn.abandon("test over")
    assert delivery.failures == {}


async def test_nothing_is_written_to_a_relay_before_its_join_is_confirmed() -> None:
    send, _recv = trio.testing.memory_stream_pair()
    conn = make_conn(send, joined=False)
    frame, eof = Delivery(1), Delivery(1)
    conn.submit_frame(0, CODEC.encode(wire.Shutdown()), frame)
    conn.submit_eof(eof, goodbye="shutting down")
    # Settled at once (a shutdown does not wait on it); the handshake still owns the stream.
    assert frame.failures[conn] == "not joined yet (its Ready has not verified)"
    assert eof.failures[conn] == "not joined yet (its Ready has not verified)"
    assert conn.idle and conn.alive
    session = conn.open_session(CODEC)
    assert conn.open_session(CODEC) is session  # one session per connection
