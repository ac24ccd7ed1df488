"""examples/prometheus/ and examples/grafana/: the rules pass the real ``promtool`` (Debian ``prometheus``),
their unit tests pass ``promtool test rules``, and every metric the rules and the dashboard use exists in a
real scrape of a real ``rankwatch daemon`` watching a real job, with the token that shows per-job series."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request

import pytest
from conftest import REPO, free_port, rankwatch_cmd, wait_for
from prometheus_client.parser import text_string_to_metric_families

PROM = REPO / "examples" / "prometheus"
DASHBOARD = REPO / "examples" / "grafana" / "rankwatch-dashboard.json"
PROMTOOL = shutil.which("promtool")
JOB_PROC = REPO / "tests" / "procs" / "alert_job.py"
# series Prometheus makes itself, not rankwatch
PROMETHEUS_OWN = {"up"}

needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian package prometheus) not installed")


@needs_promtool
def test_rules_pass_promtool_check():
    result = subprocess.run([PROMTOOL, "check", "rules", "rankwatch-rules.yml"], cwd=PROM, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 6 rules found" in result.stdout


@needs_promtool
def test_rules_unit_tests_pass_promtool_test():
    result = subprocess.run([PROMTOOL, "test", "rules", "rankwatch-rules.test.yml"], cwd=PROM,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def metric_names_in(text: str) -> set[str]:
    """Every identifier in PromQL expressions that names a series (rankwatch's, or Prometheus' ``up``)."""
    return set(re.findall(r"\brankwatch_[a-zA-Z0-9_]+", text)) | {m for m in PROMETHEUS_OWN
                                                               if re.search(rf"\b{m}\{{", text)}


def expressions() -> dict[str, str]:
    yaml = pytest.importorskip("yaml")
    rules = yaml.safe_load((PROM / "rankwatch-rules.yml").read_text())
    out = {f"rule {r['alert']}": r["expr"] for g in rules["groups"] for r in g["rules"]}
    dash = json.loads(DASHBOARD.read_text())
    for p in dash["panels"]:
        for t in p["targets"]:
            out[f"panel {p['title']} {t['refId']}"] = t["expr"]
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            out[f"variable {v['name']}"] = v["definition"]
    return out


def test_the_dashboard_is_grafana_json_over_one_prometheus_datasource():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "rankwatch" and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and all(t["expr"] for t in p["targets"]), p["title"]


def scrape(port: int, token: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.read().decode()


def exposed(text: str) -> set[str]:
    names = set()
    for fam in text_string_to_metric_families(text):
        names.add(fam.name)
        names.update(s.name for s in fam.samples)
        if fam.type == "counter":
            names.add(fam.name + "_total")
        if fam.type == "histogram":
            names.update(fam.name + suffix for suffix in ("_bucket", "_sum", "_count"))
    return names


@pytest.mark.slow
def test_every_metric_in_the_rules_and_dashboard_is_in_a_real_scrape(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    token = tmp_path / "metrics.token"
    token.write_text("tok-123\n")
    token.chmod(0o600)
    env = {**os.environ, "RANKWATCH_SHM_DIR": str(shm), "RANKWATCH_JOB_ID": "scraped"}
    job = subprocess.Popen([sys.executable, str(JOB_PROC), "--ranks", "2"], env=env, stdout=subprocess.PIPE,
                           text=True, start_new_session=True)
    port = free_port()
    daemon = subprocess.Popen(
        rankwatch_cmd("daemon", "--shm-dir", str(shm), "--out", str(tmp_path / "out"), "--metrics-port", str(port),
                      "--metrics-token-file", str(token), "--poll-interval", "0.3", "--json-logs"),
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "daemon.log", "w"), start_new_session=True)
    try:
        assert job.stdout.readline().strip() == "ready"

        def full() -> str | None:
            try:
                text = scrape(port, "tok-123")
            except OSError:
                return None
            return text if text.count("rankwatch_step_duration_median_seconds{") >= 2 else None

        text = wait_for(full, 120)
        assert text, (tmp_path / "daemon.log").read_text()[-3000:]
        names = exposed(text) | PROMETHEUS_OWN
        used = {where: metric_names_in(expr) for where, expr in expressions().items()}
        assert all(used.values()), [w for w, n in used.items() if not n]
        missing = {where: sorted(n - names) for where, n in used.items() if n - names}
        assert not missing, missing
        # without the token: node totals only, no job of anyone
        anonymous = scrape(port)
        assert "scraped" not in anonymous and "rankwatch_rank_" not in anonymous
        assert 'rankwatch_ranks{state="running"} 2.0' in anonymous
    finally:
        for p in (daemon, job):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
