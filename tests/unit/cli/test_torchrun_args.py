"""torchrun command-line parsing without torch (watchdog/cli/torchrun_args.py), checked against torch's own
``get_args_parser()``; and that ``rankwatch run``'s watchdog process never loads torch."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import pytest
from conftest import REPO, free_port, rankwatch_cmd, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rankwatch.watchdog.cli import torchrun_args as ta
from rankwatch.watchdog.errors import UserError

HOOK = "rankwatch.hooks"


def clean_env(**pet: str) -> dict[str, str]:
    """This process's environment without PET_* variables, plus the given ones."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("PET_")}, **pet}


def torch_parse(args: list[str], env: dict[str, str]) -> dict | None:
    """torch's reading of a torchrun command line in this process (torch's env actions read os.environ when
    the parser is built); None where torchrun would refuse it."""
    from torch.distributed.run import get_args_parser

    with mock.patch.dict(os.environ, env, clear=True):
        try:
            with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
                return vars(get_args_parser().parse_args(args))
        except SystemExit:
            return None
        except ValueError:  # check_env: PET_<FLAG> that is not an integer
            return None


def hand(args: list[str], env: dict[str, str]) -> ta.Parsed | None:
    try:
        return ta._hand_parse(args, env)
    except ta._Unsure:
        return None


def check_rewrite(args: list[str], cmd: ta.TorchrunCommand, env: dict[str, str]) -> None:
    """The rewritten command line means the same to torchrun, except that the hook runs first and is handed
    exactly the script (and -m) and arguments that torchrun would have run."""
    before, after = torch_parse(args, env), torch_parse(cmd.args, env)
    assert before is not None and after is not None, cmd.args
    ignore = {"module", "training_script", "training_script_args"}
    assert {k: v for k, v in after.items() if k not in ignore} == {k: v for k, v in before.items() if k not in ignore}
    hook_argv = list(after["training_script_args"])
    if hook_argv[:1] == ["--"]:  # the hook skips a leading `--`
        hook_argv = hook_argv[1:]
    script = [before["training_script"], *before["training_script_args"]]
    if before["run_path"]:
        assert after["training_script"] == ta.hook_main_path()
        assert hook_argv == script
    else:
        assert after["module"] is True and after["training_script"] == HOOK
        assert hook_argv == (["-m"] if before["module"] else []) + script
    rdzv = before["rdzv_id"] if before["rdzv_id"] not in ("", "none") else None
    assert (cmd.rdzv_id, cmd.nnodes, cmd.node_rank, cmd.master_addr, cmd.master_port, cmd.nproc_per_node) == (
        rdzv,
        before["nnodes"],
        before["node_rank"],
        before["master_addr"],
        before["master_port"],
        before["nproc_per_node"],
    )


# -- the option table is torch's --------------------------------------------------------------------------
def test_option_table_matches_the_installed_torch():
    """Every option torch's parser has, with the same spellings, dest, arity, type, default, choices and
    PET_ environment default; nothing more, nothing less. When a torch upgrade fails this, update OPTIONS
    (an option missing from the table only costs the child parser's start-up; a changed one would be wrong)."""
    from torch.distributed.argparse_util import check_env, env
    from torch.distributed.run import get_args_parser

    with mock.patch.dict(os.environ, clean_env(), clear=True):
        parser = get_args_parser()
    theirs = {}
    positionals = []
    for action in parser._actions:
        if not action.option_strings:
            positionals.append((action.dest, action.nargs))
            continue
        if action.dest == "help":
            assert action.option_strings == ["-h", "--help"]
            continue
        if action.nargs == 0:
            kind = "flag"
        else:
            assert action.nargs is None, action
            kind = {str: "str", int: "int", float: "float"}.get(action.type) or action.type.__name__
            kind = "csv" if kind == "comma_separated_list" else kind
        theirs[tuple(action.option_strings)] = (
            action.dest,
            kind,
            action.default,
            tuple(action.choices) if action.choices else None,
            isinstance(action, (env, check_env)),
        )
    ours = {opt.names: (opt.dest, opt.kind, opt.default, opt.choices, opt.env) for opt in ta.OPTIONS}
    assert ours == theirs
    assert positionals == [("training_script", None), ("training_script_args", "...")]
    assert parser.prefix_chars == "-" and parser.fromfile_prefix_chars is None
    assert ta._csv("a,,b,c") == ["a,b", "c"]


