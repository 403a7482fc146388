"""The admission decision (issue 37), without trio: every row of the table in
``flodl_trio/coordinator/_admission.py`` over a plain Roster, a Hello (or Resume) and the terms,
with the exact reason a relay is refused with."""

from __future__ import annotations

import itertools
import tracemalloc

import attrs
import pytest

from flodl_trio import wire
from flodl_trio.coordinator._admission import (
    Contradiction,
    Grow,
    Join,
    Refuse,
    Reject,
    Rejoin,
    Replace,
    Resume,
    Supersede,
    TakeOver,
    Terms,
    ending,
    judge,
)
from flodl_trio.coordinator._roster import Roster

SIGS = {"model": bytes(range(32))}
PEER = "10.0.0.5:7000"
WHO = f"authenticated Hello from relay 'host-x' at {PEER}"
NONCE = bytes(16)


@attrs.define(eq=False)
class Conn:
    """What admission reads of a relay connection."""

    host: str
    ranks: tuple[int, ...]
    peer: str = "10.0.0.9:4000"
    alive: bool = True
    awaiting_resume: bool = False
    model_sigs: dict[str, bytes] = attrs.Factory(lambda: dict(SIGS))

    @property
    def rank_set(self) -> frozenset[int]:
        return frozenset(self.ranks)


def hello(host: str, ranks: tuple[int, ...], *, world: int = 4,
          sigs: dict[str, bytes] | None = None,
          resume: int | None = None) -> wire.HelloReceived:
    """An authenticated Hello; with ``resume``, a Resume naming that generation."""
    sigs = SIGS if sigs is None else sigs
    msg = wire.Hello(host=host, world_size=world, model_sigs=sigs, ranks=ranks, nonce=NONCE)
    if resume is None:
        return wire.HelloReceived(msg)
    return wire.HelloReceived(msg, wire.Resume(host=host, world_size=world, model_sigs=sigs,
                                               ranks=ranks, nonce=NONCE, generation=resume))


def roster_of(*conns: Conn, world: int = 4, least: int | None = None,
              run: bool = False) -> Roster[Conn]:
    roster: Roster[Conn] = Roster(world, min_world=least)
    for conn in conns:
        roster.register(conn, 0.0)
        roster.confirm(conn)
    if run:
        roster.start_running(1.0)
    return roster


def ask(roster: Roster[Conn], received: wire.HelloReceived, *, terms: Terms | None = None,
        claims: dict[int, Conn] | None = None, stopped: str | None = None,
        ready: bool = False) -> object:
    return judge(roster, received, PEER, terms=terms or Terms(), claims=claims or {},
                 stopped=stopped, ready=ready)


# ------------------------------------------------------------------ row 1: a newer generation


@pytest.mark.parametrize("run", [False, True])
def test_a_resume_naming_a_newer_generation_is_closed_unrefused_whatever_the_phase(
    run: bool,
) -> None:
    a = Conn("host-x", (0, 1))
    roster = roster_of(a, Conn("host-b", (2, 3)), run=run)
    assert ask(roster, hello("host-x", (0, 1), resume=5), terms=Terms(generation=3)) == Reject(
        "newer generation", f"relay 'host-x' at {PEER}: Resume naming generation 5, expected "
        "at most this coordinator's 3; closed (it follows a newer coordinator)")
    # Its own generation, an older one, or a coordinator without a store: judged as usual.
    for generation, seen in ((3, 3), (3, 2), (None, 9)):
        verdict = ask(roster, hello("host-x", (0, 1), resume=seen),
                      terms=Terms(generation=generation))
        assert not isinstance(verdict, Reject)


# ------------------------------------------------------------------ rows 2 to 5: formation


def test_a_re_dial_during_formation_replaces_the_same_relay_then_joins_without_it() -> None:
    old = Conn("host-x", (0, 1))
    roster = roster_of(old)
    assert ask(roster, hello("host-x", (0, 1))) == Replace((old,))
    roster.unregister(old)  # what applying Replace does
    assert ask(roster, hello("host-x", (0, 1))) == Join({0: "host-x", 1: "host-x"})


def test_only_an_adopting_coordinator_replaces_the_hosts_relay_awaiting_its_resume() -> None:
    waiting = Conn("host-x", (0, 1, 2), peer="(not resumed)", awaiting_resume=True)
    roster = roster_of(waiting)
    received = hello("host-x", (1,))
    assert ask(roster, received, terms=Terms(adopting=True)) == Replace((waiting,))
    # Without an adopted session the same Hello names a rank another relay carries.
    assert ask(roster, received) == Contradiction(
        f"{WHO}: rank 1 was already announced by relay 'host-x' at (not resumed)")


