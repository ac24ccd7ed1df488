"""The one evidence ladder, as data, strongest first: every rung the live verdict (``core.verdict.decide``)
and the offline diagnosis (``diagnose.reasoning``) ask, with the rule each source runs for it.

A rung is one kind of evidence; a source has its rule for a rung or does not (live-only facts: a stopped
process, GPU use, stacks; log-only facts: rankwatch's own line, a launcher's report). Where both sources
hold the evidence they ask the same rung: an end by its own cause (``exits`` live, ``exit_cause`` offline),
a collective mismatch, the wait-for graph (``core.engine.blame`` over either source's facts), ranks behind
in one process group, everyone in the same collective. Live weighs every rung (the strongest that singles
ranks out decides, weaker ones back or question it); offline the first rung that concludes decides.
A new bug class is one fact extractor (``core.live_facts``, ``diagnose.log_facts``) or one rung here. Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .. import engine
from ..engine import Finding
from ..facts import FactSet, Progress, Rung
from ..live_facts import (
    gpu_facts,
    in_collective_facts,
    progress_facts,
    stack_facts,
    thread_facts,
    waits_on_peers,
)
from ..policy import OfflinePolicy, VerdictPolicy
from ..schema import UNKNOWN
from ..snapshot import EXITED, RUNNING, RankView
from . import names as n
from .counters import rule_behind as counters_behind
from .counters import rule_collective, rule_not_waiting
from .ended import rule_exit_cause, rule_report_only
from .exits import abort_on_mismatch, abort_with_odd_counts, rule_gone, rule_stopped, split_consequence
from .logged import rule_logged_verdict
from .mismatch import rule_mismatch
from .peers import rule_wrong_peer
from .progress import rule_behind, rule_lone_collective
from .recorder import Behind, fr_behind, rule_fr, split_behind
from .threads import rule_thread_died
from .waits import rule_outside, rule_wait_for
from .waits import rule_same_collective as facts_same_collective
from .weak import rule_same_collective, rule_stacks

NONE = "none"


@dataclass
class LiveCase:
    """What the live rules read: every rank's view, the flight recorder's facts (``core.fr_facts``), the
    policy, the exit facts, and the facts made from the views (``core.live_facts``), each made once and only
    when a rung reads it: the engine's (``facts``, built by ``core.verdict``), where the live ranks are
    (``live_progress``), their stacks and GPU use (``seen``)."""

    views: Sequence[RankView]
    present: Sequence[RankView]
    live: Sequence[RankView]
    fr: FactSet | None
    policy: VerdictPolicy
    ends: FactSet  # the exit rungs' facts: ends and where every rank is (``core.live_facts.exit_facts``)
    facts: FactSet | None = None
    _progress: list[Progress] | None = field(default=None, repr=False)
    _seen: FactSet | None = field(default=None, repr=False)
    _fr_rows: list[Behind] | None = field(default=None, repr=False)

    def fr_rows(self) -> list[Behind]:
        """The ranks behind in the flight recorder's groups (``rules.recorder.fr_behind``), made once: its rung
        and the document's ``flight_recorder`` section read them."""
        if self._fr_rows is None:
            self._fr_rows = fr_behind(self.fr) if self.fr is not None else []
        return self._fr_rows

    def live_progress(self) -> list[Progress]:
        """Where every live rank is (``Progress`` facts; the exit facts' own where they were made)."""
        if self._progress is None:
            made = self.ends.progress
            self._progress = [p for p in made if p.how == RUNNING] if made else progress_facts(self.live)
        return self._progress

    def exited(self) -> list[int]:
        """The ranks that exited normally (made with the exit facts whenever one did)."""
        return [p.rank for p in self.ends.progress if p.how == EXITED]

    def seen(self) -> FactSet:
        """The ranks that answered, their stack equivalence classes, the live ranks' GPU use and helper
        threads that died."""
        if self._seen is None:
            self._seen = FactSet(ranks=tuple(v.rank for v in self.present), stacks=stack_facts(self.present),
                                 gpu=gpu_facts(self.live), threads=thread_facts(self.present))
        return self._seen


OfflineRule = Callable[[FactSet, OfflinePolicy], Finding | None]
LiveRule = Callable[[LiveCase], Finding | None]


