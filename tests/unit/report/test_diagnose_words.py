"""The words of the offline findings (report.findings), checked on purpose: rules hand over data, these
sentences are the one place it becomes text, and a person acts on them."""

from __future__ import annotations

from rankwatch.watchdog.core.engine import Finding
from rankwatch.watchdog.core.facts import Rung
from rankwatch.watchdog.report.findings import failure_label, words


def test_an_own_failure_reads_cause_then_the_downstream_ranks() -> None:
    f = Finding("exit_cause", "dead_rank", [3], Rung.EXIT_CAUSE, "high",
                {"cause": "cuda_oom", "detail": "", "signal": None, "waiting": [0, 1, 2], "node": "gpu7"})
    w = words(f)
    assert w.reason == ("rank 3 failed first: CUDA out of memory; ranks 0–2 then waited on it (timeouts / lost "
                        "peer) — downstream")
    assert w.next_action.startswith("rank 3 ran out of GPU memory")
    assert w.would_decide == ""


def test_a_bare_sigabrt_says_why_it_cannot_decide() -> None:
    f = Finding("exit_cause", "dead_rank", [1], Rung.EXIT_CAUSE, "low",
                {"cause": None, "detail": "", "signal": "SIGABRT", "bare_abort": True, "decided": False})
    w = words(f)
    assert "died by SIGABRT that torchrun did not send" in w.reason and "end the same way" in w.reason
    assert w.would_decide


def test_failure_labels() -> None:
    assert failure_label({"cause": "python_error", "detail": "ValueError: x"}) == "Python exception ValueError: x"
    assert failure_label({"cause": "hw_fault", "detail": "Xid 79"}) == "GPU hardware fault (Xid 79)"
    assert failure_label({"signal": "SIGKILL"}) == "died by SIGKILL that torchrun did not send"


def test_behind_names_the_collective_it_did_not_enter() -> None:
    f = Finding("behind", "hang", [2], Rung.COUNTERS, "high",
                {"source": "enqueued", "low": 1042, "high": 1043, "behind": [2], "ahead": [0, 1, 3]})
    w = words(f)
    assert w.reason.startswith("rank 2 is behind: last enqueued collective 1042 while ranks 0, 1, 3 reached 1043")
    assert "collective #1043" in w.next_action


def test_root_cause_victims_get_a_note() -> None:
    f = Finding("outside", "hang", [2], Rung.WAITING, "medium",
                {"waiting": [0, 1, 3], "told": [], "peer_only": False, "root_cause_victims": [0]})
    (note,) = words(f).notes
    assert note.startswith("torchrun's 'Root Cause (first observed failure)' names rank 0")


def test_nothing_found_lists_what_was_seen() -> None:
    w = words(Finding("none", "unknown", [], Rung.SILENCE, "low", {"decided": False, "seen": [0, 1]}))
    assert w.reason == "no failure, timeout or exit message in these logs (ranks 0, 1 seen)"
