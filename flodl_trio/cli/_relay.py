"""``flodl-trio relay``: one host's relay, dialing ``--coordinator`` (one address, a fixed list,
or the leader's address in an ``etcd://`` session store) and riding out a lost durable
coordinator for ``--coordinator-grace`` seconds (docs/failover.rst)."""

from __future__ import annotations

import argparse
import signal
import ssl
import time
from functools import partial
from typing import Any

import trio

from .._config import RelayConfig
from .._errors import JoinRefused, MembershipError, WrongSession
from .._timeouts import clock_time_in
from ..net._transport import format_address
from ..relay import Relay, StoreDialer, open_relay
from ._common import (
    EXIT_OK,
    STOP_SIGNALS,
    CommandFailed,
    SignalStop,
    UsageError,
    liveness_seconds,
    load_salt,
    os_error_text,
    parse_model_sigs,
    parse_ranks,
)
from ._errors import MAX_LINE, shorten
from ._run import stopped
from ._targets import check_names, coordinator_target

POLL_S = 0.1  # how often the relay's failover state is looked at, for its lines


def _tls_client(args: argparse.Namespace) -> ssl.SSLContext | None:
    if not args.tls_ca:
        return None
    try:
        return ssl.create_default_context(cafile=args.tls_ca)
    except (OSError, ssl.SSLError) as exc:
        raise UsageError(f"--tls-ca {args.tls_ca!r}: {os_error_text(exc)}") from None


def relay_config(args: argparse.Namespace) -> RelayConfig:
    overrides: dict[str, Any] = {}
    if args.coordinator_grace is not None:
        if not args.coordinator_grace >= 0:
            raise UsageError(f"--coordinator-grace: expected seconds >= 0, got "
                             f"{args.coordinator_grace!r}")
        overrides["coordinator_grace"] = args.coordinator_grace
    if args.coord_liveness_timeout is not None:
        overrides["coord_liveness_timeout"] = liveness_seconds(args.coord_liveness_timeout)
    return RelayConfig(rejoin_when_fenced=args.rejoin_when_fenced, **overrides)


def waiting_line(host: str, what: str, until: float, connect_timeout: float) -> str:
    """The line a relay prints once when its join waits for something (no leader published
    yet, a resolver that failed for now).

    >>> import time
    >>> noon = time.mktime((2026, 1, 1, 12, 0, 31, 0, 0, -1))
    >>> waiting_line("h", "no coordinator published at etcd://e:1/r yet", noon, 30)[26:]
    'published at etcd://e:1/r yet; retrying until 12:00:31 (connect_timeout 30 s)'
    """
    clock = time.strftime("%H:%M:%S", time.localtime(until))
    return f"relay {host!r}: {what}; retrying until {clock} (connect_timeout {connect_timeout:g} s)"


async def tell_failover(relay: Relay, host: str, grace: float, *,
                        interval: float = POLL_S) -> None:
    """Print one line when the relay loses its durable coordinator and rides it out, and one
    when it resumed; and one when its join waits for something it names (polled: the relay's
    state, every ``interval`` seconds, until cancelled)."""
    resumed = relay.reconnects
    away_said = False
    waiting_said = False
    while True:
        waiting = relay.waiting
        if waiting is not None and not waiting_said:
            waiting_said = True
            print(shorten(waiting_line(host, *waiting, relay.config.connect_timeout),
                          MAX_LINE), flush=True)
        away = relay.reconnecting
        if relay.reconnects > resumed and not away_said:
            away = relay.last_lost  # resumed between two looks (moved to a newer leader)
        if away is not None and not away_said:
            away_said = True
            print(shorten(f"relay {host}: lost the coordinator ({away}); riding it out for up "
                          f"to {grace:g} s, re-dialing", MAX_LINE), flush=True)
        if relay.reconnects > resumed:
            resumed = relay.reconnects
            away_said = relay.reconnecting is not None
            dropped = relay.dropped_while_reconnecting
            print(f"relay {host}: resumed with the coordinator (generation "
                  f"{relay.generation}; {dropped} frame(s) from the ranks dropped meanwhile)",
                  flush=True)
        await trio.sleep(interval)


async def tell_wakeups(relay: Relay, host: str, *, interval: float = POLL_S) -> None:
    """Print one line when every rank the relay carries was fenced and it joins again with
    them, and one when it is back (polled every ``interval`` seconds, until cancelled; a
    wake-up done between two looks gets both lines)."""
    woken = relay.wakeups
    said = False
    while True:
        woke = relay.wakeups > woken
        if not said and (relay.rejoining is not None or woke):
            said = True
            ranks, reason = relay.rejoining or relay.last_wakeup or ((), "?")
            print(shorten(f"relay {host}: the coordinator fenced every rank it carries "
                          f"({reason}); joining again with ranks {list(ranks)}", MAX_LINE),
                  flush=True)
        if woke:
            woken, said = relay.wakeups, False
            print(f"relay {host}: back in the run with its ranks (wake-up {woken})",
                  flush=True)
        await trio.sleep(interval)


