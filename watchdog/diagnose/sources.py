"""Inputs: expand paths (files, directories, ``-``), say which rank a path belongs to, and stream
candidate lines out of any amount of bytes in constant memory.

Reading is chunked and prefiltered: one combined regex over each 4 MiB block finds the few lines
that can matter, so Python only touches those (large regular files: grep in parallel pieces,
``prefilter.py``, same lines). Line numbers are still exact (newlines are counted in C between
candidates). Overlong lines are cut at ``MAX_LINE`` bytes, so memory stays bounded even for a file
without a single newline.
"""

from __future__ import annotations

import codecs
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from ..errors import UserError
from .parser import PathRank
from .patterns import BLOCK_END, BLOCK_START, PREFILTER, PREFILTER_EXTRA
from .prefilter import candidates as grep_candidates

CHUNK = 4 << 20  # bytes per read: large enough that per-chunk overhead vanishes
MAX_LINE = 64 << 10  # longest line kept; the rest of a longer line is dropped
MAX_BLOCK_LINES = 1_000_000  # lines of one failure report read whole (8 per failed rank)

# torchrun --log-dir: <log-dir>/<run-id>/attempt_<n>/<local_rank>/{stdout,stderr}.log (error.json)
_LOGDIR_PATH = re.compile(r"attempt_\d+[/\\](\d{1,7})[/\\](?:stdout|stderr|error)\.(?:log|json)$")
# a file named for its rank: rank-3.log, rank_3.out, train.rank3.txt
_RANK_NAME = re.compile(r"(?:^|[^a-z])rank[-_.]?(\d{1,7})(?:\D|$)", re.IGNORECASE)
# which ranks print at all: distinct line prefixes in the first chunk of each source (torchrun's, and
# Open MPI's --tag-output "[1,3]<stdout>:")
_DISCOVER = re.compile(
    rb"^(?:\[[A-Za-z_]{1,32}\d{1,7}\]:(?:\[rank\d{1,7}\]:)?|\[rank\d{1,7}\]:"
    rb"|\[\d{1,7},\d{1,7}\]<std(?:out|err)>:)",
    re.M,
)
# not logs: skipped when a directory is expanded (a file named on the command line is always read) —
# scripts and docs next to the logs would be read as log text, checkpoints and archives cost gigabytes
NOT_LOGS = frozenset((
    ".py", ".pyc", ".sh", ".bash", ".md", ".rst", ".ipynb", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".c", ".cc",
    ".cpp", ".h", ".hpp", ".cu", ".so", ".o", ".whl", ".tar", ".gz", ".tgz", ".bz2", ".xz", ".zst", ".zip", ".7z",
    ".png", ".jpg", ".jpeg", ".gif", ".svg", ".pdf", ".pt", ".pth", ".ckpt", ".safetensors", ".bin", ".npy", ".npz",
    ".pkl", ".parquet", ".arrow", ".h5",
))
HEAD = 1 << 20  # bytes of each source searched for rank prefixes and job keys


@dataclass(frozen=True)
class TextPolicy:
    """When a file is not a log at all (an executable, a checkpoint, an archive): `diagnose` says so instead
    of reading it and answering "undecided"."""

    # bytes looked at from the start (after a hole of NULs, below): a log's first lines are text (launcher
    # banners, torchrun's config), a binary format shows its header and tables there; git and grep look as far
    head_bytes: int = 8192
    # a head with more than this share of bytes that are not text (NUL and other control bytes than tab,
    # newline, CR, FF, VT, backspace and ESC; bytes that are not UTF-8) is binary: every log of
    # tests/fixtures/logs reads 0 %, a log with a few odd bytes (a Latin-1 name, a cut multi-byte character,
    # a progress bar's stray bytes) a few %, while random or compressed bytes read ~53 %, /bin/true 89 %
    max_binary_share: float = 0.3
    # a log that logrotate's copytruncate cut while its writer wrote on without O_APPEND starts with a hole of
    # NULs: skipped (up to this much) before the head is looked at
    max_leading_nul_bytes: int = 64 << 20


