"""What ``rankwatch inspect`` knows of each rank, turned into the views the verdict engine decides over.

A job that was never wrapped has no record: no step counter, no phase timer, no collective sequence. What
it has are facts of the process table and of its stacks — alive, stopped (``T``), a zombie with its wait
status, gone altogether (the launcher started a local rank that is no longer there), and where the main
thread is (``stack_phase``: the phase, waiting in ``torch.distributed``/DDP's reducer or not). These map
onto the same ``RankView`` the live pipeline builds, so the same ``decide`` names the rank: exits and
stops first, then the minority that does not wait for its peers and its phase, then an odd stack.
Steps and time in phase stay 0 (unknown); the evidence says so. Pure: facts in, views and lines out.

Before any of that, ``judge_progress`` says whether the job is stalled at all: a job found at one look
in the middle of a healthy step has ranks "not waiting" and odd stacks like a hung one, so every rank is
looked at twice (``InspectPolicy``) and a job whose ranks all made progress in between is *running*.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from .fr_trace import RankTrace
from .policy import InspectPolicy
from .ranks import fmt_ranks
from .snapshot import CRASHED, DEAD, EXITED, RUNNING, STOPPED, UNKNOWN, RankView
from .stack_phase import phase_from_frames
from .stacks import Frame, signature, stack_top, waiting_on_peers

# Linux signal numbers (kept here: the ``signal`` module is for sending them, which the core never does)
SIGNAL_NAMES = {1: "SIGHUP", 2: "SIGINT", 3: "SIGQUIT", 4: "SIGILL", 6: "SIGABRT", 7: "SIGBUS", 8: "SIGFPE",
                9: "SIGKILL", 11: "SIGSEGV", 13: "SIGPIPE", 15: "SIGTERM"}
# signals a launcher sends when it tears a worker group down after a failure (torchrun: SIGTERM, then
# SIGKILL after its grace period; Ctrl-C: SIGINT): a rank ended by one of these is a consequence
TEARDOWN_SIGNALS = frozenset({1, 2, 15})


@dataclass(frozen=True)
class RankFact:
    """One rank as the process table and py-spy saw it."""

    rank: int
    node: str
    node_rank: int
    pid: int  # -1: no process left (the launcher started it, it is gone and reaped)
    proc_state: str  # /proc state letter; "" when the process vanished while it was inspected
    exit_status: int | None = None  # waitpid status of a zombie
    frames: tuple[Frame, ...] = ()  # the main thread, innermost first; () when no stack was read
    cpu_pct: float | None = None  # CPU use of the process over the inspection
    stack_error: str | None = None  # why no stack was read (py-spy's error)


def python_frames(frames: Sequence[Frame]) -> tuple[Frame, ...]:
    """The Python frames of a stack (``--native`` adds C/C++ frames from shared objects, which the rules on
    library boundaries and waits do not read: the bundle keeps them)."""
    return tuple(f for f in frames if f.filename.endswith(".py") or f.filename.startswith("<"))


def _signal_name(sig: int) -> str:
    return SIGNAL_NAMES.get(sig, f"signal {sig}")


def views_from_facts(
    facts: Sequence[RankFact], *, stack_top_frames: int = 5, signature_frames: int = 12
) -> tuple[list[RankView], list[str]]:
    """Views for ``decide`` and the evidence lines that say which facts they rest on."""
    lines: list[str] = []
    # a peer that died by its own signal (or is gone) makes the others' non-zero exits its consequences
    lost = [
        f.rank
        for f in facts
        if f.pid < 0
        or (f.exit_status is not None and os.WIFSIGNALED(f.exit_status)
            and os.WTERMSIG(f.exit_status) not in TEARDOWN_SIGNALS)
    ]
    views = []
    sites: dict[str, list[int]] = {}
    for f in facts:
        f = replace(f, frames=python_frames(f.frames))
        state, cause, verified = _state_of(f, lost, lines)
        phase, waiting = _read_stack(f, sites, lines) if f.frames and state in (RUNNING, STOPPED) else (None, None)
        views.append(
            RankView(
                rank=f.rank,
                node=f.node,
                pid=f.pid,
                state=state,
                step=0,
                phase=phase,
                in_phase_s=0.0,
                since_progress_s=0.0,
                exit_cause=cause,
                node_rank=f.node_rank,
                verified=verified,
                stack_top=stack_top(f.frames, stack_top_frames) if state in (RUNNING, STOPPED) else (),
                stack_signature=signature(f.frames, signature_frames) if state in (RUNNING, STOPPED) else None,
                waiting=waiting,
            )
        )
    waiting_ranks = sum(len(r) for r in sites.values())
    if len(sites) > 1 and waiting_ranks == sum(1 for v in views if v.state == RUNNING):
        # every live rank waits, but not in the same collective: the wait-for graph has two sides, and the
        # side that called what nobody else did is the suspect (without sequence numbers: from the stacks)
        parts = "; ".join(f"{fmt_ranks(r)} in {site}" for site, r in sorted(sites.items(), key=lambda kv: len(kv[1])))
        lines.append(f"every live rank waits for peers, in different collectives: {parts}")
    lines.append("inspected without the hook: steps and time in phase are unknown (shown as 0)")
    return views, lines


def _state_of(f: RankFact, lost: Sequence[int], lines: list[str]) -> tuple[str, str | None, bool]:
    """(state, exit cause, verified) from the process's exit status or /proc state, with its line."""
    state, cause, verified = RUNNING, None, True
    if f.pid < 0:
        state, verified = DEAD, False
        lines.append(f"rank {f.rank}: its process is gone (the launcher started it on node {f.node_rank})")
    elif f.exit_status is not None:
        st = f.exit_status
        if os.WIFSIGNALED(st):
            sig = os.WTERMSIG(st)
            if sig in TEARDOWN_SIGNALS and [r for r in lost if r != f.rank]:
                state, cause = CRASHED, f"{_signal_name(sig)}: the launcher's teardown after a peer was lost"
            else:
                state = DEAD
            lines.append(f"rank {f.rank}: exited, killed by {_signal_name(sig)} (zombie, not yet reaped)")
        else:
            code = os.WEXITSTATUS(st)
            if code == 0:
                state = EXITED
            else:
                state = CRASHED
                others = [r for r in lost if r != f.rank]
                cause = f"exit code {code}" + (
                    " after a peer was lost (waiters end with a communication error)" if others else ""
                )
            lines.append(f"rank {f.rank}: exited with code {code} (zombie, not yet reaped)")
    elif f.proc_state in ("Z", "X", ""):
        state = DEAD
        lines.append(f"rank {f.rank}: its process ended while it was inspected")
    elif f.proc_state == "T":
        state = STOPPED
    elif f.proc_state == "?":
        state = UNKNOWN
    if state in (RUNNING, STOPPED) and not f.frames:
        # alive but unread: not "not waiting" — no evidence either way, so it takes no side
        state = UNKNOWN
        lines.append(f"rank {f.rank}: no stack read ({f.stack_error or 'py-spy returned none'}): left out of the "
                     "comparison")
    return state, cause, verified


