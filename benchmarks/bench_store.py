"""Cross-node correlation through one TCPStore: store round trips per poll, and leader verdict latency.

Simulates NODES node daemons (8 ranks each) on 127.0.0.1 with the real `Correlator` / `JobStore`:
node 0 (the leader, hosting the TCPStore server) runs in this process; the other nodes run as threads
in two worker processes (so one interpreter lock does not serialise 256 daemons). Only loopback traffic;
every thread and process has a hard deadline and the run cleans up after itself.

1. Polls: every node runs the per-poll protocol (`publish_snapshot` + `poll_incident`) every POLL_S
   seconds, start times spread over the interval like unsynchronised daemons. Each node's store client
   is wrapped in a counting proxy, so the round trips per poll per node are counted exactly (every
   TCPStore call is one request/response).
2. Incidents: the last node claims incident <gen> (as the detecting node does); every node sees it on
   its next poll, "captures stacks" for a random 0.05–0.5 s, then calls `resolve`, which writes
   `evidence/<gen>/<k>`; the leader's `resolve` gathers every node's evidence, decides (a rank stuck in
   the dataloader, the others in backward) and writes `verdict/<gen>`; the followers wait for it.
   Leader verdict latency = time the leader's `set(verdict/<gen>)` returned minus the time the LAST
   node's `set(evidence/<gen>/<k>)` returned (CLOCK_MONOTONIC, shared by processes on one machine).
   The leader's gather waits server-side for every node's evidence key, then reads them in one
   `multi_get`; followers wait server-side for `verdict/<gen>` (no sleep-polls). Also measured: how long
   after the last evidence the LAST node holds the verdict (the issue-25 target, <= 100 ms).

    python benchmarks/bench_store.py                 # 8, 64, 256 nodes
    python benchmarks/bench_store.py --quick         # 8 polls and 6 incidents per size (~1 min)
    python benchmarks/bench_store.py --nodes 256
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Every TCPStore connect makes c10d reverse-resolve the peer address (getnameinfo → a PTR query for
# 127.0.0.1); with glibc's default 5 s resolver timeout one dropped DNS packet outlasts the 3 s connect
# timeout of JobStore. Bound it for this benchmark's processes (inherited by the spawned workers).
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import structlog

RANKS_PER_NODE = 8
TARGET_LATENCY_S = 1.0
TARGET_HELD_MS = 100  # issue 25: every node holds the verdict this soon after the last evidence
CAPTURE_S = (0.05, 0.5)  # simulated stack capture per node per incident
JOB = "bench-store"


def quiet() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class CountingStore:
    """Wraps a TCPStore: counts every call (one request/response each) and stamps evidence/verdict sets."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls = 0
        self.by_op: Counter[str] = Counter()
        self.marks: list[tuple[str, float, int]] = []  # (key, monotonic time the set returned, value bytes)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kw: Any) -> Any:
            self.calls += 1
            self.by_op[name] += 1
            out = attr(*args, **kw)
            if name == "set" and ("/evidence/" in args[0] or "/verdict/" in args[0]):
                self.marks.append((args[0], time.monotonic(), len(args[1])))
            return out

        return call


def make_correlator(k: int, port: int, nnodes: int) -> Any:
    from rankwatch.watchdog.cluster.correlate import Correlator

    return Correlator(JOB, k, "127.0.0.1", port, nnodes=nnodes)


@functools.cache
def all_views(world: int) -> list[Any]:
    """One rank (of some node) stuck in the dataloader, the rest blocked in backward (see bench_verdict)."""
    from bench_verdict import shape_dataloader

    return shape_dataloader(world)[0]


def node_views(k: int, world: int) -> list[Any]:
    return all_views(world)[k * RANKS_PER_NODE : (k + 1) * RANKS_PER_NODE]


