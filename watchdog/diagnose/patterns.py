"""Compiled patterns for the messages real jobs print, one group per message family. Pure, no state.

Templates come from the sources that print them (cited per pattern) and from logs captured with
``examples/ddp_demo.py`` under torchrun (tests/fixtures/logs/README.md). Multi-line structures
(Python tracebacks, torch elastic's failure report) are assembled in ``parser.py``; this module only
answers "what does this one line say".
"""

from __future__ import annotations

import re
import signal as _signal
from dataclasses import dataclass

from ..core.failures import COMMUNICATION, WATCHDOG_ABORT
from ..core.ranks import MAX_RANK

# --- cheap prefilter ----------------------------------------------------------------------------
# A line can only matter if it contains one of these literals, so only such lines reach Python.
# Speed comes from their first letters: every alternative of PREFILTER starts with an uppercase letter
# (E, F, K, N, R, T), which ordinary log text rarely has, so the regex engine's first-character skip
# does almost all the work in C (~300 MB/s, against ~55 MB/s for an alternation led by lowercase
# letters). The few keywords that start in lowercase are found with bytes.find (≥1 GB/s each).
# Coverage, checked by tests/unit/diagnose/test_diagnose_parsing.py on every fixture: Python exceptions ("Error",
# "Exception", "Traceback", 'File "'), all of ProcessGroupNCCL's messages (glog header
# "ProcessGroupNCCL.cpp") and NCCL's own lines, gloo/CUDA errors (printed as RuntimeError/…Error),
# dmesg (Xid, OOM killer), Slurm (": error"), torchrun's agent ("exitcode", "closing signal") and its
# failure report (a block from "Failures:"/"Root Cause" to the closing "====" line, read whole).
# (NCCL_DEBUG=INFO prints millions of "NCCL INFO" lines and none of them matters: skipped here.)
PREFILTER = re.compile(
    rb'Error|Exception|NCCL(?! INFO)|Traceback|File "|NVRM: Xid|Killed process|Failures:|Root Cause'
)
PREFILTER_EXTRA: tuple[bytes, ...] = (
    b": error", b"exitcode", b"closing signal", b"enforce fail",
    # a rank that finished (FINISHED below): "Training finished/complete", "Finished training", "… done"
    b"inished", b"omplete", b"raining done", b"one training",
    # PyTorch's desync report, NCCL's per-op INFO lines, mpirun's exit notice, rankwatch's own verdict
    b"didn't finish collective", b"lagging ranks", b"opCount", b"pirun noticed", b"rankwatch: ",
    # rankwatch's own summary: its straggler diagnosis and the straggler's cause (RANKWATCH_STRAGGLER below)
    b"STRAGGLER \xe2\x80\x94 ", b"cause: ",
    # DeepSpeed's launcher (deepspeed/launcher/launch.py sigkill_handler)
    b"exits with return code", b"Killing subprocess",
    # how many ranks the job has (WORLD_SIZE below): ranks that never printed a line are still ranks
    b"world_size", b"WORLD_SIZE", b"world size", b" nranks ",
    # torch.multiprocessing.spawn's report of a child's death (MP_SPAWN_EXIT), also pasted without its class
    b"terminated with",
    # gloo's lost peer on a line of its own (the chained "Original exception:" of a monitored barrier's peers)
    b"by peer", b"by remote peer",
    # Open MPI's "The first process to do so was:" / "Process name: [[J,1],R]"
    b"first process to do so", b"Process name: [[",
)
BLOCK_START: tuple[bytes, ...] = (b"Failures:", b"Root Cause (first observed failure)")
BLOCK_END = b"\n===="


def prefilter_accepts(line: bytes) -> bool:
    """The per-line form of the scanner's test (block membership aside)."""
    return PREFILTER.search(line) is not None or any(k in line for k in PREFILTER_EXTRA)