# -- the hand parser agrees with torch's -----------------------------------------------------------------
REALISTIC = [
    ["--nproc-per-node", "4", "train.py"],
    ["--nproc_per_node=8", "train.py", "--lr", "0.1", "--epochs", "3"],
    ["--standalone", "--nproc-per-node=gpu", "train.py"],
    ["--standalone", "--nproc_per_node", "auto", "train.py", "--config", "conf/a.yaml"],
    ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29500",
     "--nproc-per-node", "8", "train.py", "--config", "c.yaml"],
    ["--nnodes=2", "--node_rank=0", "--master_addr=node-a", "--master_port=29400", "train.py"],
    ["--nnodes=1:4", "--rdzv-backend=c10d", "--rdzv-endpoint=host:29400", "--rdzv-id=job42", "--max-restarts=3",
     "--nproc-per-node=8", "train.py"],
    ["--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", "--rdzv_id", "abc", "--nnodes", "1", "train.py"],
    ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29411", "--rdzv-id", "none", "train.py"],
    ["--rdzv-conf", "timeout=900,join_timeout=60", "train.py"],
    ["--rdzv-conf=read_timeout=300", "--rdzv-id=", "train.py"],
    ["-m", "pkg.train", "--foo", "bar"],
    ["--module", "--nproc-per-node", "2", "pkg.train", "-m", "x"],
    ["--nproc-per-node", "2", "-m", "--standalone", "-m", "pkg.train"],
    ["--run-path", "train.py", "a"],
    ["--run_path", "-m", "--nproc-per-node", "2", "train.py", "--x"],
    ["--monitor-interval", "0.2", "--start-method", "fork", "train.py"],
    ["--monitor_interval=5", "--start_method=forkserver", "--max_restarts", "0", "train.py"],
    ["-r", "3", "-t", "3", "--log-dir", "/tmp/logs", "train.py"],
    ["--tee=3", "--redirects=1:3,2:3", "--local-ranks-filter", "0,1", "train.py"],
    ["--log_dir=/var/log/job", "--local_ranks_filter=0", "-t", "0:3", "train.py"],
    ["--duplicate-stdout-filters", "a,,b,c", "--duplicate_stderr_filters=err", "train.py"],
    ["--logs-specs", "default", "--numa-binding", "node", "train.py"],
    ["--logs_specs=x", "--numa_binding=core-complex", "train.py"],
    ["--signals-to-handle", "SIGTERM", "--shutdown-timeout", "30", "--virtual-local-rank", "train.py"],
    ["--signals_to_handle=SIGUSR1,SIGTERM", "--shutdown_timeout=5", "--virtual_local_rank", "train.py"],
    ["--event-log-handler", "console", "--role", "trainer", "--local-addr", "10.0.0.2", "train.py"],
    ["--event_log_handler=null", "--local_addr=h", "--no_python", "echo", "hi"],
    ["--nproc-per-node", "2", "--nproc_per_node", "4", "train.py"],
    ["--standalone", "--standalone", "t.py"],
    ["--nnodes", "", "--max-restarts", " 3 ", "train.py"],
    ["--nnodes=", "train.py"],
    ["--nproc-per-node", "2", "train.py", "--nproc-per-node", "4", "--nnodes=3", "--role"],
    ["train.py", "-m", "x", "--master-port=1", "--h", "--help", "-r3", "-h"],
    ["train.py", "--lr=0.1", "--batch-size", "32", "-v", "--", "--no", "--nproc"],
    ["train.py", "x", "--", "y"],
    ["/abs/path/train.py", "--data", "/d", "--seed", "1", "--model", "gpt2", "--local_rank", "0"],
    ["examples/ddp_demo.py", "--steps", "40", "--scenario", "input_hang", "--hang-rank", "2"],
    ["t", "-1", "-"],
    ["--no-python", "x"],
]


def test_realistic_command_lines_parse_like_torch():
    env = clean_env()
    for args in REALISTIC:
        ours = hand(args, env)
        assert ours is not None, args
        assert ours.values == torch_parse(args, env), args
        if not ours.values["no_python"] or ours.values["run_path"]:
            check_rewrite(args, ta.inject_hooks(args, env), env)


