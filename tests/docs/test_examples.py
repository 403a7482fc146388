"""Every code block of the README and of docs/ runs: the examples under examples/ (which the
blocks are, verbatim or by literalinclude) run here as written, the ``>>>`` examples are doctests,
and the CLI and API references name every command, option and public module."""

from __future__ import annotations

import argparse
import doctest
import importlib
import os
import pkgutil
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import attrs
import pytest

import flodl_trio
from flodl_trio.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "examples"
README = ROOT / "README.md"


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    return [(m[1], m[2]) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)]


@pytest.mark.slow
def test_the_embedding_example_forms_trains_and_finishes() -> None:
    done = subprocess.run([sys.executable, str(EXAMPLES / "embedding.py")], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ("relay: RelayExit(reason='coordinator said Goodbye: the block exited', clean=True)"
            in done.stdout)
    assert "orchestrator saw 12 batches from 4 ranks" in done.stdout


def _example(role: str, state: Path, out: Path,
             started: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    with open(out, "wb") as sink:
        proc = subprocess.Popen([sys.executable, str(EXAMPLES / "embedding_store.py"), role,
                                 str(state)], stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT)
    started.append(proc)
    return proc


def _wait_for(out: Path, text: str) -> None:
    for _ in range(1200):  # bounded: 60 s
        if text in out.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"no {text!r} in {out.read_text()}")


@pytest.mark.slow
def test_the_store_example_survives_a_restart_of_itself_and_runs_again(tmp_path: Path) -> None:
    """Issue 39: a store-backed program could not run twice, nor adopt its own session after a
    restart (its salt was new each time)."""
    state, logs = tmp_path / "state", tmp_path / "logs"
    state.mkdir()
    logs.mkdir()
    started: list[subprocess.Popen[bytes]] = []
    hosts = _example("hosts", state, logs / "hosts-1", started)
    first = _example("orchestrate", state, logs / "first", started)
    try:
        _wait_for(logs / "first", "round 2/8 done")
        first.kill()  # a crash: the session is left for the next start to adopt
        assert first.wait(timeout=60) == -9
        again = _example("orchestrate", state, logs / "again", started)
        assert again.wait(timeout=90) == 0, (logs / "again").read_text()
        assert hosts.wait(timeout=60) == 0, (logs / "hosts-1").read_text()
        said = (logs / "again").read_text().splitlines()
        assert said[0].startswith(f"adopted the session of sqlite:{state / 'session.db'} as "
                                  "generation 2, resuming at round "), said
        assert said[-1] == "round 8/8 done"
        # The run's end reaches the relay cleanly: the coordinator's Goodbye, or its ranks
        # leaving on the Shutdown just before it (both orders happen).
        ended = (logs / "hosts-1").read_text().splitlines()[-1]
        assert ended in ("relay: RelayExit(reason='coordinator said Goodbye: the block exited', "
                         "clean=True)", "relay: RelayExit(reason='all ranks exited', clean=True)"
                         ), ended
        hosts = _example("hosts", state, logs / "hosts-2", started)
        second = _example("orchestrate", state, logs / "second", started)
        assert second.wait(timeout=90) == 0, (logs / "second").read_text()
        assert hosts.wait(timeout=60) == 0, (logs / "hosts-2").read_text()
        assert (logs / "second").read_text().splitlines()[0] == (
            f"new session of sqlite:{state / 'session.db'} as generation 3")
        assert (state / "salt").stat().st_mode & 0o777 == 0o600
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.slow
def test_the_tutorial_cluster_script_runs_as_written(tmp_path: Path) -> None:
    env = dict(os.environ, FLODL=f"{sys.executable} -m flodl_trio", TMPDIR=str(tmp_path))
    env.pop("FLODL_SALT_HEX", None)
    done = subprocess.run(["bash", str(EXAMPLES / "cli_cluster.sh")], capture_output=True,
                          text=True, timeout=180, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert '"epochs_completed": 2' in done.stdout
    assert "phase forming  world 4  covered 0" in done.stdout
    assert done.stdout.rstrip().endswith("tutorial cluster: done")
    assert list(tmp_path.iterdir()) == []  # its work directory is removed


def test_the_tutorial_says_how_to_get_flodl_trio_on_path_before_its_first_command() -> None:
    # After ./scripts/demo the command is in .venv/bin, which is not on PATH.
    text = (DOCS / "tutorial.rst").read_text()
    first_step = text.index("literalinclude")
    assert -1 < text.find(". .venv/bin/activate") < first_step
    assert -1 < text.find(".venv/bin/flodl-trio") < first_step
    script = (EXAMPLES / "cli_cluster.sh").read_text()
    assert "FLODL=.venv/bin/flodl-trio" in script  # the script itself works without activating


@pytest.mark.slow
def test_the_chaos_test_example_passes_under_pytest() -> None:
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly",
                           str(EXAMPLES / "test_chaos_example.py")], capture_output=True,
                          text=True, timeout=180, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout


@pytest.mark.slow
def test_the_in_memory_chaos_test_example_passes_under_pytest() -> None:
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly",
                           str(EXAMPLES / "test_chaos_in_memory_example.py")],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout


