"""The layout's promises: the pure core imports nothing that does I/O, every module is in docs/design.md, and the
test tree mirrors the source (docs/CONTRIBUTING.md "Where tests go")."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CORE = sorted(p.stem for p in (REPO / "watchdog" / "core").glob("*.py") if p.stem != "__init__")
# modules that read or write files, sockets, processes or devices, or that log: none belongs in the core
IO_MODULES = ("socket", "subprocess", "select", "selectors", "mmap", "signal", "threading", "psutil",
              "structlog", "torch", "pynvml", "rankwatch.hooks", "rankwatch.watchdog.observe",
              "rankwatch.watchdog.evidence", "rankwatch.watchdog.cluster", "rankwatch.watchdog.report",
              "rankwatch.watchdog.serve", "rankwatch.watchdog.cli")


def test_the_core_imports_nothing_that_does_io():
    code = (
        "import sys; before = set(sys.modules)\n"
        + "".join(f"import rankwatch.watchdog.core.{m}\n" for m in CORE)
        + "print('\\n'.join(sorted(set(sys.modules) - before)))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert len(CORE) >= 10
    bad = [m for m in loaded if m.startswith(IO_MODULES)]
    assert not bad, f"the pure core pulled in {bad}"


def test_design_layout_table_lists_every_module():
    readme = (REPO / "docs" / "design.md").read_text()
    table = readme[readme.index("## Layout"):]
    table = table[: table.index("\n## ", 5)]
    listed = set(re.findall(r"`([\w/]+\.py)`", table))
    modules = {str(p.relative_to(REPO)) for top in ("watchdog", "hooks") for p in (REPO / top).rglob("*.py")
               if p.name != "__init__.py" and p.name != "__main__.py"}
    missing = sorted(modules - listed)
    stale = sorted(m for m in listed if m.startswith(("watchdog/", "hooks/")) and m not in modules)
    assert not missing, f"docs/design.md layout table lacks {missing}"
    assert not stale, f"docs/design.md layout table names modules that do not exist: {stale}"


def test_collecting_the_suite_imports_no_torch():
    # every xdist worker imports every test module to collect it: torch at a module's top is ~1.5 s of CPU per
    # worker (with dynamo ~3 s) that only the worker running the test needs (docs/CONTRIBUTING.md)
    code = (
        "import sys, pytest\n"
        "rc = pytest.main(['--collect-only', '-q', '-n', '0', '-p', 'no:cacheprovider', 'tests'])\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', rc)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300).stdout
    assert out.splitlines()[-1] == "NO-TORCH 0", out[-3000:]


TESTS = REPO / "tests"
TEST_TOPS = {"unit", "e2e", "architecture"}
HELPERS = {"procs", "jobs", "fixtures", "child_site", "__pycache__"}  # not tests: what tests start and read


def test_the_test_tree_mirrors_the_source():
    """Tests live in tests/unit/<package>/ (a package of watchdog/, or hooks), tests/e2e/ or
    tests/architecture/, never at tests/ itself; unit folders are packages that exist."""
    packages = {p.name for p in (REPO / "watchdog").iterdir() if (p / "__init__.py").exists()} | {"hooks"}
    modules = [p for p in TESTS.rglob("test_*.py") if not HELPERS & set(p.relative_to(TESTS).parts)]
    assert len(modules) > 50
    for p in modules:
        where = p.relative_to(TESTS).parts[:-1]
        assert where and where[0] in TEST_TOPS, f"{p.relative_to(REPO)}: not under tests/unit, e2e or architecture"
        if where[0] == "unit":
            assert len(where) == 2 and where[1] in packages, f"{p.relative_to(REPO)}: not under a package's folder"
        else:
            assert len(where) == 1, p.relative_to(REPO)
    assert {d.name for d in TESTS.iterdir() if d.is_dir() and not d.name.startswith(".")} - HELPERS <= TEST_TOPS


def test_test_module_names_are_unique_and_no_folder_is_a_package():
    # pytest's default import mode imports a test module by its file name (the folders are no packages), and
    # tests import each other's helpers by that name (tests/conftest.py TEST_DIRS): one name, one file
    names = [p.name for p in TESTS.rglob("test_*.py") if "fixtures" not in p.parts]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert not [p for p in TESTS.rglob("__init__.py") if "fixtures" not in p.parts]

WATCHDOG = REPO / "watchdog"


def _folder(module: str) -> str | None:
    """The watchdog folder a module is in (``cli``, ``core``, …; "" for a module at the watchdog's top),
    None when the module is not the watchdog's."""
    parts = module.split(".")
    if parts[:2] != ["rankwatch", "watchdog"]:
        return None
    return parts[2] if len(parts) > 2 and (WATCHDOG / parts[2]).is_dir() else ""


def _imported(rel: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The absolute names of what an import statement of the module at ``rel`` (from the repo) loads."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not node.level:
        return [node.module or ""]
    package = ["rankwatch", *rel.parent.parts]
    base = package[: len(package) - node.level + 1]
    if node.module:
        return [".".join([*base, node.module])]
    return [".".join([*base, a.name]) for a in node.names]  # from .. import report


def crossing_imports(code: str, rel: Path) -> list[str]:
    """Every import inside a function (at any depth) of the module at ``rel`` that loads a module of another
    watchdog folder, as ``path:line function() imports module``."""
    own = rel.parts[1] if len(rel.parts) > 2 else ""
    found = []
    for fn in ast.walk(ast.parse(code)):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    found += [f"{rel}:{node.lineno} {fn.name}() imports {m}" for m in _imported(rel, node)
                              if _folder(m) not in (None, own)]
    return sorted(set(found))


def test_no_function_imports_across_watchdog_folders():
    # an import inside a function hides a dependency (and a cycle with it) from every reader and tool: a module
    # imports what it uses at its top; a command's module is loaded by name in one place (cli/main.COMMANDS).
    # A third-party dependency loaded where it is used (prometheus_client in serve/metrics) is not what this is
    by_module = {str(p.relative_to(REPO)): crossing_imports(p.read_text(), p.relative_to(REPO))
                 for p in sorted(WATCHDOG.rglob("*.py"))}
    crossing = [line for lines in by_module.values() for line in lines]
    assert not crossing, "imports inside functions across watchdog folders:\n" + "\n".join(crossing)


def test_the_import_check_finds_a_crossing_import():
    # the check itself, on a module of serve/ written for it: an import of another folder inside a function is
    # found, at any depth; one of the same folder, of the standard library or at the module's top is not
    code = ("from ..core import policy\n"
            "def f():\n    from ..cluster import store\n    from . import state\n    import json\n"
            "    def g():\n        from ..core.policy import ServePolicy\n")
    assert crossing_imports(code, Path("watchdog/serve/probe.py")) == [
        "watchdog/serve/probe.py:3 f() imports rankwatch.watchdog.cluster",
        "watchdog/serve/probe.py:7 f() imports rankwatch.watchdog.core.policy",
        "watchdog/serve/probe.py:7 g() imports rankwatch.watchdog.core.policy",
    ]


def test_a_module_is_loaded_by_name_only_by_the_command_table():
    # cli/main.COMMANDS is the one place a module is imported by its name as a string
    by_name = sorted(
        str(p.relative_to(REPO)) for p in WATCHDOG.rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Call) and (
            (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__"))
            or (isinstance(node.func, ast.Attribute) and node.func.attr in ("import_module", "__import__")))
    )
    # the CLI's command table, and the privsep zygote importing the modules whose handlers the root side
    # registered (it forks readers that may not read this installation once they run as a job's owner)
    assert by_name == ["watchdog/cli/main.py", "watchdog/privsep/readers.py"]


def test_the_straggler_diagnosis_is_made_in_one_place_per_purpose():
    # a job's live diagnosis is made once per poll by the daemon loop (JobEntry.straggler), and metrics, the state
    # file (status) and the straggler alerts read that one; besides it only the end-of-run summary (over the whole
    # run) and status without a watchdog (the records alone) diagnose
    calls = sorted(
        str(p.relative_to(REPO)) for p in WATCHDOG.rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "diagnose_stragglers"
    )
    assert calls == ["watchdog/cli/run.py", "watchdog/cli/status.py", "watchdog/serve/daemon.py"]
