"""Field types of the CBOR payloads and the machinery that encodes and strictly decodes them.

A message class is an attrs frozen class whose annotations say the wire type of each field
(``rank: U64``, ``lr: F64``, ``error: str | None``). From those annotations this module
derives, once per class, a strict converter for decoding and a lenient one for user
construction (an ``int`` passed for a float field becomes a float; on the wire an int there is a
``WireError``).
"""

from __future__ import annotations

import enum
import io
import math
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Union

import attrs
import cbor2

from .._errors import WireError

MAX_DEPTH = 16


def describe(value: Any) -> str:
    """A short, safe description of an arriving value for error messages."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


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
        if self.bits == 32 and math.isfinite(value) and abs(value) > 3.4028234663852886e38:
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


class StructSpec(Spec):
    """A nested plain struct (``EpochPlan``, ``EpochMetrics``, ...)."""

    plain = False

    def __init__(self, cls: type[WireMessage]) -> None:
        self.cls = cls
        self.label = cls.__name__

    def load(self, value: Any, where: str) -> Any:
        return self.cls._load_fields(value, where)

    def coerce(self, value: Any, where: str) -> Any:
        if isinstance(value, self.cls):
            return value
        if isinstance(value, list | tuple):
            return self.cls(*value)
        raise self.fail(value, where)

    def dump(self, value: Any) -> Any:
        return value._dump_fields()


class WireType:
    """Metadata for ``Annotated``: how an int/float/str/bytes field looks on the wire."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec


U64 = Annotated[int, WireType(UInt(64))]
U32 = Annotated[int, WireType(UInt(32))]
U16 = Annotated[int, WireType(UInt(16))]
U8 = Annotated[int, WireType(UInt(8))]
F64 = Annotated[float, WireType(Float(64))]
F32 = Annotated[float, WireType(Float(32))]
Nonce = Annotated[bytes, WireType(Blob(16))]
HostName = Annotated[str, WireType(Text(1, 255))]

_BASE_SPECS: dict[Any, Spec] = {bool: Bool(), str: Text(), bytes: Blob()}


def spec_of(tp: Any) -> Spec:
    """The wire spec of a resolved annotation."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        for meta in tp.__metadata__:
            if isinstance(meta, WireType):
                return meta.spec
        return spec_of(typing.get_args(tp)[0])
    if origin in (Union, types.UnionType):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(members) == 1 and len(typing.get_args(tp)) == 2:
            return Opt(spec_of(members[0]))
    if origin is tuple:
        items = typing.get_args(tp)
        if len(items) == 2 and items[1] is Ellipsis:
            return Seq(spec_of(items[0]))
        return Pair(*(spec_of(a) for a in items))
    if origin is dict:
        key, val = typing.get_args(tp)
        if key is str:
            return TextMap(spec_of(val))
    if isinstance(tp, type):
        if issubclass(tp, enum.IntEnum):
            bits = getattr(tp, "_wire_bits", 32)
            return EnumSpec(tp, bits, getattr(tp, "_wire_fallback", None))
        if issubclass(tp, WireMessage):
            return StructSpec(tp)
        if tp in _BASE_SPECS:
            return _BASE_SPECS[tp]
    raise TypeError(f"no wire type for annotation {tp!r}")


class Family:
    """A CBOR enum: the variants of ControlMsg, TimingMsg or RelayControlMsg by index."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.variants: dict[int, type[WireMessage]] = {}

    def register(self, index: int, cls: type[WireMessage]) -> None:
        if index in self.variants:
            raise TypeError(f"{self.name}: index {index} registered twice")
        self.variants[index] = cls

    def load(self, value: Any) -> WireMessage:
        if type(value) is not list or not value:
            raise WireError(f"{self.name}: expected an array [variant_index, ...], got "
                            f"{describe(value)}")
        index = value[0]
        if type(index) is not int:
            raise WireError(f"{self.name}: expected an integer variant index, got "
                            f"{describe(index)}")
        cls = self.variants.get(index)
        if cls is None:
            raise WireError(f"{self.name}: unknown variant index {index} (known 0-"
                            f"{max(self.variants)})")
        msg: WireMessage = cls._load_fields(value, cls.__name__, offset=1)
        return msg