@pytest.mark.slow
def test_the_python_examples_pass_mypy_strict(tmp_path: Path) -> None:
    # What a user copies must type-check: the typed fixtures, sending typed by direction.
    pytest.importorskip("mypy")
    examples = sorted(str(p) for p in EXAMPLES.glob("*.py"))
    done = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--cache-dir",
                           str(tmp_path / "cache"), *examples], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_readme_python_block_is_part_of_an_example_that_runs() -> None:
    # An example's snippet markers (``# --8<-- [start:proxy]``) are for the Sphinx pages only.
    sources = {p.name: re.sub(r"\n{4,}", "\n\n\n", re.sub(r"^# --8<-- .*\n", "",
                                                         p.read_text(encoding="utf-8"), flags=re.M))
               for p in EXAMPLES.glob("*.py")}
    python_blocks = [body for lang, body in fenced_blocks(README.read_text()) if lang == "python"]
    assert python_blocks
    for body in python_blocks:
        assert any(body in src for src in sources.values()), f"not in examples/:\n{body}"
    # The embedding section shows the example whole: imports, constants and main() included.
    assert (EXAMPLES / "embedding.py").read_text(encoding="utf-8") in python_blocks


def test_the_messages_sent_most_come_from_flodl_trio_itself() -> None:
    # `ft.SetGlobalStep` raised AttributeError: the embedding page's first attempt failed on it.
    wire = importlib.import_module("flodl_trio.wire")
    for name in ("StartEpoch", "EpochPlan", "SetGlobalStep", "SyncNow", "DeclareDead",
                 "Throttle", "Shutdown", "ShutdownWithSave", "Batch", "SyncAck", "Heartbeat",
                 "ControlMsg", "TimingMsg"):
        assert getattr(flodl_trio, name) is getattr(wire, name), name
        assert name in flodl_trio.__all__
    assert "``SetGlobalStep``" in (DOCS / "embedding.rst").read_text()


def test_the_testing_extra_brings_what_the_pytest_plugin_needs() -> None:
    # A user's chaos tests need pytest and pytest-trio (trio_mode); the test extra pins the same.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    names = {re.split(r"[<>=!~ ]", req, maxsplit=1)[0] for req in extras["testing"]}
    assert {"pytest", "pytest-trio"} <= names
    assert set(extras["testing"]) <= set(extras["test"])
    for page in (DOCS / "chaos.rst", README):
        text = page.read_text()
        assert "trio_mode = true" in text and "testing" in text, page.name


def test_every_readme_shell_command_names_a_script_or_a_documented_install_step() -> None:
    install = (DOCS / "install.rst").read_text()
    for lang, body in fenced_blocks(README.read_text()):
        if lang != "bash":
            continue
        for line in body.splitlines():
            command = line.split("#", 1)[0].strip()
            if command.startswith("./scripts/"):
                script = ROOT / command.split()[0]
                assert script.is_file() and os.access(script, os.X_OK), command
            elif command:
                assert command in install, f"README command not in docs/install.rst: {command}"


def test_every_literalinclude_names_an_example_and_markers_that_exist() -> None:
    pattern = re.compile(r"literalinclude:: (\S+)\n((?:\s+:[\w-]+:.*\n)*)")
    found = 0
    for page in DOCS.glob("*.rst"):
        for m in pattern.finditer(page.read_text()):
            target = (DOCS / m[1]).resolve()
            assert target.parent == EXAMPLES and target.is_file(), (page.name, m[1])
            text = target.read_text()
            for marker in re.findall(r":(?:start-after|end-before): (.*)", m[2]):
                assert marker.strip() in text, (page.name, marker)
            found += 1
    assert found >= 8


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.rst")
                                        if ">>>" in p.read_text()))
