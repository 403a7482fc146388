"""Every Python code block of README.md and docs/*.rst runs as shown, so no page can drift again.

The rule, for each block (a README ```python block, an rst ``code-block:: python``, and for
``literalinclude``: all the includes of one file on one page, concatenated in page order, since a
page that shows a file in pieces must still show everything the pieces use):

1. it compiles;
2. it is executed as a module in a fresh namespace: its imports run and its functions and
   constants are defined. ``__name__`` is not ``"__main__"``, so a script's
   ``trio.run(main)`` guard does not start a cluster: blocks that need one are whole example
   files, and tests/docs/test_examples.py runs those examples (embedding, CLI cluster,
   chaos tests) for real;
3. every name it reads anywhere, annotations included, is a builtin or is bound in the block
   itself (imported, defined, assigned, a parameter): a reader who copies the block has
   everything it uses.

``>>>`` examples are doctests (tests/docs/test_examples.py); TOML blocks must parse.
"""

from __future__ import annotations

import ast
import builtins
import re
import tomllib
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"

_DIRECTIVE = re.compile(
    r"^\.\. (code-block|code|literalinclude):: *(\S*)\n((?:[ \t]+:[\w-]+:.*\n)*)", re.M)


def _indented_body(text: str, start: int) -> str:
    """The indented block that follows a directive (after its options and one blank line)."""
    lines: list[str] = []
    for line in text[start:].splitlines()[1:]:  # the first is the blank line
        if line.strip() and not line.startswith((" ", "\t")):
            break
        lines.append(line)
    body = "\n".join(lines).rstrip()
    indent = min((len(ln) - len(ln.lstrip()) for ln in lines if ln.strip()), default=0)
    return "\n".join(ln[indent:] for ln in body.splitlines()) + "\n"


def _included(page: Path, target: str, options: str) -> str:
    text = (page.parent / target).resolve().read_text(encoding="utf-8")
    after = re.search(r":start-after: (.*)", options)
    before = re.search(r":end-before: (.*)", options)
    if after:
        text = text.split(after[1].strip(), 1)[1].split("\n", 1)[1]
    if before:
        text = text.split(before[1].strip(), 1)[0]
    return text


def rst_blocks(page: Path) -> list[tuple[str, str, str]]:
    """(label, language, code) of every code block of ``page``, includes grouped by file."""
    text = page.read_text(encoding="utf-8")
    out: list[tuple[str, str, str]] = []
    includes: dict[str, list[str]] = {}
    for m in _DIRECTIVE.finditer(text):
        kind, arg, options = m[1], m[2], m[3]
        if kind == "literalinclude":
            language = re.search(r":language: (\w+)", options)
            if language and language[1] == "python":
                includes.setdefault(arg, []).append(_included(page, arg, options))
            continue
        out.append((f"{page.name}:{text[:m.start()].count(chr(10)) + 1}", arg,
                    _indented_body(text, m.end())))
    for target, pieces in includes.items():
        out.append((f"{page.name}:{target}", "python", "\n\n".join(pieces)))
    return out


def readme_blocks() -> list[tuple[str, str, str]]:
    text = README.read_text(encoding="utf-8")
    return [(f"README.md:{text[:m.start()].count(chr(10)) + 1}", m[1], m[2])
            for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)]


ALL_BLOCKS = readme_blocks() + [b for page in sorted(DOCS.glob("*.rst")) for b in rst_blocks(page)]
PYTHON = [b for b in ALL_BLOCKS if b[1] == "python"]


def unbound_names(code: str) -> set[str]:
    """Names the code reads that it never binds (and that are not builtins)."""
    tree = ast.parse(code)
    read: set[str] = set()
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return read - bound - set(dir(builtins))


def test_the_pages_have_python_blocks_to_check() -> None:
    labels = [label for label, _, _ in PYTHON]
    assert any(label.startswith("README.md") for label in labels)
    assert {"embedding.rst:../examples/embedding.py",
            "chaos.rst:../examples/test_chaos_example.py"} <= set(labels)


@pytest.mark.parametrize(("label", "code"), [(b[0], b[2]) for b in PYTHON],
                         ids=[b[0] for b in PYTHON])
def test_every_python_block_imports_what_it_uses_and_runs(label: str, code: str) -> None:
    assert unbound_names(code) == set(), f"{label} uses names it does not import or define"
    module = types.ModuleType("docblock_" + re.sub(r"\W", "_", label))
    exec(compile(code, label, "exec"), module.__dict__)  # the docs' own code


@pytest.mark.parametrize(("label", "code"), [(b[0], b[2]) for b in ALL_BLOCKS if b[1] == "toml"],
                         ids=[b[0] for b in ALL_BLOCKS if b[1] == "toml"])
def test_every_toml_block_parses(label: str, code: str) -> None:
    tomllib.loads(code)


def test_the_name_check_catches_a_snippet_without_its_imports() -> None:
    snippet = ("async def f(coord: ft.Coordinator) -> None:\n"
               "    await coord.broadcast_control(SyncNow())\n")
    assert unbound_names(snippet) == {"ft", "SyncNow"}
    assert unbound_names("import flodl_trio as ft\nfrom flodl_trio import SyncNow\n"
                         + snippet) == set()
