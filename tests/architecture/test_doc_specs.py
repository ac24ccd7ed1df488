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
from rankwatch.watchdog.core.doc_checks import STORE_VERDICT_FIELDS, VERDICT_FIELDS, document_problems
from rankwatch.watchdog.diagnose.facts import Evidence
from rankwatch.watchdog.diagnose.reasoning import diagnose_evidence
from rankwatch.watchdog.verdict import decide


def live_verdict() -> dict[str, Any]:
    return decide([], job_id="j", incident_id="i", detected_after_s=1.0).to_json()


def test_the_store_reads_the_disk_spec_tightened() -> None:
    assert set(VERDICT_FIELDS) <= set(STORE_VERDICT_FIELDS)


@pytest.mark.parametrize("read", [validate_verdict, parse_verdict])
def test_a_live_verdict_passes_both_readings(read: Any) -> None:
    doc = live_verdict()
    assert document_problems(doc) == []
    assert read(json.dumps(doc).encode())["incident_id"] == "i"


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
