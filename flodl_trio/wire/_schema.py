"""Message classes, families of variants, and how annotations map to wire types.

A message class is an attrs frozen class whose annotations say the wire type of each field
(``rank: U64``, ``lr: F64``, ``error: str | None``). From those annotations ``spec_of`` derives,
once per class, the field specs (``_specs``): a strict converter for decoding and a lenient one for
user construction (an ``int`` passed for a float field becomes a float; on the wire an int there
is a ``WireError``). The spec walk here is the labelled reference path; ``_codegen`` generates the
fast per-class loaders that run first and fall back to it to name the failing field.
"""

from __future__ import annotations

import enum
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Union

from .._errors import WireError
from ._specs import (
    Blob,
    Bool,
    EnumSpec,
    Float,
    Mismatch,
    Opt,
    Pair,
    Seq,
    Spec,
    Text,
    TextMap,
    UInt,
    describe,
)


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
        return value.dump_fields()


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
        # index -> generated loader of that variant (filled by _codegen.finalize)
        self.fast: dict[int, Callable[[Any], Any]] = {}

    def register(self, index: int, cls: type[WireMessage]) -> None:
        if index in self.variants:
            raise TypeError(f"{self.name}: index {index} registered twice")
        self.variants[index] = cls

    def load(self, value: Any) -> WireMessage:
        """Strictly convert a decoded CBOR array into its variant.

        Raises:
            WireError: naming the family or the variant and field, what was expected and what
                arrived.
        """
        if type(value) is list and value:
            index = value[0]
            # type() is int, not ==: 1.0 and True hash and compare equal to 1.
            if type(index) is int:
                fast = self.fast.get(index)
                if fast is not None:
                    try:
                        msg: WireMessage = fast(value)
                        return msg
                    except Mismatch:
                        pass  # the reference path below names the field that failed
        return self.load_labelled(value)

    def load_labelled(self, value: Any) -> WireMessage:
        """The reference path of :meth:`load`: slower, and names what failed."""
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
    """Base of every wire message and nested struct; subclasses are attrs frozen classes.

    ``_codegen.finalize`` fills the class variables below and replaces ``to_wire`` and
    ``dump_fields`` by generated per-class functions; the definitions here are the reference.
    """

    __slots__ = ()
    _family: ClassVar[Family | None] = None
    _index: ClassVar[int] = -1
    _fields: ClassVar[tuple[tuple[str, Spec], ...]] = ()
    _fast_load: ClassVar[Callable[[Any], Any]]
    _loader_source: ClassVar[str] = ""

    def __attrs_post_init__(self) -> None:
        name = type(self).__name__
        for field, spec in type(self)._fields:
            value = getattr(self, field)
            fixed = spec.coerce(value, f"{name}.{field}")
            if fixed is not value:
                object.__setattr__(self, field, fixed)

    @classmethod
    def strict_load(cls, value: Any, where: str) -> Any:
        """A plain struct from its decoded CBOR array: the fast loader, else the labelled path."""
        try:
            return cls._fast_load(value)
        except Mismatch:
            return cls._load_fields(value, where)

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
        # checked strictly.
        inst = object.__new__(cls)
        for (field, spec), item in zip(fields, value[offset:], strict=True):
            object.__setattr__(inst, field, spec.load(item, f"{where}.{field}"))
        return inst

    def dump_fields(self) -> list[Any]:
        return [spec.dump(getattr(self, f)) if not spec.plain else getattr(self, f)
                for f, spec in type(self)._fields]

    def to_wire(self) -> list[Any]:
        body = self.dump_fields()
        if self._family is None:
            return body
        return [self._index, *body]


def wire_enum(bits: int, fallback: str | None = None) -> Callable[[type[Any]], type[Any]]:
    """Give an IntEnum its wire width and the member an unknown value decodes to (default:
    32 bits, an unknown value is an error). Apply above the enum class."""

    def apply(cls: type[Any]) -> type[Any]:
        setattr(cls, "_wire_bits", bits)  # noqa: B010 - an enum body would make it a member
        if fallback is not None:
            setattr(cls, "_wire_fallback", cls[fallback])  # noqa: B010
        return cls

    return apply


def variant(family: Family, index: int) -> Callable[[type[Any]], type[Any]]:
    """Register an attrs class as variant ``index`` of ``family`` (apply above attrs)."""

    def register(cls: type[Any]) -> type[Any]:
        cls._family = family
        cls._index = index
        family.register(index, cls)
        return cls

    return register
