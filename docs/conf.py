"""Sphinx configuration of the flodl-trio documentation (``./scripts/docs`` builds it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flodl_trio import __version__  # noqa: E402

project = "flodl-trio"
author = "the flodl-trio authors"
copyright = "2026, the flodl-trio authors"  # noqa: A001
release = __version__
version = __version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
]

# Google-style docstrings (Args: / Returns: / Raises: / Attributes:), as in Trio.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# A class without its own docstring must not borrow its base's (every message class has one).
autodoc_inherit_docstrings = False
autodoc_default_options = {"members": True, "undoc-members": True, "show-inheritance": True}

# Links to Trio's and Python's documentation need their inventories, which need the network.
# CI reaches only package registries, so they are opt-in: FLODL_DOCS_INTERSPHINX=1 fetches them;
# without it no inventory is loaded and references stay plain text (never a warning, so the
# build with -W passes offline).
intersphinx_mapping: dict[str, tuple[str, str | None]] = {}
if os.environ.get("FLODL_DOCS_INTERSPHINX") == "1":
    intersphinx_mapping = {
        "python": ("https://docs.python.org/3", None),
        "trio": ("https://trio.readthedocs.io/en/stable", None),
    }
intersphinx_timeout = 5

templates_path: list[str] = []
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path: list[str] = []
html_theme_options = {"description": "The control plane of a multi-host training cluster, on Trio"}


# A name re-exported by several public modules (flodl_trio.SessionSalt is flodl_trio.wire's,
# scheduler re-exports ReformationError, ...) is documented once, where api.rst first meets it;
# a second description would be a "duplicate object" warning, and -W turns it into an error.
_documented: set[tuple[str, str]] = set()


def _skip_reexports(app: object, what: str, name: str, obj: object, skip: bool,
                    options: object) -> bool | None:
    if what != "module" or skip:
        return None
    key = (getattr(obj, "__module__", "") or "", getattr(obj, "__qualname__", name))
    if not key[0] or not isinstance(obj, type) and not callable(obj):
        return None
    if key in _documented:
        return True
    _documented.add(key)
    return None


def setup(app: object) -> None:
    app.connect("autodoc-skip-member", _skip_reexports)  # type: ignore[attr-defined]
