"""Rewriting a torchrun command line so every rank starts through ``-m rankwatch.hooks``.

The hook module is inserted right before the training script, so the user's torchrun options and the
script's arguments pass through untouched. Finding the script means parsing torchrun's command line, and
this runs in ``rankwatch run``'s watchdog process, which lives as long as the job: importing
``torch.distributed.run`` for its ``get_args_parser()`` kept torch mapped on every node for the whole run
(230 MiB RSS against 36 MiB without it: benchmarks/bench_footprint.py). So torch is never imported here.
Two parsers, one of which always decides:

1. **A hand parser** (``_hand_parse``) for the grammar torchrun's command lines use in practice: the
   option strings of torch 2.13's ``get_args_parser()``, verbatim (dash and underscore spellings,
   ``-m``/``-r``/``-t``), each as ``--opt value`` or ``--opt=value``; flags without a value; the first
   token that is not an option or an option's value is the training script, and everything after it
   belongs to the script. ``PET_<DEST>`` environment defaults are applied the way torch's ``env`` /
   ``check_env`` actions do (torchrun sees the same environment), and typed values (int, float,
   choices) are checked the way argparse would.
2. **torch's own parser in a short-lived child** (``_torch_parse``: ``python -c …`` prints the parsed
   namespace as JSON and exits, so torch never enters the watchdog; 1.5–2.5 s). The hand parser hands the
   command line over whenever it cannot vouch for the answer: an option it does not know (one that a
   newer torch added, an abbreviation such as ``--nnode``, bundled short options such as ``-r3``, ``-h``,
   a bare ``--``), a value that starts with ``-``, a value that fails its type or choices, a missing
   script, a ``--`` right after the script (argparse swallows it), or a script argument that argparse
   would reject as an ambiguous abbreviation of a torchrun option (torchrun itself fails on
   ``train.py --no 1``: argparse matches every token before the first ``--`` against its options).

Why a hybrid rather than either alone: torch's parser in a child is exact for every torch and Python
version but costs a second torch import (1.5–2.5 s) on every start; a hand parser alone is free but
drifts silently when torch adds or changes options. The hybrid is exact whenever it is unsure, and fast
for the command lines it knows; every one of its own answers is a plain exact-match reading that every
argparse version agrees on (abbreviations, whose rules and ambiguity errors differ between Python
versions, are left to argparse). What remains is a known option changing its arity or type in a
future torch: tests/unit/cli/test_torchrun_args.py compares the table with the installed torch's parser option by
option (and fails on options the table lacks, which cost only the child's start-up), and the hand
parser with torch's on many realistic and generated command lines, so such drift fails the tests on the
torch upgrade instead of misplacing the script at run time. Errors torch's parser certainly gives — under
the torch release the table copies (``TABLE_TORCH``) — are given at once in argparse's words (a value
of the wrong type or outside its choices) or as "no such option" (one that no option string starts
with), instead of after a torch import that takes seconds on a loaded node; every other error comes from
torch's parser, in torchrun's own words.

The rewrite: ``HEAD -m rankwatch.hooks [-m] SCRIPT ARGS…`` (the user's ``-m``/``--module`` flags move
after the hook, which runs the module). Where torch's reading involved a bare ``--`` before the script's
arguments, one follows the hook (the hook skips it), so those arguments stay out of torchrun's option
matching as they were. ``--run-path`` makes torchrun ``runpy.run_path`` the script inside its worker
processes (``-m`` is ignored then), so the hook is given as the path of ``rankwatch/hooks/__main__.py``.
``--no-python`` runs a program that is not Python: refused.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from ..errors import UserError

log = structlog.get_logger("rankwatch.run")

HOOK_MODULE = "rankwatch.hooks"
CHILD_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class TorchrunCommand:
    args: list[str]  # arguments for `python -m torch.distributed.run`
    rdzv_id: str | None
    nnodes: str
    node_rank: int
    master_addr: str | None
    master_port: int | None
    nproc_per_node: str
    script: str = ""  # the training script, or the module with ``module``
    module: bool = False
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    standalone: bool = False


# -- torchrun's option grammar (torch 2.13 torch/distributed/run.py get_args_parser) ---------------------
def _csv(value: str) -> list[str]:
    """torchrun's comma_separated_list: ``,,`` stands for a literal comma."""
    placeholder = "<COMMA_PLACEHOLDER>"
    return [item.replace(placeholder, ",") for item in value.replace(",,", placeholder).split(",")]


_CONVERT: dict[str, Callable[[str], Any]] = {"str": str, "int": int, "float": float, "csv": _csv}


@dataclass(frozen=True)
class _Opt:
    names: tuple[str, ...]
    dest: str
    kind: str  # "flag" (check_env: store True, no value) or a key of _CONVERT (one value)
    default: Any = None
    choices: tuple[str, ...] | None = None
    env: bool = True  # default read from PET_<DEST> (torch's env / check_env actions)