TEXT_POLICY = TextPolicy()
_TEXT_CONTROLS = frozenset(b"\t\n\r\f\v\b\x1b")


def binary_share(head: bytes) -> float:
    """Share of ``head``'s bytes that are not text: control bytes a log does not print and bytes that are not
    UTF-8 (a multi-byte character cut at the end of ``head`` counts as text)."""
    if not head:
        return 0.0
    bad = sum(1 for b in head if (b < 32 and b not in _TEXT_CONTROLS) or b == 127)
    decoded = codecs.getincrementaldecoder("utf-8")("surrogateescape").decode(head, final=False)
    bad += sum(1 for ch in decoded if "\udc80" <= ch <= "\udcff")
    return bad / len(head)


def not_text(path: str, policy: TextPolicy = TEXT_POLICY) -> str | None:
    """Why the regular file ``path`` is not a text log (None when it is, or cannot be read here: opening it
    again reports that)."""
    try:
        with open(path, "rb") as f:
            head = f.read(policy.head_bytes)
            skipped = 0
            while head and not head.strip(b"\0") and skipped < policy.max_leading_nul_bytes:
                skipped += len(head)
                head = f.read(policy.head_bytes)
            if head.startswith(b"\0"):  # the hole ends inside this block: the head is what follows it
                text = head.lstrip(b"\0")
                skipped += len(head) - len(text)
                head = text + f.read(policy.head_bytes - len(text))
    except OSError:
        return None
    if not head and skipped:
        return "nothing but NUL bytes"
    share = binary_share(head)
    if share > policy.max_binary_share:
        return f"binary data: {share:.0%} of its first {len(head)} bytes are not text"
    return None


@dataclass(frozen=True, slots=True)
class Source:
    name: str  # as shown in evidence ("-" for stdin)
    path: str | None  # None for stdin
    path_rank: PathRank


@dataclass(slots=True)
class ScanStats:
    bytes: int = 0
    lines: int = 0
    candidates: int = 0


def rank_from_path(path: str) -> PathRank:
    """The rank a file's location implies, if any (local rank for torchrun's per-rank dirs)."""
    m = _LOGDIR_PATH.search(path)
    if m:
        return PathRank(local_rank=int(m.group(1)))
    m = _RANK_NAME.search(os.path.basename(path))
    if m:
        return PathRank(rank=int(m.group(1)))
    return PathRank()


def expand(args: list[str]) -> list[Source]:
    """Files as given, directories recursively in sorted order (without ``NOT_LOGS`` and files that are not
    text), ``-`` as stdin. Missing, or a file named here that is not text (``TextPolicy``) → UserError."""
    out: list[Source] = []
    for arg in args:
        if arg == "-":
            out.append(Source("-", None, PathRank()))
            continue
        if os.path.isdir(arg):
            for root, dirs, files in os.walk(arg):
                dirs.sort()
                for name in sorted(files):
                    if os.path.splitext(name)[1].lower() in NOT_LOGS:
                        continue
                    full = os.path.join(root, name)
                    # a core file or a checkpoint without a telling name beside the logs: not read
                    if os.path.isfile(full) and not_text(full) is None:
                        out.append(Source(full, full, rank_from_path(full)))
            continue
        if not os.path.exists(arg):
            raise UserError(f"no such file or directory: {arg}")
        if not os.path.isfile(arg) and not _is_readable_stream(arg):
            raise UserError(f"not a regular file or directory: {arg}")
        why = not_text(arg) if os.path.isfile(arg) else None  # a pipe is read as it comes
        if why is not None:
            raise UserError(f"{arg} is not a log ({why})")
        out.append(Source(arg, arg, rank_from_path(arg)))
    return out


