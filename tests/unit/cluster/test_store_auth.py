"""The job store is authenticated: with a shared secret every value rankwatch writes carries an HMAC bound to
its key and job, and anything else is rejected; without one, other nodes' claims and verdicts are checked
against what this node sees and never kill here.

Real TCPStores on loopback, a raw ``torch.distributed.TCPStore`` client playing the forger (anyone who can
reach the store port), the real CLI for the secret file, and two real ``rankwatch daemon`` sidecars around a
healthy two-node torchrun job for the end-to-end check.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import structlog
from conftest import (
    DEMO,
    LineReader,
    examples_module,
    free_port,
    new_tracker,
    rankwatch_cmd,
    resolve_and_decide,
    start_daemon,
    stop_daemon,
    torchrun_args,
    wait_for,
)
from rankwatch.hooks.record import read_record
from rankwatch.watchdog.cluster.auth import seal
from rankwatch.watchdog.cluster.correlate import Correlator, SharedIncident
from rankwatch.watchdog.core.detect import Trigger, local_stall_signs
from rankwatch.watchdog.core.policy import CapturePolicy, CorrelationPolicy, ServePolicy, StallPolicy
from rankwatch.watchdog.core.snapshot import RankView
from rankwatch.watchdog.verdict import decide

SECRET = b"3q2+7wAAAAAx1Y8PhWmLc0tZrVd9Jq4B"  # what `head -c 24 /dev/urandom | base64` looks like


def view(rank: int, *, phase: str = "forward", since: float = 0.2, state: str = "running") -> RankView:
    return RankView(rank=rank, node=f"n{rank // 2}", pid=1000 + rank, state=state, step=5, phase=phase,
                    in_phase_s=since, since_progress_s=since)


def decide_fn(job: str):
    def fn(views, notes, how, remote_fr):
        doc = decide(views, job_id=job, incident_id="inc", detected_after_s=1.0, extra_evidence=list(notes))
        return dataclasses.replace(doc.document(), correlation=how)

    return fn


def incident_doc(gen: int = 1, incident_id: str = "forged", by: int = 1) -> dict:
    return {"schema": "rankwatch.incident/1", "gen": gen, "id": incident_id, "by": by, "issued": time.time(),
            "trigger": {"kind": "stall", "ranks": [0], "reason": "FORGED", "detected_after_s": 5.0}}


def verdict_doc(job: str, initiating: int, incident_id: str = "inc") -> dict:
    """A schema-valid verdict naming ``initiating``, as a forger would write it (bound to ``incident_id`` now:
    without a secret a forger can write any binding; the binding stops replays, the MAC forgeries)."""
    views = [view(r, phase="dataloader" if r == initiating else "backward", since=9.0) for r in range(4)]
    doc = decide(views, job_id=job, incident_id="forged", detected_after_s=9.0).to_json()
    assert doc["initiating_ranks"] == [initiating]
    doc["reason"] = "FORGED " + doc["reason"]
    doc["correlation"] = "leader node 0 over 2 node(s)"
    doc["bound"] = {"incident": incident_id, "issued": time.time()}
    return doc


class Stores:
    """A leader and a follower Correlator on one loopback TCPStore, plus a raw client without any secret."""

    def __init__(self, job: str, *, secret: bytes | None, policy: CorrelationPolicy | None = None) -> None:
        import torch.distributed as dist

        self.job = job
        port = free_port()
        self.leader = Correlator(job, 0, "127.0.0.1", port, nnodes=2, secret=secret, policy=policy)
        assert wait_for(lambda: self.leader.store is not None, timeout=30), self.leader.error
        self.follower = Correlator(job, 1, "127.0.0.1", port, nnodes=2, secret=secret, policy=policy)
        assert wait_for(lambda: self.follower.store is not None, timeout=30), self.follower.error
        self.client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))

    def forge(self, key: str, value: str | bytes | dict) -> None:
        self.client.set(f"rankwatch/{self.job}/{key}", json.dumps(value) if isinstance(value, dict) else value)

    def close(self) -> None:
        self.follower.close()
        self.leader.close()


@pytest.fixture
def signed():
    s = Stores("g", secret=SECRET, policy=CorrelationPolicy(verdict_timeout_s=1.5, evidence_timeout_s=10.0))
    yield s
    s.close()


@pytest.fixture
def unsigned():
    s = Stores("u", secret=None, policy=CorrelationPolicy(verdict_timeout_s=1.5))
    yield s
    s.close()


def events(logs: list[dict], name: str) -> list[dict]:
    return [e for e in logs if e.get("event") == name]


# -- (a) with a secret -----------------------------------------------------------------------------------


def test_forged_claim_is_rejected_once_per_key_and_ignored(signed):
    with structlog.testing.capture_logs() as logs:
        signed.forge("incident/current", incident_doc())
        assert signed.follower.poll_incident() is None
        assert signed.leader.poll_incident() is None
        assert signed.follower.poll_incident() is None  # still ignored, not logged again
    rejected = [e for e in events(logs, "store_value_rejected") if e["key"] == "incident/current"]
    assert len(rejected) == 2, rejected  # one line per key and node (leader and follower)
    assert all("unauthenticated" in e["error"] for e in rejected)


def test_a_value_signed_for_another_key_job_or_secret_is_rejected(signed):
    text = json.dumps(incident_doc())
    replays = {
        "another key": seal(SECRET, "g", "incident/1", text),
        "another job": seal(SECRET, "h", "incident/current", text),
        "another secret": seal(b"another secret of 32 bytes......", "g", "incident/current", text),
        "tampered body": seal(SECRET, "g", "incident/current", text).replace('"forged"', '"forgeX"'),
        "no MAC": "rankwatch.signed/1 \n" + text,
    }
    for why, value in replays.items():
        signed.forge("incident/current", value)
        assert signed.follower.poll_incident() is None, why
    # the same document sealed for exactly this key and job is accepted: the rejections above are the binding
    signed.forge("incident/current", seal(SECRET, "g", "incident/current", text))
    inc = signed.follower.poll_incident()
    assert inc is not None and inc.incident_id == "forged"


def test_forged_verdict_is_not_adopted(signed):
    signed.forge("verdict/1", verdict_doc("g", initiating=0))
    inc = SharedIncident(gen=1, incident_id="inc", by_node=1, trigger={})
    with structlog.testing.capture_logs() as logs:
        verdict, how, decided_here = resolve_and_decide(
            signed.follower,
            inc, [view(2, phase="dataloader", since=9.0), view(3, phase="backward", since=9.0)], "n1", 4,
            decide_fn("g"),
        )
    assert decided_here and how.startswith("local: no valid verdict"), how
    assert "FORGED" not in verdict["reason"] and verdict["initiating_ranks"] == [2]
    assert len([e for e in events(logs, "store_value_rejected") if e["key"] == "verdict/1"]) == 1


def test_leader_and_follower_still_agree_through_forged_values(signed):
    """Forged evidence and a forged verdict written before the real ones neither stop the exchange nor end up
    in the verdict: the leader waits for the follower's signed evidence, the follower for the leader's verdict."""
    signed.follower.policy = CorrelationPolicy(verdict_timeout_s=15.0)
    signed.forge("verdict/1", verdict_doc("g", initiating=3))
    signed.forge("evidence/1/1", {"schema": "rankwatch.node/1", "kind": "evidence", "node_rank": 1, "node": "n1",
                                  "seq": 0, "ranks": [dict(vars(view(1, phase="dataloader", since=99.0)),
                                                           stack_top=[])]})
    leader_claim = signed.leader.claim("real-incident", {"kind": "stall", "ranks": [0], "reason": "no progress"})
    assert leader_claim.gen == 1 and leader_claim.by_node == 0
    remote = signed.follower.poll_incident()
    assert remote is not None and remote.incident_id == "real-incident"  # a signed claim is trusted as before
    result: dict = {}

    def follow():
        result["out"] = resolve_and_decide(signed.follower, remote, [view(1, phase="backward", since=9.0)], "n1", 2,
                                                decide_fn("g"))

    t = threading.Thread(target=follow)
    t.start()
    verdict0, how0, _ = resolve_and_decide(signed.leader, leader_claim, [view(0, phase="dataloader", since=9.0)],
                                           "n0", 2, decide_fn("g"))
    t.join(timeout=30)
    verdict1, how1, decided_here = result["out"]
    assert how0 == "leader node 0 over 2 node(s)"
    assert verdict0["initiating_ranks"] == [0]  # the follower's real evidence (rank 1 waiting), not the forged
    assert verdict0["ranks"]["1"]["phase"] == "backward"
    assert not decided_here and verdict1["initiating_ranks"] == [0] and "FORGED" not in verdict1["reason"]
    assert verdict1["correlation"] == how1 == how0


def test_a_forged_value_squatting_a_claim_key_is_replaced_once(signed):
    signed.forge("incident/1", incident_doc(gen=1, incident_id="squatter", by=1))
    won = signed.leader.claim("leader-incident", {"kind": "stall", "ranks": [0], "reason": "r"})
    assert won.gen == 1 and won.by_node == 0 and won.incident_id == "leader-incident"
    joined = signed.follower.claim("follower-incident", {"kind": "stall", "ranks": [2], "reason": "r"})
    assert joined == won  # the follower joins the leader's claim instead of replacing it in turn
    current = signed.follower.poll_incident()
    assert current is not None and current.incident_id == "leader-incident"


def test_nodes_that_disagree_on_having_a_secret_do_not_trust_each_other():
    import torch.distributed as dist  # noqa: F401  (the store needs it)

    port = free_port()
    leader = Correlator("m", 0, "127.0.0.1", port, secret=SECRET)
    assert wait_for(lambda: leader.store is not None, timeout=30)
    follower = Correlator("m", 1, "127.0.0.1", port, secret=None)
    assert wait_for(lambda: follower.store is not None, timeout=30)
    try:
        leader.claim("signed", {"kind": "stall", "ranks": [0], "reason": "r"})
        with structlog.testing.capture_logs() as logs:
            assert follower.poll_incident() is None
        assert "no --store-secret-file" in events(logs, "store_value_rejected")[0]["error"]
    finally:
        follower.close()
        leader.close()


# -- (b) the secret file, through the CLI ----------------------------------------------------------------


def secret_file(tmp_path: Path, mode: int, content: bytes = SECRET + b"\n", name: str = "store.secret") -> Path:
    path = tmp_path / name
    path.write_bytes(content)
    path.chmod(mode)
    return path


def daemon_once(procs, tmp_path: Path, *extra: str, env: dict | None = None):
    (tmp_path / "shm").mkdir(exist_ok=True, mode=0o700)
    cmd = rankwatch_cmd("daemon", "--shm-dir", str(tmp_path / "shm"), "--out", str(tmp_path / "out"), "--once",
                        "--json-logs", *extra)
    return procs.run(cmd, timeout=60, text=True, env=env)


@pytest.mark.parametrize(
    ("mode", "content", "message"),
    [
        (0o644, SECRET, "mode 0644 lets group or others read it"),
        (0o640, SECRET, "mode 0640 lets group or others read it"),
        (0o600, b"short\n", "5 bytes; a secret has 16 to 4096"),
        (0o600, b"x" * 5000, "over 4096 bytes; a secret has 16 to 4096"),
    ],
)
def test_a_bad_secret_file_is_one_line_and_exit_2(procs, tmp_path, mode, content, message):
    path = secret_file(tmp_path, mode, content)
    r = daemon_once(procs, tmp_path, "--store-secret-file", str(path))
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()  # refused before anything was created or started


def test_missing_or_odd_secret_files_are_refused(procs, tmp_path):
    (tmp_path / "adir").mkdir(mode=0o700)
    for path, message in ((tmp_path / "nope", "No such file"), (tmp_path / "adir", "not a regular file")):
        r = daemon_once(procs, tmp_path, "--store-secret-file", str(path))
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


def test_secret_file_from_the_environment_and_through_a_symlink(procs, tmp_path):
    bad = secret_file(tmp_path, 0o644, name="bad.secret")
    r = daemon_once(procs, tmp_path, env=dict(os.environ, RANKWATCH_STORE_SECRET_FILE=str(bad)))
    assert r.returncode == 2 and "mode 0644" in r.stderr, r.stderr
    good = secret_file(tmp_path, 0o400, name="good.secret")
    (tmp_path / "link").symlink_to(good)  # Kubernetes mounts Secrets through symlinks
    r = daemon_once(procs, tmp_path, env=dict(os.environ, RANKWATCH_STORE_SECRET_FILE=str(tmp_path / "link")))
    assert r.returncode == 0, r.stderr


def test_run_refuses_a_readable_secret_before_launching_torchrun(procs, tmp_path):
    path = secret_file(tmp_path, 0o644)
    out = tmp_path / "out"
    cmd = rankwatch_cmd("run", "--out", str(out), "--store-secret-file", str(path), "--",
                        "--nproc-per-node", "1", DEMO)
    r = procs.run(cmd, timeout=60, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "mode 0644" in r.stderr, r.stderr
    assert not out.exists()


def test_one_trailing_newline_is_not_part_of_the_secret(tmp_path):
    from rankwatch.watchdog.cluster.auth import load_secret

    assert load_secret(str(secret_file(tmp_path, 0o600, SECRET + b"\n", "a"))) == SECRET
    assert load_secret(str(secret_file(tmp_path, 0o600, SECRET, "b"))) == SECRET
    assert load_secret(str(secret_file(tmp_path, 0o600, SECRET + b"\n\n", "c"))) == SECRET + b"\n"


# -- (c) without a secret --------------------------------------------------------------------------------


def test_without_a_secret_the_store_is_announced_unauthenticated_once():
    with structlog.testing.capture_logs() as logs:
        corr = Correlator("w", 0, "127.0.0.1", free_port(), secret=None)
        corr.close()
    assert len(events(logs, "store_unauthenticated")) == 1


def test_unauthenticated_verdict_naming_a_progressing_local_rank_is_refused(unsigned):
    inc = SharedIncident(gen=1, incident_id="inc", by_node=0, trigger={})
    unsigned.forge("verdict/1", verdict_doc("u", initiating=2))
    local = [view(2, phase="forward", since=0.2), view(3, phase="backward", since=0.3)]  # healthy here
    with structlog.testing.capture_logs() as logs:
        verdict, how, decided_here = resolve_and_decide(unsigned.follower, inc, local, "n1", 4, decide_fn("u"),
                                                               stall_timeout_s=3.0)
    assert decided_here and how.startswith("local: refused the leader's unauthenticated verdict"), how
    assert "rank 2" in how and verdict["correlation"] == how and "FORGED" not in verdict["reason"]
    refused = events(logs, "remote_verdict_refused")
    assert len(refused) == 1 and refused[0]["progressing_here"] == [2]


def test_a_refused_verdict_naming_the_rank_this_nodes_own_evidence_names_is_adopted(unsigned):
    # rank 2 ran on past a collective its peers wait in and blocked half a second ago: "progressing" by the
    # stall timeout, but this node's own verdict names it too — the nodes write one verdict, not two
    inc = SharedIncident(gen=1, incident_id="inc", by_node=0, trigger={})
    unsigned.forge("verdict/1", verdict_doc("u", initiating=2))
    local = [view(2, phase="forward", since=0.5), view(3, phase="backward", since=9.0)]
    with structlog.testing.capture_logs() as logs:
        verdict, _, decided_here = resolve_and_decide(unsigned.follower, inc, local, "n1", 4, decide_fn("u"),
                                                        stall_timeout_s=3.0)
    assert len(events(logs, "remote_verdict_refused")) == 1  # the check still ran
    assert not decided_here and verdict["initiating_ranks"] == [2]
    assert verdict["correlation"] == "leader node 0 over 2 node(s)", verdict["correlation"]


def test_unauthenticated_verdict_consistent_with_local_views_is_adopted(unsigned):
    # the named local rank is stuck here too
    unsigned.forge("verdict/1", verdict_doc("u", initiating=2))
    inc = SharedIncident(gen=1, incident_id="inc", by_node=0, trigger={})
    stuck = [view(2, phase="dataloader", since=9.0), view(3, phase="backward", since=9.0)]
    _, _, decided_here = resolve_and_decide(unsigned.follower, inc, stuck, "n1", 4, decide_fn("u"), stall_timeout_s=3.0)
    assert not decided_here
    # the named rank lives on another node: nothing here contradicts it
    unsigned.forge("verdict/2", verdict_doc("u", initiating=0, incident_id="inc2"))
    inc2 = SharedIncident(gen=2, incident_id="inc2", by_node=0, trigger={})
    healthy = [view(2, since=0.2), view(3, since=0.2)]
    verdict, _, decided_here = resolve_and_decide(unsigned.follower, inc2, healthy, "n1", 4, decide_fn("u"),
                                                  stall_timeout_s=3.0)
    assert not decided_here and verdict["initiating_ranks"] == [0]


def test_local_stall_signs():
    stall = StallPolicy(timeout_s=4.0)
    assert local_stall_signs([view(0, since=0.5), view(1, since=1.9)], stall, 0.1, 0.5) is None
    assert "rank 1 without progress" in (local_stall_signs([view(0, since=0.5), view(1, since=2.0)], stall, 0.1, 0.5)
                                         or "")
    assert "gone or stopped" in (local_stall_signs([view(0), view(1, state="dead")], stall, 0.1, 0.5) or "")
    # a rank inside its declared budget explains the others' waiting, as in local detection
    checkpoint = RankView(rank=0, node="n0", pid=5, state="running", step=5, phase="checkpoint", in_phase_s=30.0,
                          since_progress_s=30.0, budget_s=900.0, budget_elapsed_s=30.0)
    assert local_stall_signs([checkpoint, view(1, since=30.0)], stall, 0.1, 0.5) is None


def test_an_unconfirmed_unauthenticated_claim_waits_then_is_dropped(unsigned):
    corr = unsigned.follower
    inc = SharedIncident(gen=1, incident_id="forged", by_node=0, trigger={})
    with structlog.testing.capture_logs() as logs:
        assert corr.screen_unauthenticated(inc, None, give_up_after_s=0.3) is None
        assert corr.screen_unauthenticated(inc, None, give_up_after_s=0.3) is None
        time.sleep(0.4)
        assert corr.screen_unauthenticated(inc, None, give_up_after_s=0.3) is None
        assert corr.screen_unauthenticated(inc, "rank 2 stuck", give_up_after_s=0.3) is None  # dropped for good
        inc2 = SharedIncident(gen=2, incident_id="real", by_node=0, trigger={})
        assert corr.screen_unauthenticated(inc2, "rank 2 stuck", give_up_after_s=0.3) == inc2
    assert len(events(logs, "remote_claim_unconfirmed")) == 1
    assert len(events(logs, "remote_claim_ignored")) == 1
    assert len(events(logs, "remote_claim_confirmed_locally")) == 1


def test_a_signed_claim_needs_no_local_confirmation(signed):
    inc = SharedIncident(gen=1, incident_id="x", by_node=0, trigger={})
    assert signed.follower.screen_unauthenticated(inc, None, give_up_after_s=0.0) == inc


class FakeKiller:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def kill_job(self, job_id, ranks):
        self.calls.append(job_id)


def pipeline_with(killer):
    from rankwatch.watchdog.evidence.gpu import GpuWatch
    from rankwatch.watchdog.evidence.ras_watch import RasWatch
    from rankwatch.watchdog.serve.incident import IncidentPipeline

    return IncidentPipeline(capture_policy=CapturePolicy(), serve_policy=ServePolicy(), gpu=GpuWatch(),
                            ras=RasWatch(disabled=True), killer=killer)


def request(tmp_path: Path, *, trusted: bool):
    from rankwatch.watchdog.observe.process import Identity
    from rankwatch.watchdog.serve.incident import IncidentRequest

    ident = Identity.__new__(Identity)  # never signalled: the killer is a fake
    return IncidentRequest(
        job_id="j", incident_id="i", trigger=Trigger("stall", (0,), "r", 3.0, 3.0), views=(view(0),),
        job_dir=str(tmp_path), node="n0", world_size=4, incidents_dir=str(tmp_path / "inc"),
        latest_views=lambda: [view(0)], identities=(ident,), trusted=trusted,
    )


def test_an_unauthenticated_remote_incident_never_kills(tmp_path):
    killer = FakeKiller()
    pipeline = pipeline_with(killer)
    try:
        with structlog.testing.capture_logs() as logs:
            pipeline.act(request(tmp_path, trusted=False))
        assert killer.calls == []
        assert "no store secret" in events(logs, "kill_refused")[0]["reason"]
        pipeline.act(request(tmp_path, trusted=True))
        assert killer.calls == ["j"]
    finally:
        pipeline.close()


def test_daemon_captures_an_unauthenticated_claim_only_once_its_own_rank_stalls(tmp_path, unsigned):
    """In-process daemon, a real record of this process: a forged claim while the rank progresses opens
    nothing; once the rank has made no progress for half the stall timeout the claim is captured, as an
    incident that may not kill (trusted False) and says it came unauthenticated."""
    from rankwatch.watchdog.observe.process import ProcessTable
    from rankwatch.watchdog.serve.daemon import Daemon, DaemonConfig

    shm, out = tmp_path / "shm", tmp_path / "out"
    shm.mkdir(mode=0o700)
    (shm / "u").mkdir(mode=0o700)
    t = new_tracker(shm / "u" / "rank-2.hb", rank=2, world_size=4, local_world_size=2, job_id="u")
    daemon = Daemon(
        DaemonConfig(shm_dir=str(shm), out_dir=str(out), stall=StallPolicy(timeout_s=6.0), job_filter="u"),
        procs=ProcessTable(protected={1}),  # the record is this test process's own
        capture=lambda targets, job_dir, token, policy: {},
        correlators={"u": unsigned.follower},
    )
    submitted = []
    real_submit = daemon.pipeline.submit
    daemon.pipeline.submit = lambda req, done: (submitted.append(req), real_submit(req, done))[1]
    try:
        unsigned.forge("incident/current", incident_doc(gen=1, incident_id="forged", by=0))
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # a healthy rank: steps keep coming
            for slot in (0, 1, 2, 3):
                t.enter(slot)
                t.exit(slot)
            t.step()
            daemon.poll_once()
            time.sleep(0.1)
        assert daemon.jobs["u"].incident is None and not submitted
        t.enter(0)  # now it hangs in its dataloader; the claim is confirmed after 3 s, local detection is at 6 s
        assert wait_for(lambda: (daemon.poll_once(), submitted)[1], timeout=10, interval=0.2)
        req = submitted[0]
        assert req.shared is not None and req.shared.incident_id == "forged" and req.trusted is False
        assert "unauthenticated claim; here: rank 2 without progress" in req.trigger.reason
        assert req.trigger.reason.startswith("signalled by node 0")
        assert daemon.drain(30)
    finally:
        daemon.correlators.clear()  # the fixture closes the correlator
        daemon.close()


# -- (d) end to end: two `rankwatch daemon` sidecars, a healthy job, a forger -----------------------------


def start_two_nodes(procs, tmp_path: Path, demo_args: list[str], extra: list[str], nproc: int = 2):
    """Two simulated nodes: each a `rankwatch daemon` (node 0's hosts the store) and a plain torchrun
    running the demo under ``-m rankwatch.hooks`` with ``nproc`` ranks."""
    master, store_port = free_port(), free_port()
    daemons, jobs = [], []
    for k in (0, 1):
        shm, out = tmp_path / f"shm{k}", tmp_path / f"out{k}"
        daemons.append((start_daemon(procs, shm, out, "--store-port", str(store_port), *extra), shm, out))
        env = dict(os.environ, RANKWATCH_SHM_DIR=str(shm))
        env.pop("RANKWATCH_JOB_ID", None)
        env.pop("RANKWATCH_STORE_SECRET_FILE", None)
        jobs.append(procs.start(
            [sys.executable, "-m", "torch.distributed.run",
             *torchrun_args(nproc, "x", "-m", "rankwatch.hooks", DEMO, *demo_args, nnodes=2, node_rank=k,
                            master_port=master)],
            env=env,
        ))
    return daemons, jobs, store_port


@pytest.mark.parametrize("with_secret", [True, False], ids=["secret", "no-secret"])
def test_forged_incident_in_a_healthy_job_makes_no_bundle(procs, tmp_path, with_secret):
    import torch.distributed as dist

    extra = ["--on-stall", "kill"]
    if with_secret:
        extra += ["--store-secret-file", str(secret_file(tmp_path, 0o600))]
    # one rank per node: what is checked is the two daemons' handling of a forged claim in their store, not
    # the ranks (each a torch start-up)
    daemons, jobs, store_port = start_two_nodes(procs, tmp_path, ["--steps", "100000", "--step-sleep-ms", "20"],
                                                extra, nproc=1)
    # the job runs on both nodes and node 0's daemon hosts the store
    assert wait_for(lambda: all(len(list(shm.glob("*/rank-*.hb"))) == 1 for _, shm, _ in daemons), timeout=120)
    job_id = next(p.name for p in (tmp_path / "shm0").iterdir() if p.is_dir())
    logs = [LineReader(d.stderr) for d, _, _ in daemons]
    client = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=datetime.timedelta(seconds=60))
    # the job is past its first steps on both nodes (so both daemons have published snapshots to the store)
    assert wait_for(lambda: all(read_record(str(p)).steps_done >= 5 for _, shm, _ in daemons
                                for p in shm.glob("*/rank-*.hb")), timeout=120)
    prefix = f"rankwatch/{job_id}/"
    claim = json.dumps(incident_doc(gen=1, incident_id="20990101T000000Z-001-forged", by=1))
    client.set(prefix + "incident/1", claim)
    client.set(prefix + "incident/current", claim)
    client.set(prefix + "verdict/1", json.dumps(verdict_doc(job_id, initiating=0)))
    # each daemon is done with the claim: rejected (bad signature), or unconfirmed and then dropped for good
    final = ('"store_value_rejected"', "incident/current") if with_secret else ('"remote_claim_ignored"',)
    for log in logs:
        assert log.wait_for(*final, timeout=120), log.lines[-20:]
    for _, _, out in daemons:
        assert not list(out.glob("*/incidents/*")), [log.lines[-20:] for log in logs]
    assert all(j.poll() is None for j in jobs), "a forged claim must never kill"
    for (d, _, _), log in zip(daemons, logs, strict=True):
        stop_daemon(d, log)
    logs = [log.text() for log in logs]
    if with_secret:
        assert all('"store_value_rejected"' in log and "incident/current" in log for log in logs), logs
    else:
        assert all('"remote_claim_unconfirmed"' in log and '"store_unauthenticated"' in log for log in logs), logs
    assert not any('"incident_detected"' in log for log in logs), logs


def test_signed_daemons_still_agree_on_a_real_hang(procs, tmp_path):
    """The whole exchange signed (snapshots, claim, evidence, verdict): both nodes' bundles carry the
    leader's verdict, the secret given through the environment as systemd's EnvironmentFile would. One rank per
    node: the signed exchange between the nodes is the point (the hung rank is node 1's). This is also the suite's
    systemd-style pair (two `rankwatch daemon` sidecars over plain `torchrun -m rankwatch.hooks`, no `rankwatch
    run`) on a real hang; the unsigned exchange of a real hang is test_multinode.py's, under `rankwatch run`."""
    scenario, fault_rank = "compute-hang", 1  # node 1's rank
    expect = examples_module("fault_catalogue").FAULTS[scenario]  # the right answer: the catalogue's
    secret = secret_file(tmp_path, 0o600)
    os.environ["RANKWATCH_STORE_SECRET_FILE"] = str(secret)
    try:
        daemons, jobs, _ = start_two_nodes(
            procs, tmp_path,
            ["--scenario", scenario, "--fault-rank", str(fault_rank), "--fault-step", "4", "--steps", "400"], [],
            nproc=1,
        )
    finally:
        del os.environ["RANKWATCH_STORE_SECRET_FILE"]

    def all_verdicts():
        found = [json.loads(p.read_text()) for _, _, out in daemons for p in out.glob("*/incidents/*/verdict.json")]
        return found if len(found) == 2 else None

    found = wait_for(all_verdicts, timeout=150)
    assert found, [d.stderr for d, _, _ in daemons]
    assert found[0]["initiating_ranks"] == found[1]["initiating_ranks"] == expect.ranks(fault_rank)
    assert found[0]["incident_id"] == found[1]["incident_id"]
    assert found[0]["phase"] == found[1]["phase"] == expect.phase
    assert found[0]["kind"] == found[1]["kind"] and found[0]["kind"] in expect.kinds
    assert all(v["correlation"].startswith("leader node 0 over 2 node(s)") for v in found), found
    assert all(j.poll() is None for j in jobs), "daemons must not kill without --on-stall kill"