# --- rank prefixes --------------------------------------------------------------------------------
# torchrun --tee/--redirects console prefix "[default3]:" (role + local rank) and c10d's own
# "[rank3]:" (global rank, torch/distributed logging), possibly both: "[default3]:[rank3]: ...".
_BRACKET_PREFIX = re.compile(r"\[([A-Za-z_]+?)(\d{1,7})\]:[ ]?")
# srun --label: "  5: message" (task id, which is the global rank under srun-launched jobs)
_SLURM_LABEL = re.compile(r"\s{0,6}(\d{1,7}): ")
# Ray actors: "(WorkerDict pid=3490362) [rank1]:..."
_RAY_PREFIX = re.compile(r"\([^()]{0,80}pid=\d+[^()]{0,40}\)\s+")
# "[rankN]:" glued after a progress bar ("…loss=5.46][rank0]:[E709 …")
_RANK_ANYWHERE = re.compile(r"\[rank(\d{1,7})\]:")
# Open MPI / Horovod --tag-output: "[1,3]<stderr>:" (job id, rank) and the older "[3]<stdout>:"
_MPI_TAG = re.compile(r"\[(?:\d{1,7},)?(\d{1,7})\]<(?:stdout|stderr|stddiag)>:[ ]?")
# a wrapper that tags each line with the worker's pid: "[80749] " or "[80749]: " (3+ digits, so the
# failure report's "[1]:" entry numbers and other small indices are not taken for pids)
_PID_BRACKET = re.compile(r"\[(\d{3,8})\]:?[ ]")
# Determined.ai: "[rank=3] "
_DET_RANK = re.compile(r"\[rank=(\d{1,7})\][ ]?")
# pdsh (DeepSpeed's multi-node launcher): "worker-1: " before another prefix
_PDSH_HOST = re.compile(r"([A-Za-z][\w.\-]{0,63}): (?=\[|\d{4}-)")
# "[host:pid:n] " (host, pid, thread or local index): the host and pid are kept, the last number is not a rank
_HOST_PID = re.compile(r"\[([A-Za-z][\w.\-]{0,63}):(\d{1,8}):\d{1,8}\]:?[ ]?")
# wall-clock prefixes a wrapper or Python logging adds: "2024-01-01 12:00:00,123 - INFO - ",
# "2024-01-01 12:00:00,123 - trainer - ERROR - ", "[2024-01-01 12:00:00] [INFO] ", "2024-01-01T12:00:00.5Z "
_LEVEL = r"(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)"
_TS_PREFIX = re.compile(
    r"(\[)?(\d{4})-(\d\d)-(\d\d)[ T_](\d\d):(\d\d):(\d\d)(?:[.,](\d{1,9}))?(?:Z|[+-]\d\d:?\d\d)?(?(1)\])"
    r"(?:[ \t]*(?:[-|][ \t]*)?(?:[\w.\-]{1,64}[ \t]*[-|][ \t]*)?\[?" + _LEVEL + r"\]?(?:[ \t]*[-|:](?=[ \t]))?)?"
    r"[ \t]*:?[ \t]*"
)
# Python logging's default format: "ERROR:root:", "INFO:torch.distributed.elastic.agent.server.api:"
_PYLOG_PREFIX = re.compile(_LEVEL + r":[\w.\-]{1,80}:")
MAX_PREFIXES = 8  # prefixes stripped from one line (timestamp, pid, [defaultN]:, [rankN]:, …)



@dataclass(frozen=True, slots=True)
class Prefix:
    rank: int | None = None
    local_rank: int | None = None
    pid: int | None = None  # from "[80749] " or "[host:pid:n]"
    host: str | None = None
    ts: float | None = None  # a wall-clock prefix, on ``glog_time``'s scale


# the common torchrun shapes in one match: "[default3]:[rank3]:", "[default3]:", "[rank3]:"
_TORCHRUN_PREFIX = re.compile(r"\[(?:default(\d{1,7})\]:(?:\[rank(\d{1,7})\]:)?|rank(\d{1,7})\]:) ?")


def stamp_time(m: re.Match[str]) -> float:
    """A "YYYY-MM-DD HH:MM:SS[.frac]" match (groups 2-8 of ``_TS_PREFIX``) on ``glog_time``'s scale."""
    month, day, hh, mm, ss = (int(m.group(i)) for i in range(3, 8))
    frac = float("0." + m.group(8)) if m.group(8) else 0.0
    return ((month * 31 + day) * 24 + hh) * 3600 + mm * 60 + ss + frac


