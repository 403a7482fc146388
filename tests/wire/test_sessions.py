"""The sans-IO sessions of the legs after the join, without Trio (like h11's tests).

Each rule of each side, both directions, and every cut of the byte stream: the events do not
depend on how the peer's bytes were split into reads.
"""

from __future__ import annotations

from typing import Any

import pytest

from flodl_trio import AuthError, FrameTooLarge, WireError, wire
from flodl_trio.wire import (
    NEED_DATA,
    CoordinatorSession,
    Deliver,
    EndOfStream,
    Invalid,
    RankFrame,
    RankLinkSession,
    RankSession,
    UpstreamSession,
)

SALT = wire.SessionSalt(bytes(range(16)))
OTHER_SALT = wire.SessionSalt(b"\xee" * 16)
KEY = b"k" * 32
CODEC = wire.FrameCodec(SALT)
DATA, CONTROL, FANOUT = (int(wire.RecordKind.DATA), int(wire.RecordKind.CONTROL),
                         int(wire.RecordKind.FANOUT))


def coordinator_side(ranks: tuple[int, ...] = (2, 3)) -> CoordinatorSession:
    return CoordinatorSession(wire.RecordOpener(KEY, wire.RELAY_TO_COORD),
                              wire.RecordSealer(KEY, wire.COORD_TO_RELAY), CODEC,
                              host="h1", ranks=ranks)


def relay_side(ranks: tuple[int, ...] = (2, 3)) -> UpstreamSession:
    return UpstreamSession(wire.RecordOpener(KEY, wire.COORD_TO_RELAY),
                           wire.RecordSealer(KEY, wire.RELAY_TO_COORD), host="h1", ranks=ranks)


def drain(session: Any) -> list[Any]:
    """Every event up to NEED_DATA or the end (bounded)."""
    out = []
    for _ in range(10_000):
        event = session.next_event()
        if event is NEED_DATA:
            return out
        out.append(event)
        if isinstance(event, EndOfStream):
            return out
    raise AssertionError("no NEED_DATA or end after 10,000 events")


def events_of(session: Any, chunks: list[bytes]) -> list[Any]:
    out = []
    for chunk in chunks:
        session.receive_data(chunk)
        out += drain(session)
    return out


def comparable(events: list[Any]) -> list[Any]:
    """Errors compare by identity: an end is compared by its reason, cleanness and error type."""
    return [(e.reason, e.clean, type(e.error)) if isinstance(e, EndOfStream) else e
            for e in events]


def every_cut(make: Any, stream: bytes) -> None:
    """Cut ``stream`` at every byte (and feed it byte by byte): the same events each time."""
    whole = comparable(events_of(make(), [stream, b""]))
    assert isinstance(whole[-1], tuple)
    for cut in range(1, len(stream)):
        assert comparable(events_of(make(), [stream[:cut], stream[cut:], b""])) == whole, cut
    single = [stream[i:i + 1] for i in range(len(stream))] + [b""]
    assert comparable(events_of(make(), single)) == whole


# -- coordinator side of a relay -------------------------------------------------------------


def relay_records(*items: tuple[int, int, bytes]) -> bytes:
    sealer = wire.RecordSealer(KEY, wire.RELAY_TO_COORD)
    return b"".join(sealer.seal(kind, rank, payload) for kind, rank, payload in items)


def test_coordinator_gets_timing_and_metrics_of_the_ranks_the_relay_carries() -> None:
    beat = wire.Heartbeat(rank=2, step_count=5)
    metrics = wire.Metrics(rank=3, epoch=1, avg_loss=0.5, batches_processed=4, epoch_ms=2.0,
                           samples_processed=8, share_complete_ms=1.0, compute_only_ms=1.0,
                           data_starve_ms=0.0, scalars={})
    session = coordinator_side()
    stream = relay_records((DATA, 2, CODEC.encode(beat)), (DATA, 3, CODEC.encode(metrics)),
                           (CONTROL, 0, wire.encode(wire.RankExit(rank=3))))
    assert events_of(session, [stream, b""]) == [
        beat, metrics, wire.RankExit(rank=3),
        EndOfStream("connection closed by the relay (EOF)", True)]
    assert session.close_reason == "connection closed by the relay (EOF)"


