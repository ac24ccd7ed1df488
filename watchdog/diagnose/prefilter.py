"""Candidate lines of a large log file at disk speed: ``grep -E`` finds the lines holding a keyword.

Python's fastest searches cover one keyword per pass (``bytes.find``) or run an alternation at
~150–300 MB/s (``re``); a log of hundreds of megabytes with twenty keywords then takes seconds. GNU grep
runs one alternation of them all in one pass in its own process. The regex (``ere``) is derived from the
pattern table itself: per alternative of ``PREFILTER`` its leading literal (plus a literal negative
lookahead after it, so ``NCCL(?! INFO)`` drops NCCL_DEBUG=INFO's lines in grep), plus ``PREFILTER_EXTRA``
and ``BLOCK_START``: a pattern added there is covered without a second list, and every line grep hands
back is still checked with ``prefilter_accepts``. The file is cut into line-aligned pieces, one grep per
CPU, each fed by ``splice`` and ended by a random sentinel line whose number is the piece's line count (no
pass over the file counts newlines). torch elastic's failure report is read whole from the file after its
first line, as the chunked scanner does. Used for regular files of ``GREP_MIN_BYTES`` or more where grep
exists; anything else (stdin, pipes, small files, no grep, a pattern without a literal) goes through
``sources.scan``, which yields the same lines. Memory stays bounded: grep's output is read line by line,
each cut at ``max_line``.
"""

from __future__ import annotations

import fcntl
import functools
import os
import re
import secrets
import shutil
import stat
import subprocess
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO

from .patterns import BLOCK_END, BLOCK_START, PREFILTER, PREFILTER_EXTRA, prefilter_accepts

GREP_MIN_BYTES = 16 << 20  # below this the chunked scanner is as quick (grep's start-up ~2 ms)
PIECE_MIN_BYTES = 32 << 20  # a grep per this much at least: below it, a second process costs more than it saves
MAX_GREPS = 8  # side by side; past this the disk, not the CPUs, is the limit
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


@functools.cache
def _grep_works(grep: str, pattern: bytes) -> bool:
    """grep takes these options and this regex and answers in the format read here (a BusyBox or BSD grep
    may not): checked once per process on two lines, a few milliseconds; if not, the chunked scanner runs."""
    try:
        done = subprocess.run([os.fsencode(grep), b"-E", b"-a", b"-b", b"-n", b"-e", pattern, b"-e", b"rankwatch-end"],
                              input=b"step 1\nrankwatch-end\n", capture_output=True, timeout=30, check=False,
                              env=dict(os.environ, LC_ALL="C"))
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and done.stdout == b"2:7:rankwatch-end\n"


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
    if not _grep_works(grep, pattern):
        return None
    return _run(grep, pattern, fd, st.st_size, stats, chunk, max_line, max_block_lines, prefixes, head, discover,
                head_bytes)


def _pieces(fd: int, size: int) -> list[tuple[int, int]]:
    """Byte ranges of about equal size that start at line starts, one per grep (``workers()`` of them)."""
    n = max(1, min(workers(), size // PIECE_MIN_BYTES))
    starts = [0]
    for i in range(1, n):
        start = _line_end(fd, max(starts[-1], i * size // n)) + 1
        if start >= size:
            break
        starts.append(start)
    return list(zip(starts, [*starts[1:], size], strict=True))


def workers() -> int:
    """Greps run side by side: one per CPU this process may use, at most ``MAX_GREPS``."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_GREPS))


def _feed(fd: int, start: int, end: int, pipe: int, sentinel: bytes) -> None:
    """Bytes ``start``…``end`` of the file into grep's stdin (splice: the kernel moves the pages, this thread
    holds no GIL meanwhile), then the sentinel line that numbers the piece's end."""
    try:
        off = start
        while off < end:
            want = min(end - off, _PIECE)
            if hasattr(os, "splice"):
                n = os.splice(fd, pipe, want, offset_src=off)
            else:  # Python 3.9 or not Linux
                n = os.write(pipe, os.pread(fd, want, off))
            if n <= 0:
                break  # the file shrank
            off += n
        glue = b"" if off == start or os.pread(fd, 1, off - 1) == b"\n" else b"\n"
        os.write(pipe, glue + sentinel + b"\n")
    except OSError:
        pass  # grep is gone (killed or failed): its own exit status reports it
    finally:
        os.close(pipe)


class _Grep:
    """One grep over one piece, fed by its own thread."""

    def __init__(self, cmd: list[bytes], fd: int, start: int, end: int, sentinel: bytes) -> None:
        self.start = start
        r, w = os.pipe()
        try:
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, _PIECE)  # fewer wake-ups than 64 KiB at a time
        except (OSError, AttributeError):
            pass
        env = dict(os.environ, LC_ALL="C")
        try:
            self.proc = subprocess.Popen(cmd, stdin=r, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                         bufsize=1 << 16)
        except BaseException:
            os.close(w)
            raise
        finally:
            os.close(r)
        self.feeder = threading.Thread(target=_feed, args=(fd, start, end, w, sentinel), name="diagnose-feed",
                                       daemon=True)
        self.feeder.start()

    def finish(self) -> None:
        self.proc.wait()
        if self.proc.returncode not in (0, 1):  # 1: no line matched
            err = self.proc.stderr.read(500).decode("utf-8", "replace").strip() if self.proc.stderr else ""
            raise OSError(f"grep failed ({self.proc.returncode}): {err}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for s in (self.proc.stdout, self.proc.stderr):
            if s is not None:
                s.close()
        self.feeder.join()


def _run(
    grep: str, pattern: bytes, fd: int, size: int, stats: Any, chunk: int, max_line: int,
    max_block_lines: int, prefixes: set[bytes] | None, head: list[bytes] | None, discover: Any, head_bytes: int,
) -> Iterator[tuple[int, bytes]]:
    first = _head(fd, chunk)
    if first and prefixes is not None:
        prefixes.update(discover(first[:head_bytes]))
    if first and head is not None:
        head.append(first[:head_bytes])
    # every piece ends in a line only this process can know; its number there is the piece's line count
    sentinel = b"rankwatch-end-" + secrets.token_hex(16).encode()
    cmd = [os.fsencode(grep), b"-E", b"-a", b"-b", b"-n", b"-e", pattern, b"-e", sentinel]
    greps: list[_Grep] = []
    last = 0  # the highest line number yielded (a report's lines may also hold keywords)
    base = 0  # lines before the current piece
    try:
        for start, end in _pieces(fd, size):
            greps.append(_Grep(cmd, fd, start, end, sentinel))
        for g in greps:
            lines = 0
            for lineno, offset, text, accepted in _grep_lines(g.proc.stdout, max_line):
                if text == sentinel:
                    lines = lineno - 1
                    continue
                lineno += base
                offset += g.start
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
            g.finish()
            base += lines
    finally:
        for g in greps:
            g.close()
    stats.bytes += size
    stats.lines += base


def _grep_lines(out: Any, max_line: int) -> Iterator[tuple[int, int, bytes, bool]]:
    """(line number, byte offset, text cut at ``max_line``, prefilter verdict) per line of grep -b -n output."""
    while True:
        line = out.readline(max_line + 64)
        if not line:
            return
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
        yield int(lineno_s), int(offset_s), text[:max_line], accepted


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