def split_prefix(line: str) -> tuple[Prefix, str]:
    """Strip launcher/logging prefixes; return what they say (ranks, pid, host, time) and the body.

    A line may carry several, in any order a wrapper stacks them: "2024-01-01 12:00:00,123 - INFO -
    [default3]:[rank3]: …", "[1,3]<stderr>:[rank3]: …", "[80749] [rank0]: …", "5: [rank5]: …". Each
    is recognised at the current position and stripped; the first text that is not a known prefix is
    the body (a glog header like "[E1130 10:12:45 …]" stays: the parser reads its time).
    """
    f = _TORCHRUN_PREFIX.match(line)
    if f and not line.startswith("[", f.end()):
        lr, r1, r2 = f.groups()
        r = r1 or r2
        return Prefix(int(r) if r else None, int(lr) if lr else None), line[f.end() :]
    rank: int | None = None
    local: int | None = None
    pid: int | None = None
    host: str | None = None
    ts: float | None = None
    pos = 0
    for _ in range(MAX_PREFIXES):
        c = line[pos : pos + 1]
        m: re.Match[str] | None = None
        if c == "[":
            if m := _DET_RANK.match(line, pos):
                rank = int(m.group(1))
            elif m := _BRACKET_PREFIX.match(line, pos):
                if m.group(1) == "rank":
                    rank = int(m.group(2))
                else:
                    local = int(m.group(2))
            elif m := _MPI_TAG.match(line, pos):
                rank = int(m.group(1))
            elif m := _TS_PREFIX.match(line, pos):
                ts = stamp_time(m) if ts is None else ts
            elif m := _PID_BRACKET.match(line, pos):
                pid = int(m.group(1)) if pid is None else pid
            elif m := _HOST_PID.match(line, pos):
                host, pid = m.group(1), int(m.group(2))
        elif c == "(":
            m = _RAY_PREFIX.match(line, pos)
        elif c.isdigit() or c == " ":
            if c.isdigit() and (m := _TS_PREFIX.match(line, pos)):
                ts = stamp_time(m) if ts is None else ts
            elif rank is None and local is None and (m := _SLURM_LABEL.match(line, pos)):
                rank = int(m.group(1))
        elif c in "DIWEFC" and (m := _PYLOG_PREFIX.match(line, pos)):
            pass
        elif pos == 0 and c.isalpha() and (m := _PDSH_HOST.match(line, pos)):
            nxt = m.end()
            if not (_TORCHRUN_PREFIX.match(line, nxt) or _BRACKET_PREFIX.match(line, nxt) or _DET_RANK.match(line, nxt)
                    or _TS_PREFIX.match(line, nxt)):
                m = None
            else:
                host = m.group(1)
        if m is None or m.end() == pos:
            break
        pos = m.end()
    if rank is None and local is None and "[rank" in line:
        g = _RANK_ANYWHERE.search(line, pos, pos + 400)
        if g:
            rank = int(g.group(1))
            pos = g.end()
    if rank is not None and rank > MAX_RANK:
        rank = None
    if local is not None and local > MAX_RANK:
        local = None
    return Prefix(rank, local, pid, host, ts), line[pos:]


# --- glog / torch logging header -----------------------------------------------------------------
# c10 glog: "[E1118 20:32:23.955028747 ProcessGroupNCCL.cpp:629] "; torch.distributed python logging:
# "E1130 19:33:13.287000 8704 site-packages/torch/.../api.py:1002] ".
GLOG = re.compile(
    r"\[?([EWIF])(\d{1,2})(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d+))?(?: +\d+)? +[^\s\]]+:\d+\] ?"
)


def glog_time(m: re.Match[str]) -> float:
    """Seconds since the start of the year (month*31 days): ordering within one node's logs only."""
    month, day, hh, mm, ss = (int(m.group(i)) for i in range(2, 7))
    frac = float("0." + m.group(7)) if m.group(7) else 0.0
    return ((month * 31 + day) * 24 + hh) * 3600 + mm * 60 + ss + frac