def _read_stack(f: RankFact, sites: dict[str, list[int]], lines: list[str]) -> tuple[str | None, bool | None]:
    """(phase, waiting on peers) of a live rank from its stack; a rank waiting in a collective joins its
    site in ``sites``."""
    sp = phase_from_frames(f.frames)
    waiting = waiting_on_peers(f.frames)
    where = f"{sp.phase}" + (f" ({sp.op})" if sp.op else "")
    if waiting is not False and sp.phase in ("collective", "backward"):
        sites.setdefault(where if sp.op else f"{sp.phase} (DDP's gradient all-reduce)", []).append(f.rank)
    if f.cpu_pct is not None or sp.op:
        lines.append(
            f"rank {f.rank}: "
            + ", ".join(x for x in (f"in {where}" if sp.op else "",
                                    f"{f.cpu_pct:.0f}% CPU" if f.cpu_pct is not None else "") if x)
        )
    return sp.phase, waiting


# -- running or stalled: two looks ----------------------------------------------------------------------
@dataclass(frozen=True)
class RankLook:
    """One rank at one look: what moves when a rank makes progress."""

    rank: int
    at: float  # monotonic seconds when its CPU time was read
    alive: bool  # the process discovery found (same start time), not a zombie
    state: str  # /proc state letter at this look
    cpu_ticks: int | None  # user + system CPU time so far, in clock ticks
    signature: str | None  # its main thread's stack signature; None when no stack was read
    fr_counter: tuple[int, int] | None = None  # (newest record id, completed entries) of a live flight recorder
    wakeups: int | None = None  # times its main thread was woken from a wait so far (None: unknown)


