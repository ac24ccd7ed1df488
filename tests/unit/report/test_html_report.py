"""Self-contained HTML report: real summary and verdict documents, the library call and the CLI."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys

import pytest
from rankwatch.watchdog.core.snapshot import RUNNING, RankView
from rankwatch.watchdog.core.steps import StepTiming
from rankwatch.watchdog.core.straggler import diagnose_stragglers
from rankwatch.watchdog.errors import UserError
from rankwatch.watchdog.report.html import EXTRA_COLOURS, PHASE_COLOURS, nice_ticks, render_html, write_html
from rankwatch.watchdog.report.text import summary_text
from rankwatch.watchdog.verdict import decide

EVIL = "<script>alert('x')</script>"
MS = 1_000_000


def rings(n_ranks: int = 4, steps: int = 40, slow: int = 3) -> dict[int, list[StepTiming]]:
    """Rank ``slow`` spends 30 ms more in forward; the others wait for it in the all-reduce."""
    out = {}
    for r in range(n_ranks):
        t, ring = 0, []
        for s in range(steps):
            own = {"dataloader": 4.0, "forward": 40.0 if r == slow else 10.0, "backward": 20.0, "optimizer": 3.0}
            phases = {**own, "collective": 1.0 if r == slow else 31.0}
            if s == 0:
                phases["idle"] = 5000.0  # start-up: must not flatten the timeline
            dur = sum(phases.values())
            ring.append(StepTiming(step=s, start_ns=t, end_ns=t + int(dur * MS), phases_ms=phases))
            t += int(dur * MS)
        out[r] = ring
    return out


def summary_doc(incidents: list[str], verdicts: tuple = ()) -> dict:
    per_rank = rings()
    diag = diagnose_stragglers(per_rank)
    assert diag.label == "COMPUTE STRAGGLER" and diag.straggler_ranks == [3]
    return json.loads(json.dumps(diag.summary_doc("job-html", incidents, per_rank, verdicts)))


def verdict_doc(incident_id: str = "20260101T000000Z-001-stall") -> dict:
    views = []
    for r in range(4):
        behind = r == 1
        views.append(RankView(
            rank=r, node="node-a", pid=1000 + r, state=RUNNING, step=7,
            phase="dataloader" if behind else "collective", in_phase_s=42.0, since_progress_s=42.0,
            coll_seq=4 if behind else 5, coll_done=4, coll_op="all_reduce",
            stack_top=("train.py:12 in <module>", "loader.py:88 in __next__") if behind
            else ("train.py:30 in <module>",),
        ))
    doc = decide(views, job_id="job-html", incident_id=incident_id, detected_after_s=31.5).to_json()
    assert doc["initiating_ranks"] == [1] and doc["phase"] == "dataloader"
    doc["reason"] += " " + EVIL
    doc["evidence"].append("log line " + EVIL)
    return json.loads(json.dumps(doc))


def assert_self_contained(page: str) -> None:
    assert not re.search(r"""(?:src|href|action|xlink:href)\s*=\s*["']?\s*(?:https?:|//|data:)""", page, re.I)
    assert "http://" not in page and "https://" not in page
    assert "<script" not in page.lower()
    assert "<link" not in page.lower() and "@import" not in page and "url(" not in page
    assert "default-src 'none'" in page


def polylines(page: str, series: str = "own") -> list[str]:
    return re.findall(rf'<polyline class="rank" data-series="{series}" data-rank="(\d+)" points="([^"]+)"', page)


def test_summary_and_verdict_page(tmp_path):
    verdict = verdict_doc()
    summary = summary_doc([verdict["incident_id"]])
    out = tmp_path / "report.html"
    write_html(str(out), [verdict, summary], base_dir=str(tmp_path))
    page = out.read_text()
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    assert page.startswith("<!DOCTYPE html>")
    assert_self_contained(page)
    # summary: headline, straggler, phases table, chart, timeline
    assert "COMPUTE STRAGGLER — rank 3 in <code>forward</code>" in page
    assert "rank 3 ◀" in page  # the straggler's bar is marked
    for phase in ("dataloader", "forward", "backward", "optimizer", "collective"):
        assert f"{phase}</td>" in page
    lines = polylines(page)
    assert sorted(r for r, _ in lines) == ["0", "1", "2", "3"]
    for _, points in lines:
        assert len(points.split()) == 39  # step 0 left out
    straggler_line = re.search(r'<polyline class="rank" data-series="own" data-rank="3"[^>]*>', page).group(0)
    assert 'stroke="#d62728"' in straggler_line
    # own work and waiting are drawn apart: the straggler is high in the first, its peers in the second
    def mean_y(series: str, rank: str) -> float:  # SVG y grows downward: a smaller y is a higher value
        (points,) = [p for r, p in polylines(page, series) if r == rank]
        return sum(float(xy.split(",")[1]) for xy in points.split()) / len(points.split())

    assert mean_y("own", "3") < min(mean_y("own", r) for r in "012")
    assert mean_y("wait", "3") > max(mean_y("wait", r) for r in "012")
    assert len(polylines(page, "wait")) == 4
    # the phases that wait (and idle) have colours of their own
    colours = [PHASE_COLOURS[p] for p in ("collective", "grad_sync", "idle")]
    assert len(set(colours)) == 3 and not set(colours) & set(EXTRA_COLOURS)
    # incidents list links to the verdict section
    assert f'<a href="#incident-0">{verdict["incident_id"]}</a>' in page
    # verdict: headline, reason escaped, evidence, per-rank table with the initiator highlighted
    assert "HANG — initiating rank 1 in phase <code>dataloader</code>" in page
    assert "confidence high" in page
    assert EVIL not in page and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    assert "train.py:12 in &lt;module&gt;" in page
    assert re.search(r'<tr class="hl"><td>1 ◀</td><td class="l">node-a</td>', page)
    assert "all_reduce #5" in page