def _is_readable_stream(path: str) -> bool:
    """Named pipes and /dev/stdin-like paths are fine to stream."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)


def open_source(src: Source) -> BinaryIO:
    if src.path is None:
        return sys.stdin.buffer
    try:
        return open(src.path, "rb")  # the caller closes it
    except OSError as exc:
        raise UserError(f"cannot read {src.path}: {exc.strerror or exc}") from exc


def discover_prefixes(head: bytes) -> set[bytes]:
    """Distinct rank prefixes at line starts of a chunk (a rank that only printed progress exists too)."""
    return {m.group(0) for m in _DISCOVER.finditer(head)}


def _candidates(body: bytes, prefilter: re.Pattern[bytes], extra: tuple[bytes, ...]) -> set[int]:
    """Start offsets of the lines in ``body`` that contain a keyword."""
    hits = [m.start() for m in prefilter.finditer(body)]
    for kw in extra:
        i = body.find(kw)
        while i >= 0:
            hits.append(i)
            nl = body.find(b"\n", i)
            i = body.find(kw, nl + 1) if nl >= 0 else -1
    return {body.rfind(b"\n", 0, h) + 1 for h in hits}


def _block_lines(body: bytes, start: int) -> tuple[list[int], bool]:
    """Line starts from ``start`` to the report's closing "====" line; True if it runs past ``body``."""
    end = body.find(BLOCK_END, start)
    stop = len(body) if end < 0 else end + 1
    out: list[int] = []
    pos = start
    while pos < stop and len(out) < MAX_BLOCK_LINES:
        out.append(pos)
        nl = body.find(b"\n", pos)
        if nl < 0:
            break
        pos = nl + 1
    return out, end < 0 and len(out) < MAX_BLOCK_LINES


def scan(
    stream: BinaryIO,
    stats: ScanStats,
    prefilter: re.Pattern[bytes] = PREFILTER,
    chunk: int = CHUNK,
    max_line: int = MAX_LINE,
    prefixes: set[bytes] | None = None,
    extra: tuple[bytes, ...] = PREFILTER_EXTRA,
    head: list[bytes] | None = None,
) -> Iterator[tuple[int, bytes]]:
    """Yield (1-based line number, line bytes) for lines the prefilter accepts, in order.

    Lines of torch elastic's failure report are yielded whole (block from "Failures:" to "===="),
    since its field lines carry no keyword of their own. ``prefixes`` collects the rank prefixes at
    line starts of the first chunk, ``head`` receives that chunk's first ``HEAD`` bytes (job keys).
    """
    if prefilter is PREFILTER and extra is PREFILTER_EXTRA:  # large regular files: grep -E (prefilter.py)
        fast = grep_candidates(
            stream, stats, chunk=chunk, max_line=max_line, max_block_lines=MAX_BLOCK_LINES, prefixes=prefixes,
            head=head, discover=discover_prefixes, head_bytes=HEAD,
        )
        if fast is not None:
            yield from fast
            return
    base = 0  # newlines before the start of the current buffer
    carry = b""
    first = True
    in_block = False  # a failure report continues from the previous buffer
    while True:
        block = stream.read(chunk)
        if not block:
            if not carry:
                break
            block, carry, tail = carry + b"\n", b"", True  # last line without a newline
        else:
            tail = False
            stats.bytes += len(block)
            block = carry + block if carry else block
        cut = block.rfind(b"\n")
        if cut < 0:
            carry = block[:max_line]
            continue
        body, carry = block[: cut + 1], block[cut + 1 :]
        if len(carry) > max_line:
            carry = carry[:max_line]
        if first and prefixes is not None:
            prefixes.update(discover_prefixes(body[:HEAD]))
        if first and head is not None:
            head.append(body[:HEAD])
        first = False
        starts = _candidates(body, prefilter, extra)
        if in_block:
            more, in_block = _block_lines(body, 0)
            starts.update(more)
        for kw in BLOCK_START:  # a failure report: read every line of it
            i = body.find(kw)
            while i >= 0:
                le = body.find(b"\n", i)
                more, in_block = _block_lines(body, le + 1)
                starts.update(more)
                i = body.find(kw, le + 1)
        counted = 0
        for ls in sorted(starts):
            le = body.find(b"\n", ls)
            base += body.count(b"\n", counted, ls)
            counted = ls
            stats.candidates += 1
            yield base + 1, body[ls : min(le, ls + max_line)]
        base += body.count(b"\n", counted)
        if tail:
            break
    stats.lines += base