@pytest.mark.parametrize(("received", "reason"), [
    (hello("host-x", (2,), world=8), f"{WHO}: world_size mismatch: the coordinator's "
     "world_size is 4, the relay's is 8"),
    (hello("host-x", (1, 2)), f"{WHO}: rank 1 was already announced by relay 'host-a' at "
     "10.0.0.9:4000"),
    (hello("host-x", (2, 4)), f"{WHO}: rank 4 is out of range for world_size 4"),
    (hello("host-x", ()), f"{WHO}: expected at least one rank, got an empty rank list"),
    (hello("host-x", (2,), sigs={"model": bytes(32)}), f"{WHO}: model signature mismatch: "
     "relay 'host-x' and relay 'host-a' at 10.0.0.9:4000 disagree on 'model' (expected "
     "0001020304050607... for 'model', got "
     "0000000000000000...)"),
])
def test_a_hello_contradicting_the_forming_world_fails_formation(
    received: wire.HelloReceived, reason: str,
) -> None:
    roster = roster_of(Conn("host-a", (0, 1)))
    assert ask(roster, received) == Contradiction(reason)


def test_formation_refuses_a_lost_relays_ranks_to_another_host_without_takeover() -> None:
    lost = Conn("host-a", (0, 1))
    roster = roster_of(lost)
    roster.unregister(lost)  # its connection ended during formation: uncovered, not dead
    assert ask(roster, hello("host-x", (1, 2))) == Refuse(
        f"{WHO}: rank 1 was announced by host 'host-a', whose relay was lost; expected that "
        "host to bring it back (a different host takes over ranks only with "
        "CoordinatorConfig(allow_rank_takeover=True), CLI --allow-takeover)", forming=True)
    # Its own host, or a spare with takeover on, joins (the spare's takeover is recorded).
    assert ask(roster, hello("host-a", (0, 1))) == Join({0: "host-a", 1: "host-a"})
    assert ask(roster, hello("host-x", (1, 2)), terms=Terms(allow_takeover=True)) == Join(
        {1: "host-a", 2: None})


def test_formation_refuses_ranks_another_relays_rejoin_claims() -> None:
    claimant = Conn("host-b", (2,), peer="10.0.0.2:1")
    roster = roster_of(Conn("host-a", (0, 1)))
    assert ask(roster, hello("host-x", (2, 3)), claims={2: claimant}) == Refuse(
        f"{WHO}: rank 2 is being rejoined by relay 'host-b' at 10.0.0.2:1", forming=True)


def test_a_plain_join_names_each_ranks_host_before() -> None:
    roster = roster_of(Conn("host-a", (0, 1)))
    assert ask(roster, hello("host-x", (2, 3))) == Join({2: None, 3: None})


def test_a_plain_join_allocates_nothing_that_grows_with_the_world() -> None:
    # 2,047 relays of 8 ranks joined out of 16,384: the last relay's Hello is judged in the
    # hub for every relay of a large formation (issue 23's budget).
    world = 16384
    roster: Roster[Conn] = Roster(world)
    for first in range(0, world - 8, 8):
        conn = Conn(f"host-{first}", tuple(range(first, first + 8)))
        roster.register(conn, 0.0)
        roster.confirm(conn)
    received = hello("host-last", tuple(range(world - 8, world)), world=world)
    assert isinstance(ask(roster, received), Join)  # warm: first-call caches
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        verdict = ask(roster, received)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert verdict == Join({r: None for r in range(world - 8, world)})
    assert peak < 8192, peak  # a list of the world's 2,047 relays alone would be 16 KiB


# ------------------------------------------------------------------ rows 6 to 9: refusals


def test_nothing_rejoins_a_run_that_is_ending() -> None:
    roster = roster_of(Conn("host-a", (0, 1)), Conn("host-b", (2, 3)), run=True)
    roster.mark_dead(2, "gone")
    stopped = "max_failure 1 reached"
    assert ask(roster, hello("host-b", (2,)), stopped=stopped) == Refuse(
        f"authenticated Hello from relay 'host-b' at {PEER}: expected a running cohort to "
        "rejoin, but max_failure 1 reached")
    roster.begin_shutdown()
    expected = Refuse(f"authenticated Hello from relay 'host-b' at {PEER}: expected a running "
                      "cohort to rejoin, but the coordinator is shutting down")
    assert ask(roster, hello("host-b", (2,))) == expected
    assert ending(roster, "host-b", PEER, None) == expected.reason


