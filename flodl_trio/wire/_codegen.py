"""Per-class fast loaders and dumpers, generated once from the field specs.

Decoding a frame used to walk the field specs with one ``Spec.load`` call per field and an
error label (``"Batch.rank"``) formatted for every field of every frame, failing or not. Here each
message class gets one generated function that unpacks its array and checks every scalar field
inline (``type(x) is not int or not 0 <= x < 2**64``). The generated code never builds an error
message: on the first mismatch it raises :class:`Mismatch`, and the caller re-decodes the same
value with the labelled reference path (``WireMessage._load_fields``), which names the message,
the field and what arrived. So the two paths must agree on what is valid; the reference path is the
authority (if it accepts a value that the fast path refused, its result is used).

The generated source of a class is kept in ``cls._loader_source`` for reading and debugging, and
is registered with :mod:`linecache` so tracebacks through it show the lines.
"""

from __future__ import annotations

import linecache
import typing
from collections.abc import Callable
from typing import Any

import attrs

from . import _specs as specs
from ._schema import StructSpec, WireMessage, spec_of
from ._specs import F32_MAX, Mismatch, Spec


class _Source:
    """Accumulates the generated functions of one class and the names they refer to."""

    def __init__(self, cls_name: str) -> None:
        self.cls_name = cls_name
        self.ns: dict[str, Any] = {"Mismatch": Mismatch, "_inf": float("inf"), "_F32_MAX": F32_MAX}
        self.blocks: list[str] = []
        self._count = 0

    def name(self, stem: str, value: Any) -> str:
        self._count += 1
        key = f"_{stem}_{self._count}"
        self.ns[key] = value
        return key

    def bad(self, spec: Spec, x: str) -> str | None:
        """An expression that is true when ``x`` is not valid *and returned as is*, or None when
        ``spec`` converts its value (then use :meth:`convert`)."""
        if isinstance(spec, specs.UInt):
            return f"type({x}) is not int or not 0 <= {x} < {spec.limit}"
        if isinstance(spec, specs.Float):
            if spec.bits == 32:
                # nan and ±inf are f32 values; only finite values beyond f32's range are refused.
                return f"type({x}) is not float or (abs({x}) > _F32_MAX and abs({x}) != _inf)"
            return f"type({x}) is not float"
        if isinstance(spec, specs.Bool):
            return f"type({x}) is not bool"
        if isinstance(spec, specs.Text):
            if not spec.min_bytes and spec.max_bytes is None:
                return f"type({x}) is not str"
            size = f"len({x}.encode('utf-8', 'surrogatepass'))"
            upper = "" if spec.max_bytes is None else f" <= {spec.max_bytes}"
            return f"type({x}) is not str or not {spec.min_bytes} <= {size}{upper}"
        if isinstance(spec, specs.Blob):
            if spec.length is None:
                return f"type({x}) is not bytes"
            return f"type({x}) is not bytes or len({x}) != {spec.length}"
        if isinstance(spec, specs.Opt):
            inner = self.bad(spec.inner, x)
            return None if inner is None else f"{x} is not None and ({inner})"
        return None

    def convert(self, spec: Spec, label: str) -> str:
        """The name of a generated function ``f(x) -> value`` that raises Mismatch; ``label``
        (``"Metrics_scalars"``) names it in the source."""
        if isinstance(spec, StructSpec):
            if "_fast_load" not in spec.cls.__dict__:
                _install(spec.cls)  # a nested struct is generated before the classes using it
            return self.name(f"load_{spec.cls.__name__}", spec.cls._fast_load)
        lines: list[str]
        if isinstance(spec, specs.EnumSpec):
            members = self.name(f"{spec.cls.__name__}_members", {int(m): m for m in spec.cls})
            # A value outside the enum goes to the reference path: it applies the fallback
            # member (SaveReason) or raises the error listing the known values.
            lines = [f"    if {self.bad(spec.uint, 'x')}:", "        raise Mismatch",
                     f"    m = {members}.get(x)", "    if m is None:", "        raise Mismatch",
                     "    return m"]  # fmt: skip
        elif isinstance(spec, specs.Opt):
            inner = self.convert(spec.inner, label)
            lines = [f"    return None if x is None else {inner}(x)"]
        elif isinstance(spec, specs.Seq):
            lines = ["    if type(x) is not list:", "        raise Mismatch"]
            bad = self.bad(spec.inner, "e")
            if bad is not None:
                lines += ["    for e in x:", f"        if {bad}:", "            raise Mismatch",
                          "    return tuple(x)"]  # fmt: skip
            else:
                inner = self.convert(spec.inner, f"{label}_item")
                lines += [f"    return tuple([{inner}(e) for e in x])"]
        elif isinstance(spec, specs.Pair):
            names = [f"a{i}" for i in range(len(spec.items))]
            lines = [f"    if type(x) is not list or len(x) != {len(names)}:",
                     "        raise Mismatch", f"    {_targets(names)} = x"]  # fmt: skip
            items = zip(names, spec.items, strict=True)
            lines += self.checks([(n, s, f"{label}_{i}") for i, (n, s) in enumerate(items)])
            lines += [f"    return ({_targets(names)})"]
        elif isinstance(spec, specs.TextMap):
            lines = ["    if type(x) is not dict:", "        raise Mismatch"]
            bad = self.bad(spec.inner, "e")
            if bad is not None:
                lines += ["    for k, e in x.items():",
                          f"        if type(k) is not str or {bad}:", "            raise Mismatch",
                          "    return x"]  # fmt: skip
            else:
                inner = self.convert(spec.inner, f"{label}_value")
                lines += ["    for k in x:", "        if type(k) is not str:",
                          "            raise Mismatch",
                          f"    return {{k: {inner}(e) for k, e in x.items()}}"]  # fmt: skip
        else:
            raise TypeError(f"{self.cls_name}: no fast loader for {type(spec).__name__}")
        return self.function(f"load_{label}", ["x"], lines)

    def checks(self, fields: list[tuple[str, Spec, str]]) -> list[str]:
        """Lines checking (or converting) each local variable of ``(variable, spec, label)``."""
        lines = []
        for var, spec, label in fields:
            bad = self.bad(spec, var)
            if bad is not None:
                lines += [f"    if {bad}:", "        raise Mismatch"]
            else:
                lines += [f"    {var} = {self.convert(spec, label)}({var})"]
        return lines

    def function(self, stem: str, args: list[str], body: list[str]) -> str:
        self._count += 1
        name = f"_{stem}_{self._count}"
        self.blocks.append(f"def {name}({', '.join(args)}):\n" + "\n".join(body) + "\n")
        return name

    def compile(self, entry: str, kind: str) -> tuple[Callable[..., Any], str]:
        source = "\n".join(self.blocks)
        filename = f"<flodl_trio.wire generated {kind} of {self.cls_name}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        exec(compile(source, filename, "exec"), self.ns)  # our own source, built above
        fn: Callable[..., Any] = self.ns[entry]
        return fn, source


