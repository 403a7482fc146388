"""Fault plans: what goes wrong on one connection, and when (per direction)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

import attrs

from .._errors import ConfigError
from ..wire import READ_SIZE

Direction = Literal["up", "down", "both"]
_DIRECTIONS = ("up", "down", "both")
_CHUNK = READ_SIZE  # the proxy reads like the library's own loops


def _drip_piece(rate: float) -> int:
    # ~20 writes a second keeps a high rate cheap while a low rate still trickles 1 byte at a time.
    return max(1, int(rate // 20))


@attrs.frozen
class Fault:
    """One fault of a :class:`FaultPlan` (see the builder methods for what each kind does).

    Attributes:
        kind: ``"cut"``, ``"stall"``, ``"corrupt"``, ``"delay"``, ``"drip"`` or ``"reset"``.
        direction: ``"up"``, ``"down"`` or ``"both"``.
        offset: the byte offset for cut / stall / corrupt / reset (None: reset at once).
        seconds: the hold time of a delay.
        rate: bytes per second of a drip.
        xor: the mask a corrupt applies.
    """

    kind: str
    direction: Direction
    offset: int | None = None
    seconds: float = 0.0
    rate: float = 0.0
    xor: int = 0


@attrs.frozen
class _Schedule:
    """A plan seen from one direction: what happens at which offset."""

    cut_at: int | None
    stall_at: int | None
    reset_at: int | None
    corrupt: Mapping[int, int]
    delay: float
    rate: float | None

    def action_at(self, offset: int) -> str | None:
        for action, at in (
            ("reset", self.reset_at),
            ("cut", self.cut_at),
            ("stall", self.stall_at),
        ):
            if at is not None and offset >= at:
                return action
        return None

    def room(self, offset: int) -> int | None:
        """Bytes that may pass before the next cut / stall / reset boundary (None: unlimited)."""
        boundaries = (self.cut_at, self.stall_at, self.reset_at)
        ahead = [at - offset for at in boundaries if at is not None and at > offset]
        return min(ahead) if ahead else None

    def corrupted(self, data: bytes | bytearray, offset: int) -> bytes:
        if not self.corrupt:
            return bytes(data)
        out = bytearray(data)
        for at, mask in self.corrupt.items():
            if offset <= at < offset + len(out):
                out[at - offset] ^= mask
        return bytes(out)


class FaultPlan:
    """The faults of one connection, built with chainable methods.

    Example::

        FaultPlan().corrupt(12, "up").stall(4096, "down")
    """

    def __init__(self) -> None:
        self._faults: list[Fault] = []

    @property
    def faults(self) -> tuple[Fault, ...]:
        """The faults added so far, in order."""
        return tuple(self._faults)

    def _add(self, fault: Fault) -> FaultPlan:
        if fault.direction not in _DIRECTIONS:
            raise ConfigError(
                f"{fault.kind}: direction must be one of {_DIRECTIONS}, got {fault.direction!r}"
            )
        self._faults.append(fault)
        return self

    @staticmethod
    def _offset(kind: str, value: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{kind}: expected a byte offset int >= 0, got {value!r}")
        return value

    def cut(self, after_bytes: int, direction: Direction) -> FaultPlan:
        """Once ``after_bytes`` passed in ``direction``, close both sides gracefully (FIN)."""
        return self._add(Fault("cut", direction, self._offset("cut", after_bytes)))

    def stall(self, after_bytes: int, direction: Direction) -> FaultPlan:
        """After ``after_bytes``, forward nothing more in ``direction``; the connection stays open.

        The stalled side is no longer read, so its writer eventually blocks on a full window.
        """
        return self._add(Fault("stall", direction, self._offset("stall", after_bytes)))

    def corrupt(self, at_byte: int, direction: Direction, *, xor: int = 0xFF) -> FaultPlan:
        """XOR the byte at offset ``at_byte`` of ``direction`` with ``xor`` (1..255)."""
        if isinstance(xor, bool) or not isinstance(xor, int) or not 1 <= xor <= 0xFF:
            raise ConfigError(f"corrupt: xor must be an int in 1..255, got {xor!r}")
        return self._add(Fault("corrupt", direction, self._offset("corrupt", at_byte), xor=xor))

    def delay(self, seconds: float, direction: Direction) -> FaultPlan:
        """Hold each chunk ``seconds`` before forwarding it (in order, one chunk at a time)."""
        if not (isinstance(seconds, int | float) and math.isfinite(seconds) and seconds >= 0):
            raise ConfigError(f"delay: expected finite seconds >= 0, got {seconds!r}")
        return self._add(Fault("delay", direction, seconds=float(seconds)))

    def drip(self, bytes_per_second: float, direction: Direction) -> FaultPlan:
        """Forward at most ``bytes_per_second`` in ``direction``, in small timed pieces."""
        rate = bytes_per_second
        if not (isinstance(rate, int | float) and math.isfinite(rate) and rate > 0):
            raise ConfigError(f"drip: expected a finite bytes_per_second > 0, got {rate!r}")
        return self._add(Fault("drip", direction, rate=float(rate)))

    def reset(self, after_bytes: int | None = None, direction: Direction = "both") -> FaultPlan:
        """RST the connection: at once (the default), or once ``after_bytes`` passed."""
        offset = None if after_bytes is None else self._offset("reset", after_bytes)
        return self._add(Fault("reset", direction, offset))

    @property
    def resets_at_once(self) -> bool:
        """Whether the plan resets the connection before any byte passes."""
        return any(f.kind == "reset" and f.offset is None for f in self._faults)

    def schedule(self, direction: Literal["up", "down"]) -> _Schedule:
        """Compile the faults that apply to one direction."""
        mine = [f for f in self._faults if f.direction in (direction, "both")]

        def first(kind: str) -> int | None:
            offsets = [f.offset for f in mine if f.kind == kind and f.offset is not None]
            return min(offsets) if offsets else None

        corrupt: dict[int, int] = {}
        for f in mine:
            if f.kind == "corrupt" and f.offset is not None:
                corrupt[f.offset] = corrupt.get(f.offset, 0) ^ f.xor
        rates = [f.rate for f in mine if f.kind == "drip"]
        return _Schedule(
            cut_at=first("cut"),
            stall_at=first("stall"),
            reset_at=0 if self.resets_at_once else first("reset"),
            corrupt={at: mask for at, mask in corrupt.items() if mask},
            delay=sum(f.seconds for f in mine if f.kind == "delay"),
            rate=min(rates) if rates else None,
        )

    def __repr__(self) -> str:
        return f"FaultPlan({', '.join(f'{f.kind}@{f.offset}:{f.direction}' for f in self._faults)})"
