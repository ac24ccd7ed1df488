"""The grep-accelerated scan of large files (diagnose/prefilter.py) yields exactly what the chunked
scanner yields: the same candidate lines with the same numbers, whole failure reports, the same line
and byte counts, rank prefixes and head, on every fixture log and on a synthetic mix."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from rankwatch.watchdog.diagnose import events as ev
from rankwatch.watchdog.diagnose import patterns, prefilter
from rankwatch.watchdog.diagnose.parser import SourceParser
from rankwatch.watchdog.diagnose.sources import ScanStats, scan

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "logs"
pytestmark = pytest.mark.skipif(shutil.which("grep") is None, reason="no grep on this machine")


def _scan(path: Path, grep: bool, monkeypatch: pytest.MonkeyPatch, pieces: int = 3) -> tuple[object, ...]:
    """What ``scan`` yields and counts, through grep (``pieces`` of them side by side) or the chunked scanner."""
    monkeypatch.setattr(prefilter, "GREP_MIN_BYTES", 0 if grep else 1 << 62)
    monkeypatch.setattr(prefilter, "PIECE_MIN_BYTES", 1)
    monkeypatch.setattr(prefilter, "workers", lambda: pieces)
    stats, prefixes, head = ScanStats(), set[bytes](), list[bytes]()
    with open(path, "rb") as f:
        lines = list(scan(f, stats, prefixes=prefixes, head=head))
    return lines, stats.bytes, stats.lines, stats.candidates, prefixes, head


def test_needles_come_from_the_pattern_table() -> None:
    keys = prefilter.needles()
    assert keys is not None
    for k in patterns.PREFILTER_EXTRA + patterns.BLOCK_START:
        assert k in keys
    # every line the prefilter's regex accepts holds one of the fixed strings
    for line in (b'  File "train.py", line 3', b"NCCL WARN x", b"RuntimeError: boom", b"NVRM: Xid (PCI:0000)"):
        assert patterns.PREFILTER.search(line)
        assert any(k in line for k in keys)


def test_a_pattern_without_a_literal_turns_the_fast_path_off() -> None:
    assert prefilter.needles(re.compile(rb"Error|\d+ failed"), (), ()) is None
    assert prefilter.needles(re.compile(rb"error", re.IGNORECASE), (), ()) is None
    assert prefilter.ere(re.compile(rb"Error|\d+ failed"), (), ()) is None
    assert prefilter.ere(re.compile(rb"Error"), (b"a\nb",), ()) is None  # grep -e would split it in two


def _grep_lines(pattern: bytes, lines: list[bytes], tmp_path: Path) -> set[bytes]:
    path = tmp_path / "lines.log"
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    out = subprocess.run([b"grep", b"-E", b"-a", b"-e", pattern, bytes(path)], capture_output=True,
                         env={"LC_ALL": "C", "PATH": "/usr/bin:/bin"}, check=False).stdout
    return set(out.splitlines())


def test_the_grep_regex_drops_nccl_info_and_keeps_every_other_nccl_line(tmp_path: Path) -> None:
    pattern = prefilter.ere()
    assert pattern is not None
    lines = [b"[3] NCCL INFO Channel 03/0", b"NCCL INFO", b"[3] NCCL WARN x", b"NCCL", b"NCCL INF", b"NCCL INFX",
             b"NCCLX", b"ProcessGroupNCCL.cpp:1 NCCL INFO and NCCL error", b"x NCCL INFO y Error", b"step 3 loss 1",
             b"NCCL  INFO", b'  File "a.py", line 1', b"Root Cause (first observed failure):", b"training complete"]
    got = _grep_lines(pattern, lines, tmp_path)
    assert got == {ln for ln in lines if patterns.prefilter_accepts(ln)}  # exact for these: no line to recheck


def test_whatever_follows_a_literal_only_narrows_the_grep_regex(tmp_path: Path) -> None:
    """Constructs grep is not given (a class, a repeat, a lookbehind) are dropped: a superset, rechecked."""
    table = re.compile(rb"Err(?:or|no)\d+|Warn(?![0-9]+x)|Foo(?!bar)baz|Qz.b(?<!q)")
    extra = (b"x[y]*", b"$(z)")
    pattern = prefilter.ere(table, extra, ())
    assert pattern is not None
    lines = [b"Error7", b"Errno", b"Warn12x", b"Warn", b"Foobaz", b"Qz.b", b"Qzb", b"x[y]*", b"$(z)", b"xy", b"z",
             b"Qa", b"Er", b"Fo"]
    got = _grep_lines(pattern, lines, tmp_path)
    assert got >= {ln for ln in lines if table.search(ln) or any(k in ln for k in extra)}
    assert got == {b"Error7", b"Errno", b"Warn12x", b"Warn", b"Foobaz", b"Qz.b", b"Qzb", b"x[y]*", b"$(z)"}


def test_every_fixture_line_the_parser_uses_passes_the_grep_prefilter(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the pattern table reads (the parser fed every line) reaches it through grep too: a pattern added to
    the table without a keyword of its own would fail here, not be silently dropped on large logs."""
    monkeypatch.setattr(prefilter, "GREP_MIN_BYTES", 0)
    files = [p for p in sorted(FIXTURES.rglob("*")) if p.is_file() and p.suffix in (".log", ".txt", ".out")]
    assert files
    for path in files:
        full = SourceParser("x")
        needed = {
            e.line
            for i, line in enumerate(path.read_bytes().decode(errors="replace").splitlines(), 1)
            for e in full.feed(i, line)
            if e.family != ev.TRACEBACK  # reported at a frame line, which the scan keeps via 'File "'
        }
        with open(path, "rb") as f:
            kept = {n for n, _ in scan(f, ScanStats())}
        assert needed <= kept, (path, sorted(needed - kept))


