"""The SVG a rank pushes (``DashboardSetSvg``) is shown on the status page only after an
allow-list rebuild: nothing that runs script or reaches outside the document survives it."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

import flodl_trio as ft

SVG = 'xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink"'

HOSTILE = {
    "script element": f'<svg {SVG}><script>alert(1)</script><rect width="5"/></svg>',
    "script in CDATA": f'<svg {SVG}><script><![CDATA[fetch("http://x")]]></script></svg>',
    "onload": f'<svg {SVG} onload="alert(1)"><rect width="5" onclick="alert(2)"/></svg>',
    "onmouseover upper case": f'<svg {SVG}><rect ONMOUSEOVER="alert(1)" width="5"/></svg>',
    "xlink:href to http": f'<svg {SVG}><use xlink:href="http://evil.example/x.svg#a"/></svg>',
    "href to javascript": f'<svg {SVG}><use href="javascript:alert(1)"/></svg>',
    "image with data url": f'<svg {SVG}><image href="data:image/png;base64,AAAA"/></svg>',
    "a link": f'<svg {SVG}><a href="http://evil.example"><rect width="5"/></a></svg>',
    "foreignObject": (f'<svg {SVG}><foreignObject><body xmlns="http://www.w3.org/1999/xhtml">'
                      '<iframe src="http://evil.example"/></body></foreignObject></svg>'),
    "style url()": f'<svg {SVG}><rect style="fill:url(http://evil.example/a.svg#g)"/></svg>',
    "fill url()": f'<svg {SVG}><rect fill="url(https://evil.example/p#g)" width="5"/></svg>',
    "style element @import": (f'<svg {SVG}><style>@import url(http://evil.example/a.css);'
                              '</style></svg>'),
    "animate rewriting href": (f'<svg {SVG}><use href="#a"><set attributeName="href" '
                               'to="javascript:alert(1)"/></use></svg>'),
    "css escape": f'<svg {SVG}><rect style="fill:u\\72l(http://evil.example)"/></svg>',
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_svg_loses_every_script_handler_and_external_reference(case: str) -> None:
    clean = ft.sanitize_svg(HOSTILE[case])
    lowered = clean.lower()
    for forbidden in ("<script", "alert", "fetch", " on", "http://evil", "https://evil",
                      "javascript:", "data:", "foreignobject", "<iframe", "<style", "@import",
                      "<image", "<a ", "<set", "\\"):
        assert forbidden not in lowered, (case, clean)
    assert ET.fromstring(clean).tag == "{http://www.w3.org/2000/svg}svg"  # still a valid SVG
    if '<rect width="5"' in HOSTILE[case] and "<a " not in HOSTILE[case]:
        assert '<rect width="5">' in clean  # the inert part is kept


def test_benign_svg_keeps_its_shapes_local_references_and_text() -> None:
    source = (f'<svg {SVG} viewBox="0 0 10 10"><defs><linearGradient id="g">'
              '<stop offset="0" stop-color="red"/></linearGradient></defs>'
              '<rect id="r" width="10" height="5" fill="url(#g)" style="stroke:blue;bogus:1"/>'
              '<use xlink:href="#r" y="5"/><text x="1" y="9">loss &lt; 0.5 &amp; falling</text>'
              '</svg>')
    clean = ft.sanitize_svg(source)
    assert 'fill="url(#g)"' in clean
    assert 'style="stroke:blue"' in clean
    assert 'href="#r"' in clean
    assert "loss &lt; 0.5 &amp; falling" in clean
    assert re.search(r"<stop [^>]*stop-color=\"red\"", clean)


def test_matplotlib_style_doctype_is_accepted_but_entities_are_refused() -> None:
    doctype = ('<?xml version="1.0"?><!DOCTYPE svg PUBLIC "-//W3C//DTD SVG 1.1//EN" '
               '"http://www.w3.org/Graphics/SVG/1.1/DTD/svg11.dtd">')
    assert "<rect" in ft.sanitize_svg(doctype + f'<svg {SVG}><!-- c --><rect/></svg>')
    laughs = ('<!DOCTYPE svg [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;">]>'
              f'<svg {SVG}><text>&b;</text></svg>')
    with pytest.raises(ft.SvgRejected, match="DTD"):
        ft.sanitize_svg(laughs)
    external = f'<!DOCTYPE svg [<!ENTITY x SYSTEM "file:///etc/passwd">]><svg {SVG}>&x;</svg>'
    with pytest.raises(ft.SvgRejected, match="DTD"):
        ft.sanitize_svg(external)


@pytest.mark.parametrize(("source", "match"), [
    ("<svg", "not well-formed"),
    ('<html xmlns="http://www.w3.org/1999/xhtml"><script/></html>', "expected an <svg> root"),
    ("<svg><rect/></svg>", "expected an <svg> root"),  # no SVG namespace: not an SVG
    (f"<svg {SVG}>" + "<g>" * 40 + "</g>" * 40 + "</svg>", "deeper than"),
    (f"<svg {SVG}>" + "<rect/>" * 5000 + "</svg>", "more than 4096 elements"),
    (f"<svg {SVG}>" + " " * 70000 + "</svg>", "expected at most 65536"),
])
def test_unusable_svg_is_refused_with_the_reason(source: str, match: str) -> None:
    with pytest.raises(ft.SvgRejected, match=match):
        ft.sanitize_svg(source)
