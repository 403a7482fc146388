"""The field types of FT/2 payloads (SPEC §2.7): one ``Spec`` per wire type.

``load`` is strict (decoding: the exact CBOR type, in range) and names the field that failed;
``coerce`` is for user construction (an ``int`` for a float field becomes a float; on the wire an
int there is a ``WireError``); ``dump`` gives the value cbor2 encodes.
"""

from __future__ import annotations

import enum
import math
from typing import Any

from .._errors import WireError

F32_MAX = 3.4028234663852886e38  # the largest finite f32


class Mismatch(Exception):
    """Raised by a generated fast loader on the first invalid item; never escapes the codec.

    Its catcher re-runs the labelled reference path, which raises the precise ``WireError``.
    """


def describe(value: Any) -> str:
    """A short, safe description of an arriving value for error messages."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def check_utf8(text: str, where: str, label: str) -> None:
    """Refuse a str that has no UTF-8 encoding at construction, not in ``encode`` much later.

    A lone surrogate (``"\\udc80"``, e.g. from ``os.fsdecode`` of a name that is not UTF-8) is a
    valid Python str that cbor2 cannot encode.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise WireError(
            f"{where}: expected {label}, got a str that is not valid UTF-8 ({exc.reason} at "
            f"index {exc.start})"
        ) from None


class Spec:
    """One wire type. ``load`` is strict (decoding); ``coerce`` is for user construction."""

    label: str = "?"
    plain: bool = True  # encodes as itself

    def load(self, value: Any, where: str) -> Any:
        raise NotImplementedError

    def coerce(self, value: Any, where: str) -> Any:
        return self.load(value, where)

    def dump(self, value: Any) -> Any:
        return value

    def fail(self, value: Any, where: str) -> WireError:
        return WireError(f"{where}: expected {self.label}, got {describe(value)}")


class UInt(Spec):
    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.limit = 1 << bits
        self.label = f"u{bits}"

    def load(self, value: Any, where: str) -> Any:
        if type(value) is not int or not 0 <= value < self.limit:
            if isinstance(value, enum.IntEnum):
                return self.load(int(value), where)
            raise self.fail(value, where)
        return value


class Float(Spec):
    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.label = f"f{bits}"

    def load(self, value: Any, where: str) -> Any:
        if type(value) is not float:
            raise self.fail(value, where)
        if self.bits == 32 and math.isfinite(value) and abs(value) > F32_MAX:
            raise WireError(f"{where}: expected f32, got {value!r} (out of f32 range)")
        return value

    def coerce(self, value: Any, where: str) -> Any:
        if type(value) is int:
            value = float(value)
        return self.load(value, where)


class Bool(Spec):
    label = "bool"

    def load(self, value: Any, where: str) -> Any:
        if type(value) is not bool:
            raise self.fail(value, where)
        return value


class Text(Spec):
    def __init__(self, min_bytes: int = 0, max_bytes: int | None = None) -> None:
        self.min_bytes = min_bytes
        self.max_bytes = max_bytes
        self.label = "str" if max_bytes is None else f"str of {min_bytes}-{max_bytes} UTF-8 bytes"

    def load(self, value: Any, where: str) -> Any:
        if type(value) is not str:
            raise self.fail(value, where)
        if self.min_bytes or self.max_bytes is not None:
            n = len(value.encode("utf-8", "surrogatepass"))
            if n < self.min_bytes or (self.max_bytes is not None and n > self.max_bytes):
                raise WireError(f"{where}: expected {self.label}, got {n} bytes")
        return value

    def coerce(self, value: Any, where: str) -> Any:
        if type(value) is str:
            check_utf8(value, where, self.label)
        return self.load(value, where)


class Blob(Spec):
    def __init__(self, length: int | None = None) -> None:
        self.length = length
        self.label = "bytes" if length is None else f"bytes({length})"

    def load(self, value: Any, where: str) -> Any:
        if type(value) is not bytes:
            raise self.fail(value, where)
        if self.length is not None and len(value) != self.length:
            raise WireError(f"{where}: expected {self.label}, got {len(value)} bytes")
        return value

    def coerce(self, value: Any, where: str) -> Any:
        if isinstance(value, bytearray | memoryview):
            value = bytes(value)
        return self.load(value, where)


