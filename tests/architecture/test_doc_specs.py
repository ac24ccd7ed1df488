"""One spec per document: a verdict read back from disk (report, status) and one read from the job store
(adopted from the leader, ``inspect --store``) are checked against the same field table, the store's
reading tightened (it is acted on)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from rankwatch.watchdog.cluster.correlate import validate_verdict
from rankwatch.watchdog.cluster.inspect_exchange import parse_verdict
from rankwatch.watchdog.cluster.store import ValueRejected
from rankwatch.watchdog.core.doc_checks import document_problems
from rankwatch.watchdog.core.document import ACTED_ON, FIELDS, DocumentError, VerdictDocument
from rankwatch.watchdog.diagnose.facts import Evidence
from rankwatch.watchdog.diagnose.reasoning import diagnose_evidence
from rankwatch.watchdog.verdict import decide


def live_verdict() -> dict[str, Any]:
    return decide([], job_id="j", incident_id="i", detected_after_s=1.0).to_json()


def test_the_store_reads_the_disk_spec_tightened() -> None:
    assert set(ACTED_ON) <= set(FIELDS)


@pytest.mark.parametrize("read", [validate_verdict, parse_verdict])
def test_a_live_verdict_passes_both_readings(read: Any) -> None:
    doc = live_verdict()
    assert document_problems(doc) == []
    got = read(json.dumps(doc).encode())
    assert (got[0] if isinstance(got, tuple) else got).incident_id == "i"


@pytest.mark.parametrize("read", [validate_verdict, parse_verdict])
@pytest.mark.parametrize(
    ("field", "bad"),
    [("initiating_ranks", [True]), ("kind", "nonsense"), ("confidence", "sure"), ("job_id", None),
     ("evidence", "x"), ("ranks", [])],
)
def test_the_store_rejects_what_it_cannot_act_on(read: Any, field: str, bad: Any) -> None:
    doc = {**live_verdict(), field: bad}
    with pytest.raises(ValueRejected, match=field):
        read(json.dumps(doc).encode())


def test_an_offline_verdict_is_a_disk_document_not_a_store_one() -> None:
    doc = diagnose_evidence(Evidence()).to_json()  # logs name no job or incident: nulls on disk
    assert document_problems(doc) == []
    with pytest.raises(ValueRejected, match="job_id"):
        validate_verdict(json.dumps(doc).encode())


def test_every_producer_writes_a_document_that_reads_back_whole() -> None:
    """Live, offline, finalized and slimmed documents are one type: each round-trips through ``from_json``
    unchanged, so what a node writes is exactly what a reader (the store, a report) gets back."""
    from rankwatch.watchdog.core.detect import Trigger
    from rankwatch.watchdog.core.finalize import finalize_verdict

    live = decide([], job_id="j", incident_id="i", detected_after_s=1.0).document()
    trig = Trigger("stall", (1,), "no progress \x1b[31m", 3.0, 2.5)
    done = finalize_verdict(live, trigger=trig, correlation="leader")
    offline = diagnose_evidence(Evidence()).document()
    for doc in (live, done, offline, done.slimmed(0)):
        assert VerdictDocument.from_json(json.loads(json.dumps(doc.to_json()))) == doc
    assert done.trigger is not None and "\x1b" not in done.trigger.reason  # cleaned where it is completed
    assert done.to_json()["stall_timeout_s"] == 3.0 and done.correlation == "leader"
    # a key a newer writer added survives an older reader
    newer = {**done.to_json(), "from_the_future": {"x": 1}}
    assert VerdictDocument.from_json(newer).to_json()["from_the_future"] == {"x": 1}


@pytest.mark.parametrize(
    ("field", "bad", "named"),
    [("trigger", "x", "trigger"),
     ("missing_ranks", [1.5], "missing_ranks"), ("schema", "rankwatch.verdict/0", "schema")],
)
def test_a_bent_document_names_the_field(field: str, bad: Any, named: str) -> None:
    with pytest.raises(DocumentError, match=named.replace(".", r"\.")):
        VerdictDocument.from_json({**live_verdict(), field: bad})
