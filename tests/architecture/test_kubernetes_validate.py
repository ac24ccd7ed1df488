"""examples/kubernetes/ against the Kubernetes API schemas (pip ``kubernetes-validate --strict``, several
versions), the placement and hardening every pod needs, the PodMonitor's shape, and the Dockerfile: what it
copies builds a wheel holding every rankwatch package, and it builds for real where a Docker daemon runs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
from conftest import REPO

yaml = pytest.importorskip("yaml")

K8S = REPO / "examples" / "kubernetes"
CORE_MANIFESTS = ("rankwatch-daemonset.yaml", "training-job.yaml")
VALIDATOR = shutil.which("kubernetes-validate")
VERSIONS = ("1.28.0", "1.31.0", "1.34.0", "1.37.0")


def load(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def pod_specs() -> dict[str, dict]:
    out = {}
    for name in CORE_MANIFESTS:
        for d in load(name):
            if d["kind"] == "DaemonSet" or d["kind"] == "Job":
                out[d["kind"]] = d["spec"]["template"]["spec"]
    return out


@pytest.mark.slow
@pytest.mark.skipif(VALIDATOR is None, reason="kubernetes-validate not installed (pip install kubernetes-validate)")
@pytest.mark.parametrize("version", VERSIONS)
def test_manifests_pass_kubernetes_validate_strict(version):
    result = subprocess.run([VALIDATOR, "--strict", "-k", version, *(str(K8S / m) for m in CORE_MANIFESTS)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == sum(len(load(m)) for m in CORE_MANIFESTS), result.stdout


def test_every_pod_runs_on_gpu_nodes_without_a_token_and_every_container_has_resources():
    specs = pod_specs()
    ds = specs["DaemonSet"]
    (term,) = ds["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]} in term["matchExpressions"]
    assert specs["Job"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    priority = {d["metadata"]["name"]: d for d in load("rankwatch-daemonset.yaml") if d["kind"] == "PriorityClass"}
    assert ds["priorityClassName"] in priority
    assert 0 < priority[ds["priorityClassName"]]["value"] < 1_000_000_000  # below system-*-critical
    for kind, spec in specs.items():
        assert spec["automountServiceAccountToken"] is False, kind
        for c in spec.get("initContainers", []) + spec["containers"]:
            res = c.get("resources", {})
            assert res.get("requests") and res.get("limits"), f"{kind}/{c['name']} has no requests and limits"


def test_namespaces_allow_what_the_pods_need_and_no_more_than_they_say():
    """hostPID and hostPath are beyond Pod Security 'baseline': each namespace holding such pods is labelled
    'privileged' for enforce, audit and warn, and the docs say why."""
    for name in CORE_MANIFESTS:
        docs = load(name)
        (ns,) = [d for d in docs if d["kind"] == "Namespace"]
        labels = ns["metadata"]["labels"]
        for mode in ("enforce", "audit", "warn"):
            assert labels[f"pod-security.kubernetes.io/{mode}"] == "privileged", (name, mode)
        for d in docs:
            if d["kind"] in ("DaemonSet", "Job"):
                assert d["metadata"]["namespace"] == ns["metadata"]["name"]
    ops = (REPO / "docs" / "operations.md").read_text()
    section = ops[ops.index("## Pod Security"):]
    for word in ("hostPID", "hostPath", "SYS_PTRACE", "baseline", "privileged"):
        assert word in section, word


def test_podmonitor_scrapes_the_daemons_metrics_port_with_the_token():
    (pm,) = load("rankwatch-podmonitor.yaml")
    assert (pm["apiVersion"], pm["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    ds = next(d for d in load("rankwatch-daemonset.yaml") if d["kind"] == "DaemonSet")
    assert pm["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert pm["spec"]["namespaceSelector"]["matchNames"] == [ds["metadata"]["namespace"]]
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    assert endpoint["port"] in {p["name"] for p in container["ports"]}
    assert endpoint["path"] == "/metrics"
    # the token the PodMonitor presents is the secret the daemon reads with --metrics-token-file
    cmd = container["command"]
    token_path = cmd[cmd.index("--metrics-token-file") + 1]
    (mount,) = [m for m in container["volumeMounts"] if token_path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in ds["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    cred = endpoint["authorization"]["credentials"]
    assert volume["secret"]["secretName"] == cred["name"] and token_path.endswith("/" + cred["key"])
    # the rules' job label: the PodMonitor's jobLabel names the label whose value becomes job="rankwatch"
    assert ds["spec"]["template"]["metadata"]["labels"][pm["spec"]["jobLabel"]] == "rankwatch"


def dockerfile_copies() -> list[str]:
    text = (REPO / "Dockerfile").read_text()
    return [p for line in re.findall(r"^COPY (.+)$", text, re.M) for p in line.split()[:-1]]


@pytest.mark.slow
def test_what_the_dockerfile_copies_builds_every_rankwatch_package(tmp_path):
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    for rel in dockerfile_copies():
        src = REPO / rel.rstrip("/")
        (shutil.copytree if src.is_dir() else shutil.copy)(src, ctx / rel.rstrip("/"))
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                             "-w", str(tmp_path / "wheel"), str(ctx)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = (tmp_path / "wheel").glob("rankwatch-*.whl")
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    toml = (REPO / "pyproject.toml").read_text()
    listed = toml.split("[tool.setuptools]")[1].split("[tool.setuptools.package-dir]")[0]
    packages = re.findall(r'"(rankwatch\.[a-z_.]+)"', listed)
    for pkg in packages:
        assert pkg.replace(".", "/") + "/__init__.py" in names, pkg
    assert "rankwatch/watchdog/serve/reaper.py" in names  # the --on-incident subreaper ships too
    text = (REPO / "Dockerfile").read_text()
    assert 'CMD ["rankwatch", "daemon"' in text


def docker_daemon() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


@pytest.mark.slow
def test_the_image_builds_and_runs_the_daemon():
    if not docker_daemon():
        pytest.skip("no Docker daemon here")
    result = subprocess.run(["docker", "build", "-q", "-t", "rankwatch-test:ci", str(REPO)], capture_output=True,
                            text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    run = subprocess.run(["docker", "run", "--rm", "rankwatch-test:ci", "rankwatch", "daemon", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "--metrics-token-file" in run.stdout
