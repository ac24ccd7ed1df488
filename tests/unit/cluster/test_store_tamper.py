"""Tampering with the job store is evidence of tampering, never of a rank (issue 43, item 1).

A real two-node job (two `rankwatch run` agents on one machine, as documented for multi-node; 2 ranks per
node, gloo), rank 2 (node 1's local rank 0) hangs in its dataloader, and a hostile local process deletes and
overwrites node 1's evidence key in the store in a loop. With and without the store secret both nodes must
still name rank 2 — never rank 3, its innocent peer on node 1 — and never by a missing node; the tampering
is in the logs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from conftest import LineReader, examples_module, free_port, wait_for
from rankwatch.watchdog.core.evidence_items import REJECTED, NodeEvidence, UnauthenticatedExchange
from test_multinode import one_verdict_each, start_node
from test_store_auth import secret_file

# the right answer of the job's fault: the catalogue's (examples/fault_catalogue.py)
FAULTS = examples_module("fault_catalogue").FAULTS
VANDAL = str(Path(__file__).resolve().parents[2] / "procs" / "store_vandal.py")


@pytest.mark.parametrize("with_secret", [True, False], ids=["secret", "no-secret"])
def test_tampered_evidence_never_blames_an_innocent_rank(procs, tmp_path, with_secret):
    master, store = free_port(), free_port()
    scenario, fault_rank = "input-hang", 2  # node 1's local rank 0: rank 3 is its innocent peer
    expect = FAULTS[scenario]
    args = ["--scenario", scenario, "--fault-rank", str(fault_rank), "--fault-step", "6", "--steps", "400"]
    extra: tuple[str, ...] = ("--on-stall", "kill")
    if with_secret:
        extra += ("--store-secret-file", str(secret_file(tmp_path, 0o600)))
    nodes = [start_node(procs, tmp_path, k, master, store, args, extra) for k in (0, 1)]
    count = tmp_path / "vandal.count"
    keys = [f"rankwatch/mn/evidence/{gen}/1" for gen in (1, 2)]
    vandal = procs.start([sys.executable, VANDAL, "127.0.0.1", str(store), *keys], text=True,
                         env=dict(os.environ, VANDAL_COUNT=str(count)))
    assert LineReader(vandal.stdout).wait_for("ready", timeout=120)
    logs = [LineReader(p.stderr) for p, _ in nodes]
    v0, v1 = one_verdict_each(nodes, timeout=240)
    vandal.kill()
    deletes, overwrites = map(int, count.read_text().split())
    assert deletes > 100 and overwrites > 100  # it really went on deleting and overwriting all along
    for v in (v0, v1):
        assert v["kind"] in expect.kinds, v["finding"]
        assert (v["initiating_ranks"], v["phase"]) == (expect.ranks(fault_rank), expect.phase), v["finding"]
        assert v.get("decided_by") != "missing_node"
        assert v["ranks"]["3"]["state"] != "missing"
    exchange = v0.get("exchange") or v1.get("exchange")
    assert exchange is not None and exchange["authenticated"] is with_secret
    # whatever the leader met of the tampering it said: a value it read as junk, or node 1's evidence it never
    # held. (It may also have read node 1's genuine value in the few ms before the vandal's next overwrite:
    # then there was nothing to say, and the verdict above is right on evidence it really holds.)
    held = exchange["nodes"]["1"]
    said = wait_for(lambda: logs[0].wait_for('"store_value_rejected"', "evidence/1/1", timeout=1)
                    or logs[0].wait_for('"store_evidence_', timeout=1), timeout=30)
    assert said or held == "heard", (held, logs[0].lines[-30:])
    if not with_secret:
        assert {"kind": UnauthenticatedExchange.KIND} in v0["evidence_items"], v0.get("evidence_items")


# -- the exchange itself, on a real loopback TCPStore (fast tier) ------------------------------------------


def _stuck_views():
    from test_store_auth import view

    return ([view(0, phase="backward", since=9.0), view(1, phase="backward", since=9.0)],
            [view(2, phase="dataloader", since=9.0), view(3, phase="backward", since=9.0)])


@pytest.mark.parametrize("with_secret", [True, False], ids=["secret", "no-secret"])
def test_a_node_whose_evidence_and_snapshot_are_junk_is_not_named_as_missing(with_secret):
    """Everything node 1 wrote is overwritten with junk: the leader names neither of its ranks (it cannot
    judge them), says why, and node 1 keeps its own verdict over its own ranks."""
    import threading

    from conftest import resolve_and_decide
    from rankwatch.watchdog.cluster.correlate import SharedIncident
    from rankwatch.watchdog.core.policy import CorrelationPolicy
    from test_store_auth import SECRET, Stores, decide_fn

    s = Stores("t", secret=SECRET if with_secret else None,
               policy=CorrelationPolicy(verdict_timeout_s=8.0, evidence_timeout_s=2.0))
    try:
        node0, node1 = _stuck_views()
        claim = s.leader.claim("inc", {"kind": "stall", "ranks": [2], "reason": "no progress"})
        remote = s.follower.poll_incident() or SharedIncident(claim.gen, claim.incident_id, 0, {}, claim.issued)
        out: dict = {}

        def follow() -> None:
            out["r"] = resolve_and_decide(s.follower, remote, node1, "n1", 4, decide_fn("t"), stall_timeout_s=3.0)

        t = threading.Thread(target=follow)
        t.start()
        assert s.leader.store is not None and s.leader.store.wait_for([f"evidence/{claim.gen}/1"], 30.0)
        s.forge(f"evidence/{claim.gen}/1", b"junk")
        s.forge("node/1", b"junk")
        verdict0, _, _ = resolve_and_decide(s.leader, claim, node0, "n0", 4, decide_fn("t"))
        t.join(timeout=60)
        verdict1, how1, decided_here = out["r"]
        assert not set(verdict0["initiating_ranks"]) & {2, 3}, verdict0["reason"]
        assert verdict0.get("decided_by") != "missing_node"
        assert verdict0["exchange"] == {"authenticated": with_secret, "nodes": {"0": "heard", "1": "tampered"}}
        (node1,) = [i for i in verdict0["evidence_items"] if i["kind"] == NodeEvidence.KIND]
        assert (node1["node"], node1["held"], node1["why"], node1["judged"]) == (1, "tampered", REJECTED, [])
        # node 1 refuses a verdict made without its evidence and names its own hung rank
        assert decided_here and how1.startswith("local: the leader decided without this node's evidence"), how1
        assert (verdict1["kind"], verdict1["initiating_ranks"], verdict1["phase"]) == ("hang", [2], "dataloader")
    finally:
        s.close()


def test_a_deleted_evidence_key_of_a_live_node_is_unavailable_and_judged_on_its_snapshot():
    """Node 1 publishes snapshots (its poll loop) but its evidence key stays empty (deleted before the leader
    read it): it is alive, so its ranks are judged on its last authenticated snapshot, not named as silent."""
    import threading

    from conftest import resolve_and_decide
    from rankwatch.watchdog.core.policy import CorrelationPolicy
    from test_store_auth import SECRET, Stores, decide_fn

    s = Stores("d", secret=SECRET, policy=CorrelationPolicy(evidence_timeout_s=1.5))
    try:
        node0, node1 = _stuck_views()
        s.follower.publish_snapshot("n1", node1)
        claim = s.leader.claim("inc", {"kind": "stall", "ranks": [2], "reason": "no progress"})
        stop = threading.Event()

        def polls() -> None:  # node 1's poll loop goes on while the leader waits
            while not stop.wait(0.2):
                s.follower.publish_snapshot("n1", node1)

        t = threading.Thread(target=polls)
        t.start()
        try:
            verdict, _, _ = resolve_and_decide(s.leader, claim, node0, "n0", 4, decide_fn("d"))
        finally:
            stop.set()
            t.join()
        assert (verdict["kind"], verdict["initiating_ranks"], verdict["phase"]) == ("hang", [2], "dataloader")
        assert verdict["exchange"]["nodes"]["1"] == "unavailable"
        (node1,) = [i for i in verdict["evidence_items"] if i["kind"] == NodeEvidence.KIND]
        assert (node1["node"], node1["held"], node1["authenticated"]) == (1, "unavailable", True), node1
        assert node1["judged"], node1  # judged on its last authenticated snapshot
    finally:
        s.close()


def test_a_node_whose_snapshot_is_past_the_read_budget_is_unknown_not_silent():
    """A store stuffed with big values fills what one look may read before node 1's snapshot is reached: node 1
    (its evidence deleted too) is then unknown, never "silent", so its ranks are not named as a lost node."""
    from conftest import resolve_and_decide
    from rankwatch.watchdog.core.policy import CorrelationPolicy
    from test_store_auth import SECRET, Stores, decide_fn

    s = Stores("b", secret=SECRET, policy=CorrelationPolicy(evidence_timeout_s=1.0))
    try:
        node0, node1 = _stuck_views()
        s.follower.publish_snapshot("n1", node1)  # alive: its daemon published, then its evidence vanished
        assert s.leader.store is not None
        s.leader.store.read_budget_bytes = 0  # as after a look that read its budget of stuffed values
        claim = s.leader.claim("inc", {"kind": "stall", "ranks": [2], "reason": "no progress"})
        verdict, _, _ = resolve_and_decide(s.leader, claim, node0, "n0", 4, decide_fn("b"))
        assert verdict["exchange"]["nodes"]["1"] == "unavailable", verdict["exchange"]
        assert verdict.get("decided_by") != "missing_node" and not {2, 3} & set(verdict["initiating_ranks"]), verdict
    finally:
        s.close()
