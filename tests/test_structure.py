"""The package's shape: no module reaches into another object's underscored attributes, and no
two modules import each other (directly or round a longer cycle).

The rules are those of the project's structure check: ``name._attr`` where ``name`` is not
``self`` or ``cls`` (dunders allowed) is a private reach; every ``import``/``from ... import`` of a
``flodl_trio`` module counts as an edge (``TYPE_CHECKING`` imports and imports inside functions
included), except a package importing its own submodules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import flodl_trio

ROOT = Path(flodl_trio.__file__).parent
PKG = ROOT.name


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def parsed_modules() -> dict[str, tuple[Path, ast.Module]]:
    return {module_name(p): (p, ast.parse(p.read_text(encoding="utf-8")))
            for p in sorted(ROOT.rglob("*.py"))}


def private_reaches(tree: ast.Module) -> list[str]:
    return [
        f"line {node.lineno}: {node.value.id}.{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr.startswith("_")
        and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
        and node.value.id not in ("self", "cls")
    ]


def imported(mod: str, path: Path, tree: ast.Module) -> set[str]:
    deps: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith(PKG):
                deps.add(target)
                deps.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            deps.update(a.name for a in node.names if a.name.startswith(PKG))
    return deps


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    cycles.append(sorted(comp))
    return cycles


def module_graph() -> dict[str, set[str]]:
    modules = parsed_modules()
    graph: dict[str, set[str]] = {}
    for mod, (path, tree) in modules.items():
        deps = {d for d in imported(mod, path, tree) if d in modules and d != mod}
        # A package re-exporting its own submodules is not a cycle worth reporting.
        graph[mod] = {d for d in deps if not d.startswith(mod + ".")}
    return graph


def test_no_module_reaches_into_another_objects_underscored_attributes() -> None:
    found = {
        str(path.relative_to(ROOT.parent)): reaches
        for path, tree in parsed_modules().values()
        if (reaches := private_reaches(tree))
    }
    assert found == {}


def test_no_import_cycle_between_the_packages_modules() -> None:
    assert import_cycles(module_graph()) == []


def test_the_checks_see_a_reach_and_a_cycle_when_there_is_one() -> None:
    tree = ast.parse("def f(coord):\n    return coord._phase, self._ok, coord.__dict__\n")
    assert private_reaches(tree) == ["line 2: coord._phase"]
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
    # The package's real graph is walked: the coordinator's modules are in it.
    graph = module_graph()
    assert "flodl_trio.coordinator._roster" in graph["flodl_trio.coordinator.formation"]


# ------------------------------------------------------------------------- the tests' own shape

TESTS = Path(__file__).parent
# Test files that stay at the top of tests/: they are about the package as a whole.
TOP_LEVEL_TESTS = {"test_structure.py"}


def packages_without_tests(tests: Path, packages: set[str]) -> list[str]:
    return sorted(name for name in packages if not list((tests / name).glob("test_*.py")))


def loose_test_files(tests: Path) -> list[str]:
    return sorted(p.name for p in tests.glob("test_*.py") if p.name not in TOP_LEVEL_TESTS)


def imports_of_test_modules(tree: ast.Module) -> list[str]:
    """The test modules (``test_*``) that ``tree`` imports, as written."""
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names]
    names += [("." * node.level) + (node.module or "") for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom)]
    return [n for n in names if any(part.startswith("test_") for part in n.split("."))]


def same_named_test_files(tests: Path) -> dict[str, list[str]]:
    seen: dict[str, list[str]] = {}
    for path in sorted(tests.rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(tests)))
    return {name: paths for name, paths in seen.items() if len(paths) > 1}


def test_tests_have_a_folder_per_package_and_no_loose_test_files() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert "relay" in packages and "wire" in packages
    assert packages_without_tests(TESTS, packages) == []
    assert loose_test_files(TESTS) == []


def test_no_test_module_imports_another() -> None:
    """Shared set-ups live in tests/helpers/ or in a folder's conftest.py fixtures."""
    found = {
        str(path.relative_to(TESTS)): imports
        for path in sorted(TESTS.rglob("*.py"))
        if (imports := imports_of_test_modules(ast.parse(path.read_text(encoding="utf-8"))))
    }
    assert found == {}


def test_test_file_names_are_unique_across_the_folders() -> None:
    """The folders have no ``__init__.py`` (pytest imports each test file by its base name), so
    of two files of one name in two folders, the second would fail to import."""
    assert same_named_test_files(TESTS) == {}


def test_the_tests_shape_checks_see_what_they_forbid(tmp_path: Path) -> None:
    (tmp_path / "wire").mkdir()
    (tmp_path / "relay").mkdir()
    for name in ("test_structure.py", "test_loose.py", "wire/test_frames.py",
                 "relay/test_frames.py"):
        (tmp_path / name).write_text("")
    assert packages_without_tests(tmp_path, {"wire", "relay", "store"}) == ["store"]
    assert loose_test_files(tmp_path) == ["test_loose.py"]
    assert same_named_test_files(tmp_path) == {
        "test_frames.py": ["relay/test_frames.py", "wire/test_frames.py"]}
    tree = ast.parse("import test_board\nfrom test_http import get\nfrom .test_x import y\n"
                     "from helpers.http import get\nimport trio\n")
    assert imports_of_test_modules(tree) == ["test_board", "test_http", ".test_x"]
