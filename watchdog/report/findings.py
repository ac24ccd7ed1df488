"""Findings in words: the one place the sentences of the live verdict and of the offline diagnosis are
written, one phrase per finding (``words``).

Every rule of ``core`` (the ladder's rungs, the engine) hands over a structured ``Finding`` (rule, kind,
ranks, strength, data) and the live verdict adds notes (what weaker rungs, stacks, GPU use and silent
nodes say) as data; tests assert on that data, not on these words. Offline a finding becomes a reason, a
next action and what would decide; live a reason and evidence lines, which ``verdict.stage``
writes into the verdict document. Every value may come from a hostile log or record: the parser bounds
it and the renderers (``diagnose.render``, ``report.text``/``html``) clean it before it is shown.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.engine import Finding
from ..core.facts import DESYNC_REPORT, NAMED_IN_MESSAGE, NCCL_OP_COUNTS, STORE_KEYS
from ..core.ranks import fmt_ranks, ranks_verb
from .live_words import LiveContext, live_words


@dataclass
class Words:
    reason: str
    next_action: str = ""
    would_decide: str = ""
    notes: list[str] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)  # live: the verdict's evidence lines for the finding


_CAUSE = {"cuda_oom": "CUDA out of memory", "host_oom": "killed by the host OOM killer"}


def failure_label(d: Mapping[str, Any]) -> str:
    """An end's cause in a few words: 'CUDA out of memory', 'Python exception …', 'died by SIGKILL …'."""
    cause, detail = d.get("cause"), d.get("detail") or ""
    if cause in _CAUSE:
        return _CAUSE[cause]
    if cause == "cuda_error":
        return f"CUDA error: {detail}" if detail else "CUDA error"
    if cause == "hw_fault":
        return f"GPU hardware fault ({detail})"
    if cause == "python_error":
        return f"Python exception {detail[:120]}"
    if d.get("signal"):
        return f"died by {d['signal']} that torchrun did not send"
    return "failed"


def _exit_action(d: Mapping[str, Any], who: str) -> str:
    cause, sig = d.get("cause"), d.get("signal")
    on = f" on {d['node']}" if d.get("node") else ""
    if cause == "hw_fault":
        return (f"take the GPU of {who}{on} out of service and check it (nvidia-smi -q -d ECC, dcgmi diag, "
                "dmesg for Xid); restart the job on other hardware — the other ranks' timeouts are consequences")
    if cause == "cuda_oom":
        return (f"{who} ran out of GPU memory: lower its memory use (batch/sequence length, activation "
                "checkpointing) and check for uneven work across ranks; the other ranks only timed out")
    if cause == "cuda_error":
        return (f"debug the kernel failure on {who}: rerun with CUDA_LAUNCH_BLOCKING=1 (and "
                "compute-sanitizer) to find the faulting op; the other ranks only waited for it")
    if cause == "host_oom":
        return (f"{who} was killed for host RAM{on}: reduce DataLoader workers / prefetch / pinned memory, or "
                "request more memory; check dmesg / the Slurm step's memory limit")
    if cause == "python_error":
        return (f"fix the exception on {who} (traceback ending at {d.get('site') or '?'}); the other ranks failed "
                "because it left")
    if sig == "SIGKILL":
        return (f"find what killed {who}{on}: the kernel OOM killer (dmesg -T | grep -i 'killed process'), "
                "the scheduler (preemption, memory limit) or a person; the other ranks only lost their peer")
    if sig in ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT"):
        return (f"{who} crashed natively ({sig}): rerun with PYTHONFAULTHANDLER=1 and core dumps enabled to get "
                "its stack; check extensions / custom kernels it alone runs")
    return f"look at {who}'s own log first; the other ranks' errors are consequences"


