"""pytest plugin of flodl-trio (registered through the ``pytest11`` entry point).

Fixtures:
    memory_network: a fresh :class:`flodl_trio.testing.MemoryNetwork`; at teardown it asserts
        that every stream and listener was closed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .testing import MemoryNetwork


@pytest.fixture
def memory_network() -> Iterator[MemoryNetwork]:
    """An in-memory network that works under ``MockClock``; leaks fail the test at teardown."""
    net = MemoryNetwork()
    yield net
    net.assert_all_closed()
