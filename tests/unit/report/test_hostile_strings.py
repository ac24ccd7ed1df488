"""Hostile strings from records, documents, stacks and logs never reach a terminal, a file or HTML raw.

Every string rankwatch shows was written by someone it does not trust (any user can create a job dir; a
training script names its phases and threads; logs quote exception messages). Escape sequences, bidi
overrides and carriage returns must come out inert, and 10 kB in one field must come out bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unicodedata
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO, bundle_dirs, free_port, new_tracker, rankwatch_cmd, start_daemon, wait_for
from rankwatch.watchdog.core.text import ELLIPSIS, NAME, clean
from rankwatch.watchdog.evidence.capture import RankCapture, render_text

ESCAPES = "\x1b[2J\x1b]0;pwned\x07"
BIDI = "\u202e\u2066"
HOSTILE = ESCAPES + "\r" + BIDI + "evil\x9b31m\x00\x7f" + "x" * 10_000
# what a terminal or browser could act on; '\n' is allowed only as a line separator
BIDI_CONTROLS = {chr(c) for c in [*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x061C]}
MAX_LINE = 5_000  # the longest field (PROSE) plus a label


def unsafe_chars(text: str) -> list[str]:
    return sorted({c for c in text if c != "\n" and (unicodedata.category(c) in ("Cc", "Cf", "Cs")
                                                      or c in BIDI_CONTROLS or c in "\u2028\u2029")})


def assert_inert(text: str, *, max_line: int = MAX_LINE) -> None:
    bad = unsafe_chars(text)
    assert not bad, f"unsafe characters reached the output: {[hex(ord(c)) for c in bad]}"
    assert "pwned\x07" not in text and "\x1b" not in text and "\r" not in text
    longest = max((len(line) for line in text.splitlines()), default=0)
    assert longest <= max_line, f"a line of {longest} characters"


# -- the helper ---------------------------------------------------------------------------------------------
def test_clean_replaces_controls_bidi_and_format_characters_and_keeps_printable_unicode():
    assert clean("node-7 ✓ Grüße 東京 🚀") == "node-7 ✓ Grüße 東京 🚀"
    assert clean("a\x1b[2Jb") == "a?[2Jb"
    assert clean("a\x07\x00\x7f\x9b\u202e\u2066\u200b\ufeff\ud800b") == "a" + "?" * 9 + "b"
    assert clean("one\ttwo\nthree\rfour\u2028five\xa0six") == "one two three four five six"
    assert clean("a\r\nb\x1bc", multiline=True) == "a\nb?c"
    assert clean(None) == "None" and clean(12) == "12"


def test_clean_doc_cleans_every_string_key_and_value_at_any_depth_once():
    from rankwatch.watchdog.core.straggler_live import LiveStraggler
    from rankwatch.watchdog.core.text import PROSE, clean_doc

    doc = {"a\x1b[2J": [{"op": "x\r\ny"}, ("t\x9b", 3)], "n": 1.5, "b": True, "none": None, "long": "z" * 10_000}
    out = clean_doc(doc)
    assert out == {"a?[2J": [{"op": "x  y"}, ("t?", 3)], "n": 1.5, "b": True, "none": None,
                   "long": "z" * (PROSE - 1) + ELLIPSIS}
    assert clean_doc(out) == out and doc["a\x1b[2J"][0]["op"] == "x\r\ny"  # idempotent; the input unchanged
    live = LiveStraggler(rank=1, label="INPUT STRAGGLER", phase=ESCAPES + "ph", since_step=3, since_unix=1.0,
                         why=HOSTILE)
    assert not unsafe_strings(live.doc())  # the straggler alert's document and the state file


def test_clean_bounds_the_length_with_an_ellipsis():
    out = clean(HOSTILE, 100)
    assert len(out) == 100 and out.endswith(ELLIPSIS)
    assert clean("x" * 100, 100) == "x" * 100
    assert len(clean("y" * 10_000_000)) <= 512  # cut before scanning: 10 MB costs nothing


# -- rankwatch status ------------------------------------------------------------------------------------
@pytest.fixture
def hostile_job(tmp_path):
    """A live rank (this process maps the record) with a hostile hostname, phase name and job dir name."""
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    job = "job" + ESCAPES + BIDI
    (shm / job).mkdir(mode=0o700)
    tracker = new_tracker(shm / job / "rank-0.hb", hostname=HOSTILE, job_id="j")
    slot = tracker.slot(ESCAPES + "\r" + BIDI + "ph")
    for _ in range(3):
        tracker.enter(slot)
        tracker.exit(slot)
        tracker.step()
    tracker.enter(slot)
    yield shm, tracker


def test_status_prints_no_control_characters_from_records(hostile_job):
    shm, _tracker = hostile_job
    out = subprocess.run(rankwatch_cmd("status", "--shm-dir", str(shm), "--all"), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ph" in out.stdout and "job" in out.stdout, out.stdout
    assert_inert(out.stdout + out.stderr)


def test_status_json_holds_cleaned_bounded_values(hostile_job):
    shm, _tracker = hostile_job
    out = subprocess.run(rankwatch_cmd("status", "--shm-dir", str(shm), "--json", "--all"), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert_inert(out.stdout)
    assert "\\u001b" not in out.stdout and "\\u202e" not in out.stdout  # cleaned, not merely JSON-escaped
    (job,) = json.loads(out.stdout)["jobs"]
    (row,) = job["ranks"]
    # the record holds 63 bytes of it (up to the NUL): controls became '?', the CR a space
    assert row["node"] == "?[2J?]0;pwned? ??evil?31m" and len(row["node"]) <= NAME
    assert row["phase"].endswith("ph") and not unsafe_chars(row["phase"])
    assert not unsafe_chars(job["job_id"])


# -- rankwatch report -------------------------------------------------------------------------------------
def hostile_verdict() -> dict:
    return {
        "schema": "rankwatch.verdict/1", "job_id": HOSTILE, "incident_id": "inc-1", "kind": "hang",
        "initiating_ranks": [1], "phase": HOSTILE, "confidence": "high" + ESCAPES, "reason": HOSTILE,
        "detected_after_s": 3.5,  # a string here is refused before rendering (test_cli_errors)
        "ranks": {
            "0": {"node": HOSTILE, "pid": HOSTILE, "state": HOSTILE, "step": 3, "phase": "collective",
                  "in_phase_s": 1.0, "collective": {"seq": HOSTILE, "op": HOSTILE}, "gpu_util": None,
                  "stack_top": [HOSTILE, HOSTILE]},
            "1": {"node": "n", "pid": 2, "state": "running", "step": 2, "phase": HOSTILE, "in_phase_s": HOSTILE,
                  "collective": None, "gpu_util": None, "stack_top": []},
        },
        "evidence": [HOSTILE, HOSTILE],
        "trigger": {"kind": HOSTILE, "reason": HOSTILE},
    }


def hostile_summary() -> dict:
    return {
        "schema": "rankwatch.summary/1", "job_id": HOSTILE, "diagnosis": "INPUT STRAGGLER" + ESCAPES,
        "straggler_ranks": [1], "phase": HOSTILE, "steps": 5, "why": HOSTILE,
        "step_time_ms": {"median": 10.0, "worst": 12.0, "worst_rank": HOSTILE},
        "phases": {HOSTILE: {"median_ms": 4.0, "worst_ms": 9.0, "worst_rank": 1, "skew_ms": 5.0},
                   "forward": {"median_ms": HOSTILE, "worst_ms": 3.0, "worst_rank": HOSTILE}},
        "ranks": {"0": {"steps": 5, "step_time_ms": 10.0, "phases": {HOSTILE: 4.0}},
                  "1": {"steps": 5, "step_time_ms": 12.0, "phases": {HOSTILE: 9.0}}},
        "timeline": {"0": [[1, 10.0], [2, 11.0]], "1": [[1, 12.0], [2, 12.5]]},
        "incidents": ["inc-1" + ESCAPES, HOSTILE],
    }


@pytest.fixture
def hostile_run(tmp_path) -> Path:
    """A run dir as `rankwatch run --out` leaves it, every document and stack file hand-written to be hostile."""
    run = tmp_path / "run"
    bundle = run / "incidents" / "inc-1"
    (bundle / "stacks").mkdir(parents=True)
    (bundle / "verdict.json").write_text(json.dumps(hostile_verdict()))
    (bundle / "stacks" / "groups.txt").write_text(f"[abc] ranks 0 (1)\n    {HOSTILE}\n\x1b]8;;http://x\x1b\\\n")
    (run / "summary.json").write_text(json.dumps(hostile_summary()))
    return run


def test_report_text_of_hostile_verdict_and_summary_is_inert_and_bounded(hostile_run):
    for target in (hostile_run, hostile_run / "incidents" / "inc-1", hostile_run / "summary.json"):
        out = subprocess.run(rankwatch_cmd("report", str(target)), capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "rankwatch" in out.stdout
        assert_inert(out.stdout + out.stderr)
        assert len(out.stdout) < 80_000  # ~15 hostile fields, each bounded


def test_hostile_string_in_a_typed_field_is_refused_inertly(tmp_path):
    path = tmp_path / "verdict.json"
    path.write_text(json.dumps({**hostile_verdict(), "detected_after_s": HOSTILE}))
    out = subprocess.run(rankwatch_cmd("report", str(path)), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert "'detected_after_s' must be a number" in out.stderr
    assert_inert(out.stderr)


def test_report_json_escapes_every_control_character(hostile_run):
    out = subprocess.run(rankwatch_cmd("report", str(hostile_run), "--json"), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert not unsafe_chars(out.stdout)  # the document as written, its controls JSON-escaped
    assert json.loads(out.stdout)[0]["job_id"] == HOSTILE


def test_html_report_holds_no_control_characters(hostile_run, tmp_path):
    page = tmp_path / "report.html"
    out = subprocess.run(rankwatch_cmd("report", str(hostile_run), "--html", str(page)), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    html = page.read_text(encoding="utf-8")
    assert "Stack groups" in html and "pwned" in html  # the text is there, inert
    assert_inert(html, max_line=200_000)  # the page puts many cells on one line
    assert "\x1b]8;;" not in html
    assert len(html) < 400_000


# -- stack files in bundles and offline diagnosis ---------------------------------------------------------
def test_stack_text_of_hostile_frames_and_thread_names_is_inert():
    frames = [{"name": HOSTILE, "filename": "/x/" + HOSTILE, "line": HOSTILE}]
    cap = RankCapture(rank=0, pid=1,
                      pyspy_threads=[{"os_thread_id": 1, "thread_name": HOSTILE, "active": True, "frames": frames}],
                      pyspy_error=HOSTILE, responder_error=HOSTILE, notes=[HOSTILE])
    text = render_text(cap)
    assert_inert(text)
    cap = RankCapture(rank=0, pid=1, responder_stacks={"threads": [{"thread_id": HOSTILE, "thread_name": HOSTILE,
                                                                     "frames": [*frames, HOSTILE]}]})
    assert_inert(render_text(cap))


def test_bundle_groups_text_cleans_frames_and_errors():
    from rankwatch.watchdog.core.snapshot import RankView
    from rankwatch.watchdog.report.bundle import groups_text

    views = [RankView(rank=r, node=HOSTILE, pid=100 + r, state="running", step=1, phase=HOSTILE, in_phase_s=1.0,
                      since_progress_s=1.0, stack_top=(HOSTILE, "f (a.py:1)"),
                      stack_signature="abc" if r == 0 else None)
             for r in (0, 1)]
    caps = {1: RankCapture(rank=1, pid=101, pyspy_error=HOSTILE)}
    text = groups_text(views, caps)
    assert "no stack" in text
    assert_inert(text)


def test_diagnose_of_a_hostile_log_prints_no_control_characters(tmp_path):
    src = (REPO / "tests" / "fixtures" / "logs" / "torchrun_tee" / "dead_rank_r2.log").read_text()
    log = tmp_path / "hostile.log"
    log.write_text("\n".join(line + ESCAPES + BIDI + "\r" + "z" * 10_000 for line in src.splitlines()) + "\n")
    out = subprocess.run(rankwatch_cmd("diagnose", str(log)), capture_output=True, text=True, timeout=120)
    assert out.returncode in (0, 1), out.stderr
    assert "why:" in out.stdout
    assert_inert(out.stdout + out.stderr)


# -- every sink of a real daemon: verdict.json, webhook, Alertmanager, --on-incident, the HTML report ---------
ESC_CSI, CRLF, OSC8, C1_CSI, SCRIPT = "\x1b[31m", "\r\n", "\x1b]8;;http://x\x07", "\x9b", "<script>"
# what a job names itself: the record keeps phase and op names to 23 bytes, the host name to 63
JOB_STRINGS = {
    "host": ESC_CSI + "node" + CRLF + OSC8 + SCRIPT + "alert(1)</script>" + C1_CSI,
    "phase": "\x1b[2J" + CRLF + SCRIPT + C1_CSI + "ph",
    "op": OSC8 + "op",
    "exc": ESC_CSI + "boom" + CRLF + OSC8 + "link\x1b]8;;\x07 " + C1_CSI + "1m" + SCRIPT + "alert(1)</script>",
    "thread": ESC_CSI + "main" + CRLF + OSC8 + SCRIPT,
}


def unsafe_strings(doc: object, where: str = "") -> list[str]:
    """Every string (key or value, at any depth) of a parsed document holding a character a terminal,
    chat client or dashboard could act on — a newline too: no field of these documents is a block of lines."""
    if isinstance(doc, str):
        return [f"{where}: {doc!r}"] if unsafe_chars(doc) or "\n" in doc else []
    if isinstance(doc, dict):
        return [bad for k, v in doc.items() for bad in unsafe_strings(k, where) + unsafe_strings(v, f"{where}.{k}")]
    if isinstance(doc, list):
        return [bad for i, v in enumerate(doc) for bad in unsafe_strings(v, f"{where}[{i}]")]
    return []


def test_a_real_hostile_job_reaches_every_sink_of_a_real_daemon_cleaned(procs, tmp_path):
    from test_alerts import Receiver

    shm, out = tmp_path / "shm", tmp_path / "out"
    shm.mkdir(mode=0o700)
    env_file = tmp_path / "incident.env"
    hook = tmp_path / "on-incident.sh"
    hook.write_text(f"#!/bin/sh\nenv -0 > {env_file}.tmp && mv {env_file}.tmp {env_file}\n")
    hook.chmod(0o700)
    receiver = Receiver()
    am_url = receiver.url.rsplit("/", 2)[0] + "/api/v2/alerts"
    port = free_port()
    daemon = start_daemon(procs, shm, out, "--notify", receiver.url, "--notify", am_url, "--on-incident", str(hook),
                          "--metrics-port", str(port), poll="0.2", stall="2")

    def running_ranks() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                return 'rankwatch_ranks{state="running"} 2.0' in resp.read().decode()
        except OSError:
            return False
    try:
        ranks = []
        for r in (0, 1):
            env = dict(os.environ, RANKWATCH_SHM_DIR=str(shm), RANKWATCH_JOB_ID="hostile", RANK=str(r),
                       LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                       RANKWATCH_HOSTILE=json.dumps(JOB_STRINGS))
            rank = procs.start([sys.executable, str(REPO / "tests" / "procs" / "hostile_job.py")], env=env, text=True,
                               stdin=subprocess.PIPE)
            assert rank.stdout.readline().startswith("ready"), rank.stderr.read()
            ranks.append(rank)
        assert wait_for(running_ranks, timeout=60), "the daemon never watched both ranks"
        ranks[1].stdin.write("go\n")  # rank 1 raises now; rank 0 waits in its collective for it
        ranks[1].stdin.flush()
        assert ranks[1].wait(timeout=60) == 1
        found = wait_for(lambda: bundle_dirs(out / "hostile" / "incidents"), timeout=120)
        assert found, daemon.stderr.read() if daemon.poll() is not None else "no incident bundle"
        assert wait_for(env_file.exists, timeout=60), "the --on-incident command never ran"
        assert wait_for(lambda: {p for p, _, _ in receiver.requests} >= {"/hooks/secret-token", "/api/v2/alerts"},
                        timeout=60), receiver.requests
    finally:
        receiver.close()

    # the text reached the documents (cleaned, not dropped), and no document carries a control character
    verdict_file = found[0] / "verdict.json"
    verdict = json.loads(verdict_file.read_text())
    text = json.dumps(verdict, ensure_ascii=False)
    assert "boom" in text and "<script>" in text and "?]8;;http://x?" in text, text
    assert any("node" in e["node"] for e in verdict["ranks"].values()), verdict["ranks"]
    assert not unsafe_strings(verdict), unsafe_strings(verdict)
    ranks_doc = json.loads((found[0] / "ranks.json").read_text())
    assert not unsafe_strings(ranks_doc), unsafe_strings(ranks_doc)
    for path, _, body in receiver.requests:
        posted = json.loads(body)
        assert not unsafe_strings(posted), (path, unsafe_strings(posted))
        if path == "/hooks/secret-token" and posted.get("status") == "firing":
            assert posted["ranks"] == verdict["ranks"] and posted["reason"] == verdict["reason"]
    raw_env = env_file.read_bytes().split(b"\0")
    env = dict(item.decode("utf-8", "replace").split("=", 1) for item in raw_env if item.startswith(b"RANKWATCH_"))
    assert env["RANKWATCH_BUNDLE"] == str(found[0]) and env["RANKWATCH_JOB_ID"] == "hostile"
    assert not unsafe_strings(env), unsafe_strings(env)
    # the HTML report of the run escapes what stays markup in the documents
    page = tmp_path / "report.html"
    result = subprocess.run(rankwatch_cmd("report", str(found[0]), "--html", str(page)), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    html = page.read_text(encoding="utf-8")
    assert "&lt;script&gt;" in html and "<script>alert" not in html and "<script>" + C1_CSI not in html
    assert_inert(html, max_line=200_000)
    # the stack files alone keep what py-spy read (a human asked for them): the raw thread name may be there
    assert (found[0] / "stacks").is_dir()
