"""One lifecycle for :func:`open_coordinator`, :func:`open_relay` and :func:`open_rank`.

Each of them owns a nursery of background tasks, runs the caller's body, and must then let
exactly one exception out (SPEC §4.6), never an ``ExceptionGroup``:

1. the body's own exception, if it raised one (other than ``Cancelled``);
2. else a ``KeyboardInterrupt``/``SystemExit`` from anywhere (never disguised);
3. else the component's own :class:`FlodlError` (the failure it recorded, or one a task raised);
4. else one ``trio.Cancelled``, when the cancellation came from outside (the caller's scope);
5. else :class:`FlodlInternalError`, raised ``from`` the group.

The exceptions that were not chosen (cancellations aside) are not dropped: they become the chosen
exception's ``__context__``, as one group.

The background tasks run in a nursery that an outside cancellation does not reach: a cancelled
coordinator must still say ``Shutdown``, half-close and drain its relays, which needs its readers
and writers alive. The component's own shutdown (shielded and bounded by the component's grace)
runs first; the lifecycle cancels the background tasks when the block ends.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import NoReturn

import trio

from ._errors import FlodlError, FlodlInternalError

__all__ = ["Lifecycle", "choose_one_exception", "open_lifecycle", "raise_keeping_context"]

log = logging.getLogger("flodl_trio.lifecycle")


class Lifecycle:
    """The part of a component's lifecycle its ``open_*`` function uses.

    Attributes:
        what: the component, for messages (``"coordinator"``, ``"relay 'host-a'"``).
        nursery: where the component starts its background tasks; an outside cancellation does
            not reach them, the end of the lifecycle does.
        body_exc: what the caller's body raised, once it has (None otherwise).
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.body_exc: BaseException | None = None
        self._tasks: trio.Nursery | None = None
        self._body_scope = trio.CancelScope()
        self._services_scope: trio.CancelScope | None = None
        self._whole: trio.CancelScope | None = None  # open_lifecycle's: start-up and body

    @property
    def nursery(self) -> trio.Nursery:
        """Where the component starts its background tasks (see the class docstring)."""
        if self._tasks is None:
            raise FlodlInternalError(f"{self.what}: the lifecycle's nursery is not open yet")
        return self._tasks

    @property
    def body_scope(self) -> trio.CancelScope:
        """The cancel scope around the body; cancelling it is how a failing component stops it."""
        return self._body_scope

    def cancel_body(self) -> None:
        """Stop the body (it sees ``Cancelled``; the block then raises the component's failure)."""
        self._body_scope.cancel()

    @contextmanager
    def body(self) -> Iterator[trio.CancelScope]:
        """Wrap the ``yield`` of an ``open_*`` function: records what the body raised."""
        with self._body_scope:
            try:
                yield self._body_scope
            except BaseException as exc:
                self.body_exc = exc
                raise

    def stop_tasks(self) -> None:
        """Cancel the background tasks (the lifecycle does it when the block ends)."""
        if self._services_scope is not None:
            self._services_scope.cancel()

    async def host_tasks(self, *, task_status: trio.TaskStatus[None]) -> None:
        """Host :attr:`nursery` until :meth:`stop_tasks` (``open_lifecycle`` starts it)."""
        # Shielded: the caller's cancellation must not cut the tasks that its graceful shutdown
        # still needs. ``stop_tasks`` is their only way out besides their own failure.
        with trio.CancelScope(shield=True) as scope:
            self._services_scope = scope
            async with trio.open_nursery() as tasks:
                self._tasks = tasks
                task_status.started()
                try:
                    await trio.sleep_forever()
                finally:
                    if tasks.cancel_scope.cancel_called and not scope.cancel_called:
                        # A background task failed (its nursery cancelled this wait): stop
                        # the component now -- its start-up wait (formation) or the body --
                        # rather than when something else ends; the tasks that are still
                        # shielded (writers) end with its graceful shutdown.
                        self.stop_all()

    def stop_all_with(self, scope: trio.CancelScope) -> None:
        """``scope`` covers the component's start-up and body (``open_lifecycle``'s)."""
        self._whole = scope

    def stop_all(self) -> None:
        """Cancel the start-up and the body (a background task failed)."""
        if self._whole is not None:
            self._whole.cancel()


