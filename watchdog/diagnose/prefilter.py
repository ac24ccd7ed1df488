"""Candidate lines of a large log file at disk speed: ``grep -F`` finds the lines holding a keyword.

Python's fastest searches cover one keyword per pass (``bytes.find``, ~0.5–1 GB/s) or run an
alternation at ~150–300 MB/s (``re``); a log of hundreds of megabytes with twenty keywords then takes
seconds. GNU grep searches every fixed string in one pass (~1 GB/s) in its own process, in parallel
with this one, which counts the lines and parses the few candidates. The keywords are derived from the
pattern table itself (``needles``): the leading literal of every alternative of ``PREFILTER`` plus
``PREFILTER_EXTRA`` and ``BLOCK_START``, so a pattern added there is covered without a second list;
a line grep hands back is still checked with ``prefilter_accepts`` (a keyword like ``NCCL`` stands for
``NCCL(?! INFO)``). torch elastic's failure report is read whole from the file after its first line,
as the chunked scanner does. Used for regular files of ``GREP_MIN_BYTES`` or more where grep exists;
anything else (stdin, pipes, small files, no grep, a pattern without a literal) goes through
``sources.scan``, which yields the same lines. Memory stays bounded: grep's output is read line by
line, each cut at ``max_line``.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Iterator
from typing import Any, BinaryIO

from .patterns import BLOCK_END, BLOCK_START, PREFILTER, PREFILTER_EXTRA, prefilter_accepts

GREP_MIN_BYTES = 16 << 20  # below this the chunked scanner is as quick (grep's start-up ~2 ms)
WC_MIN_BYTES = 8 << 20  # a tail after grep's last line longer than this is counted by wc -l (~4x Python)
_PIECE = 1 << 20  # bytes per read of a failure report or of the line count


def _leading_literal(branch: Any) -> bytes:
    out = bytearray()
    for op, arg in branch:
        if str(op) != "LITERAL":
            break
        out.append(arg)
    return bytes(out)


def _branches(pattern: re.Pattern[bytes]) -> list[Any]:
    from re import _parser  # type: ignore[attr-defined]  # the stdlib's own parser, stable since 3.11

    parsed = _parser.parse(pattern.pattern, pattern.flags)
    items = list(parsed)
    if len(items) == 1 and str(items[0][0]) == "BRANCH":
        return list(items[0][1][1])
    return [items]


def _parsed(prefilter: re.Pattern[bytes]) -> list[Any] | None:
    """The alternatives of the prefilter as the stdlib parser sees them; None where grep cannot stand in for it
    (case-insensitive, or an alternative without a leading literal)."""
    if prefilter.flags & re.IGNORECASE:
        return None
    try:
        branches = _branches(prefilter)
    except Exception:
        return None
    lits = [_leading_literal(b) for b in branches]
    if not lits or any(not lit or b"\n" in lit or b"\0" in lit for lit in lits):
        return None
    return branches


@functools.cache
def needles(
    prefilter: re.Pattern[bytes] = PREFILTER,
    extra: tuple[bytes, ...] = PREFILTER_EXTRA,
    blocks: tuple[bytes, ...] = BLOCK_START,
) -> tuple[bytes, ...] | None:
    """Fixed strings such that every line the prefilter accepts holds one; None when an alternative has no
    leading literal (or the pattern is case-insensitive), so only the exact scanner is safe."""
    branches = _parsed(prefilter)
    if branches is None:
        return None
    return tuple(dict.fromkeys((*map(_leading_literal, branches), *extra, *blocks)))


_ERE_SPECIAL = frozenset(b".[]()*+?{}|^$\\")


def _ere_literal(lit: bytes) -> bytes:
    return b"".join(b"\\" + bytes([c]) if c in _ERE_SPECIAL else bytes([c]) for c in lit)


def _ere_not_followed(lit: bytes) -> bytes:
    """ERE for "then not ``lit``" at the end of an alternative, as ``(?!lit)`` reads within one line: the line
    ends, or differs from ``lit`` at some byte. (?! INFO) -> ($|[^ ]| ($|[^I])| I($|[^N])|…)."""
    alts = []
    for i, c in enumerate(lit):
        other = b"[^]]" if c == ord("]") else b"[^" + bytes([c]) + b"]"  # one byte: no range, no class
        alts.append(_ere_literal(lit[:i]) + b"($|" + other + b")")
    return b"(" + b"|".join(alts) + b")"


def _ere_branch(branch: Any) -> bytes:
    """A superset of what one alternative matches, in ERE: its leading literal, and a negative lookahead of a
    literal right after it where the alternative ends with one (``NCCL(?! INFO)``: NCCL_DEBUG=INFO prints
    millions of such lines; grep drops them). Anything else after the literal only narrows the match, and
    every line grep hands back is checked again with ``prefilter_accepts``, so it is left out."""
    lit = _leading_literal(branch)
    rest = list(branch)[len(lit):]
    if len(rest) == 1 and str(rest[0][0]) == "ASSERT_NOT":
        direction, sub = rest[0][1]
        ahead = _leading_literal(sub)
        if direction == 1 and ahead and len(ahead) == len(list(sub)) and b"\n" not in ahead:
            return _ere_literal(lit) + _ere_not_followed(ahead)
    return _ere_literal(lit)


@functools.cache
def ere(
    prefilter: re.Pattern[bytes] = PREFILTER,
    extra: tuple[bytes, ...] = PREFILTER_EXTRA,
    blocks: tuple[bytes, ...] = BLOCK_START,
) -> bytes | None:
    """One POSIX extended regex (``grep -E``, C locale) that matches every line the prefilter accepts and every
    line that opens a failure report, derived from the pattern table, so a pattern added there is covered
    without a second list; None where ``needles`` is None."""
    branches = _parsed(prefilter)
    if branches is None:
        return None
    if any(not k or b"\n" in k or b"\0" in k for k in (*extra, *blocks)):  # argv holds no NUL; -e splits at \n
        return None
    alts = [*map(_ere_branch, branches), *map(_ere_literal, extra), *map(_ere_literal, blocks)]
    return b"|".join(dict.fromkeys(alts))


def _grep() -> str | None:
    return shutil.which("grep")


def _count_newlines(fd: int, start: int, size: int) -> int:
    """Newlines in bytes ``start``…``size`` (pread: the shared file offset grep reads from is untouched)."""
    n, off = 0, start
    while off < size:
        piece = os.pread(fd, min(4 * _PIECE, size - off), off)
        if not piece:
            break
        n += piece.count(b"\n")
        off += len(piece)
    return n


def _wc_newlines(fd: int, start: int) -> int | None:
    """Newlines from byte ``start`` to the end, counted by ``wc -l`` (several times Python's speed, in its own
    process); None where wc is missing or fails."""
    wc = shutil.which("wc")
    if wc is None:
        return None
    try:
        os.lseek(fd, start, os.SEEK_SET)  # grep has exited: the offset is free
        done = subprocess.run([wc, "-l"], stdin=fd, capture_output=True, check=False, timeout=3600,
                              env=dict(os.environ, LC_ALL="C"))
    except (OSError, subprocess.SubprocessError):
        return None
    out = done.stdout.split()
    return int(out[0]) if done.returncode == 0 and out and out[0].isdigit() else None


def _total_lines(fd: int, size: int, lineno: int, offset: int) -> int:
    """Lines in the file, given that line ``lineno`` (0: none) starts at byte ``offset``: grep numbered every
    line up to its last match, so only the tail after it is counted here (in a failing job's log, a few lines)."""
    start = 0
    if lineno:
        start = _line_end(fd, offset) + 1
        if start > size:  # that line is the last one, without a newline
            return lineno
    tail = None
    if size - start > WC_MIN_BYTES:
        tail = _wc_newlines(fd, start)
    if tail is None:
        tail = _count_newlines(fd, start, size)
    last = os.pread(fd, 1, size - 1) if size else b"\n"
    return lineno + tail + (0 if last == b"\n" else 1)  # a last line without a newline is a line too


def _head(fd: int, chunk: int) -> bytes:
    """The first chunk up to its last newline (what the chunked scanner searches for rank prefixes)."""
    block = os.pread(fd, chunk, 0)
    cut = block.rfind(b"\n")
    return block[: cut + 1] if cut >= 0 else b""


def _block(fd: int, start: int, first_lineno: int, max_line: int, max_lines: int) -> Iterator[tuple[int, bytes]]:
    """Lines of a failure report from byte ``start`` up to (not including) the line after the first
    "\\n====" at or past ``start``, numbered from ``first_lineno``."""
    buf, off, lineno, pos = b"", start, first_lineno, 0
    emitted = 0
    while emitted < max_lines:
        nl = buf.find(b"\n", pos)
        if nl < 0:
            piece = os.pread(fd, _PIECE, off)
            if not piece:
                if pos < len(buf):
                    yield lineno, buf[pos : pos + max_line]
                return
            off += len(piece)
            buf = buf[pos:] + piece
            pos = 0
            continue
        yield lineno, buf[pos : min(nl, pos + max_line)]
        emitted += 1
        lineno += 1
        if buf.startswith(BLOCK_END[1:], nl + 1):  # the next line is the closing "====" line
            return
        pos = nl + 1


def candidates(
    stream: BinaryIO,
    stats: Any,
    *,
    chunk: int,
    max_line: int,
    max_block_lines: int,
    prefixes: set[bytes] | None,
    head: list[bytes] | None,
    discover: Any,
    head_bytes: int,
) -> Iterator[tuple[int, bytes]] | None:
    """The grep-accelerated form of ``sources.scan`` for a large regular file; None where it does not apply."""
    pattern = ere()
    grep = _grep()
    if pattern is None or grep is None:
        return None
    try:
        fd = stream.fileno()
        st = os.fstat(fd)
    except (OSError, ValueError, AttributeError):
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size < GREP_MIN_BYTES or stream.tell() != 0:
        return None
    return _run(grep, pattern, fd, st.st_size, stats, chunk, max_line, max_block_lines, prefixes, head, discover,
                head_bytes)


def _run(
    grep: str, pattern: bytes, fd: int, size: int, stats: Any, chunk: int, max_line: int,
    max_block_lines: int, prefixes: set[bytes] | None, head: list[bytes] | None, discover: Any, head_bytes: int,
) -> Iterator[tuple[int, bytes]]:
    first = _head(fd, chunk)
    if first and prefixes is not None:
        prefixes.update(discover(first[:head_bytes]))
    if first and head is not None:
        head.append(first[:head_bytes])
    cmd = [os.fsencode(grep), b"-E", b"-a", b"-b", b"-n", b"-e", pattern]
    env = dict(os.environ, LC_ALL="C")
    os.lseek(fd, 0, os.SEEK_SET)
    proc = subprocess.Popen(cmd, stdin=fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, bufsize=1 << 16)
    assert proc.stdout is not None
    last = 0  # the highest line number yielded (a report's lines may also hold keywords)
    seen_lineno = seen_offset = 0  # grep's last line: every line before it is numbered
    try:
        out = proc.stdout
        while True:
            line = out.readline(max_line + 64)
            if not line:
                break
            whole = line.endswith(b"\n")
            lineno_s, _, rest = line.partition(b":")
            offset_s, _, text = rest.partition(b":")
            if whole:
                text = text[:-1]
            accepted = prefilter_accepts(text)
            prev = text[-64:]
            while not whole:  # an overlong line: keep its start, drop the rest (still searched, as scan does)
                more = out.readline(1 << 20)
                if not more:
                    break
                whole = more.endswith(b"\n")
                accepted = accepted or prefilter_accepts(prev + more)
                prev = more[-64:]
            lineno, offset = int(lineno_s), int(offset_s)
            seen_lineno, seen_offset = lineno, offset
            text = text[:max_line]
            if lineno > last and accepted:
                stats.candidates += 1
                last = lineno
                yield lineno, text
            if any(k in text for k in BLOCK_START):
                # the report's field lines hold no keyword: read them from the file after this line
                nl = _line_end(fd, offset)
                for n, raw in _block(fd, nl + 1, lineno + 1, max_line, max_block_lines):
                    if n > last:
                        stats.candidates += 1
                        last = n
                        yield n, raw
        proc.wait()
        if proc.returncode not in (0, 1):  # 1: no line matched
            err = proc.stderr.read(500).decode("utf-8", "replace").strip() if proc.stderr else ""
            raise OSError(f"grep failed ({proc.returncode}): {err}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for s in (proc.stdout, proc.stderr):
            if s is not None:
                s.close()
    stats.bytes += size
    stats.lines += _total_lines(fd, size, seen_lineno, seen_offset)


def _line_end(fd: int, offset: int) -> int:
    """Offset of the newline ending the line that starts at ``offset`` (end of file if none)."""
    off = offset
    while True:
        piece = os.pread(fd, _PIECE, off)
        if not piece:
            return off
        i = piece.find(b"\n")
        if i >= 0:
            return off + i
        off += len(piece)
