"""``coordinator --linger S``: the finished run's status page stays up a while.

A run of the demo forms and ends within seconds: too soon to open a browser on its live page.
After the run (its summary written and printed), the coordinator binds its address again and
serves the status page of the finished run (``/``, ``/board.json``, ``/events``,
``/state.json``) for ``S`` seconds, then exits with the run's exit code; SIGINT or SIGTERM end
the wait sooner, as the end of something already done (not a stop of the run).
"""

from __future__ import annotations

from functools import partial

import trio

from .._timeouts import clock_time_in
from ..coordinator import Coordinator
from ..net._transport import format_address
from ..status import serve_status
from ._common import STOP_SIGNALS


async def linger(address: tuple[str, int], coord: Coordinator, seconds: float) -> None:
    """Serve ``coord``'s status page on ``address`` for ``seconds`` (or until a signal)."""
    listeners = await trio.open_tcp_listeners(address[1], host=address[0])
    print(f"status page of the finished run kept up for {seconds:g} s (until "
          f"{clock_time_in(seconds)}; SIGINT or SIGTERM end it sooner): "
          f"http://{format_address(address)}/", flush=True)
    with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(partial(serve_status, listener, coord.state,
                                           request_timeout=coord.config.peek_timeout,
                                           board_fn=coord.board))
            with trio.move_on_after(seconds):
                async for _ in signals:
                    break
            nursery.cancel_scope.cancel()
        for listener in listeners:
            await listener.aclose()
