"""Configuration objects: frozen, validated attrs classes whose deadline defaults are scaled."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import attrs

from . import _timeouts as T
from ._errors import ConfigError


def _deadline(default: float) -> Any:
    """An attrs field holding a deadline: default scaled at creation, explicit values as given."""
    return attrs.field(
        factory=partial(T.scaled, default), converter=_SECONDS, validator=_check_deadline
    )


def _grace(default: float) -> Any:
    """A deadline that 0 disables: default scaled at creation, explicit values as given."""
    return attrs.field(
        factory=partial(T.scaled, default), converter=_SECONDS, validator=_check_grace
    )


def _cadence(default: float) -> Any:
    return attrs.field(default=default, converter=_SECONDS, validator=_check_cadence)


def _rate(default: float) -> Any:
    """An attrs field holding a rate per second (> 0; ``math.inf`` for unbounded)."""
    return attrs.field(default=default, converter=_PER_SECOND, validator=_check_rate)


def _number(what: str, bool_is_not: str) -> attrs.Converter[Any, float]:
    """An attrs converter to float that names the field and ``what`` it expected."""

    def convert(value: Any, inst: Any, attribute: attrs.Attribute[Any]) -> float:
        where = f"{type(inst).__name__}.{attribute.name}"
        # A bare float() converter let "abc" or None escape as ValueError/TypeError, not
        # ConfigError, and turned True into 1.0 s: a bool is a flag, not a duration.
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected {what}, got {value!r} (a bool is not "
                              f"{bool_is_not})")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected {what}, got {value!r}") from None

    return attrs.Converter(convert, takes_self=True, takes_field=True)


_SECONDS = _number("a number of seconds", "a duration")
_PER_SECOND = _number("a number per second", "a rate")

_Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _refusing(bad: Callable[[Any], bool], expected: str) -> _Validator:
    """An attrs validator: ``ConfigError`` naming the field and what it ``expected`` when
    ``bad(value)``."""

    def check(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if bad(value):
            raise ConfigError(f"{type(inst).__name__}.{attribute.name}: expected {expected}, "
                              f"got {value!r}")

    return check


def _not_int(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


_check_deadline = _refusing(lambda v: math.isnan(v) or v <= 0,
                            "seconds > 0 (math.inf disables it)")
_check_cadence = _refusing(lambda v: not math.isfinite(v) or v <= 0,
                           "a finite number of seconds > 0")
_check_rate = _refusing(lambda v: math.isnan(v) or v <= 0,
                        "a rate > 0 per second (math.inf: no pacing)")
_check_grace = _refusing(lambda v: math.isnan(v) or v < 0,
                         "seconds >= 0 (0 disables it, math.inf waits for ever)")
_positive_int = _refusing(lambda v: _not_int(v) or v <= 0, "an integer > 0")
_non_negative_int = _refusing(lambda v: _not_int(v) or v < 0, "an integer >= 0")


@attrs.frozen
class MaxFailure:
    """How many dead ranks the run tolerates before it stops with ``MAX_FAILURE_EXCEEDED``.

    Build it with :meth:`absolute`, :meth:`fraction` or :meth:`percent`; the limit is reached when
    the number of dead ranks is >= :meth:`limit`. Out-of-range arguments are a
    :class:`~flodl_trio.ConfigError`, never clamped: ``percent(0.25)`` is a quarter of one
    percent, not 25 %.

    >>> MaxFailure.percent(25).limit(8)
    2
    >>> MaxFailure.fraction(0.25) == MaxFailure.percent(25)
    True
    >>> MaxFailure.absolute(3).limit(8)
    3

    Attributes:
        count: the absolute limit, or None.
        dead_fraction: the limit as a share of the world in [0, 1], or None.
    """

    count: int | None = None
    dead_fraction: float | None = None

    @classmethod
    def absolute(cls, n: int) -> MaxFailure:
        """Fail once ``n`` ranks are dead (0 means: on the first death, like 1).

        Raises:
            ConfigError: ``n`` is not an integer >= 0.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"MaxFailure.absolute: expected an integer >= 0, got {n!r}")
        return cls(count=n)

    @classmethod
    def fraction(cls, f: float) -> MaxFailure:
        """Fail once ``ceil(f * world_size)`` ranks are dead (at least 1).

        Args:
            f: a share of the world in [0, 1] (``0.25`` is a quarter of the ranks).

        Raises:
            ConfigError: ``f`` is not a number in [0, 1].
        """
        return cls(dead_fraction=_in_range("MaxFailure.fraction", f, 1.0, "a fraction"))

    @classmethod
    def percent(cls, p: float) -> MaxFailure:
        """Fail once ``ceil(p / 100 * world_size)`` ranks are dead (at least 1).

        Args:
            p: a percentage of the world in [0, 100] (``25`` is a quarter of the ranks).

        Raises:
            ConfigError: ``p`` is not a number in [0, 100].
        """
        value = _in_range("MaxFailure.percent", p, 100.0, "a percentage")
        return cls(dead_fraction=value / 100.0)

    def limit(self, world_size: int) -> int:
        """The dead-rank count at which the run fails; at least 1."""
        if self.count is not None:
            return max(1, self.count)
        assert self.dead_fraction is not None
        # Round off binary-float noise first: 0.07 * 100 is 7.000000000000001, whose ceil is 8.
        return max(1, math.ceil(round(self.dead_fraction * world_size, 9)))

    def describe(self, world_size: int) -> str:
        """The policy and its limit in this world, for error messages and logs."""
        if self.count is not None:
            return f"absolute({self.count})"
        assert self.dead_fraction is not None
        percent = round(self.dead_fraction * 100, 9)
        return f"percent({percent:g}) = {self.limit(world_size)} of {world_size}"