@dataclass(frozen=True)
class LadderRung:
    """One kind of evidence, the rule each source runs for it (None: that source never holds it), and how the
    live verdict weighs it — the only place a rung's role is stated (``core.verdict`` reads these flags, never
    a rung's name).

    ``strong``: may name a majority of ranks. ``offline_name``: the rule name offline documents carry.
    ``first``: live, asked before the graph. ``decisive``: a naming by it decides without the graph and the
    weaker rungs (an own exit, a stop). ``final``: its finding is never weighed against weaker rungs (the dead
    and the stopped cannot be second-guessed). ``backs``: a finding of it that names the same ranks raises
    the deciding finding's confidence. ``subsumes``: weaker rungs whose disagreement is no evidence against
    this one (they read what it already read). ``lends_label``: when the wait-for graph's sinks are what this
    rung names too, the document's ``decided_by`` says this (the names dashboards know). ``derived``: no rule
    of its own, split off another rung by a refinement (``REFINEMENTS``)."""

    name: str
    what: str
    strong: bool
    live: LiveRule | None = None
    offline: OfflineRule | None = None
    offline_name: str = ""
    decided_by: str = ""  # what the live ``decided_by`` says for it (the names dashboards already know)
    first: bool = False
    after_decision: bool = False  # live: asked even when an own exit or a stop decided (the job's prior kill)
    decisive: bool = False
    final: bool = False
    backs: bool = False
    subsumes: frozenset[str] = frozenset()
    lends_label: str = ""
    derived: bool = False

    @property
    def label(self) -> str:
        return self.decided_by or self.name


def _live_after_kill(c: LiveCase) -> Finding | None:
    return engine.after_kill(c.facts) if c.facts is not None else None


def _live_wait_for(c: LiveCase) -> Finding | None:
    return engine.blame(c.facts) if c.facts is not None else None


def _live_fr(c: LiveCase) -> Finding | None:
    # with no rank alive the recorder still says who issued a mismatched collective (dumps at the ranks' ends)
    if c.fr is None:
        return None
    return rule_fr(c.fr, c.live_progress() if c.live else [], c.fr_rows(), world=[v.rank for v in c.views])


def _live_gpu(c: LiveCase) -> Finding | None:
    return rule_same_collective(in_collective_facts(c.live), c.seen().gpu, c.policy) if c.live else None


def _live_counters(c: LiveCase) -> Finding | None:
    live = c.live_progress()
    fr_waiting = {w.rank for w in c.fr.waits} if c.fr is not None else set()
    return (counters_behind(live, fr_waiting) or rule_collective(live)) if live else None


def _live_waiting(c: LiveCase) -> Finding | None:
    live = c.live_progress()
    return rule_not_waiting(live, c.exited()) if live and not any(waits_on_peers(p) for p in live) else None


LADDER: tuple[LadderRung, ...] = (
    LadderRung(n.RANKWATCH_VERDICT, "rankwatch's own verdict line in a log (it saw more than the log)", True,
               offline=lambda f, p: rule_logged_verdict(f), offline_name="rankwatch_verdict"),
    LadderRung(n.AFTER_KILL, "exits that follow rankwatch's own kill of an earlier incident's initiators", True,
               live=_live_after_kill, after_decision=True, final=True),
    LadderRung(n.EXITS, "ends by their own cause, by cause then time (early normal exits while peers are "
               "mid-step); every rank failing alike names nobody", True,
               live=lambda c: rule_gone(c.ends, c.policy), offline=rule_exit_cause, offline_name="exit_cause",
               first=True, decisive=True, final=True),
    LadderRung(n.STOPPED, "ranks stopped by SIGSTOP or a debugger", True, live=lambda c: rule_stopped(c.ends),
               first=True, decisive=True, final=True),
    LadderRung(n.FLIGHT_RECORDER, "a collective mismatch (op/size/dtype) at one seq: the flight recorder live; "
               "fingerprints, watchdog SeqNums, stacks offline", True,
               live=_live_fr, offline=lambda f, p: rule_mismatch(f), offline_name="mismatch", first=True,
               backs=True),
    LadderRung(n.WAIT_FOR, "sinks of the wait-for graph over groups, p2p peers, exits, silent nodes (live); the "
               "desync report's, a message naming whom it waited for, NCCL op counts' edges (offline)", True,
               live=_live_wait_for, offline=lambda f, p: rule_wait_for(f), offline_name="wait_for",
               # the graph already read groups, p2p peers and counters: their per-group "behind" is no
               # independent evidence against it (pipeline stages and subgroups make it disagree by design)
               subsumes=frozenset({n.EXITS_CONSEQUENCE, n.FR_BEHIND, n.COUNTERS, n.WAITING})),
    LadderRung(n.WRONG_PEER, "in a cycle of send/recv waits (no sink), the one edge to a peer its waiter never "
               "exchanged with before: that waiter's schedule is wrong (the hook's record)", False,
               live=lambda c: rule_wrong_peer(c.facts) if c.facts is not None else None, decided_by=n.COUNTERS,
               subsumes=frozenset({n.FR_BEHIND, n.COUNTERS, n.WAITING})),
    LadderRung(n.EXITS_CONSEQUENCE, "every exit a consequence and no sink: the first exit", False,
               decided_by=n.EXITS, derived=True),
    LadderRung(n.LONE_COLLECTIVE, "ranks in a collective nobody else issued, or that left early", False,
               offline=lambda f, p: rule_lone_collective(f), offline_name="lone_collective"),
    LadderRung(n.FR_BEHIND, "per process group: ranks behind or missing (the flight recorder live; one group's "
               "SeqNums offline)", True, offline=rule_behind, offline_name="behind", decided_by=n.FLIGHT_RECORDER,
               derived=True, backs=True, lends_label=n.FLIGHT_RECORDER),
    LadderRung(n.COUNTERS, "Python-level steps and collective sequence numbers and ops: ranks behind, odd ops",
               False, live=_live_counters, backs=True, lends_label=n.COUNTERS),
    LadderRung(n.OUTSIDE, "the sinks of ranks whose lines wait for someone they cannot name", False,
               offline=lambda f, p: rule_outside(f), offline_name="outside"),
    LadderRung(n.WAITING, "every rank busy and none waiting: the one earliest in the step", False,
               live=_live_waiting, backs=True),
    LadderRung(n.THREAD_DIED, "a helper thread of the rank died with an exception (the hook's record): what its "
               "training loop waits for", False, live=lambda c: rule_thread_died(c.seen(), c.live_progress()),
               backs=True),
    LadderRung(n.STACKS, "a stack no other rank shares", False, live=lambda c: rule_stacks(c.seen())),
    LadderRung(n.GPU, "every rank in one collective: a communication hang, unless one has no GPU activity", False,
               live=_live_gpu,
               offline=lambda f, p: facts_same_collective(f), offline_name="same_collective"),
    LadderRung(n.REPORT_ONLY, "only a launcher's exit report: the rank it says exited first, as a guess", False,
               offline=lambda f, p: rule_report_only(f), offline_name="report_only"),
)
"""The ladder, strongest first (docs/verdict-engine.md)."""