def test_coordinator_drops_a_frame_speaking_for_a_rank_the_relay_does_not_carry() -> None:
    session = coordinator_side()
    stream = relay_records((DATA, 2, CODEC.encode(wire.Exiting(rank=9))),
                           (CONTROL, 0, wire.encode(wire.RankDropped(rank=7, reason="slow"))))
    first, second = events_of(session, [stream])
    assert first.category == "foreign rank" and first.rank == 9
    assert "speaks for rank 9, which relay 'h1' does not carry [2, 3]" in first.detail
    assert second == Invalid("foreign rank", "RankDropped for rank 7, which relay 'h1' does "
                             "not carry", 7)


@pytest.mark.parametrize(("frame", "category"), [
    (wire.FrameCodec(OTHER_SALT).encode(wire.Heartbeat(rank=2, step_count=1)), "bad mac"),
    (b"\x00" * 3, "malformed"),
    (CODEC.encode(wire.Shutdown()), "wrong direction"),
    (CODEC.seal(int(wire.MsgKind.TIMING), b"\xff\xff"), "undecodable"),
])
def test_coordinator_counts_a_bad_frame_and_goes_on(frame: bytes, category: str) -> None:
    beat = wire.Heartbeat(rank=3, step_count=1)
    events = events_of(coordinator_side(),
                       [relay_records((DATA, 2, frame), (DATA, 3, CODEC.encode(beat)))])
    assert [type(e) for e in events] == [Invalid, wire.Heartbeat]
    assert events[0].category == category and events[0].rank == 2


def test_coordinator_skips_the_reserved_frame_kinds_silently() -> None:
    reserved = CODEC.seal(int(wire.MsgKind.RESERVED_4), b"later")
    assert events_of(coordinator_side(), [relay_records((DATA, 2, reserved))]) == []


@pytest.mark.parametrize(("kind", "payload", "category"), [
    (FANOUT, wire.encode_fanout([2], b"x"), "wrong direction"),
    (CONTROL, wire.encode(wire.Goodbye(reason="no")), "unexpected control"),
    (CONTROL, wire.encode(wire.Cadence(interval=5.0)), "unexpected control"),
    (CONTROL, b"\xff", "undecodable"),
])
def test_coordinator_drops_what_only_flows_to_the_relay(kind: int, payload: bytes,
                                                        category: str) -> None:
    (event,) = events_of(coordinator_side(), [relay_records((kind, 0, payload))])
    assert isinstance(event, Invalid) and event.category == category


def test_a_tampered_record_ends_the_connection_after_the_good_ones_before_it() -> None:
    beat = wire.Heartbeat(rank=2, step_count=1)
    good = relay_records((DATA, 2, CODEC.encode(beat)))
    both = bytearray(relay_records((DATA, 2, CODEC.encode(beat)), (DATA, 2, b"b")))
    both[-1] ^= 1  # the second record's payload: its tag no longer verifies
    session = coordinator_side()
    events = events_of(session, [bytes(both)])
    assert events[0] == beat
    assert events[1].reason.startswith("authentication failure: record #1")
    assert not events[1].clean and isinstance(events[1].error, AuthError)
    session.receive_data(good)  # ignored: the session has ended
    assert session.next_event() is events[1]
    assert session.close("later") == events[1].reason


def test_an_eof_in_the_middle_of_a_record_is_not_a_clean_end() -> None:
    record = relay_records((DATA, 2, CODEC.encode(wire.Heartbeat(rank=2, step_count=1))))
    (end,) = events_of(coordinator_side(), [record[:-1], b""])
    assert not end.clean and "peer closed mid-frame" in end.reason and "relay 'h1'" in end.reason


def test_the_loops_close_reason_wins_over_a_later_eof_which_is_then_not_clean() -> None:
    session = relay_side()
    session.receive_data(coordinator_records((CONTROL, 0, wire.encode(wire.Goodbye(reason="x")))))
    assert session.close("upstream write stall: no progress for 5s") == (
        "upstream write stall: no progress for 5s")
    assert events_of(session, [b""]) == [
        wire.Goodbye(reason="x"), EndOfStream("upstream write stall: no progress for 5s", False)]
    assert session.close_reason == "upstream write stall: no progress for 5s"


def test_coordinator_sends_only_goodbye_and_fencerank() -> None:
    session = coordinator_side()
    opener = wire.RecordOpener(KEY, wire.COORD_TO_RELAY)
    record = session.send(wire.FenceRank(rank=2, reason="dead"))
    assert opener.feed(record) == [wire.Record(CONTROL, 0, wire.encode(
        wire.FenceRank(rank=2, reason="dead")))]
    with pytest.raises(WireError, match="expected one of Goodbye, FenceRank, got RankExit"):
        session.send(wire.RankExit(rank=2))  # type: ignore[arg-type]