async def run_relay(args: argparse.Namespace) -> int:
    salt = load_salt(args, long_running=True)
    config = relay_config(args)
    ranks = parse_ranks(args.ranks)
    sigs = parse_model_sigs(args.model_sig)
    ssl_context = _tls_client(args)
    target = coordinator_target(args.coordinator, config=config)
    try:
        await check_names(args.coordinator, host=args.host)
        if isinstance(target, StoreDialer):
            await target.check()
        return await _relay(args, target, config=config, salt=salt, ranks=ranks, sigs=sigs,
                            ssl_context=ssl_context)
    finally:
        if isinstance(target, StoreDialer):
            await target.aclose()


async def _relay(args: argparse.Namespace, target: Any, *, config: RelayConfig, salt: Any,
                 ranks: list[int], sigs: dict[str, bytes],
                 ssl_context: ssl.SSLContext | None) -> int:
    with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
        stop = SignalStop(signals)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop.watch, nursery.cancel_scope)
            try:
                relay_cm = open_relay(target, salt=salt, host=args.host, ranks=ranks,
                                      world_size=args.world_size, rank_listen=args.rank_port,
                                      config=config, ssl_context=ssl_context,
                                      server_hostname=args.tls_server_name,
                                      model_sigs=sigs)
                async with relay_cm as relay, trio.open_nursery() as watching:
                    address = format_address(relay.rank_address)
                    print(f"relay {args.host} ranks {ranks} listening for ranks on {address}",
                          flush=True)
                    # At once: until the ranks dial in the relay had nothing to say for up to
                    # rank_accept_timeout, then failed.
                    wait = config.rank_accept_timeout
                    print(f"relay {args.host}: waiting for ranks {args.ranks} on {address} "
                          f"(rank_accept_timeout {wait:g} s, until {clock_time_in(wait)})",
                          flush=True)
                    watching.start_soon(tell_failover, relay, args.host,
                                        config.coordinator_grace)
                    watching.start_soon(tell_wakeups, relay, args.host)
                    stop.divert(partial(_drain_on_sigterm, relay, watching))
                    outcome = await relay.wait_closed()
                    stop.divert(None)
                    watching.cancel_scope.cancel()
                    print(f"relay {args.host} ended: {outcome.reason}", flush=True)
            except OSError as exc:
                raise CommandFailed(f"relay {args.host}: cannot listen for ranks on 127.0.0.1:"
                                    f"{args.rank_port}: {os_error_text(exc)}") from None
            except JoinRefused as exc:
                reason = " ".join(exc.reason.split())  # one line, whatever the coordinator sent
                raise CommandFailed(f"relay {args.host}: refused by the coordinator at "
                                    f"{exc.peer}: {reason}") from exc
            except WrongSession as exc:
                raise CommandFailed(f"relay {args.host}: the session salt differs from the "
                                    f"coordinator's at {exc.peer}, or that is not a coordinator "
                                    "of this session (--debug for detail)") from exc
            nursery.cancel_scope.cancel()
    if stop.signum is not None:
        return stopped(stop, f"relay {args.host}")
    if not outcome.clean:
        raise CommandFailed(f"relay {args.host}: {outcome.reason}")
    if relay.draining is not None:
        print(f"relay {args.host} drained: its ranks left after their last sync", flush=True)
    return EXIT_OK


def _drain_on_sigterm(relay: Relay, nursery: trio.Nursery, signum: int) -> bool:
    """A relay that joined drains on its first SIGTERM (issue 37): its ranks finish their
    current sync and exit, the coordinator retires them, and the relay exits 0 once they
    left. Any other signal, or SIGTERM again, stops it at once (as before)."""
    if signum != signal.SIGTERM or not relay.joined or relay.draining is not None:
        return False
    print(f"relay {relay.host}: SIGTERM: draining: ranks {list(relay.ranks)} finish their "
          "current sync and exit (SIGTERM again stops the relay at once)", flush=True)
    nursery.start_soon(_drain, relay)
    return True


async def _drain(relay: Relay) -> None:
    try:
        await relay.drain("SIGTERM")
    except MembershipError as exc:  # it ended meanwhile: nothing left to drain
        print(f"relay {relay.host}: {exc}", flush=True)