def run_node(corr: Any, cfg: dict[str, Any], go: Any, rec: dict[str, Any]) -> None:
    """One node daemon: polls, then handles cfg['incidents'] incidents; bounded by cfg["run_s"]."""
    from rankwatch.watchdog.verdict import decide

    k, n, world, poll_s = corr.node_rank, cfg["nodes"], cfg["nodes"] * RANKS_PER_NODE, cfg["poll_s"]
    views = node_views(k, world)
    store = corr.store._store
    rng = random.Random(k)

    def decide_fn(vs: Sequence[Any], notes: Sequence[str], how: Any, remote_fr: Any) -> Any:
        return decide(vs, job_id=JOB, incident_id="inc", detected_after_s=180.0, extra_evidence=notes).document()

    def poll(measure: bool = False) -> Any:
        c0, t0 = store.calls, time.perf_counter()
        corr.publish_snapshot(f"node{k:04d}", views)
        inc = corr.poll_incident()
        rec["poll_calls"].append(store.calls - c0)
        if measure:
            rec["poll_s"].append(time.perf_counter() - t0)
        return inc

    def handle(inc: Any) -> None:
        time.sleep(rng.uniform(*CAPTURE_S))
        c0 = store.calls
        res = corr.resolve(inc, views, f"node{k:04d}", world)
        verdict, how = res.verdict, res.how
        if verdict is None:  # this node decides (the leader, or alone), as the incident pipeline does
            verdict = decide_fn(res.views, res.notes, how, res.remote_fr)
            if res.publish:
                corr.publish_verdict(inc, verdict)
        rec["verdicts"].append(
            {"gen": inc.gen, "t": time.monotonic(), "calls": store.calls - c0, "kind": verdict.kind,
             "initiators": list(verdict.initiating_ranks), "how": how}
        )

    if not go.wait(timeout=cfg["connect_s"]):
        return
    deadline = time.monotonic() + cfg["run_s"]
    time.sleep(rng.uniform(0, poll_s))  # unsynchronised daemons
    for _ in range(cfg["polls"]):
        t_next = time.monotonic() + poll_s
        poll(measure=True)
        time.sleep(max(0.0, t_next - time.monotonic()))
    handled = 0
    while handled < cfg["incidents"] and time.monotonic() < deadline:
        if k == n - 1:  # the detecting node opens the next incident
            time.sleep(0.2)
            handle(corr.claim(f"inc-{corr.handled_gen + 1}", {"kind": "stall", "ranks": [], "reason": "bench"}))
            handled += 1
            continue
        t_next = time.monotonic() + poll_s
        inc = poll()
        if inc is not None:
            handle(inc)
            handled += 1
            continue
        time.sleep(max(0.0, t_next - time.monotonic()))
    rec["marks"] = store.marks
    rec["by_op"] = dict(store.by_op)


def start_nodes(ks: Sequence[int], cfg: dict[str, Any]) -> tuple[list[Any], list[dict[str, Any]]]:
    """Correlators for nodes ``ks``, connected and instrumented (raises when one cannot connect)."""
    corrs = [make_correlator(k, cfg["port"], cfg["nodes"]) for k in ks]
    t_end = time.monotonic() + cfg["connect_s"]
    while any(c.store is None for c in corrs):
        if time.monotonic() > t_end:
            raise RuntimeError(f"nodes not connected: {[c.node_rank for c in corrs if c.store is None][:5]}")
        time.sleep(0.05)
    for c in corrs:
        c.store._store = CountingStore(c.store._store)
        if getattr(c.store, "_waiter", None) is not None:  # the waits' own connection (counted, not stamped)
            c.store._waiter = CountingStore(c.store._waiter)
    recs = [{"node": c.node_rank, "poll_calls": [], "poll_s": [], "verdicts": []} for c in corrs]
    return corrs, recs


