"""The package's shape: no module reaches into another object's underscored attributes, no
module sets a field of an object another module owns, and no two modules import each other
(directly or round a longer cycle).

The rules are those of the project's structure check: ``name._attr`` where ``name`` is not
``self`` or ``cls`` (dunders allowed) is a private reach; every ``import``/``from ... import`` of a
``flodl_trio`` module counts as an edge (``TYPE_CHECKING`` imports and imports inside functions
included), except a package importing its own submodules.

A field set from outside (issue 36: ``x.attr = ...``, ``x.attr += ...``, ``x.a, x.b = ...``)
is fine only where ``x`` is ``self``/``cls`` or an object of a class the same module defines (a
record it builds). ``x``'s class is what the module can tell from an annotation, ``x =
Class(...)``, ``with Class(...) as x``, ``self.x``'s declaration or a method's return
annotation; where it cannot tell, the field must be one a class of the module declares. Trio's
cancel scopes' ``deadline`` and ``shield`` are fine too (Trio's API is to set them). Anything
else is another component's state: give its owner a method that says what happened.
"""

from __future__ import annotations

import ast
import functools
import textwrap
from collections.abc import Iterator
from pathlib import Path

import flodl_trio

ROOT = Path(flodl_trio.__file__).parent
PKG = ROOT.name


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache  # each test walks the same trees; none changes them
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


# Fields still set from outside their owner, as (module, field) pairs, each for a reason: the
# owner's documented API is the field itself. Nothing may be added; an entry whose assignment is
# gone must go (the test says so).
STILL_SET_FROM_OUTSIDE: frozenset[tuple[str, str]] = frozenset({
    ("flodl_trio/rank_client.py", "step_count"),  # RankEndpoint documents user code setting it
    ("flodl_trio/sim.py", "step_count"),  # the same, for a simulated rank's endpoint
    ("flodl_trio/wire/_cbor.py", "fp"),  # cbor2's own way to drop a decoder's read-ahead
})

# Set on a Trio cancel scope, whose API they are.
SCOPE_FIELDS = frozenset({"deadline", "shield"})


def _named(ann: ast.expr | None) -> set[str]:
    """The class names an annotation names (``X``, ``X | None``, ``"X"``, ``m.X``, ``X[T]``)."""
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        try:
            ann = ast.parse(ann.value, mode="eval").body
        except SyntaxError:
            return set()
    if isinstance(ann, ast.Name):
        return {ann.id}
    if isinstance(ann, ast.Attribute):
        return {ann.attr}
    if isinstance(ann, ast.Subscript):
        return _named(ann.value)
    if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
        return _named(ann.left) | _named(ann.right)
    return set()


def _made_by(value: ast.expr | None) -> set[str]:
    """``X(...)``, ``m.X(...)`` and ``X.make(...)``: the names that may be the class (a
    capitalised name: ``d.get(...)`` says nothing)."""
    if not isinstance(value, ast.Call):
        return set()
    func = value.func
    names = _named(func)
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        names.add(func.value.id)
    return {name for name in names if name[:1].isupper()}


def _targets(node: ast.AST) -> Iterator[ast.expr]:
    found = (list(node.targets) if isinstance(node, ast.Assign) else
             [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else [])
    while found:
        target = found.pop()
        if isinstance(target, ast.Tuple | ast.List | ast.Starred):
            found.extend(target.elts if not isinstance(target, ast.Starred) else [target.value])
        else:
            yield target


def _kinds(scope: ast.AST, names: dict[str, set[str]], self_name: str | None) -> None:
    """What ``scope`` tells of its names' classes (parameters, assignments, ``with``)."""
    for node in ast.walk(scope):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            args = node.args
            for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs):
                names.setdefault(arg.arg, set()).update(_named(arg.annotation))
        elif isinstance(node, ast.withitem) and isinstance(node.optional_vars, ast.Name):
            names.setdefault(node.optional_vars.id, set()).update(_made_by(node.context_expr))
        value = getattr(node, "value", None)
        for target in _targets(node):
            made = _made_by(value) | _named(getattr(node, "annotation", None))
            if isinstance(value, ast.Name) and value.id == "cls" and self_name:
                made.add(self_name)
            if isinstance(target, ast.Name):
                names.setdefault(target.id, set()).update(made)


def _class_of(base: ast.expr, names: dict[str, set[str]], fields: dict[str, set[str]],
              returns: dict[str, set[str]]) -> set[str]:
    """The names that may be the class of ``base`` (empty: the module cannot tell)."""
    if isinstance(base, ast.Name):
        return names.get(base.id, set())
    if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) and (
            base.value.id == "self"):
        return fields.get(base.attr, set())
    if isinstance(base, ast.Call) and isinstance(base.func, ast.Attribute) and isinstance(
            base.func.value, ast.Name) and base.func.value.id == "self":
        return returns.get(base.func.attr, set())
    return set()