class Opt(Spec):
    def __init__(self, inner: Spec) -> None:
        self.inner = inner
        self.label = f"null or {inner.label}"
        self.plain = inner.plain

    def load(self, value: Any, where: str) -> Any:
        return None if value is None else self.inner.load(value, where)

    def coerce(self, value: Any, where: str) -> Any:
        return None if value is None else self.inner.coerce(value, where)

    def dump(self, value: Any) -> Any:
        return None if value is None else self.inner.dump(value)


class Seq(Spec):
    """``list[T]`` on the wire, a tuple in Python."""

    plain = False

    def __init__(self, inner: Spec) -> None:
        self.inner = inner
        self.label = f"list[{inner.label}]"

    def load(self, value: Any, where: str) -> Any:
        if type(value) is not list:
            raise self.fail(value, where)
        load = self.inner.load
        return tuple([load(v, f"{where}[{i}]") for i, v in enumerate(value)])

    def coerce(self, value: Any, where: str) -> Any:
        if not isinstance(value, list | tuple):
            raise self.fail(value, where)
        coerce = self.inner.coerce
        return tuple([coerce(v, f"{where}[{i}]") for i, v in enumerate(value)])

    def dump(self, value: Any) -> Any:
        if self.inner.plain:
            return value
        dump = self.inner.dump
        return [dump(v) for v in value]


class Pair(Spec):
    """A fixed-arity array of heterogeneous items (``[f64 sum, u64 count]``), a tuple in Python."""

    plain = False

    def __init__(self, *items: Spec) -> None:
        self.items = items
        self.label = "[" + ", ".join(s.label for s in items) + "]"

    def _check(self, value: Any, where: str, kinds: tuple[type[Any], ...]) -> None:
        if not isinstance(value, kinds) or len(value) != len(self.items):
            raise self.fail(value, where)

    def load(self, value: Any, where: str) -> Any:
        self._check(value, where, (list,))
        pairs = zip(self.items, value, strict=True)
        return tuple(s.load(v, f"{where}[{i}]") for i, (s, v) in enumerate(pairs))

    def coerce(self, value: Any, where: str) -> Any:
        self._check(value, where, (list, tuple))
        pairs = zip(self.items, value, strict=True)
        return tuple(s.coerce(v, f"{where}[{i}]") for i, (s, v) in enumerate(pairs))

    def dump(self, value: Any) -> Any:
        return [s.dump(v) for s, v in zip(self.items, value, strict=True)]


class TextMap(Spec):
    """``map[str, T]``: a dict with text keys."""

    def __init__(self, inner: Spec) -> None:
        self.inner = inner
        self.label = f"map[str, {inner.label}]"
        self.plain = inner.plain

    def load(self, value: Any, where: str) -> Any:
        if type(value) is not dict:
            raise self.fail(value, where)
        out = {}
        for k, v in value.items():
            if type(k) is not str:
                raise WireError(f"{where}: expected text map keys, got key {describe(k)}")
            out[k] = self.inner.load(v, f"{where}[{k!r}]")
        return out

    def coerce(self, value: Any, where: str) -> Any:
        if not isinstance(value, dict):
            raise self.fail(value, where)
        out = {}
        for k, v in value.items():
            if type(k) is not str:
                raise WireError(f"{where}: expected text map keys, got key {describe(k)}")
            check_utf8(k, f"{where} key {k!r}", "text map keys")
            out[k] = self.inner.coerce(v, f"{where}[{k!r}]")
        return out

    def dump(self, value: Any) -> Any:
        if self.inner.plain:
            return value
        return {k: self.inner.dump(v) for k, v in value.items()}


class EnumSpec(Spec):
    def __init__(self, cls: type[enum.IntEnum], bits: int, fallback: enum.IntEnum | None) -> None:
        self.cls = cls
        self.uint = UInt(bits)
        self.fallback = fallback
        self.label = f"{cls.__name__} (u{bits})"
        self.plain = False

    def load(self, value: Any, where: str) -> Any:
        raw = self.uint.load(value, where)
        try:
            return self.cls(raw)
        except ValueError:
            if self.fallback is not None:
                return self.fallback
            known = ", ".join(f"{m.name}={m.value}" for m in self.cls)
            raise WireError(
                f"{where}: expected a {self.cls.__name__} ({known}), got {raw}"
            ) from None

    def coerce(self, value: Any, where: str) -> Any:
        if isinstance(value, self.cls):
            return value
        return self.load(value, where)

    def dump(self, value: Any) -> Any:
        return int(value)
