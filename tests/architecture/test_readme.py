"""The README is for users and stays true: short, a table of contents that matches its sections, the
test command CI really runs, install steps that work from this repository, options the commands have,
and a link to every document under docs/."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from conftest import rankwatch_cmd

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def _anchor(title: str) -> str:
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def test_the_readme_is_short_and_its_contents_match_its_sections():
    assert len(README.splitlines()) <= 300
    sections = re.findall(r"(?m)^## (.+)$", README)
    listed = re.findall(r"(?m)^- \[(.+?)\]\(#([\w-]+)\)$", README)
    assert sections[0] == "Contents"
    assert [t for t, _ in listed] == sections[1:]
    assert all(a == _anchor(t) for t, a in listed), listed


def test_the_test_command_is_what_ci_runs():
    ci = (REPO / ".ci" / "run").read_text()
    ci_pytest = [ln.strip() for ln in ci.splitlines() if ln.strip().startswith("python -m pytest")]
    assert ci_pytest, "no pytest line in .ci/run"
    assert f"&& {ci_pytest[-1]}\n" in README


def test_install_steps_work_from_this_repository():
    # no package index serves rankwatch: every pip install of it points at this checkout
    for line in re.findall(r"pip install[^\n]*", README):
        assert not re.search(r"pip install\s+rankwatch\b", line), line


def test_the_run_options_in_the_readme_exist():
    helptext = subprocess.run(rankwatch_cmd("run", "--help"), capture_output=True, text=True, timeout=60).stdout
    table = README[README.index("### `rankwatch run"):README.index("### `rankwatch status`")]
    options = set(re.findall(r"`(--[a-z][a-z-]+)", table))
    assert len(options) >= 8
    missing = sorted(o for o in options if o not in helptext)
    assert not missing, missing


def test_every_document_under_docs_is_linked():
    docs = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))
    assert "docs/design.md" in docs and "docs/reference.md" in docs
    unlinked = [d for d in docs if f"]({d}" not in README]
    assert not unlinked, f"README links none of {unlinked}"
    for target in re.findall(r"\]\(((?:docs|benchmarks|examples)/[^)#]*)", README):
        assert (REPO / target).exists(), target
