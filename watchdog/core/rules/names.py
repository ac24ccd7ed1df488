"""The names of the ladder's rungs (``core.rules.ladder.LADDER``), for the few places that must say which rung a
finding belongs to: the refinements between rungs (``rules.exits``, ``rules.recorder``) and the registry itself.
Documents and dashboards carry these names (``decided_by``, ``finding.rule``)."""

from __future__ import annotations

RANKWATCH_VERDICT = "rankwatch_verdict"
AFTER_KILL = "after_kill"
EXITS = "exits"
EXITS_ABORTED = "exits_aborted"  # an exit set aside as the consequence of a mismatch: no rung, its words quoted
STOPPED = "stopped"
FLIGHT_RECORDER = "flight_recorder"
WAIT_FOR = "wait_for"
WRONG_PEER = "wrong_peer"
EXITS_CONSEQUENCE = "exits_consequence"
LONE_COLLECTIVE = "lone_collective"
FR_BEHIND = "fr_behind"
COUNTERS = "counters"
OUTSIDE = "outside"
WAITING = "waiting"
STACKS = "stacks"
THREAD_DIED = "thread_died"
GPU = "gpu"
REPORT_ONLY = "report_only"
MISSING_NODE = "missing_node"  # a label, not a rung: the sinks are a node that never answered
