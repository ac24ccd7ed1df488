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
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO

from .patterns import BLOCK_END, BLOCK_START, PREFILTER, PREFILTER_EXTRA, prefilter_accepts

GREP_MIN_BYTES = 16 << 20  # below this the chunked scanner is as quick (grep's start-up ~2 ms)
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


@functools.cache
def needles(
    prefilter: re.Pattern[bytes] = PREFILTER,
    extra: tuple[bytes, ...] = PREFILTER_EXTRA,
    blocks: tuple[bytes, ...] = BLOCK_START,
) -> tuple[bytes, ...] | None:
    """Fixed strings such that every line the prefilter accepts holds one; None when an alternative has no
    leading literal (or the pattern is case-insensitive), so only the exact scanner is safe."""
    if prefilter.flags & re.IGNORECASE:
        return None
    try:
        lits = [_leading_literal(b) for b in _branches(prefilter)]
    except Exception:
        return None
    if not lits or any(not lit or b"\n" in lit for lit in lits):
        return None
    return tuple(dict.fromkeys((*lits, *extra, *blocks)))


def _grep() -> str | None:
    return shutil.which("grep")


def _count_lines(fd: int, size: int, out: list[int]) -> None:
    """Newlines in the first ``size`` bytes (pread: the shared file offset grep reads from is untouched)."""
    n, off = 0, 0
    while off < size:
        piece = os.pread(fd, min(4 * _PIECE, size - off), off)
        if not piece:
            break
        n += piece.count(b"\n")
        off += len(piece)
        if off == size and not piece.endswith(b"\n"):
            n += 1  # a last line without a newline is a line too
    out.append(n)


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
    keys = needles()
    grep = _grep()
    if keys is None or grep is None:
        return None
    try:
        fd = stream.fileno()
        st = os.fstat(fd)
    except (OSError, ValueError, AttributeError):
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size < GREP_MIN_BYTES or stream.tell() != 0:
        return None
    return _run(grep, keys, fd, st.st_size, stats, chunk, max_line, max_block_lines, prefixes, head, discover,
                head_bytes)


def _run(
    grep: str, keys: tuple[bytes, ...], fd: int, size: int, stats: Any, chunk: int, max_line: int,
    max_block_lines: int, prefixes: set[bytes] | None, head: list[bytes] | None, discover: Any, head_bytes: int,
) -> Iterator[tuple[int, bytes]]:
    first = _head(fd, chunk)
    if first and prefixes is not None:
        prefixes.update(discover(first[:head_bytes]))
    if first and head is not None:
        head.append(first[:head_bytes])
    counted: list[int] = []
    counter = threading.Thread(target=_count_lines, args=(fd, size, counted), name="diagnose-count", daemon=True)
    counter.start()
    cmd = [grep, "-F", "-a", "-b", "-n"]
    for k in keys:
        cmd += ["-e", os.fsdecode(k)]
    env = dict(os.environ, LC_ALL="C")
    os.lseek(fd, 0, os.SEEK_SET)
    proc = subprocess.Popen(cmd, stdin=fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    last = 0  # the highest line number yielded (a report's lines may also hold keywords)
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
        counter.join()
    stats.bytes += size
    stats.lines += counted[0] if counted else 0


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