def test_coordinator_events_do_not_depend_on_how_reads_were_cut() -> None:
    stream = relay_records((DATA, 2, CODEC.encode(wire.Heartbeat(rank=2, step_count=1))),
                           (DATA, 2, CODEC.encode(wire.Exiting(rank=5))),
                           (CONTROL, 0, wire.encode(wire.RankExit(rank=2))))
    every_cut(coordinator_side, stream)


# -- relay side of the coordinator -----------------------------------------------------------


def coordinator_records(*items: tuple[int, int, bytes]) -> bytes:
    sealer = wire.RecordSealer(KEY, wire.COORD_TO_RELAY)
    return b"".join(sealer.seal(kind, rank, payload) for kind, rank, payload in items)


def test_relay_delivers_data_and_fanout_to_its_local_ranks_only() -> None:
    stream = coordinator_records((DATA, 3, b"one"), (FANOUT, 0, wire.encode_fanout([2, 9, 3],
                                                                                    b"all")))
    events = events_of(relay_side(), [stream])
    assert events == [Deliver((3,), wire.len_frame(b"one")),
                      Deliver((2, 3), wire.len_frame(b"all")),
                      Invalid("not local", "fanout frame for rank 9, which is not local", 9)]


def test_relay_drops_a_frame_for_a_rank_that_is_not_local() -> None:
    assert events_of(relay_side(), [coordinator_records((DATA, 8, b"x"))]) == [
        Invalid("not local", "frame for rank 8, which is not local", 8)]


def test_a_relay_ends_cleanly_only_after_a_goodbye() -> None:
    bye = coordinator_records((CONTROL, 0, wire.encode(wire.Goodbye(reason="done"))))
    session = relay_side()
    assert events_of(session, [bye, b""]) == [
        wire.Goodbye(reason="done"), EndOfStream("coordinator said Goodbye: done", True)]
    (end,) = events_of(relay_side(), [b""])
    assert not end.clean and "without a Goodbye" in end.reason


def test_relay_takes_fencerank_of_a_local_rank_and_counts_the_rest() -> None:
    stream = coordinator_records(
        (CONTROL, 0, wire.encode(wire.FenceRank(rank=2, reason="dead"))),
        (CONTROL, 0, wire.encode(wire.FenceRank(rank=5, reason="dead"))),
        (CONTROL, 0, wire.encode(wire.RankExit(rank=2))),
        (CONTROL, 0, b"\xff"))
    events = events_of(relay_side(), [stream])
    assert events[0] == wire.FenceRank(rank=2, reason="dead")
    assert [e.category for e in events[1:]] == ["not local", "unexpected control",
                                               "undecodable"]


def test_a_bad_fanout_list_ends_the_relays_upstream_with_a_protocol_error() -> None:
    stream = coordinator_records((DATA, 2, b"ok"), (FANOUT, 0, b"\x00"))
    session = relay_side()
    events = events_of(session, [stream])
    assert events[0] == Deliver((2,), wire.len_frame(b"ok"))
    assert events[1].reason.startswith("upstream protocol error: ")
    assert isinstance(events[1].error, WireError) and not events[1].clean


def test_the_welcome_records_come_before_what_is_read_after_it() -> None:
    session = relay_side()
    session.feed_opened([wire.Record(DATA, 2, b"welcome")])
    session.receive_data(coordinator_records((DATA, 2, b"next")))
    assert drain(session) == [Deliver((2,), wire.len_frame(b"welcome")),
                              Deliver((2,), wire.len_frame(b"next"))]


def test_relay_sends_only_rankexit_and_rankdropped_upstream() -> None:
    session = relay_side()
    opener = wire.RecordOpener(KEY, wire.RELAY_TO_COORD)
    assert opener.feed(session.send(wire.RankDropped(rank=2, reason="slow"))) == [
        wire.Record(CONTROL, 0, wire.encode(wire.RankDropped(rank=2, reason="slow")))]
    assert opener.feed(session.send_frame(3, b"f")) == [wire.Record(DATA, 3, b"f")]
    with pytest.raises(WireError, match="relay→coordinator CONTROL record"):
        session.send(wire.Goodbye(reason="x"))  # type: ignore[arg-type]