@pytest.mark.parametrize(
    "pet",
    [
        {"PET_NPROC_PER_NODE": "4", "PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_PORT": "29501"},
        {"PET_MODULE": "1", "PET_RDZV_ID": "from-env", "PET_MASTER_ADDR": "10.1.1.1"},
        {"PET_RUN_PATH": "1", "PET_MODULE": "1"},
        {"PET_STANDALONE": "0", "PET_MAX_RESTARTS": "2", "PET_MONITOR_INTERVAL": "1.5"},
        {"PET_DUPLICATE_STDOUT_FILTERS": "a,,b", "PET_START_METHOD": "thread"},  # no choices check on defaults
        {"PET_NUMA_BINDING": "bogus", "PET_LOGS_SPECS": "x"},  # not env actions: ignored
        {"PET_NODE_RANK": ""},
    ],
)
def test_pet_environment_defaults_as_torch_applies_them(pet):
    env = clean_env(**pet)
    lines = (["train.py", "--x"], ["--node-rank", "0", "--master-port=1234", "-m", "pkg"], ["--standalone", "t.py"])
    for args in lines:
        theirs = torch_parse(args, env)
        try:
            ours = hand(args, env)
        except UserError:  # refused at once, as torch's parser refuses it
            assert theirs is None, (pet, args)
            continue
        if theirs is None:  # e.g. PET_NODE_RANK="" is not an int: the hand parser must not vouch for it
            assert ours is None
            continue
        assert ours is not None and ours.values == theirs, (pet, args)
        if not ours.values["no_python"]:
            check_rewrite(args, ta.inject_hooks(args, env), env)


UNSURE = [
    ["--nnode", "2", "t.py"],  # abbreviation
    ["--nproc", "2", "t.py"],  # ambiguous abbreviation
    ["-r3", "t.py"],
    ["-mt3", "t.py"],
    ["-h"],
    ["--help", "t.py"],
    ["--", "t.py"],
    ["t.py", "--", "x"],
    ["--master-port", "-1", "t.py"],
    ["--standalone=1", "t.py"],
    ["--nproc-per-node", "2"],
    ["--log-dir"],
    [],
    ["t.py", "--no", "1"],
    ["t.py", "--master=1"],
    ["t.py", "--local"],
    ["-1", "t.py"],
]