# --- torch ProcessGroupNCCL (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp) ---------------------
# logPrefix(): "[PG ID 0 PG GUID 0(default_pg) Rank 1] "; older "[PG 0 Rank 2] " and "[Rank 0] ".
PG_PREFIX = re.compile(r"\[(?:PG(?: ID)? (\d+) (?:PG GUID (\S+?) )?)?Rank (\d+)\]")
# "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1,
#  NumelOut=1, Timeout(ms)=600000) ran for 600001 milliseconds before timing out."
NCCL_WATCHDOG = re.compile(
    r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(\d+), OpType=(\w+)"
    r"(?:, NumelIn=(\d+))?"
)
# " failure detected by watchdog at work sequence id: 5 PG status: last enqueued work: 5, last
#  completed work: 4"
NCCL_STATUS = re.compile(
    r"failure detected by watchdog at work sequence id: (\d+) PG status: last enqueued work: (-?\d+), "
    r"last completed work: (-?\d+)"
)
# torch 2.2-2.4: "Timeout at NCCL work: 1, last enqueued NCCL work: 1, last completed NCCL work: 0."
NCCL_TIMEOUT_AT = re.compile(
    r"Timeout at NCCL work: (\d+), last enqueued NCCL work: (-?\d+), last completed NCCL work: (-?\d+)"
)
# HeartbeatMonitor::getNCCLWatchdogTimeoutErrorMsg: "Received a dump signal due to a collective
# timeout from this local rank|  rank N and we will try our best to dump the debug info. Last enqueued
# NCCL work: E, last completed NCCL work: C."
NCCL_DUMP_SIGNAL = re.compile(
    r"Received a dump signal due to a collective timeout from\s+(?:this local rank|rank (-?\d+))"
    r".*?Last enqueued NCCL work: (-?\d+), last completed NCCL work: (-?\d+)"
)
# torch 2.2-2.3 wording of the same two cases ("this local rank" / another rank)
NCCL_DUMP_SIGNAL_OLD = re.compile(
    r"Received a (dump signal from this local rank|global timeout from another rank) and will start to dump"
    r".*?Last enqueued NCCL work: (-?\d+), last completed NCCL work: (-?\d+)"
)
# torch 2.2-2.3 exit message on a rank that was told: "…watchdog detected a collective timeout from another
# rank 3 and notified the current rank."
NCCL_TOLD_BY = re.compile(r"detected a collective timeout from another rank (\d+)")
# heartbeat monitor on a rank that did NOT time out itself: another rank's watchdog set the store key
NCCL_OBSERVED_DUMP = "Observed flight recorder dump signal from another rank"
# watchdog on the rank whose own work failed, telling the others (torch >= 2.5)
NCCL_BROADCAST_DUMP = "Broadcasting flight-recorder dump signal to other processes"
NCCL_HEARTBEAT = re.compile(r"Heartbeat monitor timed out|watchdog got stuck for \d+ seconds")
NCCL_DUMP_TO = re.compile(r"dumping nccl trace to (\S+)")
NCCL_ABORT_NOTE = WATCHDOG_ABORT  # the watchdog taking its process down (core/failures.py)
NCCL_REMOTE = re.compile(r"ncclRemoteError|remote process exiting prematurely|NCCL communicator was aborted")
NCCL_ERROR = re.compile(r"NCCL error|DistBackendError|ncclSystemError|ncclInternalError|ncclUnhandled")
# c10d ProcessGroupWrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL): "Detected mismatch between collectives on
# ranks. Rank 0 is running collective: CollectiveFingerPrint(...), but Rank 1 is running collective: …"
OP_MISMATCH = re.compile(
    r"Detected mismatch between collectives on ranks\. Rank (\d+) is running collective: (.*?), "
    r"but Rank (\d+) is running collective: (.*)"
)
FINGERPRINT_OP = re.compile(r"OpType=(\w+)")
# PyTorch's desync report (torch/csrc/distributed/c10d/TraceUtils.h analyzeLaggingRanks / analyzeMissingRanks):
# "[1] finished collective #182, but didn't join collective #183 (count from 1)",
# "[0, 2] joined but didn't finish collective #183", "[3] are the lagging ranks that caused this timeout"
DESYNC = re.compile(
    r"\[([\d, \-]{1,2000})\] (?:(finished) collective #(\d+), but didn't join collective #\d+"
    r"|(joined) but didn't finish collective #(\d+)|(are the lagging ranks) that caused this timeout)"
)
# NCCL's per-op INFO (src/enqueue.cc): "NCCL INFO AllReduce: opCount 2f sendbuff 0x… recvbuff 0x… count 1024
# datatype 7 op 0 root 0 comm 0x… [nranks=8] stream 0x…" (opCount in hex; the comm pointer is per process)
# (gaps bounded: a hostile 64 KiB line of "count " must not cost a quadratic search)
NCCL_OPCOUNT = re.compile(
    r"NCCL INFO (\w{1,40}): opCount ([0-9a-fA-F]{1,16}) .{0,300}?\bcount (\d{1,20}).{0,300}?\[nranks=(\d{1,7})\]"
)
NCCL_HOST_PID = re.compile(r"([^\s:\[\]]+):(\d+):\d+ \[\d+\] NCCL INFO")
# Open MPI: "mpirun noticed that process rank 1 with PID 4242 on node n2 exited on signal 9 (Killed)."
# (also pasted as prose, "Mpirun noticed …", with the pid and node blanked out: "PID xxxxxx on node xxxx")
MPIRUN_NOTICED = re.compile(
    r"[Mm]pirun noticed that process rank (\d+) with PID (\S+) on node (\S+) exited on signal (\d+)"
)
# DeepSpeed's launcher: "[ERROR] [launch.py:434:sigkill_handler] ['/usr/bin/python3', '-u', 'main.py',
# '--local_rank=0', …] exits with return code = -9", after "Killing subprocess 13266" for the others
DS_EXIT = re.compile(
    r"sigkill_handler\] \[[^\]]{0,8000}?'--local_rank=(\d{1,7})'[^\]]{0,8000}\] exits with return code = (-?\d{1,4})"
)
DS_KILLING = re.compile(r"sigkill_handler\] Killing subprocess (\d+)")
# torch.multiprocessing.spawn's parent when a child dies (torch/multiprocessing/spawn.py ProcessContext.join):
# "ProcessExitedException: process 1 terminated with signal SIGKILL" / "... with exit code 1". N is the spawn
# index: the local rank on its node (the global rank only where one node spawns every rank)
MP_SPAWN_EXIT = re.compile(r"process (\d{1,7}) terminated with (?:signal (SIG[A-Z0-9]{1,10})|exit code (\d{1,4}))")
# torch elastic's failure report pasted with its table flattened into one line:
# "rank2 (local rank: 2)exitcode: -9 (pid: 36071)error file: <N/A>"
REPORT_FLAT = re.compile(r"rank\s*:?\s*(\d+) \(local[ _]rank: (\d+)\)\s*exitcode\s*: (-?\d+) \(pid: (\d+)\)")
# rankwatch's own verdict line (report/text.py ``headline``): "rankwatch: HANG — initiating rank 2 in phase
# 'dataloader' (confidence high)"
RANKWATCH_HEADLINE = re.compile(
    r"rankwatch: ([A-Z][A-Z ]{0,40}?(?:\(cause unknown\))?) — initiating (no single rank|ranks? [\d, –\-]{1,4000})"
    r"(?: in phase '([^']{0,64})')? \(confidence (high|medium|low)\)"
)