def test_relay_refuses_to_send_what_only_flows_to_it_and_seals_nothing() -> None:
    session = relay_side()
    opener = wire.RecordOpener(KEY, wire.RELAY_TO_COORD)
    with pytest.raises(WireError, match=r"CONTROL record: expected one of RankExit, "
                       r"RankDropped, Liveness, Draining, got FenceRank"):
        session.send(wire.FenceRank(rank=2, reason="x"))  # type: ignore[arg-type]
    with pytest.raises(WireError, match=r"DATA record: expected ranks of the coordinator "
                       r"\(relay 'h1'\) \[2, 3\], got \[7\]"):
        session.send_frame(7, CODEC.encode(wire.Heartbeat(rank=7, step_count=1)))
    # Nothing was sealed: the next record is the first the coordinator opens.
    assert opener.feed(session.send(wire.RankExit(rank=2))) == [
        wire.Record(CONTROL, 0, wire.encode(wire.RankExit(rank=2)))]


def test_coordinator_sends_only_control_frames_goodbye_and_fencerank_of_its_ranks() -> None:
    session = coordinator_side()
    beat = CODEC.encode(wire.Heartbeat(rank=2, step_count=1))
    refused = [
        (lambda: session.send(wire.RankExit(rank=2)),  # type: ignore[arg-type]
         "coordinator→relay CONTROL record: expected one of Goodbye, FenceRank, got RankExit"),
        (lambda: session.send(wire.FenceRank(rank=9, reason="x")),
         r"FenceRank: expected ranks of relay 'h1' \[2, 3\], got \[9\]"),
        (lambda: session.send_frame(2, beat), r"coordinator→relay 'h1' frame: expected a "
         r"ControlMsg frame \(kind 1\), got \d+ bytes of kind 2"),
        (lambda: session.send_frame(2, b"short"), "got 5 bytes of kind None"),
        (lambda: session.send_frame(5, CODEC.encode(wire.Shutdown())),
         r"DATA record: expected ranks of relay 'h1' \[2, 3\], got \[5\]"),
        (lambda: session.send_fanout([2, 3], beat), "bytes of kind 2"),
        (lambda: session.send_fanout([2, 4], CODEC.encode(wire.Shutdown())), r"got \[2, 4\]"),
        (lambda: session.send_fanout([], CODEC.encode(wire.Shutdown())), r"got \[\]"),
    ]
    for send, message in refused:
        with pytest.raises(WireError, match=message):
            send()
    relay = relay_side()
    relay.receive_data(session.send_frame(3, CODEC.encode(wire.Shutdown())))
    assert drain(relay) == [Deliver((3,), wire.len_frame(CODEC.encode(wire.Shutdown())))]


def test_relay_upstream_events_do_not_depend_on_how_reads_were_cut() -> None:
    stream = coordinator_records(
        (DATA, 2, b"a"), (FANOUT, 0, wire.encode_fanout([3, 4], b"b")),
        (CONTROL, 0, wire.encode(wire.Cadence(interval=4.0))),
        (CONTROL, 0, wire.encode(wire.Goodbye(reason="bye"))))
    every_cut(relay_side, stream)


def test_relay_takes_the_coordinators_cadence_and_the_coordinator_seals_it() -> None:
    coordinator = coordinator_side()
    relay = relay_side()
    relay.receive_data(coordinator.send(wire.Cadence(interval=5.0)))
    assert drain(relay) == [wire.Cadence(interval=5.0)]


@pytest.mark.parametrize("interval", [float("nan"), float("inf"), 0.0, -1.0, 3600.5])
def test_a_cadence_the_relay_cannot_pace_by_ends_its_upstream_naming_the_value(
        interval: float) -> None:
    stream = coordinator_records((DATA, 2, b"before"),
                                 (CONTROL, 0, wire.encode(wire.Cadence(interval=interval))),
                                 (DATA, 2, b"after"))
    events = events_of(relay_side(), [stream])
    assert events[0] == Deliver((2,), wire.len_frame(b"before"))  # what came before is kept
    (end,) = events[1:]
    assert isinstance(end, EndOfStream) and not end.clean and isinstance(end.error, WireError)
    assert end.reason == ("upstream protocol error: Cadence from the coordinator (relay 'h1'): "
                          f"expected an interval in (0, 3600] seconds, got {interval!r}")