def test_same_lines_as_the_chunked_scanner_on_every_fixture(monkeypatch: pytest.MonkeyPatch) -> None:
    files = sorted(p for p in FIXTURES.rglob("*") if p.is_file())
    assert files
    for path in files:
        slow = _scan(path, False, monkeypatch)
        for pieces in (1, 3):
            assert _scan(path, True, monkeypatch, pieces) == slow, (path, pieces)


def test_same_lines_on_a_mixed_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    body = [b"[default0]:[rank0]:step %d loss 1.0\n" % i for i in range(3000)]
    body[100] = b"[default1]:gpu:1:1 [1] NCCL INFO Channel 00\n"  # a keyword the regex then refuses
    body[200] = b"[default1]:[rank1]: RuntimeError: CUDA error\n"
    body[300] = b"x" * 100_000 + b" Error at the end of an overlong line\n"
    body[400:400] = [b"Failures:\n", b"[1]:\n", b"  rank      : 1 (local_rank: 1)\n", b"  exitcode  : -6\n",
                     b"====\n", b"after the report\n"]
    path = tmp_path / "mixed.log"
    path.write_bytes(b"".join(body) + b"training complete, no newline at the end")
    fast = _scan(path, True, monkeypatch)
    assert fast == _scan(path, False, monkeypatch)
    for pieces in (1, 2, 5, 64):  # the report and the overlong line fall on piece boundaries in some of these
        assert _scan(path, True, monkeypatch, pieces) == fast, pieces
    lines = dict(fast[0])  # type: ignore[call-overload]
    assert b"  rank      : 1 (local_rank: 1)" in lines.values()  # the report's field lines, read whole
    assert not any(b"NCCL INFO" in v for v in lines.values())
    assert fast[2] == len(body) + 1  # the last line has no newline


@pytest.mark.parametrize("tail", [b"", b"\n", b"plain tail without a newline", b"plain tail\n" * 5000])
@pytest.mark.parametrize("pieces", [1, 2, 4])
def test_line_counts_across_pieces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tail: bytes, pieces: int
) -> None:
    """Each grep's piece is numbered by the sentinel line fed after it: the same totals as the scanner."""
    for head in (b"", b"step 1\n" * 300, b"step 1\nRuntimeError: x\nstep 2\n", b"RuntimeError: no newline"):
        path = tmp_path / "t.log"
        path.write_bytes(head + tail)
        if path.stat().st_size == 0:
            continue
        fast, slow = _scan(path, True, monkeypatch, pieces), _scan(path, False, monkeypatch)
        assert fast[:4] == slow[:4], (head[:40], tail[:40])  # lines, bytes, line count, candidates



@pytest.mark.parametrize("script", ["exit 2", "echo 'usage: grep [-abcEFnv]' >&2; exit 2", "cat >/dev/null; echo 1:x"])
def test_a_grep_that_cannot_do_this_leaves_it_to_the_scanner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str
) -> None:
    """A grep without these options (BusyBox, BSD) or with another output format: the same lines, not an error."""
    fake = tmp_path / "grep"
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(0o755)
    monkeypatch.setattr(prefilter, "_grep", lambda: str(fake))
    path = tmp_path / "mixed.log"
    path.write_bytes(b"step 1\n" * 1000 + b"[rank1]: RuntimeError: boom\nstep 2\n")
    assert _scan(path, True, monkeypatch) == _scan(path, False, monkeypatch)


def test_gnu_grep_passes_the_check() -> None:
    """Else every comparison above would compare the scanner with itself."""
    grep = prefilter._grep()
    assert grep is not None
    version = subprocess.run([grep, "--version"], capture_output=True, text=True, check=False).stdout
    if "GNU" not in version:
        pytest.skip("not GNU grep")
    pattern = prefilter.ere()
    assert pattern is not None and prefilter._grep_works(grep, pattern)
