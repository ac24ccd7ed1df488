"""Prefixes, single-line patterns, the streaming scanner, and fuzzing: odd input never raises."""

from __future__ import annotations

import io
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rankwatch.watchdog.diagnose import events as ev
from rankwatch.watchdog.diagnose.facts import collect
from rankwatch.watchdog.diagnose.parser import PathRank, SourceParser
from rankwatch.watchdog.diagnose.patterns import prefilter_accepts, split_prefix
from rankwatch.watchdog.diagnose.reasoning import diagnose_evidence
from rankwatch.watchdog.diagnose.sources import ScanStats, rank_from_path, scan

LOGS = Path(__file__).resolve().parents[2] / "fixtures" / "logs"
FAMILIES = sorted(
    ev.PRIMARY | ev.WAITING | ev.MISMATCH
    | {ev.EXIT, ev.TRACEBACK, ev.AGENT_TERM, ev.FINISHED, ev.TIMEOUT_REPORTED, ev.WATCHDOG_ABORT, ev.NCCL_STATUS}
)
ALL_FIXTURE_LINES = [
    line
    for p in sorted(LOGS.rglob("*"))
    if p.is_file() and p.suffix in (".log", ".txt", ".out")
    for line in p.read_text(errors="replace").splitlines()
]


def feed(lines: list[str], path_rank: PathRank | None = None) -> list[ev.Event]:
    p = SourceParser("t.log", path_rank)
    out: list[ev.Event] = []
    for i, line in enumerate(lines, 1):
        out.extend(p.feed(i, line))
    return out


# -- prefixes ---------------------------------------------------------------------------------------
def test_prefixes() -> None:
    assert split_prefix("[default3]:[rank11]: boom") == (split_prefix("[default3]:[rank11]: x")[0], "boom")
    pre, body = split_prefix("[default3]:[rank11]: boom")
    assert (pre.rank, pre.local_rank, body) == (11, 3, "boom")
    pre, body = split_prefix("[rank0]:[E1118 20:32:23.955 ProcessGroupNCCL.cpp:629] x")
    assert pre.rank == 0 and body.startswith("[E1118")
    pre, body = split_prefix(" 12: RuntimeError: x")
    assert pre.rank == 12 and body == "RuntimeError: x"
    pre, _ = split_prefix("(WorkerDict pid=3490362) [rank1]:[E1118 x")
    assert pre.rank == 1
    pre, _ = split_prefix("Epoch 10/10: 240it [05:55, loss=5.46][rank0]:[E709 17:05:38.16 X.cpp:1] y")
    assert pre.rank == 0
    pre, body = split_prefix("step 3 loss 0.1")
    assert pre.rank is None and pre.local_rank is None and body == "step 3 loss 0.1"


def test_rank_from_path() -> None:
    assert rank_from_path("logs/run_x/attempt_0/3/stderr.log") == PathRank(local_rank=3)
    assert rank_from_path("out/rank-7.log") == PathRank(rank=7)
    assert rank_from_path("out/train_rank12.txt") == PathRank(rank=12)
    assert rank_from_path("out/frankly.log") == PathRank()


# -- single messages --------------------------------------------------------------------------------
def test_nccl_watchdog_fields() -> None:
    es = feed([
        "[rank4]:[E709 17:05:38.162555850 ProcessGroupNCCL.cpp:632] [Rank 4] Watchdog caught collective "
        "operation timeout: WorkNCCL(SeqNum=20585, OpType=ALLREDUCE, NumelIn=1259621, NumelOut=1259621, "
        "Timeout(ms)=600000) ran for 600000 milliseconds before timing out.",
        "[rank4]:[E709 17:05:38.162814866 ProcessGroupNCCL.cpp:2271] [PG ID 0 PG GUID 0(default_pg) Rank 4]  "
        "failure detected by watchdog at work sequence id: 20585 PG status: last enqueued work: 20589, last "
        "completed work: 20584",
    ])
    t, s = es
    assert (t.family, t.rank, t.seq, t.op, t.numel) == (ev.NCCL_TIMEOUT, 4, 20585, "ALLREDUCE", 1259621)
    assert t.ts is not None
    assert (s.family, s.enqueued, s.completed) == (ev.NCCL_STATUS, 20589, 20584)


def test_pg_rank_only_from_default_group() -> None:
    (a,) = feed(["[E ProcessGroupNCCL.cpp:1537] [PG 0 Rank 2] Timeout at NCCL work: 1, last enqueued NCCL "
                 "work: 1, last completed NCCL work: 0."])
    assert a.rank == 2 and a.enqueued == 1
    (b,) = feed(["[PG ID 3 PG GUID 7 Rank 1]  failure detected by watchdog at work sequence id: 5 PG status: "
                 "last enqueued work: 5, last completed work: 4"])
    assert b.rank is None  # rank within a sub-group is not a global rank


