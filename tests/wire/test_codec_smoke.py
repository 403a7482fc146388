"""Quick end-to-end smoke of the codec; the exhaustive suites live in test_wire_*.py."""

from flodl_trio import wire


def test_control_frame_round_trips_through_incremental_decoder_byte_by_byte() -> None:
    salt = wire.SessionSalt.generate()
    msg = wire.StartEpoch(wire.EpochPlan(epoch=2, partition_offset=10, partition_size=5))
    frame = wire.encode_frame(salt, msg)
    dec = wire.FrameDecoder(salt)
    got = []
    for i in range(len(frame)):
        got += dec.feed(frame[i : i + 1])
    assert len(got) == 1 and dec.at_boundary
    assert wire.frame_message(got[0]) == msg