def test_after_formation_a_contradiction_is_a_refusal_not_a_failure() -> None:
    roster = roster_of(Conn("host-a", (0, 1)), Conn("host-b", (2, 3)), run=True)
    roster.mark_dead(2, "gone")
    assert ask(roster, hello("host-b", (2,), world=8)) == Refuse(
        f"authenticated Hello from relay 'host-b' at {PEER}: world_size mismatch: the "
        "coordinator's world_size is 4, the relay's is 8")


@pytest.mark.parametrize(("host", "ranks", "reason"), [
    ("host-b", (3,), "expected every rank it names to be dead, but rank 3 exited cleanly "
     "and does not rejoin"),
    ("host-b", (0, 2), "expected every rank it names to be dead, but rank 0 is alive on "
     "relay 'host-a' at 10.0.0.9:4000"),
    ("host-x", (2,), "rank 2 was announced by host 'host-b'; expected that host to bring it "
     "back (a different host takes over dead ranks only with "
     "CoordinatorConfig(allow_rank_takeover=True), CLI --allow-takeover)"),
])
def test_a_rank_that_cannot_come_back_refuses_the_relay(
    host: str, ranks: tuple[int, ...], reason: str,
) -> None:
    roster = roster_of(Conn("host-a", (0, 1)), Conn("host-b", (2, 3)), run=True)
    roster.mark_dead(2, "gone")
    roster.mark_exited(3)
    assert ask(roster, hello(host, ranks)) == Refuse(
        f"authenticated Hello from relay {host!r} at {PEER}: {reason}")


def test_a_rejoin_in_flight_refuses_others_but_not_its_own_re_dial() -> None:
    roster = roster_of(Conn("host-a", (0, 1)), Conn("host-b", (2, 3)), run=True)
    roster.mark_dead(2, "gone")
    roster.mark_dead(3, "gone")
    claimant = Conn("host-b", (2, 3), peer="10.0.0.2:1")
    assert ask(roster, hello("host-b", (2,)), claims={2: claimant, 3: claimant}) == Refuse(
        f"authenticated Hello from relay 'host-b' at {PEER}: rank 2 is being rejoined by "
        "relay 'host-b' at 10.0.0.2:1")
    assert ask(roster, hello("host-b", (2, 3)), claims={2: claimant, 3: claimant}) == Rejoin(
        (2, 3))


# ------------------------------------------------------------------ rows 10 to 14: admitted


def test_a_host_naming_its_own_live_ranks_supersedes_its_old_connection() -> None:
    old = Conn("host-b", (2, 3))
    roster = roster_of(Conn("host-a", (0, 1)), old, run=True)
    assert ask(roster, hello("host-b", (2, 3))) == Supersede((2, 3), old=(old,))
    # One of them dead already: still admitted whole, as a Supersede (row 10 comes first).
    roster.mark_dead(3, "gone")
    assert ask(roster, hello("host-b", (2, 3))) == Supersede((2, 3), old=(old,))


def test_a_resume_takes_its_hosts_relay_awaiting_its_resume_over_and_a_hello_supersedes_it(
) -> None:
    waiting = Conn("host-b", (2, 3), peer="(not resumed)", awaiting_resume=True)
    roster = roster_of(Conn("host-a", (0, 1)), waiting, run=True)
    terms = Terms(generation=2, adopting=True)
    assert ask(roster, hello("host-b", (2, 3), resume=1), terms=terms) == Resume(
        (2, 3), conns=(waiting,))
    assert ask(roster, hello("host-b", (2, 3)), terms=terms) == Supersede((2, 3), old=(waiting,))


def test_growing_cannot_match_while_the_world_has_one_size() -> None:
    # Every Hello any host could send to a running cohort, with some ranks dead: none grows
    # the world, since a running cohort covers every rank.
    hosts = {"host-a": Conn("host-a", (0, 1)), "host-b": Conn("host-b", (2, 3))}
    roster = roster_of(*hosts.values(), run=True)
    roster.mark_dead(1, "gone")
    roster.mark_dead(2, "gone")
    verdicts = [ask(roster, hello(host, ranks), terms=Terms(allow_takeover=takeover))
                for host in (*hosts, "host-x")
                for size in range(1, 5) for ranks in itertools.combinations(range(4), size)
                for takeover in (False, True)]
    assert len(verdicts) == 3 * 15 * 2
    assert not any(isinstance(v, Grow) for v in verdicts)
    assert {type(v) for v in verdicts} == {Refuse, Rejoin, Supersede, TakeOver}