def _exit_cause(f: Finding, who: str, d: Mapping[str, Any]) -> Words:
    if d.get("all_failed"):
        return Words(
            f"every rank ({fmt_ranks(d['failed'])}) failed by its own cause and none waited on another: no "
            "rank held the others back (independent failures, or several jobs' logs read as one)",
            "diagnose each job's logs on their own; look at each rank's own failure",
            "per-job logs (one job's console and per-rank logs per run)",
        )
    if d.get("same_failure"):
        return Words(
            f"every rank ({fmt_ranks(d['failed'])}) failed the same way ({failure_label(d)}) with nothing that "
            "orders them: a cause common to all ranks (environment, launcher option, shared code path), not "
            "one rank holding the others back",
            "reproduce with one rank (or world size 2) to see the crash itself; enable faulthandler "
            "(PYTHONFAULTHANDLER=1) and core dumps so a native crash leaves a stack",
            "per-rank stderr with the crash message or a faulthandler stack from each rank",
        )
    if (late := d.get("after_waits")) is not None:
        return Words(
            f"{who} ended ({failure_label(d)}, no message of its own) {late / 60:.0f} min after "
            f"{fmt_ranks(d.get('waiting') or ())} had already timed out waiting: its end cannot be what they waited "
            "for, and a rank that hung ends the same way when its own watchdog aborts it",
            f"find what {ranks_verb(f.ranks, 'was', 'were')} doing when the others timed out (its stack, its own "
            "stderr before the abort)",
            "the rank's own stderr (a watchdog timeout line, or its own crash message), or a stack taken during "
            "the hang",
        )
    reason = f"{who} failed first: {failure_label(d)}"
    if d.get("waiting"):
        reason += f"; {fmt_ranks(d['waiting'])} then waited on it (timeouts / lost peer) — downstream"
    if d.get("bare_abort"):
        reason += (": a SIGABRT with no message of its own — the rank's own abort and ProcessGroupNCCL's "
                   "watchdog abort after a timed-out collective end the same way")
        return Words(reason, _exit_action(d, who),
                     "the rank's own stderr (a watchdog timeout line, or its own crash message)")
    return Words(reason, _exit_action(d, who))


_MISMATCH_SOURCE = {"fingerprint": "c10d's collective fingerprint check", "stack": "their stacks"}


def _mismatch(f: Finding, who: str, d: Mapping[str, Any]) -> Words:
    if d.get("source") == "size":
        noticed = fmt_ranks(d.get("noticed") or ())
        return Words(
            f"{noticed} received a message of the wrong size ({d.get('detail') or 'size mismatch'}): a peer "
            "called a collective with a different size or op. Gloo only tells the receiver, so the logs do "
            "not say which peer sent it",
            "check that every rank passes tensors of the same shape/dtype to each collective (rank-dependent "
            "sizes, uneven last batch)",
            "rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL (names both ranks and their tensor shapes) or capture "
            "flight-recorder dumps (rankwatch run) that list each rank's sizes",
        )
    if "groups" in d:
        desc = "; ".join(f"{fmt_ranks(v)} in {k}" for k, v in sorted(d["groups"].items()))
        return Words(
            f"ranks disagree on the collective ({desc}) and no group is a minority",
            "make every rank issue the same collectives in the same order",
            "the expected call order (code review) or flight-recorder dumps from each rank",
        )
    how = _MISMATCH_SOURCE.get(d.get("source", ""), f"the NCCL watchdog (same collective #{d.get('seq')})")
    sites = d.get("sites") or ()
    where = f" at {', '.join(sites)}" if sites and d.get("source") == "stack" else ""
    return Words(
        f"{who} called {', '.join(d.get('odd_ops') or ())}{where} while {fmt_ranks(d.get('majority') or ())} "
        f"called {d.get('majority_op')} (per {how}); nobody could complete",
        f"make {who} issue the same collectives in the same order as the others (look for rank-dependent "
        "branches around that call); TORCH_DISTRIBUTED_DEBUG=DETAIL checks this at every call",
    )


_WAIT_SOURCE: dict[str, Callable[[str, Mapping[str, Any]], str]] = {
    DESYNC_REPORT: lambda who, d: (f"PyTorch's desync report names {who} as the lagging rank(s) "
                                   f"({d.get('lagging') or 'lagging'}): every other rank waited for it"),
    NAMED_IN_MESSAGE: lambda who, d: (f"the ranks that gave up waiting named {who} in their own error (a monitored "
                                      f"barrier's \"failed to pass monitoredBarrier\"): {who} never arrived, the "
                                      "others' errors are the consequence"),
    NCCL_OP_COUNTS: lambda who, d: (f"{who} enqueued fewer NCCL operations than its communicator's other members "
                                    "(NCCL INFO opCount): they waited for it"),
    STORE_KEYS: lambda who, d: (f"{who} never published its rendezvous key: the other ranks' start-up store waits "
                                "timed out on it (DistStoreError … keys: …/<rank>), so it never reached "
                                "init_process_group"),
}
"""The words of each source ``core.rules.waits.NAMING_SOURCES`` decides by (a test keeps both in step)."""


def _wait_for(f: Finding, who: str, d: Mapping[str, Any]) -> Words:
    reason = _WAIT_SOURCE[d["source"]](who, d)
    return Words(reason, f"find what {ranks_verb(f.ranks, 'was', 'were')} doing instead of the next collective: "
                 "a stack during the hang (rankwatch run captures it), data loading / I/O / rank-specific work")


