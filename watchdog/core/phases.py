"""The phases of a training step: one table, read by every rule, renderer and chart.

The hook writes canonical phase names (``hooks.record.CANONICAL_PHASES``, the record's slot table — the
wire format, kept in the hook so the training process imports nothing of the watchdog; a test holds the
two equal) and training code may declare its own (checkpoint, eval). Here each canonical phase gets its
place in the step (a rank earlier in the order than its peers, same step and collective count, is behind
them), its family (input / compute / communication: what a straggler or a stuck rank's phase says about
the cause) and its place in charts. Pure data.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    name: str
    step_order: int  # place within a step (0: not a step stage — waits for peers, between phases)
    family: str | None  # "input" | "compute" | "communication" | None (between phases)


DATALOADER, FORWARD, BACKWARD, OPTIMIZER = "dataloader", "forward", "backward", "optimizer"
GRAD_SYNC, COLLECTIVE, IDLE = "grad_sync", "collective", "idle"

# in chart order: the step's stages first, then the two kinds of waiting for peers, then time outside
PHASES: tuple[Phase, ...] = (
    Phase(DATALOADER, 1, "input"),
    Phase(FORWARD, 2, "compute"),
    Phase(BACKWARD, 3, "compute"),
    Phase(OPTIMIZER, 4, "compute"),
    Phase(GRAD_SYNC, 0, "communication"),  # DDP's gradient all-reduce (the hook's grad-sync timing)
    Phase(COLLECTIVE, 0, "communication"),  # a collective the script called
    Phase(IDLE, 0, None),
)

CANONICAL = tuple(p.name for p in PHASES if p.name != GRAD_SYNC)  # what the hook's slot table holds
STEP_PHASE_ORDER = {p.name: p.step_order for p in PHASES if p.step_order}
PHASE_FAMILY = {p.name: p.family for p in PHASES if p.family}
DISPLAY_ORDER = tuple(p.name for p in PHASES)
INPUT_PHASES = frozenset(n for n, f in PHASE_FAMILY.items() if f == "input")
COMPUTE_PHASES = frozenset(n for n, f in PHASE_FAMILY.items() if f == "compute")
SYNC_PHASES = frozenset(n for n, f in PHASE_FAMILY.items() if f == "communication")