def test_an_option_this_torch_lacks_is_refused_by_hand_and_left_to_another_torch():
    """torch's own parser, in this torch, refuses an option no option string starts with: so does the hand
    parser, at once; under another torch (which may have added it) torch's parser decides."""
    args = ["--some-option-of-a-newer-torch", "t.py"]
    child = subprocess.run([sys.executable, "-m", "torch.distributed.run", *args], capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == 2 and "unrecognized arguments: --some-option-of-a-newer-torch" in child.stderr
    with pytest.raises(UserError, match="torchrun has no option '--some-option-of-a-newer-torch'"):
        ta._hand_parse(args, clean_env())
    with mock.patch.object(ta, "_installed_torch", return_value="2.14.0"):
        assert hand(args, clean_env()) is None
    assert hand(["--nnode", "1", "t.py"], clean_env()) is None  # an abbreviation: argparse decides


REFUSED = [
    ["--max-restarts", "x", "t.py"],
    ["--monitor-interval", "soon", "t.py"],
    ["--start-method", "thread", "t.py"],
    ["--numa-binding", "bogus", "t.py"],
]


def test_a_value_this_torch_refuses_is_refused_at_once():
    for args in REFUSED:
        assert torch_parse(args, clean_env()) is None, args
        with pytest.raises(UserError, match="torchrun rejected the arguments: "):
            ta._hand_parse(args, clean_env())
        with mock.patch.object(ta, "_installed_torch", return_value="2.14.0"):
            assert hand(args, clean_env()) is None, args  # another torch's parser decides


def test_the_hand_parser_declines_what_it_cannot_vouch_for():
    env = clean_env()
    for args in UNSURE:
        assert hand(args, env) is None, args
    assert hand(["t.py"], clean_env(PET_MODULE="yes")) is None  # torch raises ValueError building its parser


VALID = {"str": ["2", "gpu", "a=b", "1:4", "", "host:29400", "x y"], "int": ["0", "3", " 3 ", "29500"],
         "float": ["0.5", "1", "1e-1"], "csv": ["a,,b", "x", ""]}
ODD = ["x", "", "-1", "a=b", "fork", "thread", " 3 ", "0.5", "node", "--", "-m", "inf", "1_0"]
JUNK = ["--nnode", "-r3", "--", "-h", "--nproc", "--unknown", "-mt", "-", "--master-port=x", "--standalone=0"]
SCRIPTS = ["t.py", "pkg.mod", "", "dir/a b.py", "t", "x=y.py"]
ODD_SCRIPTS = ["-x.py", "--", "-m", "-1"]
SCRIPT_ARGS = ["--lr", "0.1", "--no", "--nnodes", "--nnodes=2", "--h", "--", "-m", "x", "--master", "--local=1",
               "-r3", "--help", "--role", "--nproc-per-node", "-", "--n=", "--x=--no"]
PETS = {"PET_NPROC_PER_NODE": ["4", "gpu"], "PET_MASTER_PORT": ["29501", "x"], "PET_MODULE": ["1", "0"],
        "PET_RUN_PATH": ["1"], "PET_MAX_RESTARTS": ["2", "bad"], "PET_NNODES": ["2", "1:1"]}


@st.composite
def command_lines(draw: st.DrawFn) -> tuple[list[str], dict[str, str]]:
    args: list[str] = []
    for _ in range(draw(st.integers(0, 6))):
        if draw(st.integers(0, 19)) == 0:
            args.append(draw(st.sampled_from(JUNK)))
            continue
        opt = draw(st.sampled_from(ta.OPTIONS))
        name = draw(st.sampled_from(opt.names))
        if opt.kind == "flag":
            args.append(name)
        else:
            good = list(opt.choices or VALID[opt.kind])
            value = draw(st.sampled_from(good if draw(st.integers(0, 3)) else ODD))
            args += [f"{name}={value}"] if draw(st.booleans()) else [name, value]
    if draw(st.integers(0, 9)):
        args.append(draw(st.sampled_from(SCRIPTS if draw(st.integers(0, 7)) else ODD_SCRIPTS)))
        args += draw(st.lists(st.sampled_from(SCRIPT_ARGS), max_size=5))
    pet = draw(st.dictionaries(st.sampled_from(sorted(PETS)), st.just(""), max_size=2))
    return args, {k: draw(st.sampled_from(PETS[k])) for k in pet}


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(command_lines())
def test_generated_command_lines_hand_parser_is_never_wrong(case):
    """Whenever the hand parser answers, torch's parser accepts the line and reads it the same way, and the
    rewrite means the same to torchrun; whenever it refuses the line, so does torch's parser."""
    args, pet = case
    env = clean_env(**pet)
    try:
        ours = hand(args, env)
    except UserError:
        assert torch_parse(args, env) is None, args
        return
    if ours is None:
        return
    assert ours.values == torch_parse(args, env), args
    if not ours.values["no_python"] or ours.values["run_path"]:
        check_rewrite(args, ta.inject_hooks(args, env), env)


# -- torch's parser in a child ---------------------------------------------------------------------------
def test_torch_child_reads_like_the_hand_parser():
    env = clean_env(PET_MASTER_PORT="29511")
    for args in (REALISTIC[4], ["--module", "--nproc-per-node", "2", "--tee=3", "pkg.train", "-m", "x"]):
        ours, child = ta._hand_parse(args, env), ta._torch_parse(args, env)
        assert child.via == "torch"
        assert (child.values, child.head, child.sep) == ({k: ours.values[k] for k in ta.FIELDS}, ours.head, ours.sep)


@pytest.mark.parametrize(
    "args",
    [
        ["--nnode", "1", "-m", "pkg.train", "a"],  # abbreviation: torch's parser resolves it
        ["--", "t.py", "--no", "1"],  # after `--`: torchrun never matches --no
        ["-m", "pkg", "--", "x"],  # the `--` is swallowed: pkg gets ['x']
    ],
)
def test_lines_the_hand_parser_declines_are_read_by_torch(args, monkeypatch):
    env = clean_env()
    # the parse inject_hooks does itself, recorded: one torch child per line (each is a torch start-up)
    parsed: list[ta.Parsed] = []
    real = ta.parse
    monkeypatch.setattr(ta, "parse", lambda a, e=None: parsed.append(real(a, e)) or parsed[-1])
    cmd = ta.inject_hooks(args, env)
    assert [p.via for p in parsed] == ["torch"]
    check_rewrite(args, cmd, env)


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--nproc", "2", "t.py"], "ambiguous option: --nproc could match --nproc-per-node, --nproc_per_node"),
        (["--max-restarts", "x", "t.py"], "argument --max-restarts/--max_restarts: invalid int value: 'x'"),
        (["--nproc-per-node", "2"], "the following arguments are required: training_script"),
    ],
)
def test_torchrun_errors_are_torchruns_own(args, why):
    with pytest.raises(UserError) as err:
        ta.inject_hooks(args, clean_env())
    assert str(err.value).startswith("torchrun rejected the arguments: ")
    assert why in str(err.value) and "\n" not in str(err.value)


def test_help_is_printed_and_nothing_runs(capsys):
    with pytest.raises(UserError, match="help"):
        ta.inject_hooks(["--help"], clean_env())
    assert "--nproc-per-node" in capsys.readouterr().out