def test_nccl_warn_and_cuda() -> None:
    (w,) = feed(["node1:123:456 [3] NCCL WARN Cuda failure 'an illegal memory access was encountered'"])
    assert (w.family, w.host, w.pid) == (ev.CUDA_ERROR, "node1", 123)
    (w,) = feed(["[2026-01-01 10:00:00] node1:123:456 [3] transport/net_ib.cc:1696 (ncclIbTest) NCCL WARN "
                 "NET/IB : Got completion from peer 10.0.0.2<5353> with status=12"])
    assert w.family == ev.PEER_LOST
    (o,) = feed(["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."])
    assert o.family == ev.CUDA_OOM
    (x,) = feed(["NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus."])
    assert (x.family, x.pid) == (ev.HW_FAULT, 1234)
    (k,) = feed(["Out of memory: Killed process 48213 (python) total-vm:1kB"])
    assert (k.family, k.pid) == (ev.HOST_OOM, 48213)


def test_gloo_messages() -> None:
    es = feed([
        "[rank0]: RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv "
        "operation to complete",
        "[rank1]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:5546. This is ...",
        "[default0]:  what():  [enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 500 vs 4. "
        "Received data size doesn't match expected size.",
    ])
    assert [e.family for e in es] == [ev.GLOO_TIMEOUT, ev.PEER_LOST, ev.SIZE_MISMATCH]
    assert es[1].detail == "peer 127.0.0.1:5546"
    assert es[2].local_rank == 0 and "500" in es[2].detail


def test_c10d_detail_fingerprint_mismatch() -> None:
    es = feed(["RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running collective: "
               "CollectiveFingerPrint(SequenceNumber=12, OpType=ALLREDUCE, TensorShape=[4]), but Rank 2 is "
               "running collective: CollectiveFingerPrint(SequenceNumber=12, OpType=ALLGATHER, TensorShape=[1])."])
    assert {(e.rank, e.op) for e in es} == {(0, "ALLREDUCE"), (2, "ALLGATHER")}


def test_traceback_names_op_phase_and_site() -> None:
    es = feed([
        "[rank3]: Traceback (most recent call last):",
        '[rank0]: Traceback (most recent call last):',
        '[rank3]:   File "/w/train.py", line 178, in main',
        '[rank0]:   File "/w/train.py", line 180, in main',
        '[rank3]:   File "/x/site-packages/torch/distributed/distributed_c10d.py", line 4287, in all_gather',
        '[rank0]:   File "/x/site-packages/torch/distributed/distributed_c10d.py", line 3252, in all_reduce',
        "[rank3]: ValueError: bad shape",
        "[rank0]: RuntimeError: Timed out waiting 10000ms for recv operation to complete",
    ])
    tb3 = next(e for e in es if e.family == ev.TRACEBACK and e.rank == 3)
    tb0 = next(e for e in es if e.family == ev.TRACEBACK and e.rank == 0)
    assert (tb3.op, tb3.phase, tb3.detail, tb3.line) == ("all_gather", "collective", "train.py:178 in main", 5)
    assert tb0.op == "all_reduce"
    assert any(e.family == ev.PY_ERROR and e.rank == 3 for e in es)
    assert not any(e.family == ev.PY_ERROR and e.rank == 0 for e in es)


def test_failure_report_entries() -> None:
    lines = (LOGS / "torchrun_tee/dead_rank_r2.log").read_text().splitlines()
    exits = [e for e in feed(lines) if e.family == ev.EXIT and e.rank is not None]
    assert {e.rank: e.signal for e in exits} == {0: "SIGTERM", 1: "SIGTERM", 3: "SIGTERM", 2: "SIGKILL"}
    assert [e.rank for e in exits if e.root_cause] == [2]
    assert next(e for e in exits if e.rank == 2).pid == 8751


# -- the scanner ------------------------------------------------------------------------------------
def test_scan_line_numbers_across_chunks() -> None:
    lines = [b"step %d loss 0.1" % i for i in range(5000)]
    hits = {17, 18, 999, 1000, 4999}
    for i in hits:
        lines[i] = b"[rank3]: RuntimeError: boom %d" % i
    data = b"\n".join(lines)  # no trailing newline
    for chunk in (7, 64, 1000, 1 << 20):
        stats = ScanStats()
        got = list(scan(io.BytesIO(data), stats, chunk=chunk))
        assert [n for n, _ in got] == [i + 1 for i in sorted(hits)], chunk
        assert all(b"boom %d" % (n - 1) in line for n, line in got)
        assert stats.lines == 5000 and stats.bytes == len(data)