@dataclass(frozen=True)
class Progress:
    """Whether a job ran between the looks, rank by rank."""

    running: bool
    moved: tuple[int, ...]  # ranks that made progress
    still: tuple[int, ...]  # ranks that did not (CPU time flat, stopped, gone): the job is stalled
    again: tuple[int, ...]  # CPU time advanced but the stack read the same: worth another look
    unread: tuple[int, ...]  # CPU time advanced, no stack at one of the looks: takes no side
    seconds: float  # the longest time between a rank's first and last look
    line: str  # one line that says what the looks saw


def fr_counter(trace: RankTrace | None) -> tuple[int, int] | None:
    """What a live flight recorder's progress reads as: the newest record and how many completed."""
    if trace is None or not trace.entries:
        return None
    return max(e.record_id for e in trace.entries), sum(1 for e in trace.entries if e.state == "completed")


def judge_progress(
    first: Mapping[int, RankLook], last: Mapping[int, RankLook], *, ticks_per_s: float,
    policy: InspectPolicy | None = None, gone: Sequence[int] = (),
) -> Progress:
    """Running or stalled from two looks at a job's ranks (``gone``: ranks the launcher started that are no
    longer there). A rank moved when its flight recorder advanced, or when its CPU time advanced and either
    its stack's signature changed or its main thread was woken from waits again and again (``InspectPolicy``).
    Running only when no rank stood still, none is stopped or gone, none still awaits a further look (CPU
    time moved, nothing else did), and at least one moved; a rank whose stack was not read takes no side."""
    policy = policy or InspectPolicy()
    moved, still, again, unread = [], [], [], []
    why: dict[str, list[int]] = {}
    spans = []
    for rank in sorted(set(first) | set(last)):
        a, b = first.get(rank), last.get(rank)
        if a is None or b is None or not (a.alive and b.alive) or b.state in ("Z", "X", ""):
            still.append(rank)
            why.setdefault("gone", []).append(rank)
            continue
        span = max(0.0, b.at - a.at)
        spans.append(span)
        if "T" in (a.state, b.state):
            still.append(rank)
            why.setdefault("stopped", []).append(rank)
            continue
        if a.fr_counter is not None and b.fr_counter is not None and a.fr_counter != b.fr_counter:
            moved.append(rank)
            why.setdefault("flight recorder advanced", []).append(rank)
            continue
        need = max(1.0, policy.min_cpu_share * span * ticks_per_s)
        cpu_moved = a.cpu_ticks is not None and b.cpu_ticks is not None and b.cpu_ticks - a.cpu_ticks >= need
        if not cpu_moved:
            still.append(rank)
            why.setdefault("CPU time flat", []).append(rank)
        elif a.signature is not None and b.signature is not None and a.signature != b.signature:
            moved.append(rank)
            why.setdefault("stack moved, CPU advanced", []).append(rank)
        elif (a.wakeups is not None and b.wakeups is not None
              and b.wakeups - a.wakeups >= max(2.0, policy.min_wakeups_per_s * span)):
            moved.append(rank)
            why.setdefault("CPU advanced, main thread woken from waits", []).append(rank)
        elif a.signature is None or b.signature is None:
            unread.append(rank)
            why.setdefault("no stack read", []).append(rank)
        else:
            again.append(rank)
            why.setdefault("CPU advanced, same stack", []).append(rank)
    if gone:
        still += [r for r in gone if r not in still]
        why.setdefault("gone", []).extend(r for r in gone if r not in why.get("gone", []))
    running = bool(moved) and not still and not again
    seconds = max(spans, default=0.0)
    parts = "; ".join(f"{fmt_ranks(sorted(ranks))}: {what}" for what, ranks in why.items())
    line = f"two looks {seconds:.1f}s apart: {parts or 'no rank'}"
    return Progress(running, tuple(moved), tuple(sorted(still)), tuple(again), tuple(unread), seconds, line)