def _value(*names: str, kind: str = "str", default: Any = None, **kw: Any) -> _Opt:
    return _Opt(names, names[-1].lstrip("-").replace("-", "_"), kind, default, **kw)


def _flag(*names: str) -> _Opt:
    return _Opt(names, names[-1].lstrip("-").replace("-", "_"), "flag", False)


OPTIONS: tuple[_Opt, ...] = (
    _value("--nnodes", default="1:1"),
    _value("--nproc-per-node", "--nproc_per_node", default="1"),
    _value("--rdzv-backend", "--rdzv_backend", default="static"),
    _value("--rdzv-endpoint", "--rdzv_endpoint", default=""),
    _value("--rdzv-id", "--rdzv_id", default="none"),
    _value("--rdzv-conf", "--rdzv_conf", default=""),
    _flag("--standalone"),
    _value("--max-restarts", "--max_restarts", kind="int", default=0),
    _value("--monitor-interval", "--monitor_interval", kind="float", default=0.1),
    _value("--start-method", "--start_method", default="spawn", choices=("spawn", "fork", "forkserver")),
    _value("--event-log-handler", "--event_log_handler", default="null"),
    _value("--role", default="default"),
    _flag("-m", "--module"),
    _flag("--no-python", "--no_python"),
    _flag("--run-path", "--run_path"),
    _value("--log-dir", "--log_dir"),
    _value("-r", "--redirects", default="0"),
    _value("-t", "--tee", default="0"),
    _value("--local-ranks-filter", "--local_ranks_filter", default=""),
    _value("--duplicate-stdout-filters", "--duplicate_stdout_filters", kind="csv", default=[]),
    _value("--duplicate-stderr-filters", "--duplicate_stderr_filters", kind="csv", default=[]),
    _value("--node-rank", "--node_rank", kind="int", default=0),
    _value("--master-addr", "--master_addr", default="127.0.0.1"),
    _value("--master-port", "--master_port", kind="int"),
    _value("--local-addr", "--local_addr"),
    _value("--logs-specs", "--logs_specs", env=False),
    _value("--numa-binding", "--numa_binding", choices=("node", "socket", "exclusive", "core-complex"), env=False),
    _value("--signals-to-handle", "--signals_to_handle", default="SIGTERM,SIGINT,SIGHUP,SIGQUIT"),
    _value("--shutdown-timeout", "--shutdown_timeout", kind="int"),
    _flag("--virtual-local-rank", "--virtual_local_rank"),
)
_BY_NAME: dict[str, _Opt] = {name: opt for opt in OPTIONS for name in opt.names}
# every option string torch's parser has (for argparse's abbreviation matching), help included; -h/--help
# themselves are left to torch's parser, which prints the help
_ALL_NAMES: tuple[str, ...] = (*_BY_NAME, "-h", "--help")

# what the rewrite and TorchrunCommand need from the parsed namespace
FIELDS = (
    "nnodes",
    "nproc_per_node",
    "rdzv_id",
    "node_rank",
    "master_addr",
    "master_port",
    "module",
    "no_python",
    "run_path",
    "training_script",
    "training_script_args",
    "rdzv_backend",
    "rdzv_endpoint",
    "standalone",
)
# the torch release whose parser OPTIONS copies: there, an option no name starts with is certainly refused
TABLE_TORCH = "2.13."


@dataclass
class Parsed:
    values: dict[str, Any]  # torchrun's namespace (FIELDS at least), training_script(_args) as torchrun reads them
    head: list[str]  # the arguments before the script, less -m/--module (the rewrite adds its own) and a bare `--`
    sep: bool = False  # a bare `--` came before the script's arguments: the rewrite keeps one after the hook
    via: str = "hand"  # which parser answered: "hand" or "torch"


class _Unsure(Exception):
    """The hand parser cannot vouch for its reading of this command line: torch's parser decides."""