def test_scan_cuts_overlong_lines() -> None:
    data = b"x" * 500_000 + b" RuntimeError\n" + b"[rank1]: RuntimeError: short\n"
    got = list(scan(io.BytesIO(data), ScanStats(), chunk=4096, max_line=1000))
    assert got[-1] == (2, b"[rank1]: RuntimeError: short")
    assert all(len(line) <= 1000 + 4096 for _, line in got)


def test_prefilter_keeps_every_meaningful_fixture_line() -> None:
    """Every line the parser finds meaningful (fed everything) must reach it through the fast path."""
    files = [p for p in sorted(LOGS.rglob("*")) if p.is_file() and p.suffix in (".log", ".txt", ".out")]
    for path in files:
        data = path.read_bytes()
        full = SourceParser("x")
        needed = {
            e.line
            for i, line in enumerate(data.decode(errors="replace").splitlines(), 1)
            for e in full.feed(i, line)
            if e.family != ev.TRACEBACK  # reported at a frame line, which the scan keeps via 'File "'
        }
        for chunk in (97, 1 << 20):
            kept = {n for n, _ in scan(io.BytesIO(data), ScanStats(), chunk=chunk)}
            assert needed <= kept, (path, sorted(needed - kept))
    assert prefilter_accepts(b"[rank3]: RuntimeError: x") and not prefilter_accepts(b"step 3 loss 0.1")


def test_failure_report_block_is_read_whole() -> None:
    data = (LOGS / "torchrun_tee/input_hang_r1.log").read_bytes()
    kept = dict(scan(io.BytesIO(data), ScanStats(), chunk=50))
    assert any(line.strip().startswith(b"host      :") for line in kept.values())
    assert any(line.strip().startswith(b"rank      : 1") for line in kept.values())


# -- fuzzing: never raise ---------------------------------------------------------------------------
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=4000), st.integers(min_value=1, max_value=300))
def test_random_bytes_never_raise(data: bytes, chunk: int) -> None:
    p = SourceParser("fuzz", PathRank(local_rank=1))
    events: list[ev.Event] = []
    for n, line in scan(io.BytesIO(data), ScanStats(), chunk=chunk, max_line=512):
        events.extend(p.feed(n, line.decode("utf-8", "replace")))
    diagnose_evidence(collect(events))


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.sampled_from(ALL_FIXTURE_LINES), min_size=1, max_size=30),
    st.lists(st.tuples(st.integers(0, 400), st.integers(0, 40), st.text(max_size=8)), max_size=6),
)
def test_mangled_real_lines_never_raise(lines: list[str], edits: list[tuple[int, int, str]]) -> None:
    mangled = []
    for i, line in enumerate(lines):
        for pos, cut, ins in edits[i % max(1, len(edits)) :][:2]:
            line = line[:pos] + ins + line[pos + cut :]
        mangled.append(line)
    events = feed(mangled)
    d = diagnose_evidence(collect(events))
    assert d.kind in ("hang", "dead_rank", "stopped_rank", "collective_mismatch", "comm_hang", "unknown")
    d.to_json()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.builds(
            ev.Event,
            family=st.sampled_from(FAMILIES),
            file=st.just("f"),
            line=st.integers(0, 100),
            text=st.just("t"),
            rank=st.none() | st.integers(0, 7),
            local_rank=st.none() | st.integers(0, 7),
            pid=st.none() | st.integers(1, 5),
            seq=st.none() | st.integers(0, 5),
            op=st.none() | st.sampled_from(["ALLREDUCE", "BROADCAST", "all_reduce"]),
            enqueued=st.none() | st.integers(-1, 5),
            completed=st.none() | st.integers(-1, 5),
            exitcode=st.none() | st.sampled_from([0, 1, -6, -9, -15]),
            detail=st.sampled_from(["", "this rank", "another rank", "rank 2"]),
            signal=st.none() | st.sampled_from(["SIGKILL", "SIGTERM", "SIGABRT"]),
            root_cause=st.booleans(),
            ts=st.none() | st.floats(0, 100),
        ),
        max_size=40,
    )
)
def test_reasoning_total_on_arbitrary_events(events: list[ev.Event]) -> None:
    d = diagnose_evidence(collect(events))
    assert set(d.initiating_ranks) <= set(int(r) for r in d.ranks)
    assert d.decided or not d.initiating_ranks or d.kind == "dead_rank"
