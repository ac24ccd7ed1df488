"""Stragglers during the run: which diagnoses persist long enough to be reported, and when they end.

The daemon diagnoses each job's recent steps every ``LiveStragglerPolicy.every_s`` (``core.straggler``
over the last ``window_steps``); this module turns that series of diagnoses into events. A rank and phase
named by ``confirm`` consecutive diagnoses is a live straggler ("started", with the step and time it was
first named); one that ``confirm`` consecutive diagnoses no longer name has ended. One diagnosis alone
never reports or clears anything, so a burst seen once does not page anyone and a straggler does not
flap. Pure: the daemon logs the events, exports the metric and puts them into an incident's evidence.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from .evidence_items import StragglerBefore
from .straggler import StragglerDiagnosis
from .straggler_cause import CAUSES, cause_line
from .text import NAME, PROSE, clean, clean_doc


@dataclass(frozen=True)
class LiveStragglerPolicy:
    # how often a job's recent steps are diagnosed: one diagnosis of 8 ranks × 100 steps costs a few ms of
    # the poll loop; every 2 s reports a straggler within ~5 s of it being visible in the window
    every_s: float = 2.0
    # steps diagnosed live: enough for ``StragglerPolicy.min_slow_steps`` and a pattern of every 4–10 steps,
    # few enough that a straggler that starts mid-run shows within ~100 steps
    window_steps: int = 100
    # below this many common steps a live diagnosis says nothing (start-up, or a job too slow to judge yet)
    min_steps: int = 20
    # consecutive diagnoses that must agree before a straggler is reported, or reported as ended
    confirm: int = 2


def can_name(diag: StragglerDiagnosis, policy: LiveStragglerPolicy) -> bool:
    """Whether a live diagnosis may name a straggler at all: a rank with peers, over ``min_steps`` common steps
    (what the live events and the followers' job-wide diagnosis both wait for)."""
    return len(diag.windows) >= 2 and diag.steps >= policy.min_steps


@dataclass(frozen=True)
class LiveStraggler:
    rank: int
    label: str
    phase: str
    since_step: int  # the first slow step the first naming diagnosis saw
    since_unix: float  # wall time of that diagnosis
    why: str
    seen: int = 1  # consecutive diagnoses that named it
    missed: int = 0  # consecutive diagnoses that did not, since it was last named
    reported: bool = False
    cause: str = ""  # ``core.straggler_cause.CAUSES``, "" when not measured
    cause_text: str = ""  # the cause's figures and next step, one line

    def doc(self) -> dict[str, Any]:
        """The JSON form (status, state file, straggler alerts), its strings cleaned: the phase is the job's."""
        doc: dict[str, Any] = clean_doc({
            "rank": self.rank,
            "label": self.label,
            "phase": self.phase,
            "since_step": self.since_step,
            "since_unix": round(self.since_unix, 3),
            "why": self.why,
            "cause": self.cause,
            "cause_text": self.cause_text,
        })
        return doc

    @classmethod
    def from_doc(cls, doc: object) -> LiveStraggler | None:
        """Back from ``doc()`` as read from a file (the daemon's state file): None unless well-typed; strings
        are cleaned and bounded here, so what ``report.evidence_words.straggler_line`` builds is safe to print."""
        if not isinstance(doc, dict):
            return None
        rank, step, since = doc.get("rank"), doc.get("since_step"), doc.get("since_unix")
        strings = [doc.get(k) for k in ("label", "phase", "why")]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (rank, step)):
            return None
        if not isinstance(since, int | float) or isinstance(since, bool) or not 0 <= since < 1e11:
            return None
        if not all(isinstance(v, str) for v in strings):
            return None
        label, phase, why = (clean(v, n) for v, n in zip(strings, (NAME, NAME, PROSE), strict=True))
        cause, cause_text = doc.get("cause"), doc.get("cause_text")
        cause = clean(cause, NAME) if isinstance(cause, str) and cause in CAUSES else ""
        cause_text = clean(cause_text, PROSE) if isinstance(cause_text, str) and cause else ""
        return cls(int(rank), label, phase, int(step), float(since), why, reported=True,  # type: ignore[arg-type]
                   cause=cause, cause_text=cause_text)


Key = tuple[int, str]
Event = tuple[str, LiveStraggler]  # ("started" | "ended", straggler)


def update_live(
    prev: Mapping[Key, LiveStraggler],
    diag: StragglerDiagnosis,
    policy: LiveStragglerPolicy,
    now_unix: float,
) -> tuple[dict[Key, LiveStraggler], list[Event]]:
    """The next live state after one diagnosis at ``now_unix`` (the caller's clock), and the events it caused."""
    now = now_unix
    named: dict[Key, LiveStraggler] = {}
    if "STRAGGLER" in diag.label and diag.straggler_ranks:
        # a rank-wide straggler has no phase: keyed by "all" (its own work, every phase)
        phase = diag.phase or "all"
        since = diag.pattern.get("since_step", diag.pattern.get("first_slow_step"))
        cause = diag.cause or {}
        for r in diag.straggler_ranks:
            named[(r, phase)] = LiveStraggler(
                r, diag.label, phase, int(since) if isinstance(since, int) else -1, now, diag.why,
                cause=str(cause.get("cause") or ""), cause_text=cause_line(cause),
            )
    out: dict[Key, LiveStraggler] = {}
    events: list[Event] = []
    for key, s in prev.items():
        if key in named:
            fresh = named.pop(key)
            s = replace(s, seen=s.seen + 1, missed=0, why=fresh.why, label=fresh.label,
                        cause=fresh.cause or s.cause, cause_text=fresh.cause_text or s.cause_text)
            if not s.reported and s.seen >= policy.confirm:
                s = replace(s, reported=True)
                events.append(("started", s))
            out[key] = s
            continue
        s = replace(s, missed=s.missed + 1, seen=0 if not s.reported else s.seen)
        if s.missed >= policy.confirm:
            if s.reported:
                events.append(("ended", s))
            continue  # forgotten
        out[key] = s
    for key, s in named.items():
        if policy.confirm <= 1:
            s = replace(s, reported=True)
            events.append(("started", s))
        out[key] = s
    return out, events


def reported(state: Mapping[Key, LiveStraggler]) -> list[LiveStraggler]:
    """The live stragglers worth showing: confirmed, by rank."""
    return sorted((s for s in state.values() if s.reported), key=lambda s: (s.rank, s.phase))


def straggler_item(s: LiveStraggler, now_unix: float) -> StragglerBefore:
    """The straggler as seen at ``now_unix`` (values are the diagnosis's own): what ``rankwatch status`` and an
    incident's evidence show (``report.evidence_words.straggler_line``)."""
    return StragglerBefore(s.rank, s.label, s.phase, s.since_step, s.since_unix, max(0.0, now_unix - s.since_unix),
                           s.why, s.cause_text)


def incident_notes(state: Mapping[Key, LiveStraggler], now_unix: float) -> list[StragglerBefore]:
    """Evidence items for an incident: the ranks that were live stragglers when the job stalled."""
    return [straggler_item(s, now_unix) for s in reported(state)]


__all__ = [
    "LiveStraggler",
    "LiveStragglerPolicy",
    "can_name",
    "incident_notes",
    "reported",
    "straggler_item",
    "update_live",
]