def _hand_parse(args: list[str], environ: Mapping[str, str]) -> Parsed:
    values: dict[str, Any] = {}
    for opt in OPTIONS:
        env_value = environ.get(f"PET_{opt.dest.upper()}") if opt.env else None
        if opt.kind == "flag":
            try:
                values[opt.dest] = bool(int(env_value if env_value is not None else "0"))
            except ValueError:
                raise _Unsure(f"PET_{opt.dest.upper()}={env_value!r}") from None  # torch raises ValueError
        else:
            values[opt.dest] = env_value if env_value is not None else opt.default
    given: set[str] = set()
    head: list[str] = []
    i = 0
    while i < len(args) and args[i].startswith("-"):
        arg = args[i]
        spec: _Opt | None = _BY_NAME.get(arg)
        inline = None
        if spec is None and "=" in arg:
            name, inline = arg.split("=", 1)
            spec = _BY_NAME.get(name)
        if spec is None:
            _refuse_if_unknown(arg)
            raise _Unsure(f"unknown option {arg!r}")
        if spec.kind == "flag":
            if inline is not None:
                raise _Unsure(f"a value for the flag {arg!r}")
            values[spec.dest] = True
            if spec.dest != "module":
                head.append(arg)
            i += 1
            continue
        if inline is None:
            if i + 1 >= len(args) or args[i + 1].startswith("-"):
                raise _Unsure(f"{arg} without a plain value")
            raw = args[i + 1]
            head += args[i : i + 2]
            i += 2
        elif inline == "--":  # argparse (3.11) drops it, leaving an empty list as the value
            raise _Unsure(f"{arg}: a bare `--` as the value")
        else:
            raw = inline
            head.append(arg)
            i += 1
        values[spec.dest] = _convert(spec, raw)
        if spec.choices is not None and values[spec.dest] not in spec.choices:
            _refuse_if_this_torch(
                f"argument {'/'.join(spec.names)}: invalid choice: {raw!r} "
                f"(choose from {', '.join(repr(c) for c in spec.choices)})"
            )
            raise _Unsure(f"{arg} {raw!r} not in {spec.choices}")
        given.add(spec.dest)
    if i >= len(args):
        raise _Unsure("no training script")
    if args[i + 1 : i + 2] == ["--"]:  # argparse versions differ on whether the script's `--` is kept
        raise _Unsure("`--` right after the training script")
    for opt in OPTIONS:  # argparse runs string defaults (here: from PET_*) through the option's type
        if opt.kind != "flag" and opt.dest not in given and isinstance(values[opt.dest], str):
            values[opt.dest] = _convert(opt, values[opt.dest])
    for arg in args[i + 1 :]:
        if arg == "--":  # argparse reads no option strings after it
            break
        if arg.startswith("--") and _ambiguous(arg):
            raise _Unsure(f"script argument {arg!r} abbreviates several torchrun options")
    values["training_script"], values["training_script_args"] = args[i], args[i + 1 :]
    return Parsed(values, head)


def _installed_torch() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return ""


def _refuse_if_this_torch(why: str) -> None:
    """A value torch's parser (in the torch OPTIONS copies) certainly refuses: said at once."""
    if _installed_torch().startswith(TABLE_TORCH):
        raise UserError(f"torchrun rejected the arguments: {why}")


def _refuse_if_unknown(arg: str) -> None:
    """``--typo`` that no option string of this torch starts with: argparse refuses it whatever follows, so
    say so at once instead of spending a torch import (seconds on a loaded node) to hear the same."""
    name = arg.split("=", 1)[0]
    if not name.startswith("--") or name == "--" or any(n.startswith(name) for n in _ALL_NAMES):
        return
    if not _installed_torch().startswith(TABLE_TORCH):
        return  # another torch may have this option: its own parser decides
    raise UserError(f"torchrun has no option {name!r} (torchrun --help lists them)")


def _convert(opt: _Opt, raw: str) -> Any:
    try:
        return _CONVERT[opt.kind](raw)
    except (TypeError, ValueError):
        _refuse_if_this_torch(f"argument {'/'.join(opt.names)}: invalid {opt.kind} value: {raw!r}")  # argparse's words
        raise _Unsure(f"{opt.names[0]} {raw!r} is not {opt.kind}") from None


def _ambiguous(arg: str) -> bool:
    """argparse errors on a ``--`` token anywhere before ``--`` that is a prefix of several option strings."""
    if arg in _ALL_NAMES:
        return False
    prefix = arg.split("=", 1)[0]
    if prefix in _ALL_NAMES:
        return False
    return sum(name.startswith(prefix) for name in _ALL_NAMES) > 1


# -- torch's parser, in a child process ------------------------------------------------------------------
_MARK = "\x1erankwatch-torchrun-args\x1e"
_CHILD = r"""
import contextlib, io, json, sys
sys.argv[0] = "torchrun"
out, err = io.StringIO(), io.StringIO()
try:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        from torch.distributed.run import get_args_parser
        ns = get_args_parser().parse_args(sys.argv[1:])
    res = {"values": {k: getattr(ns, k, None) for k in FIELDS}}
except SystemExit as exc:
    res = {"exit": exc.code if isinstance(exc.code, int) else 2, "stdout": out.getvalue(), "stderr": err.getvalue()}
except BaseException as exc:
    res = {"exit": 2, "error": f"{type(exc).__name__}: {exc}", "stderr": err.getvalue()}
sys.__stdout__.write(MARK + json.dumps(res, default=str))
"""


