"""The status page itself: ``board.html``, shipped as package data, served at ``GET /``.

One self-contained file (its style and script inline, no CDN, no build step). The response
carries a Content-Security-Policy that allows exactly that inline script and style (by hash),
images only from ``data:`` URLs and requests only to the same origin: even a hole in the page
or in the SVG sanitiser could not load or run anything else.
"""

from __future__ import annotations

import base64
import hashlib
import re
from functools import cache
from importlib import resources

__all__ = ["page"]


def _hash_source(text: str) -> str:
    digest = hashlib.sha256(text.encode()).digest()
    return "'sha256-" + base64.b64encode(digest).decode() + "'"


@cache
def page() -> tuple[bytes, list[tuple[str, str]]]:
    """The page's bytes and the response headers that go with them."""
    html = resources.files("flodl_trio.status").joinpath("board.html").read_text(encoding="utf-8")
    scripts = re.findall(r"<script>(.*?)</script>", html, re.DOTALL)
    styles = re.findall(r"<style>(.*?)</style>", html, re.DOTALL)
    policy = "; ".join([
        "default-src 'none'",
        "script-src " + " ".join(_hash_source(s) for s in scripts),
        "style-src " + " ".join(_hash_source(s) for s in styles),
        "img-src data:",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ])
    return html.encode(), [
        ("Content-Type", "text/html; charset=utf-8"),
        ("Content-Security-Policy", policy),
        ("X-Content-Type-Options", "nosniff"),
        ("Referrer-Policy", "no-referrer"),
        ("Cache-Control", "no-store"),
    ]