def _lone(f: Finding, who: str, d: Mapping[str, Any]) -> Words:
    left = []
    if d.get("finished"):
        left.append(f"{fmt_ranks(d['finished'])} had finished")
    if d.get("idle"):
        left.append(f"{fmt_ranks(d['idle'])} had no NCCL work pending (all completed up to "
                    f"#{d.get('idle_completed')}) when told of the timeout")
    silent = f"; {fmt_ranks(d['silent'])} left no message" if d.get("silent") else ""
    n = d.get("seq")
    coll = f"collective #{n}" if n is not None else "a collective"
    if d.get("shape") == "late":
        return Words(
            f"{who} timed out in {coll}, which the others had already issued (they reached #{d.get('reached')}) "
            f"before they stopped: {who} arrived late — behind — and " + "; ".join(left) + silent,
            f"find what delayed {who} before {coll} (a stack during the hang, data loading, rank-specific work); "
            "end the run with a barrier or destroy_process_group() so no rank leaves before the others' last "
            "collective completes",
            "flight-recorder dumps from every rank (the ops each one issued last)",
        )
    if d.get("shape") == "lone":
        return Words(
            f"{who} entered {coll} that no other rank issued; " + "; ".join(left) + silent,
            f"find the collective {who} issues after the others' last one: a rank-conditional collective (if "
            "rank == …: all_reduce), one more batch on that rank (uneven shards: DistributedSampler drop_last "
            "or the Join context manager), or a final metric/barrier only it reaches; "
            "TORCH_DISTRIBUTED_DEBUG=DETAIL or flight-recorder dumps show its op and call site",
        )
    at = f" in collective #{n}" if n is not None else ""
    return Words(
        f"{who} left early — exited normally while its peers were still mid-step (uneven data, an early "
        f"return): {fmt_ranks(d.get('inside') or ())} then timed out waiting for it or lost it{at}" + silent,
        f"find why {who} ran out of work first: uneven shards (DistributedSampler drop_last, the Join context "
        "manager), an early return or a rank-dependent break in its loop",
    )


_HOW_BEHIND = {"enqueued": "last enqueued collective", "timeout": "collective sequence number at the timeout",
               "last": "last collective entered"}


def _behind(f: Finding, who: str, d: Mapping[str, Any]) -> Words:
    how = _HOW_BEHIND.get(d.get("source", ""), "collective number")
    if d.get("shape") == "ahead":
        return Words(
            f"{who} issued more collectives ({how} {d.get('high')}) than {fmt_ranks(d.get('behind') or ())} "
            f"({d.get('low')}): an extra collective nobody else joined",
            f"find the collective {who} issues that the others do not (rank-dependent code)",
        )
    return Words(
        f"{ranks_verb(f.ranks, 'is', 'are')} behind: {how} {d.get('low')} while {fmt_ranks(d.get('ahead') or ())} "
        f"reached {d.get('high')}; "
        "the others timed out waiting for it to join",
        f"find what {ranks_verb(f.ranks, 'was', 'were')} doing instead of collective #{(d.get('low') or 0) + 1}: "
        "a stack during the hang "
        "(py-spy dump, or rankwatch run which captures it), data loading / I/O / rank-specific work; "
        "flight-recorder dumps show the op it last issued",
    )


def _outside(f: Finding, who: str, d: Mapping[str, Any]) -> Words:
    waiting = fmt_ranks(d.get("waiting") or ())
    told = d.get("told") or ()
    note = (f" ({fmt_ranks(told)} only received another rank's flight-recorder dump signal: told of the timeout, "
            "not timed out)") if told else ""
    if not d.get("decided", True):
        unseen = d.get("unseen") or ()
        quiet = [r for r in d.get("silent") or () if r not in unseen]
        silent = f"{fmt_ranks(d.get('silent') or ())} printed no timeout of its own"
        if unseen:
            silent = f"{fmt_ranks(unseen)} left no line in the log at all (a node lost at once leaves none)" + (
                f" and {fmt_ranks(quiet)} printed no error of its own" if quiet else "")
        elif d.get("stopped"):
            silent = (f"{fmt_ranks(d['stopped'])} printed no error of its own and ended by SIGTERM (an outside kill "
                      "and the launcher's teardown end alike), and a rank that exited 0 is in no launcher report")
        return Words(
            f"{waiting} timed out or lost a peer, but {silent}: any of them could be the one that never arrived"
            + note,
            "collect each rank's own stderr (torchrun --log-dir … --tee 3) before deciding",
            "per-rank logs of the silent ranks, or stacks taken during the hang (rankwatch run / py-spy dump), "
            "or NCCL watchdog messages with sequence numbers",
        )
    if d.get("launcher_first"):
        return Words(
            f"the launcher says {who} was the first process to exit with a failure, and {waiting} only failed "
            f"waiting on a peer (consequences){note}; {who}'s own error is not in the log",
            f"find why {who} exited: its own stderr (often printed earlier than the others' errors), dmesg for the "
            "OOM killer, the scheduler",
        )
    gone = d.get("peer_only")
    what = "lost the connection to a peer (a peer process went away)" if gone else \
        "timed out waiting in a collective"
    look = ("why it exited (its own stderr, dmesg for the OOM killer, the scheduler)" if gone else
            "its stack during the hang (rankwatch run captures py-spy stacks; py-spy dump by hand), e.g. data "
            "loading, I/O, a rank-specific branch before the collective")
    return Words(
        f"{waiting} {what}; {who} printed no such error: it never entered the collective the others waited in"
        + note,
        f"find what {ranks_verb(f.ranks, 'was', 'were')} doing: {look}",
    )