def test_the_coordinator_never_seals_a_cadence_the_relay_would_refuse() -> None:
    session = coordinator_side()
    with pytest.raises(WireError, match=r"coordinator→relay Cadence to relay 'h1': expected an "
                       r"interval in \(0, 3600\] seconds, got nan"):
        session.send(wire.Cadence(interval=float("nan")))
    relay = relay_side()  # nothing was sealed: the next record is the first the relay opens
    relay.receive_data(session.send(wire.Cadence(interval=3600.0)))
    assert drain(relay) == [wire.Cadence(interval=3600.0)]


# -- relay side of a rank --------------------------------------------------------------------


def test_relay_forwards_a_ranks_frames_until_it_is_fenced() -> None:
    session = RankLinkSession(4, host="h1")
    events = events_of(session, [wire.len_frame(b"one") + wire.len_frame(b"two")[:3]])
    assert events == [RankFrame(4, b"one")]
    session.fence("declared dead")
    session.fence("again")
    assert session.fenced == "declared dead"
    assert events_of(session, [wire.len_frame(b"two")[3:], b""]) == [
        EndOfStream("rank 4 closed its link", True)]
    fenced = CODEC.encode(wire.Fenced(rank=4, reason="declared dead"))
    assert session.send(fenced) == wire.len_frame(fenced)  # the rank still hears why


def test_a_rank_declaring_a_frame_over_the_ceiling_is_cut_after_its_good_frames() -> None:
    session = RankLinkSession(4, host="h1", max_len=8)
    events = events_of(session, [wire.len_frame(b"ok") + b"\xff\xff\xff\x00"])
    assert events[0] == RankFrame(4, b"ok")
    assert events[1].reason.startswith("rank 4 sent a bad length frame (length frame: "
                                       "declared")
    assert isinstance(events[1].error, FrameTooLarge)


def test_a_rank_closing_mid_frame_is_not_a_clean_end() -> None:
    (end,) = events_of(RankLinkSession(4, host="h1"), [wire.len_frame(b"abc")[:5], b""])
    assert not end.clean and "rank 4 (relay 'h1'): peer closed mid-frame" in end.reason


def test_relay_rank_events_do_not_depend_on_how_reads_were_cut() -> None:
    stream = b"".join(wire.len_frame(bytes([i]) * i) for i in range(6))
    every_cut(lambda: RankLinkSession(1, host="h"), stream)


# -- rank side of its relay ------------------------------------------------------------------


def rank_side() -> RankSession:
    return RankSession(CODEC, rank=2, relay="127.0.0.1:9")


def test_rank_gets_control_messages_and_ends_cleanly_after_shutdown() -> None:
    stream = b"".join(wire.len_frame(CODEC.encode(m)) for m in
                      (wire.CoordHeartbeat(), wire.DeclareDead(rank=1), wire.Shutdown()))
    session = rank_side()
    assert events_of(session, [stream, b""]) == [
        wire.CoordHeartbeat(), wire.DeclareDead(rank=1), wire.Shutdown(),
        EndOfStream("link to relay 127.0.0.1:9 ended after Shutdown", True)]
    assert session.shutdown_seen


def test_a_rank_link_ending_without_shutdown_is_not_clean() -> None:
    assert events_of(rank_side(), [b""]) == [
        EndOfStream("link to relay 127.0.0.1:9 ended without Shutdown", False)]


@pytest.mark.parametrize(("frame", "category"), [
    (wire.FrameCodec(OTHER_SALT).encode(wire.Shutdown()), "invalid frame"),
    (CODEC.encode(wire.Heartbeat(rank=2, step_count=1)), "wrong direction"),
    (CODEC.seal(int(wire.MsgKind.CONTROL), b"\xff\xff"), "undecodable"),
])
def test_rank_drops_what_is_not_a_control_frame_of_its_session(frame: bytes,
                                                               category: str) -> None:
    session = rank_side()
    events = events_of(session, [wire.len_frame(frame), b""])
    assert events[0].category == category and events[0].rank == 2
    assert not session.shutdown_seen and not events[1].clean


def test_rank_sends_only_timing_and_metrics() -> None:
    session = rank_side()
    assert session.send(wire.Exiting(rank=2)) == wire.len_frame(CODEC.encode(
        wire.Exiting(rank=2)))
    with pytest.raises(WireError, match="expected a TimingMsg or Metrics, got Shutdown"):
        session.send(wire.Shutdown())  # type: ignore[arg-type]


