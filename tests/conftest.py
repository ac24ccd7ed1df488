"""Shared helpers: real torchrun jobs on loopback, each in its own process group, always cleaned up."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from rankwatch.hooks.record import read_record

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
DEMO = str(REPO / "examples" / "ddp_demo.py")

# The test tree mirrors the source (docs/CONTRIBUTING.md "Where tests go"): tests/unit/<package>/, tests/e2e/,
# tests/architecture/; helpers stay here (procs/, jobs/, fixtures/, child_site/). No __init__.py anywhere: pytest's
# default import mode imports each test module by its file name, so every name is unique in the whole tree
# (tests/architecture/test_layout.py holds it), and tests import each other's helpers by that name
# (``from test_safety import start_rank``). Each folder goes on sys.path here, before any test module is
# imported, so such an import works whichever folder pytest collected first.
TEST_DIRS = (TESTS / "architecture", TESTS / "e2e", *sorted(p for p in (TESTS / "unit").glob("*") if p.is_dir()))
sys.path[1:1] = [str(d) for d in TEST_DIRS if str(d) not in sys.path]


_PORT_BLOCK = 1000  # ports per xdist worker, below the kernel's ephemeral range (32768-60999 by default)
_PORT_BLOCKS = 12  # 20000-31999: two runs of six workers side by side
_PORT_STRIDE = 4  # the ports a test derives from one it drew (port + 1 ...) are never drawn
_port_next = [int.from_bytes(os.urandom(2), "little") % _PORT_BLOCK]


def examples_module(name: str):  # type: ignore[no-untyped-def]
    """``examples/<name>.py`` (``fault_catalogue``: the faults and their right answers), loaded once per process
    by benchmarks/_util.py's ``examples_module`` — one loader, so a test that also loads the accuracy runner
    gets one module object."""
    util = sys.modules.get("_rankwatch_bench_util")
    if util is None:
        spec = importlib.util.spec_from_file_location("_rankwatch_bench_util", REPO / "benchmarks" / "_util.py")
        assert spec and spec.loader
        util = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = util
        spec.loader.exec_module(util)
    return util.examples_module(name)


def free_port() -> int:
    """A port free now, below the ephemeral range: a port the kernel handed out (bind to 0) can be taken by any
    outgoing connection (gloo opens hundreds) before the job binds it — a store or rendezvous then fails with
    EADDRINUSE. Each xdist worker draws from its own block, in turn, so two tests never draw the same port.
    ``RANKWATCH_TEST_PORT_OFFSET=6`` moves a run's workers to other blocks (two checkouts' runs side by side)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    offset = int(os.environ.get("RANKWATCH_TEST_PORT_OFFSET", "0"))
    base = 20000 + ((int(worker) if worker.isdigit() else 0) + offset) % _PORT_BLOCKS * _PORT_BLOCK
    for _ in range(_PORT_BLOCK // _PORT_STRIDE):
        # a stride: callers use the ports just above the one drawn too (the Slurm example's store is MASTER_PORT+1)
        port = base + _port_next[0] * _PORT_STRIDE % _PORT_BLOCK
        _port_next[0] += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {base}-{base + _PORT_BLOCK - 1}")


def torchrun_args(
    nproc: int, run_id: str, *script: str, nnodes: int = 1, node_rank: int = 0, master_port: int | None = None
) -> list[str]:
    if nnodes == 1:
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", run_id]
    else:
        rdzv = [
            f"--nnodes={nnodes}",
            f"--node-rank={node_rank}",
            "--master-addr=127.0.0.1",
            f"--master-port={master_port}",
        ]
    return ["--nproc-per-node", str(nproc), "--monitor-interval", "0.2", *rdzv, *script]


class Procs:
    """Starts processes in new sessions; kills every process group at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], **kw) -> subprocess.Popen:
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        proc = subprocess.Popen(cmd, start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def run(self, cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
        proc = self.start(cmd, **kw)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(proc)
            out, err = proc.communicate()
            raise AssertionError(f"timed out after {timeout}s: {cmd}\nstdout:\n{out}\nstderr:\n{err}")
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        """Kill the process, its group and every descendant (torchrun puts ranks in their own sessions)."""
        try:
            family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        except psutil.Error:
            family = [proc.pid]
        for pid in family:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def cleanup(self) -> None:
        for proc in self.procs:
            self.kill(proc)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            for stream in (proc.stdout, proc.stderr):
                if stream:
                    stream.close()


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.cleanup()


@pytest.fixture
def shm_dir(tmp_path):
    d = tmp_path / "shm"
    d.mkdir(mode=0o700)
    return d


def rankwatch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "rankwatch.watchdog.cli", *args]


def alive(pid: int) -> bool:
    """Running (a zombie is dead: it waits only for whoever reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[-1][0] != "Z"
    except FileNotFoundError:
        return False


def wait_for(predicate, timeout: float, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


class LineReader:
    """A running process's text stream read on a thread, so a test waits for a log line instead of sleeping."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._cv = threading.Condition()
        self._eof = False
        self._thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self._thread.start()

    def _run(self, stream) -> None:
        for line in iter(stream.readline, ""):
            with self._cv:
                self.lines.append(line)
                self._cv.notify_all()
        with self._cv:
            self._eof = True
            self._cv.notify_all()

    def wait_for(self, *needles: str, timeout: float = 60) -> str | None:
        """The first line holding every needle (None after ``timeout`` or once the stream ends without one)."""
        def found() -> str | None:
            return next((ln for ln in self.lines if all(n in ln for n in needles)), None)

        with self._cv:
            self._cv.wait_for(lambda: found() is not None or self._eof, timeout)
            return found()

    def text(self, timeout: float = 60) -> str:
        """Everything, once the stream has ended (the process exited)."""
        self._thread.join(timeout)
        with self._cv:
            return "".join(self.lines)


def stop_daemon(proc: subprocess.Popen, log: LineReader | None = None, timeout: float = 30) -> None:
    """SIGTERM a daemon and wait for it; one that outlives ``timeout`` fails the test with its threads'
    stacks (py-spy) and its last log lines, so a shutdown that hangs says where."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
        return
    except subprocess.TimeoutExpired:
        pass
    dump = subprocess.run(["py-spy", "dump", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=60)
    tail = "".join(log.lines[-30:]) if log is not None else ""
    proc.kill()
    proc.wait(timeout=30)
    pytest.fail(f"daemon {proc.pid} still running {timeout:.0f}s after SIGTERM\n{dump.stdout}{dump.stderr}\n{tail}")


def healthz_polls(port: int) -> int | None:
    """How many polls the daemon serving ``--metrics-port port`` has started (None: not answering yet)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return int(json.loads(r.read())["polls"])
    except urllib.error.HTTPError as exc:  # 503 before the first poll: the body still counts
        try:
            return int(json.loads(exc.read())["polls"])
        except (ValueError, KeyError, TypeError):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def wait_polls(port: int, more: int = 2, timeout: float = 120) -> None:
    """Until the daemon has completed ``more - 1`` whole polls after this call: "it has looked again", by the
    daemon's own pace rather than a sleep that covers fewer polls on a loaded host."""
    first = wait_for(lambda: healthz_polls(port) is not None, timeout) and healthz_polls(port)
    assert first is not None, "the daemon's /healthz never answered"
    assert wait_for(lambda: (healthz_polls(port) or 0) >= first + more, timeout), "the daemon stopped polling"


def start_daemon(procs: Procs, shm, out, *extra: str, poll: str = "0.3", stall: str = "3") -> subprocess.Popen:
    """A `rankwatch daemon` sidecar with JSON logs on stderr."""
    cmd = rankwatch_cmd("daemon", "--shm-dir", str(shm), "--out", str(out), "--stall-timeout", stall,
                        "--poll-interval", poll, "--json-logs", *extra)
    return procs.start(cmd, text=True)


def bundle_dirs(incidents: Path) -> list[Path]:
    """Finished incident bundles (temp dirs being written start with a dot)."""
    return sorted(p for p in incidents.iterdir() if not p.name.startswith(".")) if incidents.exists() else []


def skip_if_gloo_teardown_abort(result: subprocess.CompletedProcess, job_dir: Path, steps: int) -> None:
    """gloo occasionally aborts a rank (SIGABRT) while tearing down its process group after the last step on
    an overloaded host (seen about once in 100 jobs on 2 shared cores). Training itself finished, so such a
    run says nothing about what the test checks: skip it, with the reason, instead of failing."""
    from rankwatch.hooks.record import read_record

    if result.returncode == 0 or "SIGABRT" not in (result.stderr or ""):
        return
    records = [read_record(str(p)) for p in Path(job_dir).glob("rank-*.hb")]
    if records and all(r.steps_done >= steps for r in records):
        pytest.skip(f"gloo aborted a rank during process-group teardown after all {steps} steps")


def rank_pid(shm: Path, job: str, rank: int) -> int | None:
    """The pid rank ``rank``'s record names, None until the record exists (a test that acts on a rank's process
    asks again)."""
    try:
        pid = read_record(str(shm / job / f"rank-{rank}.hb")).pid
    except Exception:  # not published yet (or half written): asked again
        return None
    return pid if pid > 0 else None


def demo_job_cmd(tmp_path: Path, job_id: str, nproc: int, *demo_args: str,
                 options: tuple[str, ...] = ()) -> tuple[list[str], Path, Path]:
    """`rankwatch run --quiet` around the demo under torchrun: (command, out dir, shm dir)."""
    out, shm = tmp_path / "out", tmp_path / "shm"
    cmd = rankwatch_cmd("run", "--out", str(out), "--shm-dir", str(shm), "--quiet", *options, "--",
                        *torchrun_args(nproc, job_id, DEMO, *demo_args))
    return cmd, out, shm


def run_demo_job(procs: Procs, tmp_path: Path, job_id: str, nproc: int, *demo_args: str,
                 options: tuple[str, ...] = (), timeout: float = 240) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """`rankwatch run --quiet` around the demo under torchrun; returns (result, out dir, shm dir)."""
    cmd, out, shm = demo_job_cmd(tmp_path, job_id, nproc, *demo_args, options=options)
    return procs.run(cmd, timeout=timeout, text=True), out, shm


@pytest.fixture(params=["c", "python"])
def hook_impl(request, monkeypatch):
    """Run a test on each tracker core: the C hot paths (``hooks/_fastpath.c``) and the Python ones (the
    fallback where the extension was not built). ``new_tracker`` makes trackers of the selected one."""
    from rankwatch.hooks import tracker as tracker_mod

    if request.param not in tracker_mod.IMPLEMENTATIONS:  # .ci/run checks that CI's install built it
        pytest.skip(f"the {request.param} tracker core is not built (pip install -e . compiles hooks/_fastpath.c)")
    monkeypatch.setattr(tracker_mod, "Tracker", tracker_mod.IMPLEMENTATIONS[request.param])
    monkeypatch.setenv("RANKWATCH_HOOK_IMPL", request.param)  # and the writer processes a test starts
    return request.param


def new_tracker(path, *, pid: int | None = None, rank: int = 0, local_rank: int = 0, world_size: int = 1,
                local_world_size: int = 1, hostname: str = "nodeA", job_id: str = "j",
                start_ns: int | None = None):
    """A real shm record with its identity written, and the Tracker that writes it (as the hook's init does)."""
    from rankwatch.hooks.record import CANONICAL_PHASES, RankIdentity, RecordWriter, write_identity
    from rankwatch.hooks.tracker import Tracker

    writer = RecordWriter(str(path))
    write_identity(
        writer,
        RankIdentity(pid=os.getpid() if pid is None else pid, global_rank=rank, local_rank=local_rank,
                 world_size=world_size, local_world_size=local_world_size, node_rank=0, device=-1,
                 hostname=hostname, job_id=job_id, start_ns=time.monotonic_ns() if start_ns is None else start_ns),
        list(CANONICAL_PHASES),
    )
    return Tracker(writer)


def stalled_record(shm, job: str, *, rank: int = 0, world: int = 1, pid: int | None = None, stall_slot: int = 0):
    """A real record (written by this test process, which maps it) that finished one step and then stopped
    making progress in phase slot ``stall_slot`` (0 dataloader, 1 forward). ``pid`` defaults to this process;
    keep the returned tracker: its writer's mapping is what proves this process owns the record."""
    from pathlib import Path

    job_dir = Path(shm) / job
    job_dir.mkdir(mode=0o700, exist_ok=True)
    t = new_tracker(job_dir / f"rank-{rank}.hb", pid=pid, rank=rank, local_rank=rank, world_size=world,
                    local_world_size=world, job_id=job)
    for slot in (0, 1, 2, 3):
        t.enter(slot)
        t.exit(slot)
    t.step()
    t.enter(stall_slot)
    return t


# -- tiers ------------------------------------------------------------------------------------------------
# The fast tier is `python -m pytest -q -m "not slow"`. Rather than trusting every new test to carry the mark,
# a test is slow when it uses a fixture that starts processes, or lives in a module whose every test does.
SLOW_FIXTURES = frozenset({"procs"})
SLOW_MODULES = frozenset({
    "test_multiuser.py",  # real throwaway users, daemons under them
    "test_works_with.py",  # framework jobs under torchrun
})
# modules whose tests read one cached result per input (a `rankwatch diagnose` run per log): on one worker
SHARED_CACHE_MODULES = frozenset({"test_public_logs.py"})
# Longest first under xdist: workers take tests in collection order, so a minute-long test collected last
# runs alone at the end while the other workers idle. Modules by their longest test (--durations of the slow
# tier, 4 workers on 2 cores at load 8-15, 2026-12-02: quick benchmarks 50-217 s, two-node inspect 71 s,
# two-node jobs 54-64 s, then the 30-45 s jobs; 2026-12-03 beside two CPU hogs, after the jobs got fewer ranks:
# v3's two-node classes 64-82 s, two-node jobs 59-72 s, stragglers 47 s, e2e 49 s); the rest of the slow tier
# after these, the fast tier last.
LONG_POLES = (
    "test_benchmarks_quick.py",
    "test_inspect.py",
    "test_v3_classes.py",
    "test_multinode.py",
    "test_straggler.py",
    "test_network_cause.py",
    "test_memory_pressure_cause.py",
    "test_watchdog_e2e.py",
    "test_slurm_example.py",
    "test_torchrun_args.py",
    "test_lifecycle.py",
    "test_real_bugs.py",
    "test_works_with.py",
    "test_hook_robust.py",
    "test_run_output.py",
    "test_store_auth.py",
)


def _shares_module_fixture(item) -> bool:
    """Whether the test uses a module- or package-scoped fixture (throwaway users, a shared interpreter)."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(d.scope in ("module", "package") for chain in defs for d in chain)


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (addopts): three workers per core. Most slow tests wait rather than compute (torchrun
    start-up, stall timeouts, py-spy, daemons' polls), so more jobs than cores overlap each other's waits:
    measured on 2 cores at load 17-25, tests/e2e/test_watchdog_e2e.py took 283-384 s with 4 workers against 433 s
    with 2. Beside other busy processes a third per core matters more: each job runs in its own session, so
    each is one more scheduling group against the other load (the full suite beside two CPU hogs on 2 cores,
    2026-12-04, the same commit: 16 min 46 s with 4 workers, 15 min 04 s with 6). Not more: memory (a
    two-node job is ten torch processes) and every test's margin under load. ``-n 2`` (or ``-n 0``) on the
    command line still wins."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return 3 * cores


def _longest_first(item) -> int:
    """Sort key: the long-pole modules in their order (their torch-child tests are long without being in
    the slow tier), then the rest of the slow tier, then the fast tier."""
    name = item.path.name
    if name in LONG_POLES:
        return LONG_POLES.index(name)
    return len(LONG_POLES) + (0 if item.get_closest_marker("slow") else 1)


# the checkout's own Python code that the processes a test starts import: ranks (the hook, the demos and their
# fault table), rankwatch's CLI processes, the test jobs and benchmark helpers
BYTECODE_DIRS = ("hooks", "watchdog", "examples", "tests/procs", "tests/jobs", "tests/child_site", "benchmarks")


def _compile_checkout() -> None:
    """Write the checkout's bytecode once, before any worker starts. Under ``PYTHONDONTWRITEBYTECODE=1`` (set on
    the CI machine) no process writes it, so every rank and every ``rankwatch`` process compiled the modules it
    imports from source again (~0.1 s of CPU each, hundreds of processes per run); compiling them here costs
    ~0.3 s once. A source edited later is recompiled as before (the bytecode records the source's mtime)."""
    import compileall

    for d in BYTECODE_DIRS:
        compileall.compile_dir(str(REPO / d), quiet=2)


def _rewrite_tests_once(config) -> None:  # type: ignore[no-untyped-def]
    """Pytest caches the assertion-rewritten code of each test module (and of the plugins it rewrites: hypothesis,
    xdist, ...) in ``__pycache__``, but not under ``PYTHONDONTWRITEBYTECODE``: every xdist worker rewrote ~200
    modules again, ~3 s of CPU each, all of them at once while the run starts. The controller writes them once,
    before the workers start, with pytest's own rewriter and writer. These are pytest internals: where they
    moved, nothing is written and the workers rewrite as before (slower, never wrong: a cached file is checked
    against its source's mtime and size, as pytest always does)."""
    try:
        from _pytest.assertion import rewrite

        state = config.stash[rewrite.assertstate_key]
        files = {*state.hook._rewritten_names.values(), *(f for d in TEST_DIRS for f in d.glob("test_*.py"))}
        for fn in sorted(files):
            cache = rewrite.get_cache_dir(fn)
            pyc = cache / (fn.name[:-3] + rewrite.PYC_TAIL)
            if not rewrite.try_makedirs(cache) or rewrite._read_pyc(fn, pyc) is not None:
                continue
            source_stat, code = rewrite._rewrite_test(fn, config)
            rewrite._write_pyc(state, code, source_stat, pyc)
    except Exception:  # a cache only: the workers rewrite what is missing
        pass


# the sitecustomize of every process a test starts (a quick interpreter exit; the torch-import probe of
# RANKWATCH_TEST_CPU): tests/child_site/sitecustomize.py says why
CHILD_SITE = str(REPO / "tests" / "child_site")


def _children_load_child_site() -> None:
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if CHILD_SITE not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (CHILD_SITE, *paths) if p)


def pytest_configure(config):
    """``RANKWATCH_TEST_CPU=FILE``: each test's wall time, CPU and torch imports (tests/cpu_measure.py)."""
    _children_load_child_site()
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller (or -n 0), once per run
        _compile_checkout()
        _rewrite_tests_once(config)
    if os.environ.get("RANKWATCH_TEST_CPU"):
        from cpu_measure import CpuMeasure

        plugin = CpuMeasure(os.environ["RANKWATCH_TEST_CPU"])
        config.pluginmanager.register(plugin, "rankwatch_cpu_measure")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # tryfirst: xdist's own hook (on each worker) turns the xdist_group marks into the node ids' "@group" suffix
    # that --dist loadgroup schedules by; run after it, the marks below were added too late and every group's
    # tests were spread over the workers (each setting up the module fixture again)
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())) or item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        # under xdist (addopts -n auto) the tests sharing a module fixture run on one worker: it is set up
        # once, and two workers never create the same throwaway users
        if _shares_module_fixture(item) or item.path.name in SHARED_CACHE_MODULES:
            item.add_marker(pytest.mark.xdist_group(item.path.name))
    # only on xdist workers (every worker sorts the same collection the same way): in one process, tests
    # that share a module fixture stay next to each other and it is set up once
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=_longest_first)


def resolve_and_decide(corr, inc, views, node: str, world: int, decide, **kw):
    """A correlator used as the incident pipeline uses it (``serve.incident.correlate_and_decide``, ``decide``
    as ``(views, notes, how, remote_fr) -> VerdictDocument``). (the verdict as sinks get it: its JSON, how,
    decided here)."""
    from rankwatch.watchdog.serve.incident import DECIDED_HERE, correlate_and_decide

    verdict, how, source = correlate_and_decide(corr, inc, views, node, world, decide, **kw)
    return verdict.to_json(), how, source == DECIDED_HERE
