"""The programs of ``scripts/`` in the tests: loaded as modules, or started as processes."""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import trio

import flodl_trio as ft
from flodl_trio.testing import EventLog

SCRIPTS = Path(__file__).resolve().parent.parent.parent / "scripts"
TWO_HOSTS = (("host-a", [0, 1]), ("host-b", [2, 3]))


@functools.cache
def load_script(name: str) -> ModuleType:
    """``scripts/NAME.py`` as a module: the child programs and their parent-side handles.

    For a package ``scripts/NAME/`` (the fault scenarios of ``scripts/_chaos``) the package is
    also registered in ``sys.modules``, so that its modules import as ``NAME.x``, as they do for
    a script run from ``scripts/`` (whose folder is the first entry of its ``sys.path``).
    """
    package = SCRIPTS / name
    if package.is_dir():
        spec = importlib.util.spec_from_file_location(
            name, package / "__init__.py", submodule_search_locations=[str(package)])
    else:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    if package.is_dir():
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


async def start_relay_processes(
    nursery: trio.Nursery, coordinator: tuple[str, int], salt: ft.SessionSalt,
    children: list[Any], *, hosts: Sequence[tuple[str, list[int]]] = TWO_HOSTS,
    world_size: int = 4, extra: Sequence[str] = (),
) -> list[Any]:
    """One ``scripts/_relay_proc.py`` process (a relay and its ranks) per host, in order; each
    joins ``children`` as soon as it started, so the caller's cleanup stops it whatever fails
    next. Returns the new ones."""
    relay_process = load_script("_relay_proc").RelayProcess
    started = []
    for host, ranks in hosts:
        child = await relay_process.start(nursery, coordinator=coordinator, salt=salt, host=host,
                                          ranks=ranks, world_size=world_size, extra=tuple(extra))
        children.append(child)
        started.append(child)
    return started


@attrs.define(eq=False)
class RelayProcesses:
    """A coordinator's port bound on loopback (``bound``: the test opens the coordinator on it,
    :meth:`coordinator`) and the relay processes that dial it, each ``scripts/_relay_proc.py``
    (a relay and its simulated ranks)."""

    nursery: trio.Nursery
    bound: Any
    salt: ft.SessionSalt
    children: list[Any]
    log: EventLog = attrs.Factory(EventLog)

    def coordinator(self, config: ft.CoordinatorConfig) -> AbstractAsyncContextManager[Any]:
        """``open_coordinator`` on the bound port with this salt, recording to ``log``."""
        return ft.open_coordinator(self.bound, salt=self.salt, config=config, timeline=self.log)

    async def start(self, host: str, ranks: list[int], *, world_size: int = 4,
                    extra: Sequence[str] = ()) -> Any:
        """One more relay process, for ``host`` and its ``ranks``."""
        child = await load_script("_relay_proc").RelayProcess.start(
            self.nursery, coordinator=self.bound.address, salt=self.salt, host=host,
            ranks=ranks, world_size=world_size, extra=tuple(extra))
        self.children.append(child)
        return child

    async def start_two_hosts(self) -> list[Any]:
        """host-a (ranks 0, 1) and host-b (ranks 2, 3), in a world of 4."""
        return await start_relay_processes(self.nursery, self.bound.address, self.salt,
                                           self.children)

    async def wait_exits(self, *children: Any, limit: float = 10) -> None:
        """Each of ``children`` exited within ``limit`` seconds."""
        with trio.fail_after(limit):
            for child in children:
                await child.proc.wait()


@asynccontextmanager
async def relay_processes(*, limit: float) -> AsyncIterator[RelayProcesses]:
    """A :class:`RelayProcesses` with a new salt; the block fails after ``limit`` seconds, and
    every process is stopped when it ends, however it ends."""
    children: list[Any] = []
    try:
        with trio.fail_after(limit):
            async with trio.open_nursery() as nursery:
                bound = await ft.bind_coordinator(("127.0.0.1", 0))
                yield RelayProcesses(nursery, bound, ft.SessionSalt.generate(), children)
                nursery.cancel_scope.cancel()
    finally:
        for child in children:
            await child.stop()