def _in_range(what: str, value: Any, top: float, kind: str) -> float:
    if (isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value)
            or not 0 <= value <= top):
        raise ConfigError(f"{what}: expected {kind} in [0, {top:g}], got {value!r}")
    return float(value)


@attrs.frozen(kw_only=True)
class CoordinatorConfig:
    """Everything the coordinator needs to know besides where to listen and the salt.

    Args:
        world_size: number of global ranks (> 0); with ``min_world_size``, the largest world
            and the rank id space.
        formation_timeout: seconds for every rank (an elastic world: its minimum) to be
            covered.
        handshake_timeout: seconds for one relay connection to complete its handshake.
        heartbeat_timeout: a rank silent longer than this is declared dead.
        write_stall_timeout: a relay whose writer makes no progress this long is lost. No
            other relay's heartbeats or broadcasts wait on it (issue 13), so it needs no
            relation to the ranks' ``coord_liveness_timeout`` or to ``heartbeat_timeout``.
        peek_timeout: port mux: seconds for a connection's 4-byte magic to arrive.
        shutdown_grace: bound on the final ``Shutdown`` broadcast and close.
        heartbeat_interval: cadence of ``CoordHeartbeat`` (not scaled).
        max_failure: failure policy; ``None`` stops only when every rank is lost.
        strict_formation: make every pre-auth reject fatal (flodl's behaviour).
        max_pending_handshakes: at most this many connections may be unauthenticated at once
            in each stage (waiting for their channel magic in the port mux; between routing and
            a verified Hello in formation). With that many pending the stage stops accepting
            (the kernel's listen backlog holds the dialers, so a burst of relays waits instead
            of re-dialing) until one finishes or the oldest is *stale*: its peer silent for
            ``min(0.15 s, the stage's timeout / 20)`` with none of its bytes waiting unread.
            That one is shed (counted as ``shed``) for the next, so silent dialers holding
            slots cannot keep a relay out. Pre-auth memory is bounded by this times the Hello
            ceiling (``wire.max_hello_payload(world_size)``).
        max_rejected_handshakes: **deprecated, ignored** (a ``DeprecationWarning`` when set):
            since FT/2 no number of pre-auth rejects fails formation, or anyone who can reach
            the port could kill it; use ``strict_formation=True`` for flodl's behaviour.
        timing_buffer / metrics_buffer: capacity of ``coord.timing`` / ``coord.metrics``.
        declare_dead_on_relay_loss: a lost relay connection declares its ranks dead at once.
        allow_rank_takeover: after formation, a relay of a *different* host may take over
            ranks that are all currently dead (a spare host); off, only the host that
            announced them may bring them back (a restarted relay always may).
        resume_timeout: with a session store (``open_coordinator(store=...)``), a coordinator
            that adopted a running session waits this long for each relay of its roster to
            resume; the ranks of a relay that has not are then declared dead.
        deliver_heartbeats: deliver a ``Heartbeat`` to ``coord.timing`` for each rank a
            relay's ``Liveness`` record reports (the relays verify the ranks' heartbeats and
            coalesce them, issue 23), as when every rank's frame came through. Off, those
            heartbeats only refresh liveness and the status board's step counts: the
            cheapest idle coordinator, for consumers that do not read heartbeats.
        relay_heartbeat_rate: relay ↔ coordinator heartbeat exchanges per second the
            coordinator aims to stay under (issue 23). It paces them: each relay sends its
            ``Liveness`` record, and gets a ``CoordHeartbeat``, once per
            ``max(heartbeat_interval, min(relays / relay_heartbeat_rate,
            heartbeat_timeout / 4))`` seconds (``Coordinator.heartbeat_period``), so up to
            300 relays (at the default) nothing changes, 2,048 relays exchange every 6.8 s
            and 2,250 or more every 7.5 s. The default keeps the exchanges under a tenth of
            a core with margin at the measured ~250 µs of coordinator CPU each (issue 23).
            Ranks still heartbeat to their relay every second and their silence is still
            detected at ``heartbeat_timeout``. ``math.inf``: always ``heartbeat_interval``.
        min_world_size: elastic membership (issue 37, docs/elastic.rst): the smallest world
            the run forms with and keeps, ``1 <= min_world_size <= world_size``; None (the
            default) is ``world_size``: a fixed world. ``world_size`` is then the maximum and
            the rank id space ``[0, world_size)`` that relays and ranks are started with.
        join_window: an elastic world forms once ``min_world_size`` ranks are covered and no
            relay joined for this many seconds (at once when ``world_size`` ranks are); 0
            forms as soon as the minimum is covered. ``formation_timeout`` bounds the wait for
            the minimum.
        retire_after: a rank dead this long is retired (it stops counting in the world and
            against ``max_failure``; its id may join again later), as long as the world stays
            at or above ``min_world_size``. ``math.inf`` (the default): never automatically.
        store_write_rate: with a session store, the writes per second the coordinator's
            session writer paces itself to (issue 34; docs/failover.rst, "How often the store
            is written"): a change that can wait (a death, a join, a scheduler checkpoint saved
            with ``durable=False``, such as the reference scheduler's after every sync) is
            written at least ``1 / store_write_rate`` seconds after the previous write began,
            coalesced with every other change meanwhile; a write someone waits for
            (``save_checkpoint`` with ``durable=True``, formation) goes at once. The default
            1/s keeps an etcd store to about 60 revisions a minute in steady state; a change
            that can wait is durable within about a second. ``math.inf``: no pacing.
        pause_gc_in_formation: pause Python's cyclic garbage collector (``gc.disable``)
            from the first accept until the cohort formed (or formation failed), then resume
            it as it was (issue 38; docs/performance.rst, "The garbage collector in
            formation"): full collections over the relays being admitted were a fifth of a
            large formation's CPU. Process-wide, as the collector is; counted, so
            coordinators forming at once in one process resume it when the last one formed.
            ``False``: the collector is left alone.
    """

    world_size: int = attrs.field(validator=_positive_int)
    formation_timeout: float = _deadline(T.FORMATION_TIMEOUT)
    handshake_timeout: float = _deadline(T.HANDSHAKE_TIMEOUT)
    heartbeat_timeout: float = _deadline(T.HEARTBEAT_TIMEOUT)
    write_stall_timeout: float = _deadline(T.WRITE_STALL_TIMEOUT)
    peek_timeout: float = _deadline(T.PEEK_TIMEOUT)
    shutdown_grace: float = _deadline(T.SHUTDOWN_GRACE)
    heartbeat_interval: float = _cadence(T.HEARTBEAT_INTERVAL)
    max_failure: MaxFailure | None = attrs.field(default=None)
    strict_formation: bool = attrs.field(default=False, converter=bool)
    max_pending_handshakes: int = attrs.field(default=1024, validator=_positive_int)
    max_rejected_handshakes: int | None = attrs.field(default=None)
    timing_buffer: int = attrs.field(default=4096, validator=_positive_int)
    metrics_buffer: int = attrs.field(default=1024, validator=_positive_int)
    declare_dead_on_relay_loss: bool = attrs.field(default=True, converter=bool)
    allow_rank_takeover: bool = attrs.field(default=False, converter=bool)
    resume_timeout: float = _deadline(T.RESUME_TIMEOUT)
    deliver_heartbeats: bool = attrs.field(default=True, converter=bool)
    relay_heartbeat_rate: float = _rate(300.0)
    store_write_rate: float = _rate(1.0)
    min_world_size: int | None = attrs.field(default=None)
    join_window: float = _grace(T.JOIN_WINDOW)
    retire_after: float = _deadline(math.inf)  # never, unless asked
    pause_gc_in_formation: bool = attrs.field(default=True, converter=bool)

    @property
    def min_world(self) -> int:
        """The smallest world the run forms with and keeps (``world_size`` when fixed)."""
        return self.world_size if self.min_world_size is None else self.min_world_size

    @property
    def elastic(self) -> bool:
        """The world may grow and shrink between ``min_world`` and ``world_size``."""
        return self.min_world < self.world_size

    @min_world_size.validator
    def _check_min_world(self, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None:
            return
        if _not_int(value) or not 1 <= value <= self.world_size:
            raise ConfigError(
                f"CoordinatorConfig.min_world_size: expected an integer in [1, world_size="
                f"{self.world_size}] (the world's minimum, at most its maximum), got {value!r}")

    @max_rejected_handshakes.validator
    def _deprecated_reject_limit(self, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None:
            return
        _non_negative_int(self, attribute, value)
        warnings.warn(
            "CoordinatorConfig.max_rejected_handshakes is deprecated and ignored: since FT/2 "
            "pre-auth rejects never fail formation (strict_formation=True makes each one "
            "fatal); their resources are bounded by max_pending_handshakes",
            DeprecationWarning, stacklevel=3)

    @max_failure.validator
    def _check_max_failure(self, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and not isinstance(value, MaxFailure):
            raise ConfigError(
                f"CoordinatorConfig.max_failure: expected MaxFailure or None, got {value!r}"
            )


@attrs.frozen(kw_only=True)
class RelayConfig:
    """Deadlines of a host relay (SPEC §5).

    ``write_stall_timeout`` also bounds how long a local rank may leave its outbound queue
    (``queue_size`` frames) overflowing or its socket unread before the relay drops it; its
    siblings never wait on it, so no other deadline has to be shorter or longer than it.

    The last three apply only to a *durable* coordinator (one that sent ``Generation``: it runs
    with a session store). A relay that loses it without a ``Goodbye`` keeps its ranks connected
    for ``coordinator_grace`` seconds (0 disables: the relay ends as with any coordinator)
    while it re-dials and resumes; ``coord_liveness_timeout`` without a record from it counts as
    losing it; ``reconnect_queue`` frames from the ranks are queued meanwhile, later ones are
    dropped and counted.

    ``coord_liveness_timeout`` (default 20 s, scaled) must be at most two thirds of each of its
    ranks' own (:class:`RankConfig`, 30 s): the relay then starts riding a silent coordinator
    out, and feeding its ranks' watchdogs, before any of them fires, at any heartbeat pace
    (:func:`check_liveness_order`, docs/deadlines.rst).
    """

    rank_accept_timeout: float = _deadline(T.RANK_ACCEPT_TIMEOUT)
    connect_timeout: float = _deadline(T.CONNECT_TIMEOUT)
    handshake_timeout: float = _deadline(T.HANDSHAKE_TIMEOUT)
    write_stall_timeout: float = _deadline(T.WRITE_STALL_TIMEOUT)
    shutdown_grace: float = _deadline(T.SHUTDOWN_GRACE)
    queue_size: int = attrs.field(default=64, validator=_positive_int)
    coordinator_grace: float = _grace(T.COORDINATOR_GRACE)
    coord_liveness_timeout: float = _deadline(T.RELAY_COORD_LIVENESS_TIMEOUT)
    reconnect_queue: int = attrs.field(default=4096, validator=_non_negative_int)
    # Cadence of the relay's Liveness record: the local ranks' verified Heartbeats since the
    # last one, coalesced (issue 23); a coordinator of many relays asks for a slower one
    # (Cadence). Never scaled, like the ranks' own heartbeat_interval.
    heartbeat_interval: float = _cadence(T.HEARTBEAT_INTERVAL)
    # Issue 37, waking up: once the coordinator fenced every rank the relay still carries (its
    # host froze past heartbeat_timeout), re-dial with a fresh Hello and bring those ranks back
    # instead of ending. Off here (the library keeps its ranks' links only when asked); the
    # command line turns it on (docs/elastic.rst, "Waking up").
    rejoin_when_fenced: bool = attrs.field(default=False, converter=bool)
    # Issue 38: Python's cyclic garbage collector is paused from the relay's start until its
    # pump runs (joined) or the join failed, then resumed as it was found (flodl_trio._gc,
    # counted across relays and coordinators in one process). False leaves it alone.
    pause_gc_in_join: bool = attrs.field(default=True, converter=bool)


@attrs.frozen(kw_only=True)
class RankConfig:
    """Deadlines and cadence of a rank endpoint (SPEC §6).

    ``rejoin_when_fenced`` (issue 37): a rank the coordinator fenced waits on its link for its
    relay to bring it back (``Readmitted``) instead of ending with ``RankEvicted``; it still
    ends with it if the relay closes the link. Off by default; the command line turns it on.
    """

    connect_timeout: float = _deadline(T.CONNECT_TIMEOUT)
    handshake_timeout: float = _deadline(T.HANDSHAKE_TIMEOUT)
    coord_liveness_timeout: float = _deadline(T.COORD_LIVENESS_TIMEOUT)
    write_stall_timeout: float = _deadline(T.WRITE_STALL_TIMEOUT)
    heartbeat_interval: float = _cadence(T.HEARTBEAT_INTERVAL)
    rejoin_when_fenced: bool = attrs.field(default=False, converter=bool)


def check_liveness_order(relay: RelayConfig, rank: RankConfig, *, rank_name: str = "a rank"
                         ) -> None:
    """Refuse a relay whose coordinator-silence deadline is not at most two thirds of one of
    its ranks' (docs/deadlines.rst): the relay must notice a silent coordinator, and start
    feeding its ranks, before their own watchdogs fire.

    Why two thirds: a rank's last frame from the coordinator may be up to one heartbeat period
    older than the relay's last record, and a rank's ``coord_liveness_timeout`` must already be
    at least four periods (or a quiet coordinator looks lost); so a relay at two thirds of it
    fires at least a twelfth of it (2.5 s at the defaults) before any rank can, and still
    waits more than two and a half periods.

    >>> check_liveness_order(RelayConfig(coord_liveness_timeout=20),
    ...                      RankConfig(coord_liveness_timeout=30))
    >>> check_liveness_order(RelayConfig(coord_liveness_timeout=25),
    ...                      RankConfig(coord_liveness_timeout=30), rank_name="rank 3")
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
        ...
    flodl_trio._errors.ConfigError: RelayConfig.coord_liveness_timeout=25s: expected at most \
2/3 of rank 3's RankConfig.coord_liveness_timeout=30s (20s), so that the relay rides ...

    Raises:
        ConfigError: the relay's deadline is too long; the message names both values.
    """
    limit = rank.coord_liveness_timeout * T.RELAY_LIVENESS_SHARE
    if relay.coord_liveness_timeout > limit * (1 + 1e-9):  # 2/3 of 30 is 20.000000000000004
        raise ConfigError(
            f"RelayConfig.coord_liveness_timeout={relay.coord_liveness_timeout:g}s: expected at "
            f"most 2/3 of {rank_name}'s RankConfig.coord_liveness_timeout="
            f"{rank.coord_liveness_timeout:g}s ({limit:g}s), so that the relay rides a silent "
            "coordinator out before the rank's watchdog fires")


def relay_config_for(relay: RelayConfig | None, ranks: Sequence[RankConfig]) -> RelayConfig:
    """``relay`` checked against each of ``ranks`` (:func:`check_liveness_order`); without
    one, the defaults with a ``coord_liveness_timeout`` no longer than the order allows.

    Raises:
        ConfigError: ``relay``'s deadline is over 2/3 of one of ``ranks``' (naming both).
    """
    if relay is None:
        shortest = min((r.coord_liveness_timeout for r in ranks), default=math.inf)
        default = RelayConfig()
        return attrs.evolve(default, coord_liveness_timeout=min(
            default.coord_liveness_timeout, shortest * T.RELAY_LIVENESS_SHARE))
    for rank in ranks:
        check_liveness_order(relay, rank)
    return relay
