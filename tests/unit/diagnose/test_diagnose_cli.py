"""`rankwatch diagnose` end to end, as a user runs it (the installed console script)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

LOGS = Path(__file__).resolve().parents[2] / "fixtures" / "logs"


def run(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["rankwatch", "diagnose", *args],
        input=stdin.decode("utf-8", "replace") if stdin is not None else None,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_text_names_the_initiator() -> None:
    p = run(str(LOGS / "torchrun_tee/dead_rank_r2.log"))
    assert p.returncode == 0, p.stderr
    first = p.stdout.splitlines()[0]
    # the live verdict's headline (one renderer for live and offline)
    assert first.startswith("DEAD RANK — initiating rank 2"), first
    assert "dead_rank_r2.log:87:" in p.stdout  # evidence as file:line
    assert "next:" in p.stdout and "other ranks:" in p.stdout


def test_json_is_a_verdict() -> None:
    p = run("--json", str(LOGS / "templated/nccl_optype_mismatch_r1.log"))
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["schema"] == "rankwatch.verdict/1"
    assert doc["source"] == "logs"
    assert doc["kind"] == "collective_mismatch"
    assert doc["initiating_ranks"] == [1]
    assert doc["detected_after_s"] is None and doc["job_id"] is None
    assert doc["ranks"]["1"]["collective"] == {"seq": 57, "op": "BROADCAST"}
    assert doc["ranks"]["0"]["gpu_util"] is None
    assert all(e.split(":", 2)[1].isdigit() for e in doc["evidence"])


def test_stdin() -> None:
    data = (LOGS / "torchrun_tee/input_hang_r1.log").read_bytes()
    p = run("--json", "-", stdin=data)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["initiating_ranks"] == [1] and doc["kind"] == "hang"
    assert doc["evidence"][0].startswith("-:")


def test_directory_argument() -> None:
    p = run(str(LOGS / "logdir_input_hang_r3"))
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("HANG — initiating rank 3")
    assert "read 9 source(s)" in p.stdout


def test_undecided_exit_code_and_wording() -> None:
    p = run(str(LOGS / "torchrun_tee/size_mismatch_large.log"))
    assert p.returncode == 1
    assert "cannot decide" in p.stdout and "what would decide:" in p.stdout


def test_missing_file_is_one_line_exit_2() -> None:
    p = run(str(LOGS / "no-such.log"))
    assert p.returncode == 2
    assert p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1
    assert "no such file" in p.stderr


def test_bad_option_is_one_line_exit_2() -> None:
    p = run("--bogus", "x")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1


def assert_not_a_log(p: subprocess.CompletedProcess[str], name: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stdout[:300], p.stderr)
    assert p.stdout == "" and "Traceback" not in p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith(f"rankwatch diagnose: {name}") and "is not a log" in line, line


def test_a_binary_file_is_refused_as_not_a_log(tmp_path: Path) -> None:
    """Was: "undecided" (exit 1) or even a verdict from words found in random bytes: a file that is not text
    (``TextPolicy``) is one line and exit 2, as any other bad input."""
    exe = tmp_path / "true"
    shutil.copyfile("/bin/true", exe)
    p = run(str(exe))
    assert_not_a_log(p, str(exe))
    assert "binary data" in p.stderr
    blob = tmp_path / "core.bin"  # random bytes, with a log line's words inside
    blob.write_bytes(os.urandom(300_000) + b"\x00RuntimeError: \xff\xfe Traceback\n" + os.urandom(1000))
    assert_not_a_log(run(str(blob)), str(blob))
    zeros = tmp_path / "zeros.log"
    zeros.write_bytes(bytes(100_000))
    assert_not_a_log(run(str(zeros)), str(zeros))


def test_a_log_with_a_few_odd_bytes_is_still_read(tmp_path: Path) -> None:
    """Odd bytes in a real log (a Latin-1 name, a NUL, a bell, a cut UTF-8 character, a progress bar's \\r) and a
    hole of NULs that logrotate's copytruncate left at its start: still a log, still the same verdict."""
    lines = (LOGS / "torchrun_tee/dead_rank_r2.log").read_bytes().splitlines(keepends=True)
    odd = tmp_path / "odd.log"
    odd.write_bytes(b"".join(lines[:3]) + b"user caf\xe9 \x00 \x07 \xe2\x82 40%|####\r" + b"\n" + b"".join(lines[3:]))
    holed = tmp_path / "rotated.log"
    holed.write_bytes(bytes(200_000) + b"".join(lines))
    for log in (odd, holed):
        p = run(str(log))
        assert p.returncode == 0, p.stderr
        assert p.stdout.startswith("DEAD RANK — initiating rank 2"), p.stdout[:300]


def test_a_binary_file_in_a_log_directory_is_skipped(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    shutil.copytree(LOGS / "logdir_input_hang_r3", logs)
    shutil.copyfile("/bin/true", logs / "core")  # a core file, no telling extension
    p = run(str(logs))
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("HANG — initiating rank 3") and "read 9 source(s)" in p.stdout


def test_several_sources_at_once() -> None:
    p = run(str(LOGS / "templated/ecc_r1/slurm-771.out"), str(LOGS / "templated/ecc_r1/dmesg.txt"))
    assert p.returncode == 0 and "— initiating rank 1" in p.stdout.splitlines()[0]
    assert "Xid 48" in p.stdout or "Xid (PCI" in p.stdout


def test_a_whole_node_lost_at_once_is_undecided() -> None:
    # 4 nodes x 2 ranks, node 2 (ranks 4, 5) SIGKILLed with its agent: its console is empty, rank 7 was torn
    # down by its agent before it printed; the rest lost a peer. Was: "dead_rank [7]" (a healthy survivor).
    p = run("--json", str(LOGS / "console/node_lost_4n"))
    assert p.returncode == 1, p.stderr  # undecided
    doc = json.loads(p.stdout)
    assert (doc["initiating_ranks"], doc["decided"], doc["confidence"]) == ([], False, "low")
    assert doc["finding"]["rule"] == "outside"
    assert doc["finding"]["data"]["unseen"] == [4, 5]  # never printed a line, yet they exist
    assert doc["finding"]["data"]["silent"] == [4, 5, 7]
    text = run(str(LOGS / "console/node_lost_4n")).stdout
    assert "— initiating no single rank" in text.splitlines()[0] and "rank 7" in text.splitlines()[1]