def test_a_run_that_hung_leads_with_the_incident():
    verdict = verdict_doc()
    page = render_html([summary_doc([verdict["incident_id"]], (verdict,)), verdict], base_dir="/nonexistent")
    summary = page.split('<section class="doc summary"', 1)[1].split("</section>", 1)[0]
    first = re.findall(r'<p class="(headline \w+|context)">(.*?)</p>', summary)
    assert first[0][0] == "headline bad" and first[0][1].startswith("HANG — initiating rank 1")
    # what the steps did before the incident is context, in a calmer style than the incident's headline
    assert first[1] == ("context", "before the incident: COMPUTE STRAGGLER — rank 3 in <code>forward</code>")
    assert ".context{font-size:15px;font-weight:500;color:#444" in page
    text = summary_text(summary_doc([verdict["incident_id"]], (verdict,)))
    assert text.startswith("rankwatch: HANG — initiating rank 1") and "before the incident, diagnosis:" in text


def test_cli_renders_run_dir_with_bundle(tmp_path):
    run = tmp_path / "run"
    verdict = verdict_doc()
    bundle = run / "incidents" / verdict["incident_id"]
    (bundle / "stacks").mkdir(parents=True)
    (bundle / "verdict.json").write_text(json.dumps(verdict))
    (bundle / "stacks" / "groups.txt").write_text("2 distinct stack(s)\n[abc] ranks 1 (1)\n    f() <" + EVIL + ">\n")
    whole = "rank 1 pid 7\nThread 7 (MainThread)\n" + "".join(f"    frame_{i} (/x/train.py:{i})\n" for i in range(12))
    (bundle / "stacks" / "rank-1.txt").write_text(whole)
    (run / "summary.json").write_text(json.dumps(summary_doc([verdict["incident_id"]])))
    out = tmp_path / "out.html"
    out.write_text("old")
    os.chmod(out, 0o644)
    proc = subprocess.run([sys.executable, "-m", "rankwatch.watchdog.cli", "report", str(run), "--html", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out}" in proc.stdout
    page = out.read_text()
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    assert_self_contained(page)
    assert "COMPUTE STRAGGLER" in page and "HANG — initiating rank 1" in page
    assert "<h3>Stack groups</h3><pre>2 distinct stack(s)\n[abc] ranks 1 (1)" in page
    # where the bundle is, and rank 1's whole stack (every frame, not five)
    assert f"bundle: <code>{bundle}</code>" in page
    assert all(f"frame_{i} (/x/train.py:{i})" in page for i in range(12))
    assert EVIL not in page
    assert len(polylines(page)) == 4
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]

    # a single bundle dir finds its own stacks/groups.txt
    proc = subprocess.run([sys.executable, "-m", "rankwatch.watchdog.cli", "report", str(bundle), "--html", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    page = out.read_text()
    assert "Stack groups" in page and "COMPUTE STRAGGLER" not in page

    # an unwritable destination is one clear line and exit code 2
    proc = subprocess.run([sys.executable, "-m", "rankwatch.watchdog.cli", "report", str(run), "--html",
                           str(tmp_path / "missing" / "x.html")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "cannot write HTML report" in proc.stderr and "Traceback" not in proc.stderr


def test_partial_and_hostile_documents_still_render(tmp_path):
    summary = {"schema": "rankwatch.summary/1", "job_id": EVIL, "diagnosis": EVIL, "straggler_ranks": [0],
               "phase": EVIL, "steps": 3, "step_time_ms": {"median": "x"}, "phases": {EVIL: {"median_ms": None}},
               "ranks": {"0": {"phases": {EVIL: 5.0}}, "1": "junk"}, "incidents": [EVIL],
               "timeline": {"0": [[1, 5.0]], "1": "junk"}}
    verdict = {"schema": "rankwatch.verdict/1", "kind": EVIL, "incident_id": "../../etc", "ranks": {"0": None},
               "initiating_ranks": ["x", 0], "evidence": [EVIL]}
    page = render_html([summary, verdict], base_dir=str(tmp_path))
    assert EVIL not in page
    assert_self_contained(page)
    assert len(polylines(page, "step")) == 1  # an older summary: step time only
    with pytest.raises(UserError, match="cannot write HTML report"):
        write_html(str(tmp_path / "nope" / "r.html"), [summary], base_dir=str(tmp_path))


def test_nice_ticks():
    assert nice_ticks(75.0) == [0, 20, 40, 60, 80]
    assert nice_ticks(0.0) == [0.0, 1.0]
    assert nice_ticks(1234.0)[-1] >= 1234.0
