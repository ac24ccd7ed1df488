"""NCCL RAS as evidence: the job's local RAS endpoint asked twice per incident (``ras_client`` speaks the
protocol, ``ras_findings`` compares the answers); counts that did not move between them are stuck. Never
raises into the daemon."""

from __future__ import annotations

import structlog

from ..core.evidence_items import RasFinding
from .ras_client import DEFAULT_ADDR, DEFAULT_RAS_TIMEOUT_S, query_ras
from .ras_findings import ras_findings
from .ras_status import RasStatus

log = structlog.get_logger("rankwatch.evidence")

class RasWatch:
    """The job's local NCCL RAS endpoint, queried at an incident (twice, ``CapturePolicy.ras_recheck_s`` apart).

    RAS lives only in NCCL ≥ 2.24 jobs; elsewhere the connection is refused and ``query`` returns None
    after one log line. Loopback only (``parse_ras_addr``): RAS answers anyone, unauthenticated.
    """

    def __init__(
        self,
        addr: str = DEFAULT_ADDR,
        *,
        disabled: bool = False,
        ras_timeout_s: int = DEFAULT_RAS_TIMEOUT_S,
        timeout_s: float | None = None,
    ) -> None:
        self.addr = addr
        self.disabled = disabled
        self.ras_timeout_s = ras_timeout_s
        self.timeout_s = timeout_s

    def query(self) -> RasStatus | None:
        """One status query; None when disabled, unreachable, silent or not RAS. Never raises."""
        if self.disabled:
            return None
        try:
            return query_ras(self.addr, ras_timeout_s=self.ras_timeout_s, timeout_s=self.timeout_s)
        except Exception:
            log.exception("ras_query_failed", addr=self.addr)
            return None

    def findings(self, prev: RasStatus | None, cur: RasStatus | None) -> list[RasFinding]:
        """Findings of the latest query, sharpened by the previous one ("stuck": counts did not move)."""
        if cur is None:
            return []
        try:
            return ras_findings(prev, cur)
        except Exception:
            log.exception("ras_findings_failed", addr=self.addr)
            return []

    def evidence(self, prev: RasStatus | None, cur: RasStatus | None) -> list[RasFinding]:
        """``findings`` as the verdict's evidence items (``report.evidence_words`` phrases them)."""
        return self.findings(prev, cur)
