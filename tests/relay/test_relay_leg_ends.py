"""What a relay makes of the end of its upstream connection (issue 36): one table, one place
(``_leg.verdict``), no sockets. A durable coordinator lost in any way but a ``Goodbye`` is
ridden out; a close lets the ranks leave; a broken connection to any other coordinator fails
the relay."""

from __future__ import annotations

import pytest

from flodl_trio import WireError
from flodl_trio.relay._leg import Ending, LegEnd, Verdict, verdict
from flodl_trio.wire import EndOfStream

GOODBYE = LegEnd.of_eof(EndOfStream("coordinator said Goodbye: run over", True))
NO_GOODBYE = LegEnd.of_eof(EndOfStream("coordinator closed the connection without a Goodbye "
                                       "(it died, or dropped this relay)", False))
BAD_RECORD = LegEnd.of_eof(EndOfStream("upstream protocol error: bad MAC", False,
                                       WireError("bad MAC")))
RESET = LegEnd.lost("upstream connection lost (ConnectionResetError)")
RANKS_GONE = LegEnd.ranks_gone()

RIDE_OUT, FINISH, FAIL = Verdict.RIDE_OUT, Verdict.FINISH, Verdict.FAIL


@pytest.mark.parametrize(("end", "resumable", "expected"), [
    (RANKS_GONE, False, FINISH),
    (RANKS_GONE, True, FINISH),  # the ranks' own end is never ridden out
    (GOODBYE, False, FINISH),
    (GOODBYE, True, FINISH),  # FT/2: a Goodbye is a coordinator that shut down, not a loss
    (NO_GOODBYE, False, FINISH),  # not clean, but the ranks still get to leave
    (NO_GOODBYE, True, RIDE_OUT),
    (BAD_RECORD, False, FAIL),
    (BAD_RECORD, True, RIDE_OUT),
    (RESET, False, FAIL),
    (RESET, True, RIDE_OUT),
], ids=lambda v: v.ending.value if isinstance(v, LegEnd) else str(v))
def test_each_end_of_the_upstream_connection_has_one_meaning(
        end: LegEnd, resumable: bool, expected: Verdict) -> None:
    assert verdict(end, resumable=resumable) is expected


def test_the_end_read_from_the_coordinator_keeps_its_reason_cleanness_and_error() -> None:
    assert (GOODBYE.ending, GOODBYE.clean, GOODBYE.error) == (Ending.CLOSED, True, None)
    assert (NO_GOODBYE.ending, NO_GOODBYE.clean) == (Ending.CLOSED, False)
    assert BAD_RECORD.ending is Ending.FAILED and not BAD_RECORD.clean
    assert str(BAD_RECORD.error) == "bad MAC"
    assert BAD_RECORD.reason == "upstream protocol error: bad MAC"
    assert (RANKS_GONE.reason, RANKS_GONE.clean) == ("all ranks exited", True)
    assert [end.breaks for end in (GOODBYE, NO_GOODBYE, BAD_RECORD, RESET, RANKS_GONE)] == [
        False, False, True, True, False]
