"""Sphinx configuration of the flodl-trio documentation (``./scripts/docs`` builds it)."""

from __future__ import annotations

import os
import re
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
# Only a member the current module really documents counts as met: autodoc asks about the
# imports of a module without __all__ (flodl_trio.rank imports Heartbeat, Shutdown, ...) before
# it drops them, and counting those left every such message class out of the reference.
_documented: set[tuple[str, str]] = set()


def _skip_reexports(app: object, what: str, name: str, obj: object, skip: bool,
                    options: object) -> bool | None:
    if what != "module" or skip:
        return None
    key = (getattr(obj, "__module__", "") or "", getattr(obj, "__qualname__", name))
    if not key[0] or not isinstance(obj, type) and not callable(obj):
        return None
    module_name = app.env.temp_data.get("autodoc:module", "")  # type: ignore[attr-defined]
    module = sys.modules.get(module_name)
    public = getattr(module, "__all__", None)
    if public is None and key[0] != module_name:
        return None  # an import of a module without __all__: autodoc leaves it out
    if key in _documented:
        return True
    _documented.add(key)
    return None


def _drop_type_docstrings(app: object, what: str, name: str, obj: object, options: object,
                          lines: list[str]) -> None:
    # A constant has no docstring of its own, and autodoc would print its type's instead (int's
    # "int([x]) -> integer ..." under PROTOCOL_VERSION); api.rst describes each constant.
    type_doc = type(obj).__doc__
    if what in ("data", "attribute") and isinstance(type_doc, str) and \
            " ".join(" ".join(lines).split()) == " ".join(type_doc.split()):
        lines.clear()


# "(SPEC §7)": the specification the code was written from is not part of the repository, so a
# reader of these pages could not follow the reference; the pages link their own instead.
_SPEC_REFERENCE = re.compile(r"(?: \(SPEC §[\d.]+\)|, SPEC §[\d.]+(?=\)))")


def _drop_spec_references(app: object, what: str, name: str, obj: object, options: object,
                          lines: list[str]) -> None:
    lines[:] = [_SPEC_REFERENCE.sub("", line) for line in lines]


def setup(app: object) -> None:
    app.connect("autodoc-process-docstring", _drop_spec_references)  # type: ignore[attr-defined]
    app.connect("autodoc-skip-member", _skip_reexports)  # type: ignore[attr-defined]
    app.connect("autodoc-process-docstring", _drop_type_docstrings)  # type: ignore[attr-defined]
