"""Cost of the live straggler exchange across nodes (``cluster.live_share``; pure CPU, no processes).

While a job runs, every node publishes its ranks' recent steps and host-signal samples every
``CorrelationPolicy.live_share_every_s``, and the leader merges the other nodes' ranks into its live diagnosis —
all of it on the share thread, never the poll loop (whose only addition is handing over the lists it built
anyway). This measures, for nodes of 8 ranks at the live bounds (200 steps, 64 samples a rank, a TCP dump on one
poll in eight): one node's value (bytes), its build and encoding (a node's share thread, every share), the
leader's parse of one node's value, and the leader's merged diagnosis (``merge_live`` + the straggler diagnosis +
its cause) over NODES nodes, capped at ``live_ranks_merged`` ranks.

    python benchmarks/bench_live_share.py            # 2, 8 and 32 nodes, 5 repeats
    python benchmarks/bench_live_share.py --quick    # 2 nodes, 1 repeat (a smoke run: every step once)
    python benchmarks/bench_live_share.py --nodes 64 --repeats 3 --json live_share.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from rankwatch.watchdog.cluster.correlate import history_doc, history_from_doc
from rankwatch.watchdog.cluster.live_share import RemoteRanks, merge_live
from rankwatch.watchdog.cluster.store import parse_json
from rankwatch.watchdog.core.host_signals import GpuState, NetCounters, RankCounters
from rankwatch.watchdog.core.policy import CorrelationPolicy
from rankwatch.watchdog.core.schema import HISTORY_SCHEMA
from rankwatch.watchdog.core.steps import StepTiming
from rankwatch.watchdog.core.straggler import StragglerPolicy, diagnose_stragglers
from rankwatch.watchdog.core.straggler_cause import explain
from rankwatch.watchdog.core.straggler_live import LiveStragglerPolicy

RANKS_PER_NODE = 8
STEP_NS, POLL_NS = 70_000_000, 250_000_000
POLICY = CorrelationPolicy()


def node_data(k: int, slow: bool) -> tuple[dict[int, list[StepTiming]], list[tuple[int, dict[int, RankCounters]]]]:
    """One node's last 2,000 steps and polls (its own clock: 1000 s apart per node); node 1's way out is slow."""
    clock = (k + 1) * 1000 * 10**9
    ranks = range(k * RANKS_PER_NODE, (k + 1) * RANKS_PER_NODE)
    steps = {r: [StepTiming(step=i, start_ns=clock + i * STEP_NS, end_ns=clock + (i + 1) * STEP_NS,
                            phases_ms={"dataloader": 1.0, "forward": 5.0 + (r % 3) * 0.1, "backward": 10.0,
                                       "collective": 50.0, "optimizer": 1.0}) for i in range(2000)] for r in ranks}
    samples = []
    for i in range(2000 * STEP_NS // POLL_NS):
        t = clock + i * POLL_NS
        s = i * POLL_NS / 1e9
        samples.append((t, {r: RankCounters(
            start_ticks=7, run_ns=int(0.4e9 * s), wait_ns=int(5e6 * s), cpu_ticks=0, majflt=0, nvcsw=0,
            throttled_us=0, nr_throttled=0, cpu_some_us=0, mem_some_us=0, io_some_us=0, cgroup="/job",
            net=NetCounters(sockets=3, bytes_sent=int(2e6 * s), bytes_acked=int(2e6 * s), retrans=0, busy_us=0,
                            rtt_us=20_000 if slow else 200, delivery_bps=2_400_000 if slow else 12_500_000_000)
            if i % 4 == 0 else None,
            gpu=GpuState(device=r % 8, sm_clock_mhz=1980, sm_clock_max_mhz=1980, reasons=0, xids=0),
        ) for r in ranks}))
    return steps, samples


def timed(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3, out


def run(nodes: int, repeats: int) -> dict[str, object]:
    data = [node_data(k, slow=k == 1) for k in range(nodes)]
    extra = {"node": "host", "boot": 1.0, "seq": 1, "issued": time.time()}

    def build(k: int = 1) -> str:
        steps, samples = data[k]
        return json.dumps(history_doc(k, steps, samples, POLICY.live_steps_shared, POLICY.live_samples_per_rank,
                                      POLICY.live_samples_per_node, extra), separators=(",", ":"))

    build_ms, text = timed(build, repeats)
    raw = str(text).encode()
    parse_ms, _ = timed(lambda: history_from_doc(parse_json(raw, HISTORY_SCHEMA)), repeats)
    steps: dict[int, list[StepTiming]] = {}
    signals: dict[int, list[tuple[int, RankCounters]]] = {}
    nodes_of: dict[int, str] = {}
    node_ranks: dict[int, int] = {}
    for k in range(1, nodes):
        got_steps, got_signals = history_from_doc(parse_json(build(k).encode(), HISTORY_SCHEMA))
        for r in got_steps:
            if len(steps) < POLICY.live_ranks_merged:
                steps[r], signals[r], nodes_of[r], node_ranks[r] = got_steps[r], got_signals[r], f"n{k}", k
    remote = RemoteRanks(steps, signals, nodes_of, node_ranks)
    keep = 2 * LiveStragglerPolicy().window_steps
    local_steps = {r: s[-keep:] for r, s in data[0][0].items()}
    local_samples = data[0][1]

    def merged() -> object:
        per_rank, samples = merge_live(local_steps, local_samples, remote, POLICY.live_steps_shared,
                                       POLICY.live_samples_per_rank)
        diag = diagnose_stragglers(per_rank, StragglerPolicy(window_steps=LiveStragglerPolicy().window_steps))
        return explain(diag, samples)

    merge_ms, diag = timed(merged, repeats)
    cause = getattr(diag, "cause", None) or {}
    return {"nodes": nodes, "ranks_merged": RANKS_PER_NODE + len(steps), "value_bytes": len(raw),
            "build_ms": round(build_ms, 2), "parse_ms": round(parse_ms, 2), "merged_diagnosis_ms": round(merge_ms, 1),
            "label": getattr(diag, "label", ""), "cause": cause.get("cause"), "cause_rank": cause.get("rank")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=None, help="node counts (default 2 8 32; quick 2)")
    ap.add_argument("--repeats", type=int, default=None, help="best of this many (default 5; quick 1)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    sizes = args.nodes or ([2] if args.quick else [2, 8, 32])
    repeats = args.repeats or (1 if args.quick else 5)
    results = []
    for n in sizes:
        r = run(n, repeats)
        results.append(r)
        print(f"{n:>4} nodes ({r['ranks_merged']} ranks merged): a node's value {r['value_bytes'] / 1e3:.0f} kB, "
              f"built in {r['build_ms']} ms, parsed in {r['parse_ms']} ms; merged diagnosis "
              f"{r['merged_diagnosis_ms']} ms ({r['label']}, cause {r['cause']} rank {r['cause_rank']})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "median_merged_ms": statistics.median(
                float(str(r["merged_diagnosis_ms"])) for r in results)}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