def test_rank_events_do_not_depend_on_how_reads_were_cut() -> None:
    stream = b"".join(wire.len_frame(CODEC.encode(m)) for m in
                      (wire.CoordHeartbeat(), wire.Fenced(rank=2, reason="r"), wire.Shutdown()))
    every_cut(rank_side, stream)


def test_records_buffered_by_the_handshake_are_the_first_events() -> None:
    opener = wire.RecordOpener(KEY, wire.RELAY_TO_COORD)
    stream = relay_records((CONTROL, 0, wire.encode(wire.RankExit(rank=2))),
                           (CONTROL, 0, wire.encode(wire.RankExit(rank=3))))
    opener.push(stream[:-1])  # as the handshake leaves it: one whole record and a partial one
    session = CoordinatorSession(opener, wire.RecordSealer(KEY, wire.COORD_TO_RELAY), CODEC,
                                 host="h1", ranks=(2, 3))
    assert events_of(session, [stream[-1:]]) == [wire.RankExit(rank=2), wire.RankExit(rank=3)]


def test_what_one_side_sends_is_what_the_other_side_gets_in_both_directions() -> None:
    coordinator, relay = coordinator_side(), relay_side()
    shutdown = CODEC.encode(wire.Shutdown())
    relay.receive_data(coordinator.send(wire.FenceRank(rank=3, reason="dead"))
                       + coordinator.send_fanout([2, 3], shutdown)
                       + coordinator.send(wire.Goodbye(reason="done")))
    assert drain(relay) == [wire.FenceRank(rank=3, reason="dead"),
                            Deliver((2, 3), wire.len_frame(shutdown)), wire.Goodbye(reason="done")]
    beat = wire.Heartbeat(rank=2, step_count=9)
    coordinator.receive_data(relay.send_frame(2, CODEC.encode(beat))
                             + relay.send(wire.RankExit(rank=3)))
    assert drain(coordinator) == [beat, wire.RankExit(rank=3)]
    rank, link = rank_side(), RankLinkSession(2, host="h1")
    link.receive_data(rank.send(beat))
    (frame,) = drain(link)
    assert wire.frame_message(CODEC.open(frame.blob)) == beat
    rank.receive_data(link.send(CODEC.encode(wire.Shutdown())))
    assert drain(rank) == [wire.Shutdown()]


def test_a_relay_sends_its_ranks_only_controlmsg_frames() -> None:
    link = RankLinkSession(2, host="h1")
    with pytest.raises(WireError, match=r"relay 'h1'→rank 2 frame: expected a ControlMsg frame "
                       r"\(kind 1\), got \d+ bytes of kind 2"):
        link.send(CODEC.encode(wire.Heartbeat(rank=2, step_count=1)))
    with pytest.raises(WireError, match="got 3 bytes of kind None"):
        link.send(b"abc")
    rank = rank_side()
    rank.receive_data(link.send(CODEC.encode(wire.RelayWaiting(host="h1", detail="waiting"))))
    assert drain(rank) == [wire.RelayWaiting(host="h1", detail="waiting")]


def test_a_tampered_stream_ends_the_same_way_however_it_was_cut() -> None:
    beat = CODEC.encode(wire.Heartbeat(rank=2, step_count=1))
    stream = bytearray(relay_records((DATA, 2, beat), (DATA, 3, beat), (DATA, 2, beat)))
    stream[-1] ^= 1  # the last record's tag no longer verifies
    every_cut(coordinator_side, bytes(stream))
    (last,) = events_of(coordinator_side(), [bytes(stream)])[-1:]
    assert last.reason.startswith("authentication failure: record #2")


def test_a_relays_liveness_is_checked_every_time_even_when_it_lists_the_same_ranks() -> None:
    good = wire.Liveness(ranks=(2, 3), steps=(1, 1), ages=(0.5, 0.0))
    stale = wire.Liveness(ranks=(2, 3), steps=(2, 2), ages=(-1.0, 0.0))
    nan = wire.Liveness(ranks=(2, 3), steps=(2, 2), ages=(float("nan"), 0.0))
    events = events_of(coordinator_side(), [relay_records(
        *[(CONTROL, 0, wire.encode(m)) for m in (good, good, stale, nan, good)])])
    assert events[:2] == [good, good] and events[4] == good
    assert [(e.category, e.rank) for e in events[2:4]] == [("malformed", 2), ("malformed", 2)]