def _declared_fields(tree: ast.Module) -> set[str]:
    """The fields the module's classes declare: ``self.x = ...``, class-level annotations and
    ``__slots__``."""
    declared: set[str] = set()
    for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
        for node in ast.walk(cls):
            for target in _targets(node):
                if isinstance(target, ast.Attribute) and isinstance(
                        target.value, ast.Name) and target.value.id == "self":
                    declared.add(target.attr)
                elif isinstance(target, ast.Name) and isinstance(node, ast.AnnAssign):
                    declared.add(target.id)
                elif isinstance(target, ast.Name) and target.id == "__slots__":
                    value = getattr(node, "value", None)
                    declared.update(elt.value for elt in getattr(value, "elts", ())
                                    if isinstance(elt, ast.Constant))
    return declared


def foreign_assignments(tree: ast.Module) -> list[tuple[int, str, str]]:
    """``(line, target, field)`` of each field set on an object the module does not own."""
    local = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    declared = _declared_fields(tree)
    scopes: list[tuple[ast.AST, str | None]] = [
        (node, node.name) for node in tree.body if isinstance(node, ast.ClassDef)]
    scopes += [(node, None) for node in tree.body
               if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]
    found = []
    for scope, name in scopes:
        fields: dict[str, set[str]] = {}
        params: dict[str, set[str]] = {}  # what ``self.x = x`` says of x (its annotation)
        _kinds(scope, params, name)
        returns = {node.name: _named(node.returns) for node in ast.walk(scope)
                   if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}
        for node in ast.walk(scope):
            value = getattr(node, "value", None)
            for target in _targets(node):
                if isinstance(target, ast.Name) and isinstance(node, ast.AnnAssign):
                    fields.setdefault(target.id, set()).update(_named(node.annotation))
                elif isinstance(target, ast.Attribute) and isinstance(
                        target.value, ast.Name) and target.value.id == "self":
                    fields.setdefault(target.attr, set()).update(
                        _made_by(value) | _named(getattr(node, "annotation", None))
                        | (params.get(value.id, set()) if isinstance(value, ast.Name)
                           else set()))
        methods = [node for node in getattr(scope, "body", ())
                   if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                   ] if name is not None else [scope]
        for method in methods:
            names: dict[str, set[str]] = {"self": {name or ""}, "cls": {name or ""}}
            _kinds(method, names, name)
            for node in ast.walk(method):
                for target in _targets(node):
                    if not isinstance(target, ast.Attribute) or target.attr.startswith("__"):
                        continue
                    owner = target.value
                    if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                        continue
                    kinds = _class_of(owner, names, fields, returns)
                    if (kinds & local or (not kinds and target.attr in declared)
                            or (target.attr in SCOPE_FIELDS
                                and ast.unparse(owner).endswith("scope"))):
                        continue
                    found.append((node.lineno, ast.unparse(target), target.attr))
    return sorted(set(found))


def test_no_module_reaches_into_another_objects_underscored_attributes() -> None:
    found = {
        str(path.relative_to(ROOT.parent)): reaches
        for path, tree in parsed_modules().values()
        if (reaches := private_reaches(tree))
    }
    assert found == {}


def test_no_module_sets_a_field_of_an_object_another_module_owns() -> None:
    found: dict[str, list[str]] = {}
    allowed_seen: set[tuple[str, str]] = set()
    for path, tree in parsed_modules().values():
        module = str(path.relative_to(ROOT.parent))
        for line, target, field in foreign_assignments(tree):
            if (module, field) in STILL_SET_FROM_OUTSIDE:
                allowed_seen.add((module, field))
            else:
                found.setdefault(module, []).append(f"line {line}: {target}")
    assert found == {}
    # An entry whose assignment is gone goes too, so the list only ever shrinks.
    assert sorted(STILL_SET_FROM_OUTSIDE - allowed_seen) == []


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


def test_the_field_rule_tells_a_record_of_the_module_from_another_components_state() -> None:
    tree = ast.parse(textwrap.dedent("""\
        class Slot:
            def __init__(self) -> None:
                self.since = 0.0

        class Owner:
            def __init__(self, other: Other, slot: Slot) -> None:
                self._other = other
                self._slot = slot

            def step(self, conn: Conn, record: Slot) -> None:
                self._slot.since = 1.0
                record.since += 1.0
                made = Slot()
                made.since = 2.0
                with trio.CancelScope() as scope:
                    scope.deadline = 3.0
                self._other.flag = True
                conn.paused_since, conn.scope = 1.0, None
                self._other.since = 4.0

        def helper(items):
            for item in items:
                item.since = 5.0
                item.other = 6.0
        """))
    assert foreign_assignments(tree) == [
        (17, "self._other.flag", "flag"),
        (18, "conn.paused_since", "paused_since"),
        (18, "conn.scope", "scope"),
        (19, "self._other.since", "since"),
        (24, "item.other", "other"),
    ]


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
