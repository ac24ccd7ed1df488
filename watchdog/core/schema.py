"""The shared vocabulary of rankwatch's documents: schema names, verdict kinds, the confidence ladder and
the headline each kind is shown under. Pure constants and two tiny helpers; every writer and reader of
these documents imports them from here.
"""

from __future__ import annotations

# -- schema names (the "schema" field of each JSON document) -----------------------------------------
VERDICT_SCHEMA = "rankwatch.verdict/1"  # an incident verdict (live, or "source": "logs" offline)
SUMMARY_SCHEMA = "rankwatch.summary/1"  # the end-of-run straggler summary
NODE_SCHEMA = "rankwatch.node/1"  # a node's rank snapshot in the job store
INCIDENT_SCHEMA = "rankwatch.incident/1"  # an incident claim in the job store
HISTORY_SCHEMA = "rankwatch.history/1"  # a node's step rings for the leader's summary
LIVE_DIAGNOSIS_SCHEMA = "rankwatch.live_diagnosis/1"  # the leader's job-wide live diagnosis, for followers
STATE_SCHEMA = "rankwatch.state/1"  # what a job's watchdog publishes for ``rankwatch status``
RUNNING_SCHEMA = "rankwatch.running/1"  # a job ``rankwatch inspect`` saw make progress: no verdict, no bundle

# -- verdict kinds ------------------------------------------------------------------------------------
HANG = "hang"
DEAD_RANK = "dead_rank"
STOPPED_RANK = "stopped_rank"
COLLECTIVE_MISMATCH = "collective_mismatch"
COMM_HANG = "comm_hang"
UNKNOWN = "unknown"
KINDS = (HANG, DEAD_RANK, STOPPED_RANK, COLLECTIVE_MISMATCH, COMM_HANG, UNKNOWN)

# what a person reads first for each kind (text and HTML reports)
HEADLINES = {
    HANG: "HANG",
    DEAD_RANK: "DEAD RANK",
    STOPPED_RANK: "STOPPED RANK",
    COLLECTIVE_MISMATCH: "COLLECTIVE MISMATCH",
    COMM_HANG: "COMMUNICATION HANG",
    UNKNOWN: "STALL (cause unknown)",
}


def headline_of(kind: str) -> str:
    """The headline for a kind; an unknown kind (from an untrusted document) is shown upper-cased."""
    return HEADLINES.get(kind, kind.upper())


# -- confidence ---------------------------------------------------------------------------------------
CONFIDENCES = ("low", "medium", "high")
"""Weakest first: evidence that backs a finding raises it one step, evidence that questions it lowers it."""


def raise_confidence(confidence: str) -> str:
    """One step up the ladder, staying at "high"."""
    return CONFIDENCES[min(len(CONFIDENCES) - 1, CONFIDENCES.index(confidence) + 1)]


def lower_confidence(confidence: str) -> str:
    """One step down the ladder, staying at "low"."""
    return CONFIDENCES[max(0, CONFIDENCES.index(confidence) - 1)]