class WireMessage:
    """Base of every wire message and nested struct; subclasses are attrs frozen classes."""

    __slots__ = ()
    _family: ClassVar[Family | None] = None
    _index: ClassVar[int] = -1
    _fields: ClassVar[tuple[tuple[str, Spec], ...]] = ()

    def __attrs_post_init__(self) -> None:
        name = type(self).__name__
        for field, spec in type(self)._fields:
            value = getattr(self, field)
            fixed = spec.coerce(value, f"{name}.{field}")
            if fixed is not value:
                object.__setattr__(self, field, fixed)

    @classmethod
    def _load_fields(cls, value: Any, where: str, offset: int = 0) -> Any:
        fields = cls._fields
        if type(value) is not list or len(value) != len(fields) + offset:
            n = len(value) - offset if type(value) is list else None
            raise WireError(
                f"{where}: expected an array of {len(fields)} field(s), got "
                + (f"{n}" if n is not None else describe(value))
            )
        # Build without re-running the lenient construction checks: every field was just
        # checked strictly, and decoding is on the hot path of every frame.
        inst = object.__new__(cls)
        for (field, spec), item in zip(fields, value[offset:], strict=True):
            object.__setattr__(inst, field, spec.load(item, f"{where}.{field}"))
        return inst

    def _dump_fields(self) -> list[Any]:
        return [spec.dump(getattr(self, f)) if not spec.plain else getattr(self, f)
                for f, spec in type(self)._fields]

    def _to_wire(self) -> list[Any]:
        body = self._dump_fields()
        if self._family is None:
            return body
        return [self._index, *body]


def finalize(classes: list[type[WireMessage]]) -> None:
    """Derive the field specs of every class from its resolved annotations."""
    for cls in classes:
        hints = typing.get_type_hints(cls, include_extras=True)
        names = [a.name for a in attrs.fields(cls)]  # type: ignore[arg-type]
        cls._fields = tuple((name, spec_of(hints[name])) for name in names)


def variant(family: Family, index: int) -> Callable[[type[Any]], type[Any]]:
    """Register an attrs class as variant ``index`` of ``family`` (apply above attrs)."""

    def register(cls: type[Any]) -> type[Any]:
        cls._family = family
        cls._index = index
        family.register(index, cls)
        return cls

    return register


class _DenyTags(dict[int, Any]):
    """A semantic-decoder table that claims every tag, so cbor2 decodes none natively."""

    def __contains__(self, key: object) -> bool:
        return True

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key]

    def __getitem__(self, key: int) -> Any:
        # cbor2 6.x calls semantic decoders as (value, immutable); accept any signature so
        # the refusal itself never fails with a TypeError that hides the real reason.
        def refuse(*_args: Any) -> Any:
            raise WireError(f"CBOR tag {key} is not allowed in FT/1 payloads")

        return refuse


_DENY_TAGS = _DenyTags()


def _refuse_tag(*args: Any) -> Any:
    # cbor2 6.x calls tag hooks as (tag, immutable), older versions as (decoder, tag).
    tag = next((a for a in args if isinstance(a, cbor2.CBORTag)), None)
    number = "?" if tag is None else tag.tag
    raise WireError(f"CBOR tag {number} is not allowed in FT/1 payloads")


def cbor_loads(data: bytes, what: str) -> Any:
    """Strictly decode exactly one CBOR item.

    Raises:
        WireError: malformed CBOR, tags, indefinite lengths, duplicate map keys, nesting deeper
            than 16, or trailing bytes; the message names ``what`` was being decoded.
    """
    if not isinstance(data, bytes):
        data = bytes(data)
    fp = io.BytesIO(data)
    try:
        value = cbor2.CBORDecoder(
            fp,
            tag_hook=_refuse_tag,
            semantic_decoders=_DENY_TAGS,
            allow_indefinite=False,
            allow_duplicate_keys=False,
            max_depth=MAX_DEPTH,
        ).decode()
    except WireError as exc:
        raise WireError(f"{what}: {exc}") from None
    except (cbor2.CBORError, ValueError, TypeError, OverflowError, RecursionError) as exc:
        cause = exc.__cause__ if isinstance(exc.__cause__, WireError) else exc
        raise WireError(f"{what}: invalid CBOR payload ({cause})") from None
    if fp.tell() != len(data):
        raise WireError(
            f"{what}: expected exactly one CBOR item, got {len(data) - fp.tell()} trailing "
            f"byte(s) after it"
        )
    if isinstance(value, cbor2.CBORSimpleValue) or value is cbor2.undefined:
        raise WireError(f"{what}: expected a CBOR array, got a simple value")
    return value


def cbor_dumps(value: Any) -> bytes:
    return cbor2.dumps(value)