# rankwatch's own run summary (report/text.py ``summary_text``): "diagnosis: RANK-WIDE STRAGGLER — rank 1",
# "before the incident, diagnosis: COMPUTE STRAGGLER — rank 3 in backward", and the straggler's cause on a line
# of its own after it: "cause: cpu_contention — rank 1 waited 52.0 ms/step for a CPU, …"
RANKWATCH_STRAGGLER = re.compile(
    r"diagnosis: ((?:[A-Z]{1,12}[ -]){0,3}STRAGGLER) — (ranks? [\d, –\-]{1,4000}?)(?: in ([\w.:/-]{1,64}))?\s*$"
)
RANKWATCH_CAUSE = re.compile(r"(?:^|\s)cause: ([a-z_]{1,32}) — (.{1,600})$")


# --- NCCL (src/debug.cc ncclDebugLogV): "[ts] host:pid:tid [dev] file:line (func) NCCL WARN msg" ---
NCCL_WARN = re.compile(
    r"(?:\[[^\]]*\] )?([^\s:]+):(\d+):(\d+) \[(\d+)\](?: [^\s:]+:\d+(?: \([^)]*\))?)? NCCL WARN (.*)"
)

# --- gloo (third_party/gloo/gloo/transport/tcp/{unbound_buffer,pair}.cc) ---------------------------
# a rank that gave up waiting for a store key at start-up (torch's DistStoreError). Gloo's full-mesh
# rendezvous keys are <store prefix>/<group name>//<device>//<device index>/<group rank>: each rank sets its
# own group rank's key and waits for every peer's, so the key names the peer that never published its
# address (it never reached init_process_group). Only gloo's ("cpu") keys: NCCL's name a counter, not a rank.
STORE_WAIT_KEY = re.compile(r"wait timeout after (\d+)ms, keys: /?(?:default_pg/)?([^/\s]+)//cpu//\d+/(\d{1,7})\b")
GLOO_TIMEOUT = re.compile(r"Timed out waiting (\d+)ms for (recv|send) operation to complete")
PEER_LOST = re.compile(
    r"Connection (?:closed|reset) by (?:remote )?peer(?: \[([^\]]+)\]:(\d+))?|Read error \[([^\]]+)\]:(\d+)"
)
# "[enforce fail at …/pair.cc:456] op.preamble.length <= op.nbytes. 500 vs 4. Received data size
#  doesn't match expected size. Is there a distributed collective mismatch in your code?"
GLOO_SIZE = re.compile(
    r"op\.preamble\.length <= op\.nbytes\. (\d+) vs (\d+)|Received data size doesn't match expected size"
)
# a rank that reached its normal end: its training loop's last words, or torch's at-exit warning about a
# process group never destroyed (printed by the ProcessGroupNCCL destructor as the interpreter exits;
# torch 2.4 and 2.6+ wordings). Only believed for a rank with no error of its own (diagnose/reasoning.py).
FINISHED = re.compile(
    r"(?i:\b(?:training|fine-?tuning|pre-?training|train(?:ing)? loop)\s+(?:has\s+|is\s+)?"
    r"(?:finished|completed?|done)\b|\b(?:finished|completed|done)\s+(?:training|fine-?tuning)\b)"
    r"|process group has NOT been destroyed before we destruct ProcessGroupNCCL"
    r"|destroy_process_group\(\) was not called before program exit"
)
FINISHED_WORDS = ("inished", "omplete", "one", "destroy")  # cheap test before FINISHED
TERMINATE = re.compile(r"terminate called (?:after throwing an instance of '([^']*)'|without an active exception)")