@asynccontextmanager
async def open_lifecycle(
    what: str, *, failure: Callable[[], BaseException | None]
) -> AsyncIterator[Lifecycle]:
    """Run a component's lifecycle around the block; exactly one exception comes out.

    Args:
        what: the component, for messages.
        failure: returns the failure the component recorded (it cancelled the body for it), or
            None; asked once the block has ended.

    Raises:
        The one exception chosen as the module docstring says.
    """
    life = Lifecycle(what)
    error: BaseException
    try:
        async with trio.open_nursery() as nursery:
            life.stop_all_with(nursery.cancel_scope)
            # Shielded: started() does not hand a task over from a cancelled start, so a caller
            # cancelled before this point would leave host_tasks shielded in start's own nursery
            # and this await would never return. It returns at once: host_tasks starts at once.
            with trio.CancelScope(shield=True):
                await nursery.start(life.host_tasks)
            try:
                yield life
            finally:
                life.stop_tasks()
    except BaseExceptionGroup as group:
        error = choose_one_exception(
            group, body_exc=life.body_exc, failure=failure(),
            cancelled_from_outside=trio.current_effective_deadline() == -math.inf, what=what,
        )
    else:
        recorded = failure()
        if recorded is None:
            return
        error = recorded
    raise_keeping_context(error)


def choose_one_exception(
    group: BaseExceptionGroup[BaseException],
    *,
    body_exc: BaseException | None,
    failure: BaseException | None,
    cancelled_from_outside: bool,
    what: str = "component",
) -> BaseException:
    """Reduce a nursery's exception group to the one exception the caller should see.

    The others (cancellations aside) are attached as the chosen one's ``__context__`` group.
    """
    cancels, rest = group.split(trio.Cancelled)
    leaves = _leaves(rest) if rest is not None else []
    candidates = list(leaves)
    if failure is not None and not any(leaf is failure for leaf in leaves):
        candidates.append(failure)
    chosen: BaseException | None = None
    if body_exc is not None and not isinstance(body_exc, trio.Cancelled) and any(
        leaf is body_exc for leaf in leaves
    ):
        chosen = body_exc
    if chosen is None:
        chosen = next((leaf for leaf in leaves if not isinstance(leaf, Exception)), None)
    if chosen is None and failure is not None:
        chosen = failure
    if chosen is None:
        chosen = next((leaf for leaf in leaves if isinstance(leaf, FlodlError)), None)
    if chosen is None and cancels is not None and (cancelled_from_outside or not leaves):
        if isinstance(body_exc, trio.Cancelled):
            chosen = body_exc
        else:
            chosen = _leaves(cancels)[0]
        if leaves:
            log.error("%s: cancelled from outside while failing internally: %s", what,
                      "; ".join(repr(e) for e in leaves[:3]))
    if chosen is None:
        internal = FlodlInternalError(
            f"{what}: expected at most one failure from its tasks, got {len(leaves)}: "
            f"{'; '.join(repr(e) for e in leaves[:3])}"
        )
        # Flattened: the nesting only says which nursery each one came through.
        internal.__cause__ = BaseExceptionGroup(f"{what}: failures of its tasks", leaves)
        return internal
    others = [exc for exc in candidates if exc is not chosen]
    if others:
        _attach_context(chosen, others, what)
    return chosen


def _attach_context(chosen: BaseException, others: list[BaseException], what: str) -> None:
    previous = chosen.__context__
    if previous is not None and not chosen.__suppress_context__ and not any(
        previous is exc for exc in others
    ):
        others = [*others, previous]
    chosen.__context__ = BaseExceptionGroup(
        f"{what}: also raised while {type(chosen).__name__} was chosen", others
    )
    chosen.__suppress_context__ = False


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        out: list[BaseException] = []
        for inner in exc.exceptions:
            out.extend(_leaves(inner))
        return out
    return [exc]


def raise_keeping_context(exc: BaseException) -> NoReturn:
    """Raise ``exc`` with the ``__context__`` it has now (an ``open_*`` generator's last step)."""
    # ``raise`` inside a generator that is handling the body's exception would overwrite the
    # ``__context__`` chosen above (with the exception itself, or the group).
    context = exc.__context__
    try:
        raise exc
    finally:
        exc.__context__ = context
        del exc, context
