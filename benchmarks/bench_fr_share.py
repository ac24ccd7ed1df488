"""Cost of sharing flight-recorder traces across nodes on an incident (pure CPU, no processes).

Every node adds its ranks' newest recorder entries to its evidence (``cluster.store.fr_share``); the
leader validates each node's share (``parse_evidence_doc``) and analyses every rank's trace together
(``evidence.flight_recorder.with_remote``). This measures, per node of 8 ranks whose ring buffers are
full (TORCH_FR_BUFFER_SIZE=2000): the share's size, the time to build it, the leader's time to parse
one node's share, and the leader's analysis over NODES nodes. Two shapes: DDP (one pg, all_reduce of one
bucket tensor) and FSDP-like (4 pgs, all_gather / reduce_scatter over 64 tensors each).

    python benchmarks/bench_fr_share.py            # 8 and 64 nodes, 7 repeats (~1 min)
    python benchmarks/bench_fr_share.py --quick    # 2 nodes, 1 repeat (a smoke run: every step once)
    python benchmarks/bench_fr_share.py --nodes 256 --repeats 3 --json fr_share.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from rankwatch.watchdog.cluster.store import fr_share, node_doc, parse_evidence_doc
from rankwatch.watchdog.core.fr_trace import FrEntry, PgConfig, PgStatus, RankTrace
from rankwatch.watchdog.core.policy import CorrelationPolicy
from rankwatch.watchdog.core.snapshot import RankView
from rankwatch.watchdog.evidence.flight_recorder import FrFindings, analyse_traces, with_remote

RANKS_PER_NODE = 8
BUFFER = 2000


def trace(rank: int, world: int, shape: str, lag: int) -> RankTrace:
    """A full ring buffer; the rank ``lag`` collectives behind the others."""
    pgs = ["0"] if shape == "ddp" else ["0", "1", "2", "3"]
    tensors = 1 if shape == "ddp" else 64
    entries = []
    per_pg = BUFFER // len(pgs)
    for i, pg in enumerate(pgs):
        for seq in range(1, per_pg + 1 - lag):
            op = "all_reduce" if shape == "ddp" else ("all_gather_into_tensor_coalesced" if seq % 2 else
                                                      "reduce_scatter_tensor_coalesced")
            entries.append(FrEntry(
                record_id=len(entries), pg_id=i, pg_name=pg, pg_desc="default_pg" if pg == "0" else f"pg{pg}",
                collective_seq_id=seq, p2p_seq_id=0, op_id=seq, profiling_name=f"nccl:{op}",
                input_sizes=tuple((4096, 1024) for _ in range(tensors)), input_dtypes=("Float",) * tensors,
                output_sizes=tuple((4096, 1024) for _ in range(tensors)), output_dtypes=("Float",) * tensors,
                state="completed" if seq < per_pg - lag else "scheduled", retired=seq < per_pg - lag,
                is_p2p=False, time_created_ns=seq * 1000, time_started_ns=None, time_completed_ns=None,
                timeout_ms=600000, duration_ms=None,
            ))
    config = {pg: PgConfig(pg, "default_pg" if pg == "0" else f"pg{pg}", tuple(range(world))) for pg in pgs}
    status = {i: PgStatus(per_pg - lag, -1, per_pg - lag - 1) for i in range(len(pgs))}
    return RankTrace(rank, "2.10", "2.21.5", config, status, tuple(entries))


def view(rank: int) -> RankView:
    return RankView(rank=rank, node=f"n{rank // RANKS_PER_NODE}", pid=1000 + rank, state="running", step=9,
                    phase="backward", in_phase_s=5.0, since_progress_s=5.0, waiting=True)


def median_s(repeats: int, fn, *args) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=None, help="default 8 64, quick 2")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="2 nodes, 1 repeat")
    p.add_argument("--json", metavar="FILE", help="also write the raw numbers here")
    args = p.parse_args()
    if args.quick:  # proves every step still runs (the test suite runs it); 2 nodes are a leader and a remote
        args.nodes, args.repeats = args.nodes or [2], 1
    args.nodes = args.nodes or [8, 64]
    rows = []
    policy = CorrelationPolicy()
    print("| shape | nodes | share per node | build share | parse one node | leader analysis, all ranks |")
    print("|---|---|---|---|---|---|")
    for shape in ("ddp", "fsdp"):
        for nodes in args.nodes:
            world = nodes * RANKS_PER_NODE
            traces = {r: trace(r, world, shape, lag=1 if r == world - 1 else 0) for r in range(world)}
            node_traces = {r: traces[r] for r in range(RANKS_PER_NODE)}
            share = fr_share(node_traces, policy.fr_shared_per_pg, policy.fr_shared_bytes)
            raw = json.dumps(node_doc(0, "n0", 0, [view(r) for r in range(RANKS_PER_NODE)], "evidence",
                                      flight_recorder=share)).encode()
            kept = len(share["0"]["entries"]) if share else 0
            build = median_s(args.repeats, fr_share, node_traces, policy.fr_shared_per_pg, policy.fr_shared_bytes)
            parse = median_s(args.repeats, parse_evidence_doc, raw)
            # the leader: its own 8 ranks' traces whole, every other rank's as a node's share delivers it
            shared = parse_evidence_doc(raw).fr
            remote = {r: shared[r % RANKS_PER_NODE] for r in range(RANKS_PER_NODE, world)}
            local = analyse_traces(node_traces, [])
            leader = FrFindings(lines=local.lines, facts=local.facts, traces=node_traces)
            analysis = median_s(max(1, args.repeats // 2), with_remote, leader, remote)
            rows.append({"shape": shape, "nodes": nodes, "share_bytes": len(raw), "entries_per_rank": kept,
                         "build_s": build, "parse_node_s": parse, "analysis_s": analysis})
            print(f"| {shape} | {nodes} | {len(raw) / 1024:.0f} KiB ({kept} entries/rank) | {build * 1e3:.1f} ms "
                  f"| {parse * 1e3:.1f} ms | {analysis * 1e3:.0f} ms |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