# --- CUDA (c10/cuda/CUDAException.cpp, CUDACachingAllocator.cpp) ------------------------------------
CUDA_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory")
CUDA_ERROR = re.compile(r"CUDA error: ([^.\n]{1,120})|Cuda failure '([^']{1,120})'")
ECC = re.compile(r"ECC error|uncorrectable ECC|ECC uncorrectable")
# Linux NVRM (dmesg / kern.log): "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen
# off the bus."
XID = re.compile(r"NVRM: Xid \(PCI:([^)]*)\): (\d+),(?: pid=(\d+),)?(?: name=([^,]*),)?\s*(.*)")

# --- kernel / cgroup OOM killer, Slurm --------------------------------------------------------------
# (the kernel's "oom-kill:…,task=…,pid=N" summary always comes with the "Killed process" line)
HOST_OOM = re.compile(
    r"(?:Out of memory|Memory cgroup out of memory): Killed process (\d+) \(([^)]*)\)"
    r"|Detected (\d+) oom[-_]kill event"
)
# srun: "srun: error: node12: task 5: Killed", "srun: error: node3: tasks 0-3: Exited with exit code 1"
SLURM_TASK = re.compile(r"srun: error: (\S+): tasks? ([\d,\-]+): (.*)")
# Open MPI's mpirun (orte/tools/orterun help-orterun.txt "orterun:non-zero-exit"): "mpirun detected that one or
# more processes exited with non-zero status, thus causing the job to be terminated. The first process to do so
# was:" then "  Process name: [[50371,1],0]" (job id, vpid = the rank in MPI_COMM_WORLD) and "  Exit code:    1"
OMPI_PROCESS_NAME = re.compile(r"Process name: \[\[\d{1,10},\d{1,10}\],(\d{1,7})\]")
OMPI_FIRST_LINES = 3  # "Process name:" follows "The first process to do so was:" within this many lines
SRUN_EXIT = "srun task exit"  # the detail of the exits srun's task lines state (``parser._slurm_task``)
SLURM_CANCEL = re.compile(r"\*\*\* (?:STEP|JOB) (\S+) ON (\S+) CANCELLED AT (\S+)(?: DUE TO ([^*]+?))? \*\*\*")