def fake_child(monkeypatch, stdout: str, code: int = 0) -> None:
    def run(cmd, **kw):
        return subprocess.CompletedProcess(cmd, code, stdout, "Traceback ...\nSomeError: boom\n")

    monkeypatch.setattr(ta.subprocess, "run", run)


def child_says(values: dict) -> str:
    return ta._MARK + json.dumps({"values": {k: None for k in ta.FIELDS} | values})


def test_child_results_are_checked(monkeypatch):
    fake_child(monkeypatch, child_says({"training_script": "t.py", "training_script_args": ["x"]}))
    parsed = ta._torch_parse(["--a", "t.py", "x"], {})
    assert (parsed.head, parsed.sep) == (["--a"], False)
    parsed = ta._torch_parse(["--a", "t.py", "--", "x"], {})  # the `--` was swallowed
    assert (parsed.head, parsed.sep) == (["--a"], True)
    with pytest.raises(UserError, match="cannot find the training script"):
        ta._torch_parse(["--a", "other.py", "x"], {})
    fake_child(monkeypatch, ta._MARK + json.dumps({"exit": 2, "error": "ModuleNotFoundError: No module named 'torch'"}))
    with pytest.raises(UserError, match="No module named 'torch'"):
        ta._torch_parse(["--a", "t.py"], {})
    fake_child(monkeypatch, "garbage", code=1)
    with pytest.raises(UserError, match=r"cannot run torch's argument parser .*: SomeError: boom"):
        ta._torch_parse(["--a", "t.py"], {})


# -- the CLI -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--", "--no-python", "x"], "--no-python runs a non-Python program"),
        (["--out", "o"], "missing torchrun arguments"),
        (["--"], "missing torchrun arguments"),
    ],
)
def test_bad_torchrun_arguments_are_one_line_and_exit_2(tmp_path, argv, message):
    res = subprocess.run(rankwatch_cmd("run", *argv), capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and message in res.stderr, res.stderr
    assert res.stderr.startswith("rankwatch run: ")


# -- torch stays out of the watchdog -----------------------------------------------------------------------
def test_run_import_graph_and_parsing_do_not_import_torch():
    code = textwrap.dedent(
        f"""
        import sys
        import rankwatch.watchdog.cli.main
        from rankwatch.watchdog.cli import run
        from rankwatch.watchdog.cli.torchrun_args import inject_hooks
        run.build_parser().parse_args(["--out", "o", "--stall-timeout", "5"])
        for args in {REALISTIC!r}:
            try:
                inject_hooks(args)
            except Exception as exc:
                assert "--no-python" in str(exc), exc
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
        """
    )
    env = clean_env()
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


JOB = """
import json, os, sys, time
marker, release = sys.argv[1], sys.argv[2]
with open(marker + ".tmp", "w") as f:
    json.dump({"hooked": "rankwatch.hooks.api" in sys.modules, "argv": sys.argv[1:]}, f)
os.replace(marker + ".tmp", marker)
deadline = time.monotonic() + 60
while not os.path.exists(release) and time.monotonic() < deadline:
    time.sleep(0.1)
"""


@pytest.mark.parametrize("extra", [[], ["--run-path"]], ids=["python", "run-path"])
def test_rankwatch_run_watchdog_does_not_map_torch_while_the_job_runs(procs, tmp_path, extra):
    import psutil

    script = tmp_path / "job.py"
    script.write_text(JOB)
    marker, release = tmp_path / "started.json", tmp_path / "release"
    torchrun = ["--nproc-per-node", "1", "--monitor-interval", "0.2", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "notorch", *extra,
                str(script), str(marker), str(release)]
    cmd = rankwatch_cmd("run", "--out", str(tmp_path / "out"), "--shm-dir", str(tmp_path / "shm"), "--quiet", "--",
                        *torchrun)
    proc = procs.start(cmd, text=True, cwd=REPO, env=clean_env())
    try:
        assert wait_for(lambda: marker.exists() or proc.poll() is not None, timeout=120), "job did not start"
        assert proc.poll() is None, proc.communicate()
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        rss_mib = psutil.Process(proc.pid).memory_info().rss / 2**20
        # the rank itself did load the hook, with the script's own arguments
        started = json.loads(marker.read_text())
        assert started == {"hooked": True, "argv": [str(marker), str(release)]}
    finally:
        release.touch()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "libtorch" not in maps
    assert rss_mib < 120, rss_mib  # torch alone is ~200 MiB; the watchdog is ~40-60


def test_the_hook_main_path_is_the_hook_module():
    assert Path(ta.hook_main_path()).resolve() == (REPO / "hooks" / "__main__.py").resolve()