def test_the_doctests_of_the_docs_pass(page: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLODL_NET_TIMEOUT_SCALE", raising=False)
    result = doctest.testfile(str(DOCS / page), module_relative=False, verbose=False,
                              optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0, result


@pytest.mark.parametrize("module", ["flodl_trio._config", "flodl_trio.cli._common",
                                    "flodl_trio.port_mux", "flodl_trio.demo._story",
                                    "flodl_trio.net._interfaces", "flodl_trio.cli._errors",
                                    "flodl_trio.cli._suggest", "flodl_trio.chaos._handshakes"])
def test_the_doctests_in_docstrings_pass(module: str) -> None:
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0, result


def test_the_cli_reference_names_every_command_and_option() -> None:
    text = (DOCS / "cli.rst").read_text()
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        assert f"``{name}" in text, name
        for action in command._actions:
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    assert option in text, f"{name} {option} is not in docs/cli.rst"


def test_the_api_reference_documents_every_public_module() -> None:
    text = (DOCS / "api.rst").read_text()
    documented = set(re.findall(r"automodule:: (\S+)", text))
    public = {"flodl_trio"} | {
        f"flodl_trio.{m.name}" for m in pkgutil.iter_modules(flodl_trio.__path__)
        # cli, demo and net hold only private modules (the command line, the demo, transport)
        if not m.name.startswith("_") and m.name not in ("cli", "demo", "net")}
    assert public <= documented, sorted(public - documented)


def public_names(module_name: str) -> list[str]:
    """``__all__``, or (without one) the classes and functions the module itself defines."""
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [name for name, obj in vars(module).items() if not name.startswith("_")
            and getattr(obj, "__module__", None) == module_name]


@pytest.mark.slow
def test_the_docs_build_with_warnings_as_errors_and_name_every_public_name_and_field(
    tmp_path: Path,
) -> None:
    # The same build as ./scripts/docs and .ci/run: a docstring that breaks the reference fails
    # here, before it reaches CI. Then its inventory (objects.inv) must hold every public name of
    # every public module (a name re-exported from another module may be documented there) and
    # every field of every message class: autodoc drops members silently, and it once dropped
    # Heartbeat, Shutdown and every other message that flodl_trio.rank happens to import.
    pytest.importorskip("sphinx")
    from sphinx.util.inventory import InventoryFile

    env = {k: v for k, v in os.environ.items() if k != "FLODL_DOCS_INTERSPHINX"}
    out = tmp_path / "html"
    done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b",
                           "html", str(DOCS), str(out)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    with (out / "objects.inv").open("rb") as f:
        inventory = InventoryFile.load(f, "", lambda base, uri: uri)
    documented = {name for objects in inventory.values() for name in objects}
    modules = ["flodl_trio", "flodl_trio.wire", *sorted(
        f"flodl_trio.{m.name}" for m in pkgutil.iter_modules(flodl_trio.__path__)
        if not m.name.startswith("_") and m.name not in ("cli", "wire"))]
    missing = []
    for module_name in modules:
        for name in public_names(module_name):
            obj = getattr(importlib.import_module(module_name), name)
            homes = [m for m in modules if getattr(importlib.import_module(m), name, None) is obj]
            if not any(f"{home}.{name}" in documented for home in homes):
                missing.append(f"{module_name}.{name}")
    assert missing == []
    wire = importlib.import_module("flodl_trio.wire")
    fields = [f"{home}.{name}.{field.name}" for name in wire.__all__
              if attrs.has(cls := getattr(wire, name)) and isinstance(cls, type)
              for field in attrs.fields(cls)
              for home in ["flodl_trio" if name in flodl_trio.__all__ else "flodl_trio.wire"]]
    assert "flodl_trio.Batch.sync_divergence" in fields and len(fields) > 100
    assert [field for field in fields if field not in documented] == []
    # The specification is not in the repository: the pages (docstrings included) cite none.
    cited = [page.name for page in out.glob("*.html") if "SPEC §" in page.read_text()]
    assert cited == []


def test_the_readme_and_the_docs_cite_no_specification_outside_the_repository() -> None:
    pages = [README, *DOCS.glob("*.rst")]
    assert [p.name for p in pages if re.search(r"SPEC\b|§", p.read_text())] == []
    assert "pip install 'flodl-trio" not in README.read_text()  # it is not on a registry
