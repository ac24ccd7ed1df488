"""The exit rungs' rules over facts (``core.rules.exits``), pure: most ranks finished while a few are inside
a step, gloo's abort of a mismatched collective's receiver (two ways), and every exit a consequence. The live
verdict asks them over ``core.live_facts.exit_facts``; a log's ``diagnose.log_facts`` makes the same
``Progress`` facts where its lines say where a rank ended."""

from __future__ import annotations

from pathlib import Path

from rankwatch.watchdog.core.engine import Finding
from rankwatch.watchdog.core.facts import Ended, FactSet, Progress, Rung
from rankwatch.watchdog.core.rules.exits import (
    abort_on_mismatch,
    abort_with_odd_counts,
    rule_finished_but_one,
    split_consequence,
)
from rankwatch.watchdog.diagnose import diagnose_logs
from rankwatch.watchdog.diagnose.facts import collect
from rankwatch.watchdog.diagnose.log_facts import facts_of
from rankwatch.watchdog.diagnose.parser import SourceParser

REAL = Path(__file__).resolve().parents[2] / "fixtures" / "logs" / "realistic"


def facts(*progress: Progress, ended: tuple[Ended, ...] = ()) -> FactSet:
    return FactSet(ranks=tuple(p.rank for p in progress), progress=list(progress), ended=list(ended))


def exits(ranks: list[int], kind: str = "dead_rank") -> Finding:
    return Finding("exits", kind, ranks, Rung.EXIT_CAUSE, "high", {"shape": "first_exit"})


def test_finished_but_one_names_the_rank_still_in_a_collective_after_the_others_exited():
    done = [Progress(r, "exited", None, 40) for r in (0, 1, 2)]
    f = rule_finished_but_one(facts(*done, Progress(3, "running", "collective", 40, True, 121, "all_reduce")))
    assert f is not None and (f.kind, f.ranks) == ("collective_mismatch", [3])
    assert (f.data["shape"], f.data["stuck"], f.data["finished"], f.data["seq"]) == ("finished_but_one", [3],
                                                                                      [0, 1, 2], 121)
    # half the ranks still inside a step: no odd one out
    half = [*done[:2], Progress(2, "running", "forward", 40), Progress(3, "running", "forward", 40)]
    assert rule_finished_but_one(facts(*half)) is None
    # ranks that finished a later step than the one still inside did not leave early: not this shape
    later = [Progress(r, "exited", None, 41) for r in (0, 1, 2)]
    assert rule_finished_but_one(facts(*later, Progress(3, "running", "forward", 40))) is None


def test_finished_but_one_decides_from_a_log_where_the_others_finished():
    # ranks 0-2 print their last training-loop line and exit 0; rank 3 times out in collective #1201
    p = SourceParser("extra_collective_r3.log")
    lines = (REAL / "extra_collective_r3.log").read_text().splitlines()
    log = facts_of(collect([e for i, line in enumerate(lines, 1) for e in p.feed(i, line)]))
    f = rule_finished_but_one(log)
    assert f is not None and (f.ranks, f.data["finished"], f.data["seq"]) == ([3], [0, 1, 2], 1201)
    # the offline ladder decides the same log by its lone-collective rung, naming the same rank
    d, _ = diagnose_logs([str(REAL / "extra_collective_r3.log")])
    assert (d.initiating_ranks, d.rule) == ([3], "lone_collective")


def test_a_receiver_aborted_inside_a_mismatched_collective_is_set_aside_for_the_mismatch():
    fr = Finding("flight_recorder", "collective_mismatch", [0], Rung.FLIGHT_RECORDER, "high", {})
    alive = [Progress(r, "running", "collective", 1, True, 7) for r in (0, 1, 2)]
    before: dict[str, Finding | None] = {"exits": exits([3]), "flight_recorder": fr}
    found = abort_on_mismatch(before, facts(*alive, Progress(3, "dead", "collective")))
    new_fr = found["flight_recorder"]
    assert found["exits"] is None and found["exits_aborted"] is not None
    assert new_fr is not None and new_fr.data["aborted_receivers"] == [3]
    assert before["exits"] is not None and "aborted_receivers" not in fr.data  # a new set; nothing changed
    # killed while computing: its own death, the mismatch does not explain it
    computing = facts(*alive, Progress(3, "dead", "forward"))
    found = abort_on_mismatch({"exits": exits([3]), "flight_recorder": fr}, computing)
    assert found["exits"] is not None and "exits_aborted" not in found


def test_odd_collective_counts_name_the_sender_when_a_receiver_was_aborted():
    ranks = [Progress(3, "dead", "collective", 1, True, 6), Progress(1, "dead", "collective", 1, True, 6),
             Progress(0, "dead", "backward", 1, False, 5), Progress(2, "crashed", "idle", 1, False, 6)]
    found = abort_with_odd_counts({"exits": exits([3]), "flight_recorder": None}, facts(*ranks))
    new = found["exits"]
    assert new is not None and (new.kind, new.ranks) == ("collective_mismatch", [0])
    assert (new.data["shape"], new.data["aborted_receivers"], new.data["counts"]) == (
        "abort_with_odd_counts", [3], {6: [1, 2, 3], 5: [0]})
    # the odd rank still computing: its count is lag, not a skipped collective
    ranks[2] = Progress(0, "dead", "forward", 1, False, 5)
    found = abort_with_odd_counts({"exits": exits([3]), "flight_recorder": None}, facts(*ranks))
    assert found["exits"] is not None and found["exits"].data["shape"] == "first_exit"


def test_every_exit_a_consequence_is_weighed_below_the_wait_for_graph():
    ends = (Ended(1, own=False, cause="Connection closed by peer"),)
    found = split_consequence({"exits": exits([1])}, facts(Progress(0, "running", "forward"),
                                                           Progress(1, "crashed", "collective"), ended=ends))
    assert found["exits"] is None and found["exits_consequence"] is not None
    assert found["exits_consequence"].rule == "exits_consequence"
    own = (Ended(1, own=True, cause="CUDA error"),)
    found = split_consequence({"exits": exits([1])}, facts(Progress(1, "crashed", "forward"), ended=own))
    assert found["exits"] is not None