def _targets(names: list[str]) -> str:
    """Assignment targets that unpack exactly ``len(names)`` items."""
    return ", ".join(names) + ("," if len(names) == 1 else "")


def build_loader(cls: type[WireMessage], offset: int) -> tuple[Callable[[Any], Any], str]:
    """``load(array) -> instance`` for ``cls``; ``offset`` is 1 when item 0 is a variant index
    (already checked by the family's dispatch)."""
    fields = cls._fields
    src = _Source(cls.__name__)
    src.ns["_new"] = object.__new__
    src.ns["_cls"] = cls
    # Locals are prefixed: a field may be called ``type`` or ``len``.
    names = [f"f_{name}" for name, _ in fields]
    body = [f"    if type(v) is not list or len(v) != {len(fields) + offset}:",
            "        raise Mismatch"]  # fmt: skip
    if fields:
        body += [f"    {_targets(['_'] * offset + names)} = v"]
        body += src.checks([(var, spec, f"{cls.__name__}_{name}")
                            for var, (name, spec) in zip(names, fields, strict=True)])  # fmt: skip
    body += ["    inst = _new(_cls)"]
    for var, (name, _) in zip(names, fields, strict=True):
        # The slot descriptor's __set__ is how a frozen attrs class is filled without __init__.
        slot = next(k.__dict__[name] for k in cls.__mro__ if name in k.__dict__)
        setter = src.name(f"set_{name}", slot.__set__)
        body += [f"    {setter}(inst, {var})"]
    body += ["    return inst"]
    entry = src.function(f"load_{cls.__name__}", ["v"], body)
    return src.compile(entry, "loader")


def build_dumper(cls: type[WireMessage], index: int | None) -> Callable[[Any], list[Any]]:
    """``dump(msg) -> list`` for ``cls``: ``[index, field_1, ...]`` or ``[field_1, ...]``."""
    src = _Source(cls.__name__)
    items = [] if index is None else [str(index)]
    for name, spec in cls._fields:
        if spec.plain or (isinstance(spec, specs.Seq) and spec.inner.plain):  # a tuple is an array
            items.append(f"self.{name}")
        elif isinstance(spec, specs.EnumSpec):
            items.append(f"int(self.{name})")
        else:
            items.append(f"{src.name(f'dump_{name}', spec.dump)}(self.{name})")
    entry = src.function(f"dump_{cls.__name__}", ["self"], [f"    return [{', '.join(items)}]"])
    fn, _ = src.compile(entry, "dumper")
    return fn


def _install(cls: type[WireMessage]) -> None:
    in_family = cls._family is not None
    loader, source = build_loader(cls, offset=1 if in_family else 0)
    cls._fast_load = staticmethod(loader)
    cls._loader_source = source
    dumper = build_dumper(cls, cls._index if in_family else None)
    # Generated methods replace the reference ones (a plain struct's wire form is its fields).
    setattr(cls, "to_wire", dumper)  # noqa: B010 - mypy refuses assigning to a method
    if not in_family:
        setattr(cls, "dump_fields", dumper)  # noqa: B010
    if cls._family is not None:
        cls._family.fast[cls._index] = loader


def finalize(classes: list[type[WireMessage]]) -> None:
    """Derive every class's field specs from its resolved annotations, then generate its fast
    loader and dumper."""
    for cls in classes:
        hints = typing.get_type_hints(cls, include_extras=True)
        names = [a.name for a in attrs.fields(cls)]  # type: ignore[arg-type]
        cls._fields = tuple((name, spec_of(hints[name])) for name in names)
    for cls in classes:
        if "_fast_load" not in cls.__dict__:
            _install(cls)
