"""The demo's narrator: turns the coordinator's timeline (JSONL, read as it grows) into the lines
a person wants to read: formation, epochs, each death and its cause, each redistribution of a
dead rank's samples, lost broadcasts, and the live/dead/exited state of every rank."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any


def ranges_text(ranges: list[list[int]]) -> str:
    r"""``[[196, 196], [400, 1]]`` → ``"samples 196-391, 400"`` with an en dash (U+2013): sample
    indices, inclusive.

    >>> ranges_text([[196, 196], [400, 1]]) == "samples 196\u2013391, 400"
    True
    >>> ranges_text([[7, 1]])
    'sample 7'
    """
    parts = []
    for offset, size in ranges:
        parts.append(str(offset) if size == 1 else f"{offset}\u2013{offset + size - 1}")
    single = len(ranges) == 1 and ranges[0][1] == 1
    return ("sample " if single else "samples ") + ", ".join(parts)


class Story:
    """Reads new complete lines of a timeline file and says what they mean.

    Attributes:
        formed_ms: formation time (None until the cohort formed).
        epoch: the epoch in progress (0-based; -1 before the first).
        syncs: ``SyncNow`` rounds so far.
        dead: rank → the reason it was declared dead.
        exited: ranks that left cleanly.
        rejoined: ranks that came back after their death (issue 26).
        events: timeline lines read.
        restarts: coordinators started after the cohort formed (each appends to the same
            timeline, its clock from 0: with ``anchors`` the story puts it on the first one's
            clock, else the story's clock goes on from the last event).
        generation: the generation of the last coordinator that adopted the session (None:
            none did).
        resumed: hosts whose relay resumed with an adopting coordinator.
        epoch_coverage: epoch -> whether the scheduler counted its samples exactly once (the
            ``epoch_covered`` notes of every coordinator of the run).
        formed_at_ms: when the cohort formed, on the story's clock (None until then).
        losses: epoch -> its mean loss, whichever coordinator aggregated it.
        last_aggregated_ms: when the last epoch was aggregated, on the story's clock.
        lost_broadcasts: ``LostBroadcast`` events of every coordinator of the run.

    Args:
        path: the timeline file.
        epochs: the epochs the run was asked for.
        anchors: ``time.monotonic()`` when each coordinator of the run printed its address
            (the moment of its ``Listening`` event), appended as they start: the story's clock
            is the first coordinator's, and the demo's own lines are stamped on it
            (:meth:`clock_ms`).
    """

    def __init__(self, path: Path, epochs: int, *, anchors: Sequence[float] = ()) -> None:
        self.path = path
        self.epochs = epochs
        self.anchors = anchors
        self.offset = 0
        self.formed_ms: float | None = None
        self.formed_at_ms: float | None = None
        self.losses: dict[int, float] = {}
        self.last_aggregated_ms: float | None = None
        self.lost_broadcasts = 0
        self._first_listening_ms: float | None = None
        self.covered = 0
        self.epoch = -1
        self.syncs = 0
        self.dead: dict[int, str] = {}
        self.exited: set[int] = set()
        self.rejoined: set[int] = set()
        self.joined: dict[int, str] = {}  # rank -> host, joined a running elastic world
        self.retired: dict[int, str] = {}  # rank -> why it left the elastic world
        self.drained: list[str] = []  # hosts that left on purpose
        self.events = 0
        self.restarts = 0
        self.generation: int | None = None
        self.resumed: set[str] = set()
        self.epoch_coverage: dict[int, bool] = {}
        self._offset_ms = 0.0
        self._last_ms = 0.0

    def poll(self) -> list[str]:
        """The story lines of every event appended since the last call."""
        if not self.path.exists():
            return []
        lines: list[str] = []
        with self.path.open(encoding="utf-8") as f:
            f.seek(self.offset)
            for raw in f:
                if not raw.endswith("\n"):
                    break  # the coordinator is still writing this line
                self.offset += len(raw.encode("utf-8"))
                self.events += 1
                try:
                    event = json.loads(raw)
                except ValueError:
                    continue
                line = self._tell(event)
                if line:
                    lines.append(line)
        return lines

    def clock_ms(self, monotonic: float) -> float:
        """A moment of the demo (``time.monotonic()``) on the story's clock (the last event's
        time while the first coordinator's is not known yet)."""
        if not self.anchors or self._first_listening_ms is None:
            return self._last_ms
        return (monotonic - self.anchors[0]) * 1000.0 + self._first_listening_ms

    @staticmethod
    def stamp(t_ms: float) -> str:
        """A story line's time column: ``"  3.49s"``."""
        return f"{t_ms / 1000.0:6.2f}s"

    def _restart_offset(self, listening_ms: float) -> float:
        """The offset of a restarted coordinator's clock (its ``Listening`` at
        ``listening_ms``): from its anchor when the demo gave one, else the last event."""
        first = self._first_listening_ms
        if first is None or len(self.anchors) <= self.restarts:
            return self._last_ms
        return (self.anchors[self.restarts] - self.anchors[0]) * 1000.0 + first - listening_ms

    def _tell(self, ev: dict[str, Any]) -> str | None:
        kind = ev.get("kind")
        if kind == "Listening" and self._first_listening_ms is None:
            self._first_listening_ms = float(ev.get("t_ms", 0.0))
        elif kind == "Listening" and self.formed_ms is not None:  # a restarted coordinator
            self.restarts += 1
            self._offset_ms = self._restart_offset(float(ev.get("t_ms", 0.0)))
        t_ms = float(ev.get("t_ms", 0.0)) + self._offset_ms
        self._last_ms = max(self._last_ms, t_ms)
        t = self.stamp(t_ms)
        if kind == "RelayJoined" and self.restarts:
            self.resumed.add(str(ev["host"]))
            # No generation here: a relay may resume before the coordinator's "adopted" note.
            return f"{t}  relay {ev['host']} resumed with ranks {ev['ranks']}"
        if kind == "RelayJoined":
            self.covered += len(ev.get("ranks", []))
            return f"{t}  relay {ev['host']} joined with ranks {ev['ranks']} from {ev['peer']}"
        if kind == "FormationComplete" and self.restarts:
            return None  # an adopted session that had formed completes at once: told above
        if kind == "FormationComplete":
            self.formed_ms = float(ev["elapsed_ms"])
            self.formed_at_ms = t_ms
            return (f"{t}  formed in {self.formed_ms:.0f} ms: {ev['relays']} relays, "
                    f"{ev['world_size']} ranks")
        if kind == "FormationFailed":
            return f"{t}  formation FAILED ({ev['covered']} ranks covered): {ev['reason']}"
        if kind == "RankDeclaredDead":
            self.dead[int(ev["rank"])] = str(ev["reason"])
            return f"{t}  rank {ev['rank']} ({ev['host']}) declared dead: {ev['reason']}"
        if kind == "RankRejoined":
            self.dead.pop(int(ev["rank"]), None)
            self.rejoined.add(int(ev["rank"]))
            return f"{t}  rank {ev['rank']} ({ev['host']}) rejoined the running cohort"
        if kind in ("RankJoined", "RelayDraining", "RankRetired"):
            return self._tell_membership(t, kind, ev)
        if kind == "RankTakenOver":
            return (f"{t}  rank {ev['rank']} of host {ev['previous_host']} taken over by host "
                    f"{ev['host']}")
        if kind == "RankExited":
            self.exited.add(int(ev["rank"]))
            return None  # every rank exits at the end: the summary counts them
        if kind == "LostBroadcast":
            self.lost_broadcasts += 1
            failed = sorted(int(r) for r in ev.get("failures", {}))
            return f"{t}  broadcast of {ev['control']} missed ranks {failed}"
        if kind == "ClusterFailed":
            return f"{t}  cluster FAILED: {ev['reason']} (dead {ev['dead']})"
        if kind == "Note":
            return self._tell_note(t, str(ev.get("what")), ev.get("fields", {}))
        return None

    def _tell_membership(self, t: str, kind: str, ev: dict[str, Any]) -> str:
        """An elastic world's changes: a rank joined, a host drains, a rank retired."""
        if kind == "RankJoined":
            self.joined[int(ev["rank"])] = str(ev["host"])
            return (f"{t}  rank {ev['rank']} ({ev['host']}) joined the running cohort: the "
                    f"world is {ev['world']} ranks")
        if kind == "RelayDraining":
            self.drained.append(str(ev["host"]))
            return (f"{t}  relay {ev['host']} drains ({ev['reason']}): ranks {ev['ranks']} "
                    "finish their current sync and leave")
        self.retired[int(ev["rank"])] = str(ev["reason"])
        self.dead.pop(int(ev["rank"]), None)
        return (f"{t}  rank {ev['rank']} ({ev['host']}) retired: {ev['reason']}; the world is "
                f"{ev['world']} ranks")

    def _tell_note(self, t: str, what: str, fields: dict[str, Any]) -> str | None:
        if what == "sync":
            self.syncs += 1
            return None
        if what == "epoch_started":
            again = int(fields.get("epoch", self.epoch + 1)) == self.epoch
            self.epoch = int(fields.get("epoch", self.epoch + 1))
            return (f"{t}  epoch {self.epoch + 1}/{self.epochs} "
                    f"{'resumed from the checkpoint' if again else 'started'}")
        if what == "adopted":
            self.generation = int(fields["generation"])
            return (f"{t}  adopted the running session as generation {self.generation}: "
                    f"{len(fields['live'])} live ranks, {len(fields['dead'])} dead; resuming at "
                    f"epoch {int(fields['epoch']) + 1}/{self.epochs}")
        if what == "epoch_covered":
            self.epoch_coverage[int(fields["epoch"])] = bool(fields["exactly_once"])
            return None
        if what == "epoch_aggregated":
            self.losses[int(fields["epoch"])] = float(fields["avg_loss"])
            self.last_aggregated_ms = self._last_ms
            return (f"{t}  epoch {int(fields['epoch']) + 1}/{self.epochs} done: avg loss "
                    f"{float(fields['avg_loss']):.4f}, {self.syncs} syncs so far")
        if what == "redistributed":
            took = "; ".join(f"rank {r} takes {ranges_text(p)}"
                             for r, p in sorted(fields["to"].items(), key=lambda kv: int(kv[0])))
            left = sum(size for p in fields["to"].values() for _, size in p)
            return (f"{t}  rank {fields['from_rank']}'s {left} unprocessed samples of epoch "
                    f"{int(fields['epoch']) + 1} redistributed: {took}")
        if what == "ranks_rejoined":
            return (f"{t}  ranks {fields['ranks']} get work again from epoch "
                    f"{int(fields['from_epoch']) + 1}")
        if what == "ranks_joined":
            return (f"{t}  ranks {fields['ranks']} get work from epoch "
                    f"{int(fields['from_epoch']) + 1}")
        if what == "batch_size_mismatch":
            return (f"{t}  rank {fields['rank']} batches disagree with the plan: "
                    f"{fields['samples']} samples in {fields['batches']} batches, batch size "
                    f"{fields['batch_size']} plans {fields['planned_batches']}")
        return None

    def status_line(self, world: int) -> str:
        """One line of progress: forming (covered/world), or the epoch, syncs and deaths."""
        if self.formed_ms is None:
            return f"forming: {self.covered}/{world} ranks covered"
        epoch = max(self.epoch, 0) + 1
        return (f"epoch {epoch}/{self.epochs}, {self.syncs} syncs, {len(self.dead)} dead, "
                f"{len(self.exited)} exited")

    def restarts_text(self, layout: Mapping[str, Sequence[int]], restarted: Iterable[str]) -> str:
        """The summary's words on restarted hosts: those whose ranks all rejoined, and those
        the run ended before they were back."""
        back = sorted(h for h in restarted if set(layout[h]) <= self.rejoined)
        late = sorted(set(restarted) - set(back))
        parts = [f"restarted and rejoined: {', '.join(back)}"] if back else []
        if late:
            parts.append(f"restarted but not back before the run ended: {', '.join(late)}")
        return "; ".join(parts)

    def elastic_text(self, world: tuple[int, int], retired: Sequence[int]) -> str:
        """The summary's words on an elastic world: its range, who joined, who left."""
        joined = sorted(self.joined)
        hosts = sorted(set(self.joined.values()))
        grew = (f"ranks {joined} joined ({', '.join(hosts)})" if joined
                else "no host joined while it ran")
        drained = f"drained: {', '.join(self.drained)}" if self.drained else "no host drained"
        return (f"  world {world[0]}:{world[1]}: {grew}; {drained}; retired "
                f"{sorted(retired) if retired else sorted(self.retired)}")

    def rank_state(self, rank: int) -> str:
        if rank in self.retired:
            return "retired"
        if rank in self.dead:
            return "dead"
        if rank in self.exited:
            return "exited"
        return "alive" if self.formed_ms is not None else "starting"