def _torch_parse(args: list[str], environ: Mapping[str, str]) -> Parsed:
    code = f"FIELDS = {FIELDS!r}\nMARK = {_MARK!r}\n{_CHILD}"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, *args],
            env=dict(environ),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"cannot run torch's argument parser ({sys.executable}): {exc}") from exc
    _, mark, payload = proc.stdout.rpartition(_MARK)
    try:
        res = json.loads(payload) if mark else None
    except ValueError:
        res = None
    if not isinstance(res, dict):
        detail = _last_line(proc.stderr) or f"exit code {proc.returncode}"
        raise UserError(f"cannot run torch's argument parser ({sys.executable}): {detail}")
    if "values" not in res:
        if res.get("exit") == 0:  # -h/--help
            sys.stdout.write(res.get("stdout", ""))
            sys.stdout.flush()
            raise UserError("torchrun printed its help; nothing was started")
        if res.get("error"):
            raise UserError(f"torch's argument parser failed: {_last_line(res['error'])}")
        why = _last_line(res.get("stderr", "")).removeprefix("torchrun: error: ")
        raise UserError(f"torchrun rejected the arguments: {shlex.join(args)}" + (f": {why}" if why else ""))
    values: dict[str, Any] = res["values"]
    script, script_args = values.get("training_script"), values.get("training_script_args")
    # where the script is: its arguments end the command line, right after it or after a bare `--`
    # (the first `--` separates; argparse drops it when it touches the script: `t.py -- x` → ['x'])
    n = len(args) - len(script_args) if isinstance(script_args, list) else -1
    if isinstance(script, str) and n >= 1 and args[n:] == script_args and args[n - 1] == script:
        cut, sep = n - 1, False
    elif isinstance(script, str) and n >= 2 and args[n:] == script_args and args[n - 2 : n] == [script, "--"]:
        cut, sep = n - 2, True
    else:
        raise UserError(f"cannot find the training script in the torchrun arguments: {shlex.join(args)}")
    head = args[:cut]
    if head[-1:] == ["--"]:
        head, sep = head[:-1], True
    # an exact -m/--module here is the flag (argparse never takes an option string as a value)
    return Parsed(values, [a for a in head if a not in ("-m", "--module")], sep, via="torch")


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


# -- the rewrite -----------------------------------------------------------------------------------------
def parse(torchrun_args: list[str], environ: Mapping[str, str] | None = None) -> Parsed:
    """torchrun's reading of its command line: the hand parser's, else torch's own (in a child)."""
    env = os.environ if environ is None else environ
    try:
        return _hand_parse(torchrun_args, env)
    except _Unsure as why:
        log.debug("torchrun_args_via_torch", reason=str(why))
        return _torch_parse(torchrun_args, env)


def hook_main_path() -> str:
    import rankwatch.hooks

    return os.path.join(os.path.dirname(os.path.abspath(str(rankwatch.hooks.__file__))), "__main__.py")


def inject_hooks(torchrun_args: list[str], environ: Mapping[str, str] | None = None) -> TorchrunCommand:
    """The torchrun arguments with the hook injected before the training script, and what rankwatch needs
    to know about the job. ``environ``: the environment torchrun will run in (default: this process's)."""
    if not torchrun_args:
        raise UserError("no torchrun arguments after '--' (e.g. -- --nproc-per-node 4 train.py)")
    parsed = parse(torchrun_args, environ)
    v = parsed.values
    if v["run_path"]:  # torchrun run_path()s the script in its workers, ignoring -m and --no-python
        hook = [hook_main_path()]
    elif v["no_python"]:
        raise UserError("--no-python runs a non-Python program: rankwatch's hook cannot be injected")
    else:
        hook = ["-m", HOOK_MODULE]
    # torchrun reads everything after the hook as the hook's arguments; a `--` there (which the hook skips)
    # keeps script arguments that came after a `--` out of torchrun's option matching, as before
    new = [
        *parsed.head,
        *hook,
        *(["--"] if parsed.sep else []),
        *(["-m"] if v["module"] and not v["run_path"] else []),
        v["training_script"],
        *v["training_script_args"],
    ]
    try:
        node_rank = int(v["node_rank"])
    except (TypeError, ValueError):
        node_rank = 0
    rdzv = v["rdzv_id"] if v["rdzv_id"] not in (None, "", "none") else None
    port = v["master_port"]
    return TorchrunCommand(
        args=new,
        rdzv_id=rdzv,
        nnodes=str(v["nnodes"]),
        node_rank=node_rank,
        master_addr=v["master_addr"],
        master_port=int(port) if port is not None else None,
        nproc_per_node=str(v["nproc_per_node"]),
        script=str(v["training_script"]),
        module=bool(v["module"]) and not v["run_path"],
        rdzv_backend=str(v.get("rdzv_backend") or "static"),
        rdzv_endpoint=str(v.get("rdzv_endpoint") or ""),
        standalone=bool(v.get("standalone")),
    )