def _same_collective(f: Finding, who: str, d: Mapping[str, Any]) -> Words:
    same = d.get("same")
    at = f" ({same.get('op') or 'same call'} at {same.get('site')})" if same else ""
    return Words(
        f"every rank ({fmt_ranks(d.get('waiting') or ())}) timed out in the same collective{at}: the logs do "
        "not single out a rank — a communication hang, or a mismatch in sizes/order that these messages "
        "cannot show",
        "check the transport (NCCL_DEBUG=WARN output, NCCL RAS, network/fabric errors on the nodes) and that "
        "all ranks pass tensors of the same size",
        "flight-recorder dumps (sizes and sequence numbers per rank), TORCH_DISTRIBUTED_DEBUG=DETAIL (names "
        "mismatching ranks), or stacks from a live hang (rankwatch run)",
    )


def _report_only(f: Finding, who: str, d: Mapping[str, Any]) -> Words:
    how = d.get("signal") or f"exit code {d.get('exitcode')}"
    return Words(
        f"only torchrun's exit report says anything: {fmt_ranks(d.get('exited') or ())} exited first (ended by "
        f"{how}); without the ranks' own messages that is a guess",
        "look at that rank's own output; rerun with torchrun --log-dir DIR --tee 3 to keep it",
        "each rank's stderr (Python tracebacks, NCCL/gloo errors)",
    )


def _logged(f: Finding, who: str, d: Mapping[str, Any]) -> Words:
    return Words(
        f"rankwatch's own verdict, printed in this log: {d.get('line') or who}",
        "read that incident's bundle (rankwatch report DIR/incidents/<id>): it holds the stacks and the "
        "flight-recorder analysis the verdict rests on",
    )


def _none(f: Finding, who: str, d: Mapping[str, Any]) -> Words:
    seen = f" ({fmt_ranks(d['seen'])} seen)" if d.get("seen") else ""
    return Words(
        f"no failure, timeout or exit message in these logs{seen}",
        "pass the job's full output: torchrun's console and the per-rank logs",
        "torchrun's failure report, per-rank stderr with tracebacks, NCCL watchdog or gloo timeout messages, "
        "or dmesg/Slurm output from the nodes",
    )


OFFLINE_SHAPES = frozenset({"late", "lone", "left_early", "ahead", "behind"})
"""The shapes the offline rules' words tell apart (``_lone``, ``_behind``); live shapes are
``report.live_words``'. A test holds every shape a rule makes to one of the two."""

_WORDS: dict[str, Callable[[Finding, str, Mapping[str, Any]], Words]] = {
    "rankwatch_verdict": _logged,
    "exit_cause": _exit_cause,
    "mismatch": _mismatch,
    "wait_for": _wait_for,
    "lone_collective": _lone,
    "behind": _behind,
    "outside": _outside,
    "same_collective": _same_collective,
    "report_only": _report_only,
    "none": _none,
}


def words(f: Finding, live: LiveContext | None = None) -> Words:
    """The words of a finding: live (``live`` given: the ranks' views and every rung's finding, which
    the phrases quote) by its shape, or by its rule for the engine's; offline by its rule."""
    if live is not None:
        reason, evidence = live_words(f, live)
        return Words(reason, evidence=evidence)
    render = _WORDS.get(f.rule, _none)
    out = render(f, fmt_ranks(f.ranks), f.data)
    if victims := f.data.get("root_cause_victims"):
        out.notes.append(f"torchrun's 'Root Cause (first observed failure)' names {fmt_ranks(victims)}: that is "
                         "only the first exit torchrun noticed, and that rank was a victim, not the cause.")
    return out