# --- how many ranks there are (each a lower bound of the world: a communicator may be a subgroup) -----
# "WORLD_SIZE=8", "world_size: 8", torchrun's rendezvous "global_world_sizes=[8, 8]", NCCL's init
# "comm 0x… rank 3 nranks 8 cudaDev 3"; never torchrun's "group_world_size" / "local_world_size" (nodes,
# ranks per node)
WORLD_SIZE = re.compile(
    r"(?:(?<![A-Za-z_])(?:WORLD_SIZE|world_size|world size)\s*[=:]?\s*|global_world_sizes=\[|\brank \d{1,7} nranks )"
    r"(\d{1,7})\b"
)

# --- torch elastic (torch/distributed/elastic/multiprocessing/{api,errors/error_handler}.py) --------
# "failed (exitcode: -9) local_rank: 2 (pid: 8751) of binary: /usr/bin/python3"
ELASTIC_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\) of binary")
# "Sending process 8749 closing signal SIGTERM"
ELASTIC_CLOSING = re.compile(r"Sending process (\d+) closing signal (SIG\w+)")
# the failure report ("Failures:" … "Root Cause (first observed failure):" … entries of these fields)
REPORT_FAILURES = "Failures:"
REPORT_ROOT = "Root Cause (first observed failure)"
REPORT_TIME = re.compile(r"^\s*time\s+: (\d{4})-(\d\d)-(\d\d)_(\d\d):(\d\d):(\d\d)")
REPORT_HOST = re.compile(r"^\s*host\s+: (\S+)")
REPORT_RANK = re.compile(r"^\s*rank\s+: (-?\d+) \(local_rank: (-?\d+)\)")
REPORT_EXIT = re.compile(r"^\s*exitcode\s+: (-?\d+) \(pid: (\d+)\)(?:\s+\((SIG\w+)\))?")
REPORT_TRACEBACK = re.compile(r"^\s*traceback\s+: (.*)")

# --- Python tracebacks --------------------------------------------------------------------------
TB_START = "Traceback (most recent call last)"
TB_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')
TB_EXCEPTION = re.compile(
    r"^((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit|Failure|NotMet))(?:: ?(.*))?$"
)
# the same line outside a traceback (a paste that kept only the last lines): only on a line a rank prefix
# claims, and only a class named like an exception with a message (a bare "ValueError" is no evidence)
HEADLESS_EXCEPTION = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception)): (\S.*)$")
# a c10d collective in the innermost torch.distributed frame names the op
C10D_FILE = "distributed_c10d.py"
TORCH_PATH = re.compile(r"/(?:site|dist)-packages/|/torch/|<frozen ")
COMM_MESSAGE = COMMUNICATION  # one classification with the live verdict (core/failures.py)


def signal_name(exitcode: int) -> str | None:
    """torch elastic reports death by signal N as exitcode -N."""
    if exitcode >= 0:
        return None
    try:
        return _signal.Signals(-exitcode).name
    except ValueError:
        return f"SIG{-exitcode}"


def report_time(m: re.Match[str]) -> float:
    """The failure report's wall time on the same month*31-day scale as ``glog_time``."""
    _, month, day, hh, mm, ss = (int(m.group(i)) for i in range(1, 7))
    return ((month * 31 + day) * 24 + hh) * 3600 + mm * 60 + ss
