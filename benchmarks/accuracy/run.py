"""Localisation accuracy: how often rankwatch names the right rank, kind and phase.

Every run is a real job: ``rankwatch run --stall-timeout 3 --on-stall kill`` around torchrun (gloo on
loopback, world size 4), one fault injected at ``--fault-step`` on one rank by ``examples/fault_injection.py``
(shared by ``examples/ddp_demo.py`` and ``examples/transformer_demo.py``). Live: the first incident's
``verdict.json`` (on two-node runs the leader's); offline: ``rankwatch diagnose --json`` over the run's
console log (torchrun's and the ranks' output, rankwatch's own lines removed). The faults and their
expected answers, with the reasons, are in ``examples/fault_catalogue.py`` (``FAULTS`` for the models,
``CLASSES`` for the jobs); nothing there is tuned to what rankwatch says today.

    python benchmarks/accuracy/run.py --quick --models ddp     # 17 runs, ~4 min (each fault once, rank 0 or 3)
    python benchmarks/accuracy/run.py --models ddp --faults input-hang dead-rank --positions first other-node \\
        --repeats 3 --hogs 0 3
    python benchmarks/accuracy/run.py --quick --classes pp tpdp-tp4   # the verdict-v3 classes (CLASSES, jobs/)

Matrix: fault × rank position (``first`` 0, ``middle`` 1, ``last`` 3, ``other-node`` 2 on the second of two
simulated nodes — two ``rankwatch run`` agents, one TCPStore, same ``--run-name``) × model × hogs (0 or 3
``python -c "while True: pass"`` beside the job) × repeats. Writes ``results/<stamp>.json`` and
``results/<stamp>.md`` and prints the markdown to stdout. Runs one job at a time; every process it starts
(agents, torchrun, ranks, DataLoader workers, hogs) is killed by process group and by tracked pid.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime
import importlib.metadata
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from _util import REPO, examples_module, free_port, kill_tree, rankwatch_cmd  # noqa: E402

MODELS = {
    "ddp": str(REPO / "examples" / "ddp_demo.py"),
    "transformer": str(REPO / "examples" / "transformer_demo.py"),
}
WORLD = 4
# position → (nodes, faulting global rank); on two nodes ranks 0, 1 are node 0 (the leader), 2, 3 node 1
POSITIONS = {"first": (1, 0), "middle": (1, 1), "last": (1, WORLD - 1), "other-node": (2, 2)}
# the faults, where they fire and their right answers: one catalogue beside the demos that inject them
CATALOGUE = examples_module("fault_catalogue")
STALL_TIMEOUT, FAULT_STEP = CATALOGUE.STALL_TIMEOUT, CATALOGUE.FAULT_STEP
Expect, Klass = CATALOGUE.Expect, CATALOGUE.Klass
FAULTS: dict[str, Expect] = CATALOGUE.FAULTS  # the example models' faults (--faults)
CLASSES: dict[str, Klass] = CATALOGUE.CLASSES  # the jobs' classes (--classes)
QUICK_POSITIONS = ("first", "last")


# -- one run --------------------------------------------------------------------------------------------
def job_args(model: str, fault: str, rank: int) -> list[str]:
    e = FAULTS[fault]
    args = [MODELS[model], "--scenario", e.scenario, "--pg-timeout-s", "60"]
    if e.straggler:
        return [*args, "--straggler-rank", str(rank), "--fault-rank", str(rank), "--steps", "60"]
    return [
        *args,
        "--fault-rank",
        str(rank),
        "--fault-step",
        str(FAULT_STEP),
        "--steps",
        "400",
        "--checkpoint-budget-s",
        "1",
    ]


@dataclass(frozen=True)
class Plan:
    """What one run starts and what is right: a model fault at a position, or a v3 class."""

    model: str  # "ddp" / "transformer", or "v3" for a class of CLASSES
    fault: str  # a key of FAULTS or of CLASSES
    position: str
    nodes: int
    nproc: int  # ranks per node
    rank: int  # the faulting rank (the job's --fault-rank)
    truth: tuple[int, ...]  # the initiating ranks; () = no incident is right
    job: tuple[str, ...]  # the script and its arguments
    stall_timeout: str = STALL_TIMEOUT
    action: str | None = None
    action_node: int = 1
    rw_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


def plan_fault(model: str, fault: str, position: str) -> Plan:
    nodes, rank = POSITIONS[position]
    truth = () if FAULTS[fault].straggler else (rank,)
    return Plan(model, fault, position, nodes, WORLD // nodes, rank, truth, tuple(job_args(model, fault, rank)))


def plan_class(name: str, turn: int = 0) -> Plan:
    """The class's ``turn``-th run: the fault at ``k.ranks()[turn]`` (cycling), the truth moving with it
    where the truth is the faulting rank."""
    k = CLASSES[name]
    rank = k.ranks()[turn % len(k.ranks())]
    truth = k.truth_at(rank)
    job = (str(HERE / "jobs" / k.script), *k.args, "--fault-rank", str(rank), "--fault-step",
           str(FAULT_STEP), "--steps", str(k.steps))
    if "--pg-timeout-s" not in k.args:
        job += ("--pg-timeout-s", "60")
    where = f"rank {rank} of {k.nodes}x{k.nproc}"
    return Plan(
        "v3", name, where, k.nodes, k.nproc, rank, truth, job, k.stall_timeout, k.action, k.action_node,
        k.rw_args, k.env,
    )


def expect_of(r: dict[str, Any]) -> Expect | Klass:
    return CLASSES[r["fault"]] if r.get("model") == "v3" else FAULTS[r["fault"]]


def node_ranks(agent: subprocess.Popen[bytes]) -> list[psutil.Process]:
    """The rank processes under one node's agent: descendants with torchrun's RANK in their environment,
    other than torchrun itself."""
    found = []
    try:
        for q in psutil.Process(agent.pid).children(recursive=True):
            try:
                if "RANK" in q.environ() and "torch.distributed.run" not in " ".join(q.cmdline()):
                    found.append(q)
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return found


def read_marks(fault_log: Path) -> list[dict[str, Any]]:
    marks = []
    if fault_log.exists():
        for line in fault_log.read_text().splitlines():
            try:
                marks.append(json.loads(line))
            except ValueError:
                pass
    return marks


def node_action(plan: Plan, agents: list[Any], fault_log: Path) -> str:
    """Kill or freeze a whole node once the job marked "ready"; returns a note of what was done."""
    agent = agents[plan.action_node][0]
    t = time.time()
    if plan.action == "node-kill":
        kill_tree(agent)  # its watchdog (rankwatch run), torchrun agent and ranks, SIGKILL together
        what = f"SIGKILLed node {plan.action_node} whole (watchdog, agent, ranks)"
    else:
        ranks = node_ranks(agent)
        for q in ranks:
            with contextlib.suppress(psutil.Error):
                q.send_signal(signal.SIGSTOP)
        what = f"SIGSTOPped node {plan.action_node}'s {len(ranks)} rank processes"
    line = json.dumps({"fault": plan.action, "rank": plan.truth[0], "step": FAULT_STEP, "t": t}) + "\n"
    with open(fault_log, "a") as f:
        f.write(line)
    return what


def torchrun_args(
    nodes: int, node_rank: int, run_id: str, rdzv_port: int, master_port: int, nproc: int | None = None
) -> list[str]:
    if nodes == 1:
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}", "--rdzv-id", run_id]
    else:
        rdzv = [
            f"--nnodes={nodes}",
            f"--node-rank={node_rank}",
            "--master-addr=127.0.0.1",
            f"--master-port={master_port}",
        ]
    return ["--nproc-per-node", str(nproc or WORLD // nodes), "--monitor-interval", "0.2", *rdzv]


class Family:
    """Every process started for a run, tracked by (pid, create_time) while it lives, so that children
    re-parented away (DataLoader workers of a killed rank) are still killed at the end."""

    def __init__(self) -> None:
        self.roots: list[subprocess.Popen[bytes]] = []
        self.seen: dict[int, float] = {}

    def start(self, cmd: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(cmd, start_new_session=True, **kw)
        self.roots.append(proc)
        self.scan()
        return proc

    def scan(self) -> None:
        for root in self.roots:
            try:
                p = psutil.Process(root.pid)
                for q in [p, *p.children(recursive=True)]:
                    self.seen.setdefault(q.pid, q.create_time())
            except psutil.Error:
                pass

    def kill_all(self) -> None:
        self.scan()
        for root in self.roots:
            kill_tree(root)
        for pid, created in self.seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created:
                    p.send_signal(signal.SIGCONT)
                    p.kill()
            except psutil.Error:
                pass
        for root in self.roots:
            try:
                root.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def rankwatch_lines(line: str) -> bool:
    """rankwatch's own log lines (--json-logs: structlog JSON objects) — not part of the job's console."""
    s = line.strip()
    if not (s.startswith("{") and s.endswith("}")):
        return False
    try:
        doc = json.loads(s)
    except ValueError:
        return False
    return isinstance(doc, dict) and "event" in doc and "level" in doc


def read_verdicts(out: Path) -> list[dict[str, Any]]:
    inc = out / "incidents"
    found = []
    if inc.is_dir():
        for d in sorted(inc.iterdir()):
            f = d / "verdict.json"
            if d.name.startswith(".") or not f.is_file():
                continue
            try:
                v = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            v["_mtime"] = f.stat().st_mtime
            found.append(v)
    return found


def slim_verdict(v: dict[str, Any], node: int) -> dict[str, Any]:
    return {
        "node": node,
        "incident_id": v.get("incident_id"),
        "kind": v.get("kind"),
        "initiating_ranks": v.get("initiating_ranks"),
        "phase": v.get("phase"),
        "confidence": v.get("confidence"),
        "reason": v.get("reason"),
        "detected_after_s": v.get("detected_after_s"),
        "correlation": v.get("correlation"),
        "trigger": v.get("trigger"),
        "evidence": (v.get("evidence") or [])[:12],
        "rank_states": {
            r: {k: s.get(k) for k in ("state", "step", "phase", "in_phase_s", "collective")}
            for r, s in (v.get("ranks") or {}).items()
        },
        "mtime": v.get("_mtime"),
    }


def code_version() -> str:
    """The last commit that changed what a run measures (watchdog/, hooks/, examples/), with "+dirty" when
    watchdog/ or hooks/ have uncommitted edits (other engineers edit them while the suite runs: every run
    records what it ran)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "log", "-1", "--format=%h", "--", "watchdog", "hooks", "examples"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--", "watchdog", "hooks"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def run_one(index: int, plan: Plan, hogs: int, repeat: int, work: Path, keep: bool) -> dict[str, Any]:
    model, fault, position, nodes, rank = plan.model, plan.fault, plan.position, plan.nodes, plan.rank
    e = CLASSES[fault] if model == "v3" else FAULTS[fault]
    # Short names: AF_UNIX socket paths (108 bytes) live under these dirs — the hook's dump responder in
    # the shm job dir, multiprocessing's resource sharer (DataLoader workers passing tensors) under TMPDIR.
    run_id = f"acc{os.getpid() % 100000}-{index}"
    d = Path(tempfile.mkdtemp(prefix=f"{index:03d}-", dir=work))
    tmp = Path(tempfile.mkdtemp(prefix="rwt-"))  # the ranks' TMPDIR (checkpoint-hang's FIFO, torchrun's files)
    fault_log = d / "faults.jsonl"
    env = dict(
        os.environ,
        RW_FAULT_LOG=str(fault_log),
        TMPDIR=str(tmp),
        RES_OPTIONS="timeout:1 attempts:1",
        PYTHONUNBUFFERED="1",
    )
    env.update(plan.env)
    env.pop("RANKWATCH_JOB_ID", None)
    rdzv_port, master_port, store_port = free_port(), free_port(), free_port()
    common = ["--stall-timeout", plan.stall_timeout, "--on-stall", "kill", "--json-logs", *plan.rw_args]
    if nodes > 1:
        secret = d / "store.secret"
        fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, base64.b64encode(os.urandom(32)) + b"\n")
        os.close(fd)
        common += ["--run-name", run_id, "--store", f"127.0.0.1:{store_port}", "--store-secret-file", str(secret)]
    fam = Family()
    record: dict[str, Any] = {
        "model": model,
        "fault": fault,
        "position": position,
        "rank": rank,
        "truth": list(plan.truth),
        "nodes": nodes,
        "hogs": hogs,
        "repeat": repeat,
        "notes": [],
        "code": code_version(),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "load1": round(os.getloadavg()[0], 2),  # the machine's 1-min load average as the run starts
    }
    timeout = 240 + 120 * (hogs > 0) + 60 * (nodes > 1) + 120 * (nodes > 2)  # 8 ranks importing torch
    t0 = time.time()
    agents = []
    files = contextlib.ExitStack()
    try:
        for _ in range(hogs):
            fam.start([sys.executable, "-c", "while True: pass"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for k in range(nodes):
            out, shm = d / f"out{k}", d / f"shm{k}"
            shm.mkdir(mode=0o700)
            cmd = rankwatch_cmd(
                "run",
                "--out",
                str(out),
                "--shm-dir",
                str(shm),
                *common,
                "--",
                *torchrun_args(nodes, k, run_id, rdzv_port, master_port, plan.nproc),
                *plan.job,
            )
            so = files.enter_context(open(d / f"stdout{k}.txt", "wb"))  # noqa: SIM115
            se = files.enter_context(open(d / f"stderr{k}.txt", "wb"))  # noqa: SIM115
            agents.append((fam.start(cmd, stdout=so, stderr=se, env=env, cwd=str(d)), out, so, se))
        deadline = time.monotonic() + timeout
        acted = plan.action is None
        while time.monotonic() < deadline and any(a[0].poll() is None for a in agents):
            fam.scan()
            if not acted and any(m.get("fault") == "ready" for m in read_marks(fault_log)):
                record["notes"].append(node_action(plan, agents, fault_log))
                acted = True
            time.sleep(0.2 if not acted else 0.5)
        record["timed_out"] = any(a[0].poll() is None for a in agents)
    finally:
        fam.kill_all()
        files.close()
    record["wall_s"] = round(time.time() - t0, 2)
    record["rc"] = [a[0].returncode for a in agents]
    if record["timed_out"]:
        record["notes"].append(f"run timed out after {timeout}s (killed)")

    # -- what rankwatch said ---------------------------------------------------------------------------
    per_node = [read_verdicts(a[1]) for a in agents]
    record["incidents"] = [slim_verdict(v, k) for k, vs in enumerate(per_node) for v in vs]
    scored = per_node[0][0] if per_node[0] else next((vs[0] for vs in per_node if vs), None)
    record["verdict"] = slim_verdict(scored, 0 if per_node[0] else 1) if scored else None
    if nodes > 1 and all(per_node):
        keys = ("kind", "initiating_ranks", "phase")
        if any(per_node[k][0].get(x) != per_node[0][0].get(x) for k in range(nodes) for x in keys):
            record["notes"].append(
                "nodes' verdicts differ: "
                + "; ".join(
                    f"node {k}: {per_node[k][0].get('kind')} {per_node[k][0].get('initiating_ranks')}"
                    for k in range(nodes)
                )
            )
    if len(per_node[0]) > 1:
        record["notes"].append(f"{len(per_node[0])} incidents on the leader; the first is scored")
    summary = None
    try:
        s = json.loads((agents[0][1] / "summary.json").read_text())
        summary = {k: s.get(k) for k in ("diagnosis", "straggler_ranks", "phase", "why", "steps", "incidents")}
        # the straggler's cause (issue 41): cpu_contention, cpu_throttled, ..., own_work; None when not measured
        summary["cause"] = (s.get("cause") or {}).get("cause")
    except (OSError, ValueError, IndexError):
        pass
    record["summary"] = summary
    marks = [m for m in read_marks(fault_log) if m.get("fault") != "ready"]
    fault_t = min((m["t"] for m in marks if m.get("rank") in (rank, *plan.truth)), default=None)
    no_incident_right = not plan.truth
    record["fault_fired"] = fault_t is not None or getattr(e, "straggler", False)
    if fault_t is None and not getattr(e, "straggler", False):
        record["notes"].append("the fault never fired (no mark in RW_FAULT_LOG)")
    record["fault_to_verdict_s"] = round(scored["_mtime"] - fault_t, 2) if scored and fault_t else None

    # -- offline: rankwatch diagnose over the console log(s) -------------------------------------------
    logs = []
    for k in range(nodes):
        raw = (d / f"stderr{k}.txt").read_text(errors="replace").splitlines(keepends=True)
        job_lines = (d / f"stdout{k}.txt").read_text(errors="replace")
        console = d / f"console{k}.log"
        # ranks write nothing to stdout here; rankwatch's incident/summary text goes there, so the job's
        # console is its stderr without rankwatch's JSON log lines
        console.write_text("".join(line for line in raw if not rankwatch_lines(line)))
        logs.append(str(console))
        record.setdefault("stdout_tail", []).append(job_lines[-1500:])
    record["console_bytes"] = sum(os.path.getsize(p) for p in logs)
    entry = re.compile(rf"^\s*rank\s*:\s*{rank}\s*\(local_rank", re.M)
    record["culprit_in_report"] = any(entry.search(Path(p).read_text(errors="replace")) for p in logs)
    try:
        p = subprocess.run(rankwatch_cmd("diagnose", "--json", *logs), capture_output=True, text=True, timeout=120)
        doc = json.loads(p.stdout) if p.stdout.strip().startswith("{") else {}
        record["offline"] = {
            "rc": p.returncode,
            "kind": doc.get("kind"),
            "initiating_ranks": doc.get("initiating_ranks"),
            "confidence": doc.get("confidence"),
            "reason": doc.get("reason"),
            "error": None if doc else (p.stderr or p.stdout)[-500:],
        }
    except (subprocess.TimeoutExpired, ValueError) as exc:
        record["offline"] = {"rc": None, "error": repr(exc)[:300]}
    if record["verdict"] is None and not getattr(e, "straggler", False) and not no_incident_right:
        record["stderr_tail"] = [(d / f"stderr{k}.txt").read_text(errors="replace")[-3000:] for k in range(nodes)]
    record["score"] = score_class(record, e) if isinstance(e, Klass) else score(record, e)
    if keep:
        record["dir"] = str(d)
    else:
        shutil.rmtree(d, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return record


def score(r: dict[str, Any], e: Expect) -> dict[str, Any]:
    """right rank / kind / phase (None: not scored) / offline rank (None: n/a) and what was named."""
    v, rank = r["verdict"], r["rank"]
    off = r.get("offline") or {}
    off_named = off.get("initiating_ranks") or []
    applies = e.offline and not (e.offline_if_unreported and r.get("culprit_in_report", True))
    s: dict[str, Any] = {"offline_named": off_named, "offline": (off_named == [rank]) if applies else None}
    if e.straggler:
        summ = r.get("summary") or {}
        named = (v.get("initiating_ranks") or []) if v else (summ.get("straggler_ranks") or [])
        s.update(
            named=named,
            rank=v is None and summ.get("straggler_ranks") == [rank],
            kind=v is None and summ.get("diagnosis") in e.kinds,
            phase=v is None and summ.get("phase") == e.phase,
        )
        return s
    named = (v.get("initiating_ranks") or []) if v else []
    s.update(
        named=named,
        rank=named == [rank],
        kind=bool(v) and v.get("kind") in e.kinds,
        phase=None if e.phase is None else bool(v) and v.get("phase") == e.phase,
    )
    return s


def score_class(r: dict[str, Any], k: Klass) -> dict[str, Any]:
    """As ``score`` for a v3 class: the truth may be several ranks (a whole node) or none (no incident is
    right); ``later_wrong`` counts the incidents after the first (on any node) that name a rank outside
    the truth — a second alert blaming a healthy rank is a wrong answer too."""
    v, truth = r["verdict"], sorted(r["truth"])
    off = r.get("offline") or {}
    off_named = sorted(off.get("initiating_ranks") or [])
    firsts = {inc.get("incident_id") for inc in r["incidents"][:1]}
    later = [
        inc
        for inc in r["incidents"]
        if inc.get("incident_id") not in firsts and set(inc.get("initiating_ranks") or []) - set(truth)
    ]
    named = sorted((v.get("initiating_ranks") or []) if v else [])
    if k.straggler:  # no incident is right, and the summary names the slow rank
        summ = r.get("summary") or {}
        named = named or sorted(summ.get("straggler_ranks") or [])
        ok = v is None and not r.get("timed_out") and all(rc == 0 for rc in r["rc"])
        return {"named": named, "rank": ok and named == truth, "kind": ok and summ.get("diagnosis") in k.kinds,
                "phase": ok and summ.get("phase") == k.phase, "offline_named": off_named, "offline": None,
                "later_wrong": len(later), "confidence": None}
    if not truth:
        right = v is None and not r.get("timed_out") and all(rc == 0 for rc in r["rc"])
        return {"named": named, "rank": right, "kind": right, "phase": None, "offline_named": off_named,
                "offline": None, "later_wrong": len(later)}
    return {
        "named": named,
        "rank": named == truth and not later,
        "kind": bool(v) and v.get("kind") in k.kinds,
        "phase": None if k.phase is None else bool(v) and v.get("phase") == k.phase,
        "offline_named": off_named,
        "offline": (off_named == truth) if k.offline else None,
        "later_wrong": len(later),
        "confidence": v.get("confidence") if v else None,
    }


# -- the report -----------------------------------------------------------------------------------------
def frac(xs: list[bool | None]) -> str:
    ys = [x for x in xs if x is not None]
    return f"{sum(ys)}/{len(ys)}" if ys else "—"


def med(xs: list[float | None]) -> str:
    ys = [x for x in xs if x is not None]
    return f"{statistics.median(ys):.2f}" if ys else "—"


def pr(runs: list[dict[str, Any]], offline: bool) -> tuple[str, str]:
    if offline:
        naming = [r for r in runs if r["score"]["offline_named"]]
        exact = [r for r in naming if r["score"]["offline_named"] == [r["rank"]]]
        applicable = [r for r in runs if r["score"]["offline"] is not None]
        right = [r for r in applicable if r["score"]["offline"]]
    else:
        naming = [r for r in runs if r["score"]["named"]]
        exact = [r for r in naming if r["score"]["named"] == [r["rank"]]]
        applicable, right = runs, [r for r in runs if r["score"]["rank"]]

    def pct(a: int, b: int) -> str:
        return f"{100 * a / b:.0f}% ({a}/{b})" if b else "—"

    return pct(len(exact), len(naming)), pct(len(right), len(applicable))


def cause_cell(runs: list[dict[str, Any]], right: str | None, straggler: bool) -> str:
    """A straggler fault's cause column: the runs whose summary gave the right cause, then what each run's
    summary said (issue 41); "n/a" for a fault that slows no rank, or no rank in particular."""
    if not straggler or right is None:
        return "n/a"
    said = [(r.get("summary") or {}).get("cause") for r in runs]
    counts = ", ".join(f"{c or 'none'} {n}" for c, n in sorted(Counter(said).items(), key=lambda x: -x[1]))
    return f"{sum(c == right for c in said)}/{len(said)} ({counts})"


def report(all_runs: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    # a run whose fault never fired (the harness or the job failed before the fault step) measures nothing
    runs = [r for r in all_runs if r["fault_fired"] and r["model"] != "v3"]
    v3_runs = [r for r in all_runs if r["fault_fired"] and r["model"] == "v3"]
    invalid = [r for r in all_runs if not r["fault_fired"]]
    out = [
        f"### Localisation accuracy — {meta['date']}",
        "",
        f"`{meta['command']}` — {len(runs) + len(v3_runs)} runs"
        + (f" (+{len(invalid)} invalid, listed at the end)" if invalid else "")
        + f", {meta['wall_min']:.1f} min; "
        + (
            f"models {', '.join(meta['models'])}; positions {', '.join(meta['positions'])}; "
            f"world size {WORLD}, "
            if runs
            else ""
        )
        + (f"v3 classes {', '.join(dict.fromkeys(r['fault'] for r in v3_runs))}; " if v3_runs else "")
        + f"hogs {meta['hogs']}; repeats {meta['repeats']}; fault at step {FAULT_STEP}, --stall-timeout "
        f"{STALL_TIMEOUT} (unless a class says otherwise), --on-stall kill. {meta['machine']}"
        + (
            f" Load average (1 min) at each run's start: median {statistics.median(loads):.1f}, "
            f"{min(loads):.1f}–{max(loads):.1f}."
            if (loads := [r["load1"] for r in all_runs if r.get("load1") is not None])
            else ""
        ),
        "",
        "Code measured (last commit to watchdog/, hooks/, examples/ at the run's start; +dirty: uncommitted "
        "edits in watchdog/ or hooks/): "
        + ", ".join(
            f"{c} ({sum(str(r.get('code')) == c for r in runs + v3_runs)} runs)"
            for c in sorted({str(r.get("code")) for r in runs + v3_runs})
        )
        + ".",
        "",
    ]
    for model in meta["models"]:
        mr = [r for r in runs if r["model"] == model]
        if not mr:
            continue
        out += [
            f"**{model}**",
            "",
            "| fault | runs | right rank | right kind | right phase | median detected_after_s "
            "| median fault→verdict s | offline rank | right cause |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for fault in FAULTS:
            fr = [r for r in mr if r["fault"] == fault]
            if not fr:
                continue
            sc = [r["score"] for r in fr]
            offline = frac([s["offline"] for s in sc]) if FAULTS[fault].offline else "n/a"
            det = [r["verdict"]["detected_after_s"] for r in fr if r["verdict"]]
            ftv = [r["fault_to_verdict_s"] for r in fr]
            out.append(
                f"| {fault} | {len(fr)} | {frac([s['rank'] for s in sc])} | {frac([s['kind'] for s in sc])} | "
                f"{frac([s['phase'] for s in sc])} | {med(det)} | {med(ftv)} | {offline} | "
                f"{cause_cell(fr, FAULTS[fault].cause, FAULTS[fault].straggler)} |"
            )
        p, rc = pr(mr, offline=False)
        po, rco = pr(mr, offline=True)
        out += [
            "",
            f"Live: precision {p}, recall {rc}. Offline (`rankwatch diagnose` on the console log): "
            f"precision {po}, recall {rco} (recall over the faults whose log holds the evidence).",
            "",
        ]
    if len({r["position"] for r in runs}) > 1 or len({r["hogs"] for r in runs}) > 1:
        out += ["| slice | runs | right rank | right kind |", "|---|---|---|---|"]
        for key in ("position", "hogs", "model"):
            for val in sorted({r[key] for r in runs}, key=str):
                sr = [r for r in runs if r[key] == val]
                out.append(
                    f"| {key} = {val} | {len(sr)} | {frac([r['score']['rank'] for r in sr])} | "
                    f"{frac([r['score']['kind'] for r in sr])} |"
                )
        out.append("")
    out += ["**Misses (live)**", ""]
    n = 0
    for r in runs:
        s, e = r["score"], FAULTS[r["fault"]]
        wrong = [k for k in ("rank", "kind", "phase") if s[k] is False]
        if not wrong:
            continue
        n += 1
        v = r["verdict"]
        if e.straggler:
            summ = r.get("summary") or {}
            said = (
                f"incident {v['kind']} {v['initiating_ranks']} phase {v['phase']}: {v['reason']}"
                if v
                else f"summary {summ.get('diagnosis')} {summ.get('straggler_ranks')} phase {summ.get('phase')} "
                f"cause {summ.get('cause')}: {summ.get('why')}"
            )
        elif v:
            said = f"{v['kind']} {v['initiating_ranks']} phase {v['phase']} ({v['confidence']}): {v['reason']}"
        else:
            said = "no incident (" + ("; ".join(r["notes"]) or f"job ended, rc {r['rc']}") + ")"
        exp = f"{'/'.join(e.kinds)} [{r['rank']}]" + (f" {e.phase}" if e.phase else "")
        out.append(
            f"- {r['model']} {r['fault']} {r['position']} (rank {r['rank']}) hogs {r['hogs']} #{r['repeat']} — "
            f"wrong {', '.join(wrong)}; expected {exp}; said {said}"
        )
    if not n:
        out.append("- none")
    out += ["", "**Misses (offline, where the log holds the evidence)**", ""]
    n = 0
    for r in runs:
        s = r["score"]
        if s["offline"] is False:
            n += 1
            o = r.get("offline") or {}
            out.append(
                f"- {r['model']} {r['fault']} {r['position']} (rank {r['rank']}) hogs {r['hogs']} #{r['repeat']} — "
                f"diagnose named {o.get('initiating_ranks')} ({o.get('kind')}, exit {o.get('rc')}): {o.get('reason')}"
            )
    if not n:
        out.append("- none")
    wrong_na = [
        r
        for r in runs
        if r["score"]["offline"] is None and r["score"]["offline_named"] and r["score"]["offline_named"] != [r["rank"]]
    ]
    if wrong_na:
        out += ["", "Offline namings where the log cannot know (counted against offline precision):", ""]
        for r in wrong_na:
            o = r["offline"]
            out.append(
                f"- {r['model']} {r['fault']} {r['position']} (rank {r['rank']}) — named {o.get('initiating_ranks')} "
                f"({o.get('kind')}): {o.get('reason')}"
            )
    if v3_runs:
        out += ["", *report_classes(v3_runs)]
    if invalid:
        out += ["", "Invalid runs (the fault never fired; not scored):", ""]
        for r in invalid:
            out.append(
                f"- {r['model']} {r['fault']} {r['position']} hogs {r['hogs']} #{r['repeat']}: {'; '.join(r['notes'])}"
            )
    return "\n".join(out) + "\n"


def class_outcome(r: dict[str, Any]) -> str:
    """right / wrong / abstained for one class run: wrong names a rank outside the truth (first incident or a
    later one) or gives an incident where none is right; abstained names nobody (or misses the incident)."""
    s = r["score"]
    if s["rank"]:
        return "right"
    if s["named"] or s.get("later_wrong") or not r["truth"]:
        return "wrong"
    return "abstained"


def report_classes(runs: list[dict[str, Any]]) -> list[str]:
    """The v3 classes' table: one row per class, right / wrong (with its confidence) / abstained, split by
    hogs, the ranks the fault sat at, and the misses."""
    hogs = sorted({r["hogs"] for r in runs})
    out = [
        "**v3 classes** (`--classes`)",
        "",
        "| class | runs | fault at ranks | truth | right rank | "
        + " | ".join(f"right, hogs {h}" for h in hogs)
        + " | wrong (confidence) | abstained | right kind | right phase | later incidents blaming others "
        "| offline named | median fault→verdict s | right cause |",
        "|---|---|---|---|---|" + "---|" * len(hogs) + "---|---|---|---|---|---|---|---|",
    ]
    for name in CLASSES:
        cr = [r for r in runs if r["fault"] == name]
        if not cr:
            continue
        sc = [r["score"] for r in cr]
        wrong = [r for r in cr if class_outcome(r) == "wrong"]
        wrong_txt = (
            f"{len(wrong)} ("
            + ", ".join(f"{r['score']['named'] or 'incident'} {r['score'].get('confidence') or '-'}" for r in wrong)
            + ")"
            if wrong
            else "0"
        )
        by_hogs = [frac([r["score"]["rank"] for r in cr if r["hogs"] == h]) for h in hogs]
        out.append(
            f"| {name} | {len(cr)} | {', '.join(str(x) for x in dict.fromkeys(r['rank'] for r in cr))} | "
            f"{'per run' if len({tuple(r['truth']) for r in cr}) > 1 else (cr[0]['truth'] or 'no incident')} | "
            f"{frac([s['rank'] for s in sc])} | {' | '.join(by_hogs)} | {wrong_txt} | "
            f"{sum(class_outcome(r) == 'abstained' for r in cr)} | {frac([s['kind'] for s in sc])} | "
            f"{frac([s['phase'] for s in sc])} | {sum(s['later_wrong'] for s in sc)} | "
            f"{'; '.join(str(s['offline_named'] or 'none') for s in sc)} | "
            f"{med([r['fault_to_verdict_s'] for r in cr])} | "
            f"{cause_cell(cr, CLASSES[name].cause, CLASSES[name].straggler)} |"
        )
    total = len(runs)
    right = sum(class_outcome(r) == "right" for r in runs)
    out += ["", f"All classes: right rank {right}/{total}"
            + (f" ({100 * right / total:.1f} %)" if total else "") + "."]
    out += ["", "**Misses (v3 classes)**", ""]
    n = 0
    for r in runs:
        s = r["score"]
        wrong = [k for k in ("rank", "kind", "phase") if s[k] is False]
        if not wrong:
            continue
        n += 1
        v = r["verdict"]
        summ = r.get("summary") or {}
        said = (
            f"{v['kind']} {v['initiating_ranks']} phase {v['phase']} ({v['confidence']}): {v['reason']}"
            if v
            else f"no incident; summary {summ.get('diagnosis')} {summ.get('straggler_ranks')} phase "
            f"{summ.get('phase')} cause {summ.get('cause')}: {summ.get('why')}"
            if CLASSES[r["fault"]].straggler
            else "no incident (" + ("; ".join(r["notes"]) or f"job ended, rc {r['rc']}") + ")"
        )
        later = [
            f"{i['kind']} {i['initiating_ranks']} (node {i['node']})" for i in r["incidents"][1:]
        ]
        out.append(
            f"- {r['fault']} at rank {r['rank']} hogs {r['hogs']} #{r['repeat']} — wrong {', '.join(wrong)}; "
            f"truth {r['truth'] or 'no incident'}; said {said}"
            + (f"; later incidents: {', '.join(later)}" if later else "")
        )
    if not n:
        out.append("- none")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick",
        action="store_true",
        help="one repeat, no hogs, single node, each fault once per model "
        "at the first or the last rank alternately (with --positions: every fault at each of those)",
    )
    p.add_argument(
        "--faults", nargs="+", choices=list(FAULTS), default=None, help="default: all (none when --classes is given)"
    )
    p.add_argument(
        "--classes",
        nargs="+",
        choices=[*CLASSES, "all"],
        default=None,
        help="v3 fault classes (jobs/), each once at its own rank: " + " ".join(CLASSES),
    )
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument(
        "--positions", nargs="+", choices=list(POSITIONS), default=None, help="default: all four (--quick: first last)"
    )
    p.add_argument("--repeats", type=int, default=None, help="default 2 (--quick: 1)")
    p.add_argument(
        "--hogs", nargs="+", type=int, default=None, help="CPU hogs beside the job, e.g. 0 3 (default; --quick: 0)"
    )
    p.add_argument("--out", default=str(HERE / "results"), help="where the JSON and markdown go")
    p.add_argument("--label", default=None, help="file name stem (default: a timestamp)")
    p.add_argument(
        "--resume", action="store_true", help="keep the runs already in --out/--label's JSON and do only the rest"
    )
    p.add_argument("--keep", action="store_true", help="keep each run's dir (logs, bundles) under --work")
    p.add_argument("--work", default=None, help="scratch dir for runs (default: a temp dir, removed unless --keep)")
    p.add_argument("--machine", default=None, help="machine note for the report (default: cores, load, versions)")
    a = p.parse_args(argv)
    classes = list(CLASSES) if a.classes and "all" in a.classes else (a.classes or [])
    if a.faults is None:
        a.faults = [] if classes else list(FAULTS)
    # interruptible even when started in the background (where SIGINT is ignored): every run's processes
    # are killed by run_one's finally, then the runs so far are reported
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    positions = a.positions or (list(QUICK_POSITIONS) if a.quick else list(POSITIONS))
    repeats = a.repeats or (1 if a.quick else 2)
    hogs = a.hogs if a.hogs is not None else ([0] if a.quick else [0, 3])
    if a.quick and a.positions is None:
        positions = [x for x in positions if POSITIONS[x][0] == 1]
    os.makedirs(a.out, exist_ok=True)
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="rwacc-"))
    work.mkdir(parents=True, exist_ok=True)
    if len(str(work.resolve())) > 48:
        print(f"warning: --work {work} is long; AF_UNIX socket paths under it may exceed 108 bytes", file=sys.stderr)
    stamp = a.label or datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    if a.quick and a.positions is None:
        # every fault once per model, at the first and the last rank alternately (flipped for the next model)
        matrix = [
            (m, f, positions[(i + j) % len(positions)], h, rep)
            for j, m in enumerate(a.models)
            for h in hogs
            for rep in range(repeats)
            for i, f in enumerate(a.faults)
        ]
    else:
        matrix = [
            (m, f, pos, h, rep)
            for m in a.models
            for h in hogs
            for rep in range(repeats)
            for pos in positions
            for f in a.faults
        ]
    # a class's runs rotate its fault through k.ranks(): turn = hog index × repeats + repeat
    matrix += [
        ("v3", c, plan_class(c, hi * repeats + rep).position, h, rep)
        for hi, h in enumerate(hogs)
        for rep in range(repeats)
        for c in classes
    ]
    print(f"{len(matrix)} runs → {a.out}/{stamp}.json", file=sys.stderr)
    runs: list[dict[str, Any]] = []
    t0 = time.time()
    json_path = Path(a.out) / f"{stamp}.json"
    earlier_min = 0.0
    if a.resume and json_path.exists():
        old = json.loads(json_path.read_text())
        runs = old["runs"]
        earlier_min = old["meta"].get("wall_min", 0.0)
        done = {(r["model"], r["fault"], r["position"], r["hogs"], r["repeat"]) for r in runs}
        matrix = [x for x in matrix if x not in done]
        print(f"resuming: {len(runs)} runs done, {len(matrix)} to go", file=sys.stderr)

    def save() -> None:
        meta["wall_min"] = earlier_min + (time.time() - t0) / 60
        tmp = json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
        tmp.replace(json_path)

    machine = a.machine or (
        f"{os.cpu_count()} CPU cores (shared), load average {os.getloadavg()[0]:.1f} at start, "
        f"torch {importlib.metadata.version('torch')}, Python {sys.version.split()[0]}."
    )
    meta = {
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/accuracy/run.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "models": a.models,
        "positions": positions,
        "hogs": hogs,
        "repeats": repeats,
        "machine": machine,
        "expectations": {k: asdict(v) for k, v in FAULTS.items()},
        "class_expectations": {k: asdict(v) for k, v in CLASSES.items() if k in classes},
    }
    try:
        for i, (m, f, pos, h, rep) in enumerate(matrix, 1):
            plan = plan_class(f, hogs.index(h) * repeats + rep) if m == "v3" else plan_fault(m, f, pos)
            r = run_one(i, plan, h, rep, work, a.keep)
            runs.append(r)
            s = r["score"]
            v = r["verdict"]
            said = (
                f"{v['kind']} {v['initiating_ranks']} {v['phase']}"
                if v
                else (
                    f"summary {(r['summary'] or {}).get('straggler_ranks')}"
                    if getattr(expect_of(r), "straggler", False)
                    else "no incident"
                )
            )
            print(
                f"[{i}/{len(matrix)}] {m} {f} {pos} h{h} #{rep}: rank={s['rank']} kind={s['kind']} phase={s['phase']} "
                f"offline={s['offline']} ({said}; {r['wall_s']}s)",
                file=sys.stderr,
                flush=True,
            )
            save()
    except KeyboardInterrupt:
        print("interrupted: reporting the runs so far", file=sys.stderr)
    save()
    text = report(runs, meta)
    (Path(a.out) / f"{stamp}.md").write_text(text)
    print(text)
    if not a.work and not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
