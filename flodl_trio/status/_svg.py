"""An allow-list SVG sanitiser for what ranks push through ``DashboardSetSvg``.

A rank's SVG is shown on the status page, and the page is served from the coordinator's port, so
the SVG is treated as hostile: it is parsed (no DTD, no entities), and rebuilt from scratch out of
the elements and attributes on the lists below; everything else is dropped, never escaped and kept.
What can run code or reach out is not on the lists: ``script``, ``foreignObject``, ``image``,
``a``, ``style``, the animation elements (they can rewrite ``href``), every ``on*`` attribute, and
every reference that is not a fragment of the same document (``href="#id"``, ``url(#id)``).

The page then shows the result as an ``<img>`` with a ``data:`` URL, where a browser runs no script
and loads nothing, so one missed hole in this list is still not an exploit.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from html import escape
from typing import Final

from .._errors import SvgRejected

__all__ = ["MAX_SVG_BYTES", "sanitize_svg"]

MAX_SVG_BYTES: Final = 65536
_MAX_ELEMENTS: Final = 4096
_MAX_DEPTH: Final = 32
_SVG_NS: Final = "http://www.w3.org/2000/svg"
_XLINK_NS: Final = "http://www.w3.org/1999/xlink"

_ELEMENTS: Final = frozenset({
    "svg", "g", "defs", "title", "desc", "symbol", "use", "path", "rect", "circle", "ellipse",
    "line", "polyline", "polygon", "text", "tspan", "textPath", "linearGradient",
    "radialGradient", "stop", "clipPath", "mask", "pattern", "marker",
})
_ATTRIBUTES: Final = frozenset({
    "id", "class", "x", "y", "x1", "y1", "x2", "y2", "cx", "cy", "r", "rx", "ry", "fx", "fy",
    "width", "height", "d", "points", "viewBox", "preserveAspectRatio", "transform", "fill",
    "fill-opacity", "fill-rule", "stroke", "stroke-width", "stroke-opacity", "stroke-linecap",
    "stroke-linejoin", "stroke-dasharray", "stroke-dashoffset", "stroke-miterlimit", "opacity",
    "clip-path", "clip-rule", "mask", "font-family", "font-size", "font-weight", "font-style",
    "text-anchor", "dominant-baseline", "alignment-baseline", "letter-spacing", "dx", "dy",
    "rotate", "textLength", "lengthAdjust", "offset", "stop-color", "stop-opacity",
    "gradientUnits", "gradientTransform", "spreadMethod", "patternUnits",
    "patternContentUnits", "patternTransform", "clipPathUnits", "maskUnits",
    "maskContentUnits", "markerWidth", "markerHeight", "markerUnits", "refX", "refY", "orient",
    "marker-start", "marker-mid", "marker-end", "visibility", "display", "color",
    "vector-effect", "shape-rendering", "text-rendering", "pathLength", "href", "style",
    "version",
})
# Style properties kept in a style="" attribute; each value must pass _VALUE_OK too.
_STYLE_PROPERTIES: Final = frozenset(a for a in _ATTRIBUTES if a not in {
    "id", "class", "href", "style", "d", "points", "viewBox", "transform", "version"})
_URL: Final = re.compile(r"url\s*\(", re.IGNORECASE)
_LOCAL_URL: Final = re.compile(r"url\(\s*['\"]?#[A-Za-z_][\w.-]*['\"]?\s*\)")
_FORBIDDEN_IN_VALUE: Final = re.compile(r"[\\<>]|@import|expression|javascript:|data:",
                                        re.IGNORECASE)
_PLAIN_DOCTYPE: Final = re.compile(r"<!DOCTYPE[^\[<>]*>", re.IGNORECASE)
_FRAGMENT: Final = re.compile(r"#[A-Za-z_][\w.-]*")


def _local_name(qualified: str) -> tuple[str, str]:
    if qualified.startswith("{"):
        ns, _, name = qualified[1:].partition("}")
        return ns, name
    return "", qualified


def _value_ok(value: str) -> bool:
    """No escapes, no markup, and every ``url(`` points into this document."""
    if _FORBIDDEN_IN_VALUE.search(value):
        return False
    return len(_URL.findall(value)) == len(_LOCAL_URL.findall(value))


def _clean_style(style: str) -> str:
    kept = []
    for declaration in style.split(";"):
        prop, sep, value = declaration.partition(":")
        prop, value = prop.strip().lower(), value.strip()
        if sep and prop in _STYLE_PROPERTIES and value and _value_ok(value):
            kept.append(f"{prop}:{value}")
    return ";".join(kept)


def _clean_attributes(element: ET.Element) -> list[tuple[str, str]]:
    out = []
    for qualified, value in element.attrib.items():
        ns, name = _local_name(qualified)
        if ns not in ("", _XLINK_NS) or (ns == _XLINK_NS and name != "href"):
            continue
        if name not in _ATTRIBUTES:
            continue  # on*, and everything not known to be inert
        if name == "href":
            if not _FRAGMENT.fullmatch(value.strip()):
                continue  # only references into this document
            value = value.strip()
        elif name == "style":
            value = _clean_style(value)
            if not value:
                continue
        elif not _value_ok(value):
            continue
        out.append((name, value))
    return out


def _write(element: ET.Element, out: list[str], depth: int, budget: list[int]) -> None:
    ns, name = _local_name(element.tag) if isinstance(element.tag, str) else ("?", "")
    if ns != _SVG_NS or name not in _ELEMENTS:
        return  # dropped with its whole subtree (text included)
    if depth > _MAX_DEPTH:
        raise SvgRejected(f"SVG nested deeper than {_MAX_DEPTH} elements")
    budget[0] -= 1
    if budget[0] < 0:
        raise SvgRejected(f"SVG has more than {_MAX_ELEMENTS} elements")
    attrs = "".join(f' {n}="{escape(v, quote=True)}"' for n, v in _clean_attributes(element))
    if depth == 0:
        attrs = f' xmlns="{_SVG_NS}"' + attrs
    out.append(f"<{name}{attrs}>")
    if element.text:
        out.append(escape(element.text, quote=False))
    for child in element:
        _write(child, out, depth + 1, budget)
        if child.tail:
            out.append(escape(child.tail, quote=False))
    out.append(f"</{name}>")


def sanitize_svg(text: str, *, max_bytes: int = MAX_SVG_BYTES) -> str:
    """Rebuild ``text`` keeping only inert SVG: allow-listed elements and attributes, local
    references only.

    Args:
        text: the SVG as a rank sent it.
        max_bytes: the largest input accepted (UTF-8).

    Returns:
        A standalone ``<svg xmlns=...>`` document that runs nothing and references nothing
        outside itself.

    Raises:
        SvgRejected: it is too large, not well-formed XML, declares a DTD or entities, its root
            is not an SVG ``<svg>`` element, or it is too deep or has too many elements.
    """
    size = len(text.encode("utf-8", errors="replace"))
    if size > max_bytes:
        raise SvgRejected(f"SVG of {size} bytes: expected at most {max_bytes}")
    # matplotlib writes a plain <!DOCTYPE svg PUBLIC ...>; an internal subset could declare
    # entities (billion laughs, external files), and SVG needs none: it is refused.
    text = _PLAIN_DOCTYPE.sub("", text, count=1)
    if re.search(r"<!(DOCTYPE|ENTITY|ELEMENT|ATTLIST|NOTATION)", text, re.IGNORECASE):
        raise SvgRejected("SVG with a DTD declaring entities or elements: expected none")
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise SvgRejected(f"SVG is not well-formed XML: {exc}") from None
    if root.tag != f"{{{_SVG_NS}}}svg":
        raise SvgRejected(f"expected an <svg> root in the SVG namespace, got {root.tag!r}")
    out: list[str] = []
    _write(root, out, 0, [_MAX_ELEMENTS])
    return "".join(out)