Refinement = Callable[[Mapping[str, Finding | None], FactSet], dict[str, Finding | None]]
REFINEMENTS: tuple[Refinement, ...] = (abort_on_mismatch, abort_with_odd_counts, split_consequence, split_behind)
"""What the first rungs' findings say about each other, in order, before anything is weighed (live; each returns
a new set of findings): a death inside a mismatched collective is gloo's abort of its receiver (the mismatch
decides, ``abort_on_mismatch``; odd Python-level counts where no recorder names anyone,
``abort_with_odd_counts``); exits that are all consequences go below the graph (``split_consequence``); the
recorder's ranks behind go below the graph (``split_behind``)."""

LIVE_LADDER: tuple[LadderRung, ...] = tuple(r for r in LADDER if r.live is not None or r.derived)
"""The rungs the live verdict weighs."""

OFFLINE_LADDER: tuple[tuple[str, OfflineRule], ...] = tuple(
    (r.offline_name, r.offline) for r in LADDER if r.offline is not None
)
"""The rungs offline asks, first match decides, by the rule names offline documents carry."""

FACT_LADDER = OFFLINE_LADDER  # the old name

EDGE_LABEL: Mapping[Rung, str] = {
    Rung.EXIT_CAUSE: n.EXITS,
    Rung.STOPPED: n.STOPPED,
    Rung.FLIGHT_RECORDER: n.FLIGHT_RECORDER,
    Rung.COUNTERS: n.COUNTERS,
    Rung.WAITING: n.WAITING,
    Rung.STACKS: n.WAITING,
    Rung.SILENCE: n.MISSING_NODE,
}
"""The ladder name an engine edge's strength stands for (a wait-for finding's ``decided_by``)."""


def decide(facts: FactSet, policy: OfflinePolicy) -> Finding:
    """The first rung of ``OFFLINE_LADDER`` that concludes, else a finding that nothing was found."""
    for name, rule in OFFLINE_LADDER:
        found = rule(facts, policy)
        if found is not None:
            return _root_cause_victims(facts, found.but(rule=name, data={"decided": True, "phase": None,
                                                                       **found.data}))
    return Finding(NONE, UNKNOWN, [], Rung.SILENCE, "low", {"decided": False, "phase": None})


def _root_cause_victims(facts: FactSet, found: Finding) -> Finding:
    """torchrun's "Root Cause (first observed failure)" names only the first exit it noticed: where that
    rank is not the initiator, it was a victim (``root_cause_victims``), which the report says."""
    root = sorted({x.rank for x in facts.exited if x.root_cause})
    if root and found.ranks and not set(root) & set(found.ranks):
        return found.adding(root_cause_victims=root)
    return found


FLAGS = ("strong", "first", "decisive", "final", "backs", "derived")
"""The boolean flags of a rung, in the order ``flags_table`` shows them."""


def flags_table() -> str:
    """The ladder's roles as a markdown table (docs/verdict-engine.md holds a copy; a test compares them)."""
    head = ["rung", "live", "offline", *FLAGS, "subsumes", "lends label"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in LADDER:
        cells = [f"`{r.name}`", "yes" if r.live or r.derived else "—", f"`{r.offline_name}`" if r.offline else "—",
                 *("yes" if getattr(r, f) else "" for f in FLAGS),
                 ", ".join(f"`{x}`" for x in sorted(r.subsumes)), f"`{r.lends_label}`" if r.lends_label else ""]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)
