"""Correlation waits on the store instead of sleeping: a follower waiting for the leader's verdict blocks
on its own connection, so the same node's per-poll snapshots still go through meanwhile, and it holds the
verdict as soon as the leader publishes it (the leader reads every node's evidence after one wait)."""

from __future__ import annotations

import threading

from conftest import resolve_and_decide
from rankwatch.watchdog.core.policy import CorrelationPolicy
from test_store_auth import Stores, decide_fn, view


def test_a_follower_waiting_for_the_verdict_does_not_hold_up_its_snapshots() -> None:
    s = Stores("w", secret=None, policy=CorrelationPolicy(verdict_timeout_s=60.0, evidence_timeout_s=60.0))
    try:
        claim = s.leader.claim("inc", {"kind": "stall", "ranks": [0], "reason": "no progress"})
        remote = s.follower.poll_incident()
        assert remote is not None and remote.gen == claim.gen
        out: dict = {}
        follower = threading.Thread(target=lambda: out.setdefault("r", resolve_and_decide(
            s.follower, remote, [view(1, phase="backward", since=9.0)], "n1", 2, decide_fn("w"))))
        follower.start()
        # the follower is now blocked in its wait for verdict/1 (it has published its evidence)
        assert s.leader.store is not None
        key = f"evidence/{claim.gen}/1"
        assert s.leader.store.wait_for([key], 30.0)
        s.follower.publish_snapshot("n1", [view(1, phase="backward", since=9.0)])  # the poll loop's call
        assert follower.is_alive()  # still waiting: the snapshot did not queue behind the wait
        assert s.leader.store.get_raw("node/1") is not None
        verdict, how, _ = resolve_and_decide(s.leader, claim, [view(0, phase="dataloader", since=9.0)], "n0", 2,
                                             decide_fn("w"))
        follower.join(timeout=60)
        got, how1, decided_here = out["r"]
        assert not decided_here and got["initiating_ranks"] == verdict["initiating_ranks"] == [0]
        assert how == how1 == "leader node 0 over 2 node(s)"
    finally:
        s.close()