def test_the_grow_row_takes_uncovered_ranks_of_a_running_cohort_with_room() -> None:
    # Not a state the coordinator reaches today (see the test above): the row itself.
    roster = roster_of(Conn("host-a", (0, 1)), world=4, run=True)
    assert ask(roster, hello("host-x", (2, 3))) == Grow((2, 3))


def test_a_spare_takes_a_dead_host_s_ranks_over_only_with_takeover() -> None:
    roster = roster_of(Conn("host-a", (0, 1)), Conn("host-b", (2, 3)), run=True)
    roster.mark_dead(2, "gone")
    roster.mark_dead(3, "gone")
    terms = Terms(allow_takeover=True)
    assert ask(roster, hello("host-x", (2, 3)), terms=terms) == TakeOver(
        (2, 3), previous={2: "host-b", 3: "host-b"})
    assert ask(roster, hello("host-b", (2, 3)), terms=terms) == Rejoin((2, 3))


def test_a_dead_rank_named_during_formation_follows_the_rejoin_rules() -> None:
    roster = roster_of(Conn("host-a", (0, 1)))
    roster.mark_dead(1, "dropped")
    assert ask(roster, hello("host-a", (1,))) == Rejoin((1,))
    # Also naming a rank alive elsewhere: refused by the rejoin rules, formation goes on.
    assert ask(roster, hello("host-x", (0, 1, 2)), terms=Terms(allow_takeover=True)) == Refuse(
        f"{WHO}: expected every rank it names to be dead, but rank 0 is alive on relay "
        "'host-a' at 10.0.0.9:4000")


def test_in_an_elastic_world_a_rank_that_exited_comes_back_with_its_own_host_only() -> None:
    # An elastic world of 2 to 4 ranks (the minimum keeps exits in it).
    roster = roster_of(Conn("host-a", (0, 1)), Conn("host-b", (2, 3)), least=2, run=True)
    roster.mark_exited(2)
    roster.mark_exited(3)
    assert ask(roster, hello("host-b", (2, 3))) == Rejoin((2, 3))
    assert ask(roster, hello("host-x", (2,))) == Refuse(
        f"authenticated Hello from relay 'host-x' at {PEER}: rank 2 was announced by host "
        "'host-b'; expected that host to bring it back (a different host takes over dead "
        "ranks only with CoordinatorConfig(allow_rank_takeover=True), CLI --allow-takeover)")
    assert ask(roster, hello("host-x", (2,)), terms=Terms(allow_takeover=True)) == TakeOver(
        (2,), previous={2: "host-b"})


# ------------------------------------------------------------------ asked again


def test_after_its_ready_a_rejoin_is_judged_on_the_run_and_its_ranks_only() -> None:
    roster = roster_of(Conn("host-a", (0, 1)), Conn("host-b", (2, 3)), run=True)
    roster.mark_dead(2, "gone")
    itself = Conn("host-b", (2,), peer=PEER)
    # It holds its claim; the claims are not asked again.
    assert ask(roster, hello("host-b", (2,)), claims={2: itself}, ready=True) == Rejoin((2,))
    roster.mark_exited(2)  # meanwhile (a late Exiting)
    assert ask(roster, hello("host-b", (2,)), claims={2: itself}, ready=True) == Refuse(
        f"authenticated Hello from relay 'host-b' at {PEER}: expected every rank it names to "
        "be dead, but rank 2 exited cleanly and does not rejoin")
    assert ask(roster, hello("host-b", (2,)), stopped="no live rank is left",
               ready=True) == Refuse(
        f"authenticated Hello from relay 'host-b' at {PEER}: expected a running cohort to "
        "rejoin, but no live rank is left")


def test_after_its_ready_a_resume_still_counts_its_relay_awaiting_resume_as_its_own() -> None:
    waiting = Conn("host-b", (2, 3), peer="(not resumed)", awaiting_resume=True)
    roster = roster_of(Conn("host-a", (0, 1)), waiting, run=True)
    terms = Terms(generation=2, adopting=True)
    assert isinstance(ask(roster, hello("host-b", (2, 3), resume=2), terms=terms, ready=True),
                      Resume)
    # A Hello (no Resume) is checked against the live ranks as they are.
    assert ask(roster, hello("host-b", (2, 3)), terms=terms, ready=True) == Refuse(
        f"authenticated Hello from relay 'host-b' at {PEER}: expected every rank it names to "
        "be dead, but rank 2 is alive on relay 'host-b' at (not resumed)")