def worker(ks: list[int], cfg: dict[str, Any], go: Any, out: Any) -> None:
    quiet()
    corrs, recs = start_nodes(ks, cfg)
    out.put(("ready", len(ks)))
    threads = [
        threading.Thread(target=run_node, args=(c, cfg, go, r), daemon=True) for c, r in zip(corrs, recs, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=cfg["connect_s"] + cfg["run_s"])
    for c in corrs:
        c.close()
    out.put(("done", recs))


def run_size(nodes: int, polls: int, incidents: int, poll_s: float, procs: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    cfg = {"nodes": nodes, "port": free_port(), "polls": polls, "incidents": incidents, "poll_s": poll_s,
           "connect_s": 60.0, "run_s": 10.0 + polls * poll_s + incidents * 4.0}
    t_start = time.monotonic()
    leader_corrs, leader_recs = start_nodes([0], cfg)
    leader, lrec = leader_corrs[0], leader_recs[0]
    go, out = ctx.Event(), ctx.Queue()
    rest = list(range(1, nodes))
    chunks = [rest[i::procs] for i in range(procs) if rest[i::procs]]
    workers = [ctx.Process(target=worker, args=(ch, cfg, go, out), daemon=True) for ch in chunks]
    for w in workers:
        w.start()
    recs = [lrec]
    try:
        ready = 0
        while ready < len(rest):
            tag, val = out.get(timeout=cfg["connect_s"] + 30)
            if tag == "ready":
                ready += val
        t_go = time.monotonic()
        connect_s = t_go - t_start
        lt = threading.Thread(target=run_node, args=(leader, cfg, go, lrec), daemon=True)
        lt.start()
        go.set()
        done = 0
        while done < len(chunks):
            tag, val = out.get(timeout=cfg["run_s"] + 30)
            if tag == "done":
                recs += val
                done += 1
        lt.join(timeout=cfg["run_s"])
        wall = time.monotonic() - t_go
    finally:
        for w in workers:
            w.join(timeout=5)
            if w.is_alive():
                w.kill()
        leader.close()
    out = summarise(nodes, recs, incidents, wall)
    out["startup_s"] = round(connect_s, 1)
    return out


def summarise(nodes: int, recs: list[dict[str, Any]], incidents: int, wall: float) -> dict[str, Any]:
    calls = [c for r in recs for c in r["poll_calls"]]
    poll_s = [s for r in recs for s in r["poll_s"]]
    ev: dict[int, list[float]] = {}
    vt: dict[int, float] = {}
    verdict_bytes = evidence_bytes = 0
    for r in recs:
        for key, t, size in r.get("marks", []):
            parts = key.split("/")
            gen = int(parts[parts.index("evidence" if "/evidence/" in key else "verdict") + 1])
            if "/evidence/" in key:
                ev.setdefault(gen, []).append(t)
                evidence_bytes = size
            else:
                vt[gen] = t
                verdict_bytes = size
    leader_v = {v["gen"]: v for v in recs[0]["verdicts"]}
    per_gen = []
    for gen in sorted(vt):
        got = [v for r in recs for v in r["verdicts"] if v["gen"] == gen]
        agreed = {(v["kind"], tuple(v["initiators"])) for v in got}
        per_gen.append({
            "gen": gen,
            "evidence": len(ev.get(gen, [])),
            "latency_s": vt[gen] - max(ev[gen]),
            "spread_s": max(ev[gen]) - min(ev[gen]),
            "all_nodes_have_verdict_s": max(v["t"] for v in got) - vt[gen],
            # the figure: the last node holds the verdict this long after the last evidence
            "held_after_last_evidence_s": max(v["t"] for v in got) - max(ev[gen]),
            "nodes_with_verdict": len(got),
            "verdicts_agree": len(agreed) == 1,
            "verdict": f"{got[0]['kind']} {got[0]['initiators']}",
            "leader_calls": leader_v[gen]["calls"] if gen in leader_v else None,
            "how": leader_v[gen]["how"] if gen in leader_v else None,
        })
    out = {
        "nodes": nodes,
        "ranks": nodes * RANKS_PER_NODE,
        "polls": len(calls),
        "calls_per_poll": dict(sorted(Counter(calls).items())),
        "calls_per_poll_median": statistics.median(calls) if calls else None,
        "calls_per_poll_max": max(calls) if calls else None,
        "poll_ms_median": round(statistics.median(poll_s) * 1e3, 3) if poll_s else None,
        "poll_ms_p99": round(sorted(poll_s)[int(0.99 * (len(poll_s) - 1))] * 1e3, 3) if poll_s else None,
        "verdict_bytes": verdict_bytes,
        "evidence_bytes_per_node": evidence_bytes,
        "incidents": per_gen,
        "wall_s": round(wall, 1),
    }
    lat = [g["latency_s"] for g in per_gen]
    fan = [g["all_nodes_have_verdict_s"] for g in per_gen]
    held = [g["held_after_last_evidence_s"] for g in per_gen]
    calls_l = [g["leader_calls"] for g in per_gen if g["leader_calls"] is not None]
    out["correlate"] = {
        "latency_ms_median": round(statistics.median(lat) * 1e3, 1) if lat else None,
        "latency_ms_max": round(max(lat) * 1e3, 1) if lat else None,
        "all_nodes_have_verdict_ms_median": round(statistics.median(fan) * 1e3, 1) if fan else None,
        "held_after_last_evidence_ms_median": round(statistics.median(held) * 1e3, 1) if held else None,
        "held_after_last_evidence_ms_max": round(max(held) * 1e3, 1) if held else None,
        "leader_calls_median": statistics.median(calls_l) if calls_l else None,
        "runs": len(lat),
    }
    out["complete"] = len(per_gen) == incidents and all(
        g["evidence"] == nodes and g["nodes_with_verdict"] == nodes and g["verdicts_agree"] for g in per_gen
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--polls", type=int, default=None, help="polls per node before the incidents (20, quick 8)")
    ap.add_argument("--incidents", type=int, default=None, help="incidents per size (10, quick 6)")
    ap.add_argument("--poll-interval", type=float, default=0.5, help="the daemon's default --poll-interval")
    ap.add_argument("--procs", type=int, default=2, help="worker processes for the non-leader nodes")
    ap.add_argument("--quick", action="store_true",
                    help="8 polls and 6 incidents per size, unless --polls / --incidents say otherwise")
    ap.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    args = ap.parse_args(argv)
    polls_default, incidents_default = (8, 6) if args.quick else (20, 10)
    args.polls = polls_default if args.polls is None else args.polls
    args.incidents = incidents_default if args.incidents is None else args.incidents
    quiet()
    results = []
    for n in args.nodes:
        r = run_size(n, args.polls, args.incidents, args.poll_interval, args.procs)
        results.append(r)
        c = r["correlate"]
        print(
            f"{n:>4} nodes ({r['ranks']} ranks): store calls/poll/node median {r['calls_per_poll_median']} "
            f"max {r['calls_per_poll_max']} {r['calls_per_poll']}; poll {r['poll_ms_median']} ms "
            f"(p99 {r['poll_ms_p99']} ms)\n"
            f"      leader verdict after last evidence {c['latency_ms_median']} ms (max {c['latency_ms_max']}, "
            f"{c['leader_calls_median']} leader calls); every node holds it "
            f"{c['held_after_last_evidence_ms_median']} ms "
            f"after the last evidence (max {c['held_after_last_evidence_ms_max']}, target <= {TARGET_HELD_MS} ms); "
            f"complete={r['complete']} verdict={r['incidents'][0]['verdict'] if r['incidents'] else None} "
            f"verdict {r['verdict_bytes'] / 1e3:.0f} kB; startup {r['startup_s']} s, run {r['wall_s']} s",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    ok = all(r["complete"] for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
