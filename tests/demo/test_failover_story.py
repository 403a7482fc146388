"""The demo's story of a coordinator failover (``--kill-coordinator``), read from a timeline
that two coordinator processes appended to: the killed one's half-written last line is skipped,
the clock goes on from where the first stopped, the adoption and each relay resuming are told,
and every epoch's coverage is kept whichever coordinator closed it."""

from __future__ import annotations

import json
from pathlib import Path

from flodl_trio.demo._run import _coverage_across
from flodl_trio.demo._story import Story


def note(t_ms: float, what: str, **fields: object) -> str:
    return json.dumps({"t_ms": t_ms, "kind": "Note", "what": what, "fields": fields}) + "\n"


def test_a_restarted_coordinators_events_are_told_as_an_adoption_after_the_first_run(
        tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    first = [
        json.dumps({"t_ms": 0.0, "kind": "Listening", "address": "127.0.0.1:7000"}) + "\n",
        json.dumps({"t_ms": 10.0, "kind": "RelayJoined", "host": "host-a", "ranks": [0],
                    "peer": "127.0.0.1:5000"}) + "\n",
        json.dumps({"t_ms": 20.0, "kind": "FormationComplete", "elapsed_ms": 20.0,
                    "relays": 1, "world_size": 1}) + "\n",
        note(30.0, "epoch_started", epoch=0),
        note(900.0, "epoch_aggregated", epoch=0, avg_loss=1.5),
        note(900.0, "epoch_covered", epoch=0, exactly_once=True, samples=16, total=16,
             gaps=0, overlaps=0),
        note(910.0, "epoch_started", epoch=1),
        '{"t_ms": 1200.0, "kind": "No',  # SIGKILLed in the middle of a line; the demo ends it
    ]
    path.write_text("".join(first) + "\n", encoding="utf-8")
    story = Story(path, epochs=2)
    told = story.poll()
    assert told[-1] == "  0.91s  epoch 2/2 started" and story.restarts == 0

    with path.open("a", encoding="utf-8") as f:  # the second coordinator: its clock from 0
        f.write(json.dumps({"t_ms": 0.0, "kind": "Listening", "address": "127.0.0.1:7000"})
                + "\n")
        f.write(json.dumps({"t_ms": 5.0, "kind": "FormationComplete", "elapsed_ms": 0.0,
                            "relays": 1, "world_size": 1}) + "\n")
        f.write(note(6.0, "adopted", generation=2, live=[0], dead=[], epoch=1,
                     store="sqlite:s.db"))
        f.write(json.dumps({"t_ms": 300.0, "kind": "RelayJoined", "host": "host-a",
                            "ranks": [0], "peer": "127.0.0.1:5001"}) + "\n")
        f.write(note(310.0, "epoch_started", epoch=1))
        f.write(note(800.0, "epoch_covered", epoch=1, exactly_once=True, samples=16,
                     total=16, gaps=0, overlaps=0))
    told = story.poll()
    assert told == [
        "  0.92s  adopted the running session as generation 2: 1 live ranks, 0 dead; resuming "
        "at epoch 2/2",
        "  1.21s  relay host-a resumed with ranks [0]",
        "  1.22s  epoch 2/2 resumed from the checkpoint",
    ]
    assert story.restarts == 1 and story.generation == 2 and story.resumed == {"host-a"}
    assert story.formed_ms == 20.0  # the adopted session's formation is not a new one
    assert _coverage_across(story, 2) == {"exact": True, "inexact": []}


def test_an_epoch_whose_coverage_was_never_recorded_is_not_counted_as_covered(
        tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(note(1.0, "epoch_covered", epoch=0, exactly_once=True, samples=16, total=16,
                         gaps=0, overlaps=0)
                    + note(2.0, "epoch_covered", epoch=2, exactly_once=False, samples=20,
                           total=16, gaps=0, overlaps=4), encoding="utf-8")
    story = Story(path, epochs=3)
    story.poll()
    assert _coverage_across(story, 3) == {"exact": False, "inexact": [
        {"epoch": 2, "exactly_once": "not recorded"}, {"epoch": 3, "exactly_once": False}]}


def test_with_anchors_a_restarted_coordinators_clock_is_put_on_the_first_ones(
        tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("".join([
        json.dumps({"t_ms": 5.0, "kind": "Listening", "address": "127.0.0.1:7000"}) + "\n",
        json.dumps({"t_ms": 1000.0, "kind": "FormationComplete", "elapsed_ms": 995.0,
                    "relays": 1, "world_size": 1}) + "\n",
        note(1500.0, "epoch_started", epoch=0),
        json.dumps({"t_ms": 4.0, "kind": "Listening", "address": "127.0.0.1:7000"}) + "\n",
        note(60.0, "epoch_aggregated", epoch=0, avg_loss=1.25),
    ]), encoding="utf-8")
    # The first coordinator printed its address at demo time 100.0 s, the second at 103.5 s:
    # 3.5 s later, so its Listening (4 ms on its own clock) is at 3.505 s on the story's.
    story = Story(path, epochs=1, anchors=[100.0, 103.5])
    told = story.poll()
    assert told[-1] == "  3.56s  epoch 1/1 done: avg loss 1.2500, 0 syncs so far"
    assert story.formed_at_ms == 1000.0 and story.last_aggregated_ms == 3561.0
    assert story.losses == {0: 1.25}
    # The demo's own moments on the same clock: the kill 2.0 s after formation is at 3.00s.
    assert round(story.clock_ms(102.995), 6) == 3000.0 and Story.stamp(3000.0) == "  3.00s"
