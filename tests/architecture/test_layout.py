"""The layout's promises: the pure core imports nothing that does I/O, every module is in docs/design.md, and the
test tree mirrors the source (docs/CONTRIBUTING.md "Where tests go")."""

from __future__ import annotations

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
