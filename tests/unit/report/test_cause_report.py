"""The straggler's cause where people read it: the HTML report and, read back from rankwatch's own output, by
``rankwatch diagnose``."""

from __future__ import annotations

import json
import subprocess

from rankwatch.watchdog.core.host_signals import RankCounters
from rankwatch.watchdog.core.straggler import diagnose_stragglers
from rankwatch.watchdog.core.straggler_cause import explain
from rankwatch.watchdog.report.html import render_html
from rankwatch.watchdog.report.text import summary_text
from test_html_report import EVIL, rings

MS = 1_000_000


def caused_summary() -> dict:
    """The HTML test's run (rank 3 slower in forward), its ranks sampled with rank 3 waiting for a CPU."""
    per_rank = rings(steps=40)
    diag = diagnose_stragglers(per_rank)
    end = max(r[-1].end_ns for r in per_rank.values())
    samples = []
    for i in range(0, 41):
        t = i * end // 40
        samples.append((t, {r: RankCounters(start_ticks=1, run_ns=t // 2, wait_ns=(t * 0.6 if r == 3 else t // 1000),
                                            cpu_ticks=0, majflt=0, nvcsw=0, cgroup="/job")
                            for r in per_rank}))
    samples = [(t, {r: RankCounters(**{**c.__dict__, "wait_ns": int(c.wait_ns)}) for r, c in by.items()})
               for t, by in samples]
    explain(diag, samples)
    assert diag.cause and diag.cause["cause"] == "cpu_contention", diag.cause
    return json.loads(json.dumps(diag.summary_doc("job-cause", [], per_rank)))


def test_the_html_report_shows_the_cause_and_the_next_step():
    doc = caused_summary()
    page = render_html([doc], base_dir="/nonexistent")
    assert '<b>cause:</b> <code>cpu_contention</code> — rank 3 waited' in page, page[:3000]
    assert "<b>next:</b> see what else runs on rank 3&#x27;s CPUs" in page
    # the same words as the text summary
    text = summary_text(doc)
    assert "cause: cpu_contention — rank 3 waited" in text


def test_a_hostile_cause_is_escaped_in_the_page():
    doc = caused_summary()
    doc["cause"].update(cause=EVIL, text=EVIL, next=EVIL)  # a summary.json anyone could have written
    page = render_html([doc], base_dir="/nonexistent")
    assert EVIL not in page and page.count("&lt;script&gt;") >= 3


def test_diagnose_reads_the_straggler_and_its_cause_back_from_rankwatchs_own_summary(tmp_path):
    from conftest import rankwatch_cmd

    log = tmp_path / "console.log"
    log.write_text("[default0]:step 10 loss 0.3\n" + summary_text(caused_summary()) + "\n")
    got = subprocess.run(rankwatch_cmd("diagnose", "--json", str(log)), capture_output=True, text=True, timeout=120)
    notes = json.loads(got.stdout)["notes"]
    (note,) = [n for n in notes if "named a straggler" in n]
    assert "COMPUTE STRAGGLER — rank 3 in forward; cause: cpu_contention — rank 3 waited" in note, note
    # a cause line that is not rankwatch's vocabulary, or with no diagnosis above it, is no cause
    log.write_text("cause: cosmic_rays — everything\ndiagnosis: RANK-WIDE STRAGGLER — rank 2\ncause: bogus — x\n")
    got = subprocess.run(rankwatch_cmd("diagnose", "--json", str(log)), capture_output=True, text=True, timeout=120)
    (note,) = [n for n in json.loads(got.stdout)["notes"] if "named a straggler" in n]
    assert note.endswith("named a straggler: RANK-WIDE STRAGGLER — rank 2"), note


def test_the_accuracy_tables_have_a_cause_column_for_stragglers():
    from test_v3_classes import SUITE

    runs = [{"summary": {"cause": c}} for c in ("own_work", "own_work", "cpu_contention")]
    assert SUITE.cause_cell(runs, "own_work", True) == "2/3 (own_work 2, cpu_contention 1)"
    assert SUITE.cause_cell(runs, None, True) == "n/a" and SUITE.cause_cell(runs, "own_work", False) == "n/a"
    # every straggler the catalogue names a rank for has its right cause; the rest have none
    cat = [*SUITE.FAULTS.values(), *SUITE.CLASSES.values()]
    assert all((e.cause == "own_work") == (e.straggler and e.culprit == "fault-rank") for e in cat)
