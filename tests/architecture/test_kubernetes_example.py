"""examples/kubernetes/: the fields that make the DaemonSet work with the training pods, checked against the
daemon's real parser, the unit file's capability set and a real daemon answering the liveness probe."""

from __future__ import annotations

import re

import pytest
from conftest import REPO, free_port, rankwatch_cmd, wait_for
from rankwatch.watchdog.cli.daemon import build_parser
from test_healthz import get

yaml = pytest.importorskip("yaml")

K8S = REPO / "examples" / "kubernetes"


def docs(name: str) -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all((K8S / name).read_text()) if d}


@pytest.fixture(scope="module")
def daemonset():
    pod = docs("rankwatch-daemonset.yaml")["DaemonSet"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"][:2] == ["rankwatch", "daemon"]
    return pod, container, build_parser().parse_args(container["command"][2:])


@pytest.fixture(scope="module")
def training():
    pod = docs("training-job.yaml")["Job"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return pod, container


def host_path(pod: dict, container: dict, mount_path: str) -> str:
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == mount_path]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return volume["hostPath"]["path"]


def test_daemon_and_training_pods_share_the_nodes_shm_dir_at_the_same_path(daemonset, training):
    pod, container, args = daemonset
    tpod, tcontainer = training
    # same node dir, mounted at the same path: a rank's /proc/<pid>/maps names the record by its path
    assert host_path(pod, container, args.shm_dir) == host_path(tpod, tcontainer, args.shm_dir)
    env = {e["name"]: e.get("value") for e in tcontainer["env"]}
    assert env["RANKWATCH_SHM_DIR"] == args.shm_dir
    cmd = tcontainer["command"]
    assert cmd[0] == "torchrun" and cmd[cmd.index("-m") + 1] == "rankwatch.hooks"
    for p in (pod, tpod):  # record pids are verified in the node's PID namespace
        assert p["hostPID"] is True
    # the init container opens the shm dir to every user (01777), as the tmpfiles entry does on a host
    (init,) = pod["initContainers"]
    assert "0o1777" in " ".join(init["command"])
    assert any(m["mountPath"] == args.shm_dir for m in init["volumeMounts"])


def test_daemon_keeps_the_unit_files_capabilities_and_nothing_else(daemonset):
    _, container, _ = daemonset
    unit = (REPO / "systemd" / "rankwatch.service").read_text()
    caps = re.search(r"^CapabilityBoundingSet=(.*)$", unit, re.M).group(1).split()
    sc = container["securityContext"]
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sorted(sc["capabilities"]["add"]) == sorted(c.removeprefix("CAP_") for c in caps)
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False


def test_probe_ports_resources_and_bundles_match_the_daemons_arguments(daemonset):
    pod, container, args = daemonset
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    probe = container["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    assert ports.get(probe["port"], probe["port"]) == args.metrics_port == ports["metrics"]
    assert args.metrics_addr == "0.0.0.0"  # the kubelet probes the pod's IP, not its loopback
    limits = container["resources"]["limits"]
    assert {"cpu", "memory"} <= set(limits)
    assert host_path(pod, container, args.out).startswith("/var/lib/")  # bundles outlive the pod


def test_the_manifests_daemon_command_serves_the_probe(procs, tmp_path, daemonset):
    """The DaemonSet's own command line, with only its paths and port moved here, answers the probe."""
    _, container, args = daemonset
    port = free_port()
    # the metrics token as a Kubernetes secret volume lays it out: a symlink into a 0400 file
    secret = tmp_path / "secret"
    (secret / "..data").mkdir(parents=True)
    (secret / "..data" / "token").write_text("k8s-token\n")
    (secret / "..data" / "token").chmod(0o400)
    (secret / "token").symlink_to("..data/token")
    swap = {args.shm_dir: str(tmp_path / "shm"), args.out: str(tmp_path / "out"), str(args.metrics_port): str(port),
            args.metrics_token_file: str(secret / "token")}
    (tmp_path / "shm").mkdir(mode=0o700)
    cmd = rankwatch_cmd(*(swap.get(a, a) for a in container["command"][1:]))
    daemon = procs.start(cmd, text=True)
    probe = container["livenessProbe"]["httpGet"]["path"]
    ok = wait_for(lambda: get(f"http://127.0.0.1:{port}{probe}")[0] == 200, timeout=60)
    assert ok, daemon.stderr.read() if daemon.poll() is not None else "no answer"
    # what the PodMonitor gets with the token: the per-job families; anyone else: node totals only
    import urllib.request

    def metrics(token: str | None) -> str:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.read().decode()

    assert "rankwatch_stalled" in metrics("k8s-token")
    assert "rankwatch_stalled" not in metrics(None) and "rankwatch_open_incidents" in metrics(None)
