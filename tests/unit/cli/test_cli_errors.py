"""The CLI never throws: bad input is one line on stderr and exit 2, before anything is launched."""

from __future__ import annotations

import json
import subprocess
from importlib import import_module
from pathlib import Path

import pytest
from conftest import rankwatch_cmd

TRACEBACK = "Traceback (most recent call last)"


def run(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    # a hang guard, not a speed limit: a CLI that imports torch took 60 s on 2 cores at load 20
    return subprocess.run(rankwatch_cmd(*args), cwd=cwd, capture_output=True, text=True, timeout=timeout)


def assert_one_line_exit_2(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert TRACEBACK not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("rankwatch"), lines
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["daemon", "--metrics-port", "99999"], "--metrics-port"),
        (["daemon", "--store-port", "70000"], "--store-port"),
        (["daemon", "--store-port", "0"], "--store-port"),
        (["run", "--metrics-port", "99999", "--", "--nproc-per-node", "2", "train.py"], "--metrics-port"),
        (["run", "--", "--nproc-per-node", "2", "no_such_train.py"], "no_such_train.py"),
        (["run", "--", "--nproc-per-node", "2", "-m", "no_such_module_xyz"], "no_such_module_xyz"),
        (["run", "--", "--nproc-per-node", "2"], "training_script"),
        (["run", "--nproc-per-node", "2", "train.py"], "after '--'"),
        (["run"], "torchrun arguments"),
        (["run", "--notify", "file:///etc/passwd", "--", "--nproc-per-node", "2", "train.py"], "--notify"),
        (["run", "--notify", "http://", "--", "--nproc-per-node", "2", "train.py"], "--notify"),
        (["run", "--on-incident", "/no/such/cmd", "--", "--nproc-per-node", "2", "train.py"], "--on-incident"),
        (["daemon", "--on-incident", "'unbalanced"], "--on-incident"),
        (["status", "--watch", "--json"], "--watch"),
        (["status", "--interval", "-1"], "--interval"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_bad_arguments(tmp_path, args, needle):
    (tmp_path / "train.py").write_text("raise SystemExit('must never run')\n")
    result = run(args + (["--out", str(tmp_path / "o")] if args[0] == "daemon" else []), tmp_path)
    assert_one_line_exit_2(result, needle)
    # nothing was launched: no output dir, no incident
    assert not (tmp_path / "rankwatch-out" / "incidents").exists()
    assert "must never run" not in result.stderr


def test_run_refuses_missing_script_before_torchrun(tmp_path):
    """The typo'd script never becomes a DEAD RANK incident: torchrun is never started."""
    out = tmp_path / "out"
    result = run(["run", "--out", str(out), "--", "--nproc-per-node", "2", "trian.py"], tmp_path)
    assert_one_line_exit_2(result, "'trian.py' not found")
    assert not out.exists()


def test_version_and_help(tmp_path):
    v = run(["--version"], tmp_path)
    assert v.returncode == 0 and v.stdout.startswith("rankwatch ") and v.stdout.split()[1][0].isdigit()
    for command in ("run", "daemon", "status", "report", "diagnose"):
        h = run([command, "--help"], tmp_path)
        assert h.returncode == 0 and "usage:" in h.stdout, (command, h.stderr)


@pytest.mark.parametrize("command", ["run", "daemon", "status", "report", "diagnose"])
def test_every_option_has_help(command):
    parser = import_module(f"rankwatch.watchdog.cli.{command}").build_parser()
    undocumented = [a.option_strings or [a.dest] for a in parser._actions if not a.help]
    assert not undocumented, undocumented


VERDICT = {
    "schema": "rankwatch.verdict/1",
    "job_id": "j",
    "incident_id": "i",
    "kind": "hang",
    "initiating_ranks": [2],
    "phase": "forward",
    "confidence": "high",
    "reason": "rank 2 is stuck",
    "detected_after_s": 3.1,
}
SUMMARY = {"schema": "rankwatch.summary/1", "job_id": "j", "diagnosis": "BALANCED", "straggler_ranks": [], "why": "-",
           "steps": 10}


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"schema": "rankwatch.verdict/1"}, "'job_id' is missing"),
        ({**VERDICT, "initiating_ranks": 2}, "'initiating_ranks' must be a list"),
        ({**VERDICT, "initiating_ranks": ["2"]}, "'initiating_ranks' must be a list"),
        ({**VERDICT, "evidence": "one string"}, "'evidence'"),
        ({**VERDICT, "ranks": [1, 2]}, "'ranks'"),
        ({**SUMMARY, "timeline": {"0": 5}}, "'timeline'"),
        ({**SUMMARY, "timeline": [[1, 2]]}, "'timeline'"),
        ({**SUMMARY, "phases": {"forward": 3}}, "'phases'"),
        ({**SUMMARY, "incident_verdicts": [{"kind": "hang"}]}, "incident_verdicts[0]"),
        ({"schema": "rankwatch.verdict/9"}, "not a rankwatch verdict"),
        ([VERDICT], "not a rankwatch verdict"),
    ],
)
@pytest.mark.parametrize("html", [False, True])
def test_report_checks_documents_before_rendering(tmp_path, doc, needle, html):
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(doc))
    result = run(["report", str(path), *(["--html", str(tmp_path / "r.html")] if html else [])], tmp_path)
    assert_one_line_exit_2(result, needle)
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("doc", [VERDICT, SUMMARY, {**VERDICT, "job_id": None, "incident_id": None,
                                                   "detected_after_s": None, "source": "logs"}])
def test_report_renders_valid_documents(tmp_path, doc):
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(doc))
    result = run(["report", str(path)], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "None" not in result.stdout
    html = run(["report", str(path), "--html", str(tmp_path / "r.html")], tmp_path)
    assert html.returncode == 0 and (tmp_path / "r.html").stat().st_size > 0


def test_torchrun_root_cause_note():
    from rankwatch.watchdog.cli.run import torchrun_root_cause_note

    note = torchrun_root_cause_note([VERDICT], root_cause_printed=True)
    assert "torchrun's 'Root Cause (first observed failure)'" in note and "rankwatch names rank 2" in note
    assert VERDICT["reason"] not in note  # the why is said with the verdict, not again here
    assert "often one that failed because of the initiator" in note and note.count("\n") == 1
    killed = torchrun_root_cause_note([VERDICT], root_cause_printed=True, killed=True)
    assert "--on-stall kill stopped" in killed and "rankwatch names rank 2" in killed
    assert torchrun_root_cause_note([VERDICT], root_cause_printed=False) == ""  # torchrun printed no Root Cause
    assert torchrun_root_cause_note([{**VERDICT, "initiating_ranks": []}], root_cause_printed=True) == ""
