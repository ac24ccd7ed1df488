"""NCCL RAS replies → ``RasStatus``: the JSON report (NCCL ≥ 2.28.7) and the human text report (every NCCL
with RAS, which prints only anomalies: a summary table, ``Errors`` and ``Warnings``)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from .ras_status import RasCommunicator, RasCountGroup, RasGroupRow, RasMissingRank, RasProcess, RasRank, RasStatus


def _norm_hash(h: str) -> str:
    try:
        return f"{int(h, 16):016x}"
    except ValueError:
        return h.lower()


def parse_ras_reply(text: str, prefer: str = "json") -> RasStatus:
    """JSON when the reply is a JSON document, else the text report."""
    if prefer == "json" or text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            doc = None
        if isinstance(doc, Mapping):
            return parse_ras_json(doc, raw=text)
    return parse_ras_text(text)


def _obj(v: Any) -> Mapping[str, Any]:
    return v if isinstance(v, Mapping) else {}


def _opt_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _opt_bool(v: Any) -> bool | None:
    return v if isinstance(v, bool) else None


def _count_groups(ranks: tuple[RasRank, ...]) -> tuple[RasCountGroup, ...]:
    ops: list[str] = []
    for r in ranks:
        for op in r.collective_counts:
            if op not in ops:
                ops.append(op)
    out: list[RasCountGroup] = []
    for op in ops:
        by_value: dict[int, list[int]] = {}
        for r in ranks:
            if op in r.collective_counts:
                by_value.setdefault(r.collective_counts[op], []).append(r.rank)
        if len(by_value) > 1:
            for value, rs in sorted(by_value.items(), key=lambda kv: (-len(kv[1]), -kv[0])):
                out.append(RasCountGroup(op=op, count=value, n_ranks=len(rs), ranks=tuple(sorted(rs))))
    return tuple(out)


def parse_ras_json(doc: Mapping[str, Any], raw: str = "") -> RasStatus:
    """The ``SET FORMAT json`` report (NCCL ≥ 2.28.7, rasDumpCommsToJSON)."""
    comms: list[RasCommunicator] = []
    dead: list[RasProcess] = []
    for c in doc.get("communicators") or []:
        if not isinstance(c, Mapping):
            continue
        ranks: list[RasRank] = []
        for r in c.get("ranks") or []:
            if not isinstance(r, Mapping) or _opt_int(r.get("rank")) is None:
                continue
            st = _obj(r.get("status"))
            counts = _obj(r.get("collective_counts"))
            ranks.append(
                RasRank(
                    rank=int(r["rank"]),
                    host=r.get("host") if isinstance(r.get("host"), str) else None,
                    pid=_opt_int(r.get("pid")),
                    cuda_dev=_opt_int(r.get("cuda_dev")),
                    nvml_dev=_opt_int(r.get("nvml_dev")),
                    init_state=_opt_int(st.get("init_state")),
                    async_error=_opt_int(st.get("async_error")),
                    finalize_called=_opt_bool(st.get("finalize_called")),
                    destroy_flag=_opt_bool(st.get("destroy_flag")),
                    abort_flag=_opt_bool(st.get("abort_flag")),
                    collective_counts={str(k): v for k, v in counts.items() if _opt_int(v) is not None},
                )
            )
        missing: list[RasMissingRank] = []
        for m in c.get("missing_ranks") or []:
            if not isinstance(m, Mapping) or _opt_int(m.get("rank")) is None:
                continue
            st = _obj(m.get("status"))
            mr = RasMissingRank(
                rank=int(m["rank"]),
                host=m.get("host") if isinstance(m.get("host"), str) else None,
                pid=_opt_int(m.get("pid")),
                cuda_dev=_opt_int(m.get("cuda_dev")),
                unresponsive=_opt_bool(st.get("unresponsive")),
                dead=_opt_bool(st.get("considered_dead")),
            )
            missing.append(mr)
            if mr.dead:
                dead.append(RasProcess(pid=mr.pid, host=mr.host, gpus=str(mr.cuda_dev)))
        rank_t = tuple(sorted(ranks, key=lambda r: r.rank))
        errors = []
        if missing:
            errors.append("INCOMPLETE")
        if any(_is_error(r) for r in rank_t):
            errors.append("ERROR")
        groups = _count_groups(rank_t)
        if groups:
            errors.append("MISMATCH")
        comms.append(
            RasCommunicator(
                hash=_norm_hash(str(c.get("hash", ""))),
                size=_opt_int(c.get("size")),
                errors=tuple(errors),
                ranks=rank_t,
                missing_ranks=tuple(sorted(missing, key=lambda m: m.rank)),
                count_groups=groups,
                rank_status={r.rank: _rank_state(r) for r in rank_t},
                rank_errors={r.rank: _rank_error(r) for r in rank_t if _is_error(r)},
            )
        )
    ras = _obj(doc.get("ras"))
    version = doc.get("nccl_version")
    return RasStatus(
        format="json",
        nccl_version=version if isinstance(version, str) else None,
        communicators=tuple(comms),
        dead_processes=tuple(dict.fromkeys(dead)),
        timeouts=_opt_int(ras.get("timeouts_count")) or 0,
        raw=raw,
    )


_NCCL_OK = (0, 7)  # ncclSuccess, ncclInProgress (initialisation still running)


def _is_error(r: RasRank) -> bool:
    return (r.init_state is not None and r.init_state not in _NCCL_OK) or (
        r.async_error is not None and r.async_error not in _NCCL_OK
    )


def _rank_error(r: RasRank) -> str:
    parts = []
    if r.init_state is not None and r.init_state not in _NCCL_OK:
        parts.append(f"init error {r.init_state}")
    if r.async_error is not None and r.async_error not in _NCCL_OK:
        parts.append(f"async error {r.async_error}")
    return ", ".join(parts)


def _rank_state(r: RasRank) -> str:
    """Same precedence as client_support.cc: abort, then finalize/destroy, then init, else running."""
    if r.abort_flag:
        return "ABORT"
    if r.finalize_called or r.destroy_flag:
        return "FINALIZE"
    if r.init_state == 7:
        return "INIT"
    return "RUNNING"


_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+(?:-\d+)?)\s+(\d+)\s+(\d+)\s+([A-Z]+)\s+([A-Z,]+)\s*$")
_COMM = re.compile(r"^#(\d+)-(\d+) \(([0-9a-fA-F]+)\) ([A-Z]+)\s*$")
_PROC = re.compile(r"^\s+Process (\d+) on node (\S+) managing GPUs? (.+?)\s*$")
_RANK_WHO = (
    r"(?: -- (?:GPU (?P<gpu>\S+)(?: \(NVML \d+\))? managed by process (?P<pid>\d+) on node (?P<host>\S+)"
    r"|\[.*\]))?"
)
_DIFF_COUNTS = re.compile(r"^\s+Communicator ranks have different (\w+) operation counts")
_GROUP_UPTO = re.compile(r"^\s+(\d+) ranks have launched up to operation (\d+)")
_GROUP_NONE = re.compile(r"^\s+(\d+) ranks have not launched any operations")
_RANK_UPTO = re.compile(r"^\s+Rank (\d+) has launched up to operation (\d+)" + _RANK_WHO)
_RANK_NONE = re.compile(r"^\s+Rank (\d+) has not launched any operations" + _RANK_WHO)
_GROUP_STATUS = re.compile(r"^\s+(\d+) ranks have status (\w+)")
_RANK_STATUS = re.compile(r"^\s+Rank (\d+) has status (\w+)" + _RANK_WHO)
_GROUP_REPORTED = re.compile(r"^\s+(\d+) ranks reported (.+?)\s*$")
_RANK_REPORTED = re.compile(r"^\s+Rank (\d+) reported (.+?)" + _RANK_WHO + r"\s*$")
_RANK_PLAIN = re.compile(r"^\s+Rank (\d+)" + _RANK_WHO + r"\s*$")
_MISSING_LIST = re.compile(r"^\s+The missing ranks?: ([\d, ]+)")
_TIMEOUTS = re.compile(r"^\s+Encountered (\d+) communication timeouts?")
_VERSION = re.compile(r"^NCCL version (\S+)")


def _who(m: re.Match[str], rank: int) -> RasRank:
    """The rank a report line names, with the host, pid and GPU it may print beside it."""
    gd = m.groupdict()
    gpu = gd.get("gpu")
    return RasRank(
        rank=rank,
        host=gd.get("host"),
        pid=int(gd["pid"]) if gd.get("pid") else None,
        cuda_dev=int(gpu) if gpu and gpu.isdigit() else None,
    )


class _CommBuilder:
    """One communicator of the text report, built from the lines of its blocks (``#0-1 (hash) MISMATCH``…)."""

    def __init__(self, comm_hash: str, label: str) -> None:
        self.hash = comm_hash
        self.label = label
        self.errors: list[str] = []
        self.missing: dict[int, RasMissingRank] = {}
        self.groups: list[RasCountGroup] = []
        self.rank_status: dict[int, str] = {}
        self.rank_errors: dict[int, str] = {}
        self.ranks: dict[int, RasRank] = {}
        self.start_block("")

    def start_block(self, kind: str) -> None:
        """A new block of this communicator: what the following lines refer to starts afresh."""
        self.kind = kind  # the block's kind: MISMATCH, INCOMPLETE, ERROR...
        if kind and kind not in self.errors:
            self.errors.append(kind)
        self.op = ""  # op of the current count listing
        self.group_idx: int | None = None  # index into groups of the last multi-rank group
        self.status_ctx: str | None = None  # status of the last "N ranks have status X"
        self.error_ctx: str | None = None  # error of the last "N ranks reported X"

    def feed(self, line: str) -> None:
        """One line inside a block of this communicator (lines it does not know are skipped)."""
        if m := _DIFF_COUNTS.match(line):
            self.op, self.group_idx, self.status_ctx = m.group(1), None, None
        elif "have different status" in line:
            self.op, self.group_idx, self.status_ctx = "", None, None
        elif m := _GROUP_UPTO.match(line) or _GROUP_NONE.match(line):
            value = int(m.group(2)) if m.re is _GROUP_UPTO else 0
            n = int(m.group(1))
            self.groups.append(RasCountGroup(op=self.op or "collective", count=value, n_ranks=n, ranks=()))
            self.group_idx = len(self.groups) - 1
        elif m := _RANK_UPTO.match(line) or _RANK_NONE.match(line):
            r = int(m.group(1))
            value = int(m.group(2)) if m.re is _RANK_UPTO else 0
            self.groups.append(RasCountGroup(op=self.op or "collective", count=value, n_ranks=1, ranks=(r,)))
            self.ranks.setdefault(r, _who(m, r))
            self.group_idx = None
        elif m := _GROUP_STATUS.match(line):
            self.status_ctx = m.group(2)
        elif m := _RANK_STATUS.match(line):
            r = int(m.group(1))
            self.rank_status[r] = m.group(2)
            self.ranks.setdefault(r, _who(m, r))
        elif m := _GROUP_REPORTED.match(line):
            self.error_ctx = m.group(2)
        elif m := _RANK_REPORTED.match(line):
            r = int(m.group(1))
            self.rank_errors[r] = m.group(2)
            self.ranks.setdefault(r, _who(m, r))
        elif m := _MISSING_LIST.match(line):
            for tok in m.group(1).replace(" ", "").split(","):
                if tok.isdigit():
                    self.missing.setdefault(int(tok), RasMissingRank(rank=int(tok)))
        elif m := _RANK_PLAIN.match(line):
            self._plain_rank(int(m.group(1)), _who(m, int(m.group(1))))

    def _plain_rank(self, r: int, info: RasRank) -> None:
        """A bare ``Rank N (host, pid, GPU)`` line: it belongs to whatever the block said just before."""
        if self.kind == "INCOMPLETE":
            self.missing[r] = RasMissingRank(rank=r, host=info.host, pid=info.pid, cuda_dev=info.cuda_dev)
            return
        self.ranks.setdefault(r, info)
        if self.kind == "ERROR" and self.error_ctx:
            self.rank_errors[r] = self.error_ctx
        elif self.status_ctx is not None and not self.op:
            self.rank_status[r] = self.status_ctx
        elif self.group_idx is not None:
            g = self.groups[self.group_idx]
            self.groups[self.group_idx] = RasCountGroup(g.op, g.count, g.n_ranks, (*g.ranks, r))

    def build(self) -> RasCommunicator:
        return RasCommunicator(
            hash=self.hash,
            label=self.label,
            errors=tuple(self.errors),
            ranks=tuple(self.ranks[r] for r in sorted(self.ranks)),
            missing_ranks=tuple(self.missing[r] for r in sorted(self.missing)),
            count_groups=tuple(self.groups),
            rank_status=dict(self.rank_status),
            rank_errors=dict(self.rank_errors),
        )


class _TextReport:
    """The report's own lines (version, summary table, Errors/Warnings sections); a communicator's block
    lines go to that communicator's builder."""

    def __init__(self) -> None:
        self.version: str | None = None
        self.rows: list[RasGroupRow] = []
        self.comms: dict[str, _CommBuilder] = {}
        self.missing_procs: list[RasProcess] = []
        self.dead_procs: list[RasProcess] = []
        self.timeouts = 0
        self.section: str | None = None  # "INCOMPLETE" | "DEAD" | "TIMEOUT" | "COMM"
        self.cur: _CommBuilder | None = None

    def feed(self, line: str) -> None:
        stripped = line.strip()
        if m := _VERSION.match(line):
            self.version = m.group(1)
        elif m := _ROW.match(line):
            self.rows.append(_group_row(m))
        elif stripped in ("INCOMPLETE", "DEAD", "TIMEOUT"):
            self.section, self.cur = stripped, None
        elif stripped in ("Errors", "Warnings"):
            self.section, self.cur = None, None
        elif m := _COMM.match(line):
            h = _norm_hash(m.group(3))
            self.cur = self.comms.setdefault(h, _CommBuilder(h, f"#{m.group(1)}-{m.group(2)}"))
            self.cur.start_block(m.group(4))
            self.section = "COMM"
        elif self.section in ("INCOMPLETE", "DEAD") and (m := _PROC.match(line)):
            proc = RasProcess(pid=int(m.group(1)), host=m.group(2), gpus=m.group(3))
            (self.missing_procs if self.section == "INCOMPLETE" else self.dead_procs).append(proc)
        elif m := _TIMEOUTS.match(line):
            self.timeouts = int(m.group(1))
        elif self.section == "COMM" and self.cur is not None:
            self.cur.feed(line)

    def status(self, raw: str) -> RasStatus:
        return RasStatus(
            format="text",
            nccl_version=self.version,
            communicators=tuple(b.build() for b in self.comms.values()),
            groups=tuple(self.rows),
            missing_processes=tuple(self.missing_procs),
            dead_processes=tuple(self.dead_procs),
            timeouts=self.timeouts,
            raw=raw,
        )


def _group_row(m: re.Match[str]) -> RasGroupRow:
    """A row of the report's summary table."""
    return RasGroupRow(
        group=int(m.group(1)),
        comms=int(m.group(2)),
        nodes=int(m.group(3)),
        ranks_per_node=m.group(4),
        ranks_per_comm=int(m.group(5)),
        ranks_in_group=int(m.group(6)),
        status=m.group(7),
        errors=m.group(8),
    )


def parse_ras_text(text: str) -> RasStatus:
    """The human report (every NCCL with RAS). Unknown lines are skipped: the wording varies by release."""
    report = _TextReport()
    for line in text.splitlines():
        report.feed(line)
    return report.status(text)
