"""The grep-accelerated scan of large files (diagnose/prefilter.py) yields exactly what the chunked
scanner yields: the same candidate lines with the same numbers, whole failure reports, the same line
and byte counts, rank prefixes and head, on every fixture log and on a synthetic mix."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from rankwatch.watchdog.diagnose import patterns, prefilter
from rankwatch.watchdog.diagnose.sources import ScanStats, scan

FIXTURES = Path(__file__).parent / "fixtures" / "logs"
pytestmark = pytest.mark.skipif(shutil.which("grep") is None, reason="no grep on this machine")


def _scan(path: Path, grep: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[object, ...]:
    monkeypatch.setattr(prefilter, "GREP_MIN_BYTES", 0 if grep else 1 << 62)
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


def test_same_lines_as_the_chunked_scanner_on_every_fixture(monkeypatch: pytest.MonkeyPatch) -> None:
    files = sorted(p for p in FIXTURES.rglob("*") if p.is_file())
    assert files
    for path in files:
        assert _scan(path, True, monkeypatch) == _scan(path, False, monkeypatch), path


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
    lines = dict(fast[0])  # type: ignore[call-overload]
    assert b"  rank      : 1 (local_rank: 1)" in lines.values()  # the report's field lines, read whole
    assert not any(b"NCCL INFO" in v for v in lines.values())
    assert fast[2] == len(body) + 1  # the last line has no newline
