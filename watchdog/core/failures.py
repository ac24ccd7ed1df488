"""Why a rank ended: an initiating failure, or a consequence of another rank's — one classification for
the live verdict and offline ``diagnose``.

A rank that dies first is not necessarily the one that started it. When one rank dies its peers fail
within milliseconds with *communication* errors (connection closed or reset by peer, collective
timeouts, the watchdog's abort after a timeout) and the launcher SIGTERMs the rest; under load those
consequences can reach the watchdog before the cause does. So exits are ordered by cause first:
initiating (killed by a signal nobody on its node sent first, out of memory, a CUDA/NCCL error on that
rank, its own exception, an early normal exit while peers still need it) before consequences, and only
then by time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .ranks import rank_list

INITIATING = "initiating"
CONSEQUENCE = "consequence"



@dataclass(frozen=True)
class NamedWait:
    """An error message that names the ranks its printer waited for: the printer is a waiter, never the
    initiator, and the ranks it names are where the wait-for graph goes next. ``regex``'s first group is a
    rank list ("2", "2, 5", "1,4-5"). One row per message; the live verdict reads it from a crash mark,
    ``diagnose`` from a log line (``waited_for``)."""

    name: str
    regex: re.Pattern[str]
    source: str  # where the message comes from (the row's reason)


NAMED_WAITS: tuple[NamedWait, ...] = (
    # rank 0 of ``monitored_barrier``, after ``timeout`` without the others' messages: with
    # ``wait_all_ranks=True`` "Ranks 2, 3 failed to pass monitoredBarrier in 8000 ms", else "Rank 2 failed ..."
    NamedWait("monitored_barrier", re.compile(r"Ranks? ([\d][\d,\s\-]*?) failed to pass monitoredBarrier"),
              "torch/csrc/distributed/c10d/ProcessGroupGloo.cpp monitoredBarrier, on rank 0"),
)
# (every other rank of a monitored barrier then says it "received errors while waiting for send/recv from
# rank 0": rank 0 is the monitor that gave up, not whom it waited for — that message is a plain
# communication error, a consequence pointing nowhere)
MAX_NAMED = 4096
"""At most this many ranks are read from one message (a garbled or hostile line cannot make millions)."""


def waited_for(message: str | None) -> frozenset[int] | None:
    """The ranks a message says its printer waited for (``NAMED_WAITS``); None when it names nobody."""
    if not message or "monitoredBarrier" not in message:  # every row's message names it: a cheap gate
        return None
    for row in NAMED_WAITS:
        m = row.regex.search(message)
        if m is not None and (ranks := rank_list(m.group(1), limit=MAX_NAMED)):
            return frozenset(ranks)
    return None


# A message about communicating with peers: what a rank says when a *peer* failed (gloo, NCCL, c10d,
# the TCPStore, a monitored barrier's report of who did not arrive). Shared with diagnose/patterns.py,
# which reads the same messages from logs.
COMMUNICATION = re.compile(
    r"gloo|NCCL|nccl|Timed out|timed out|Connection (?:closed|reset)|DistBackendError|DistNetworkError"
    r"|DistStoreError|c10d|ProcessGroup|collective|peer|Socket Timeout|recvBytes|sendBytes|TCPStore"
    r"|Broken pipe|Connection refused|monitoredBarrier"
    # Horovod, once any rank failed: "Horovod has been shut down. This was caused by an exception on one of the ranks"
    r"|Horovod has been shut down"
)
# A peer's process is gone, not slow: its kernel closed or reset the connection (a frozen or unreachable peer
# gives a timeout instead). What a survivor of a killed node prints (gloo's pair.cc, a TCPStore socket).
PEER_ENDED = re.compile(r"Connection (?:closed|reset) by peer|Broken pipe")
# Errors that are the rank's own even when they mention NCCL (a CUDA fault surfaces through NCCL calls)
OWN_FAULT = re.compile(r"out of memory|OutOfMemoryError|CUDA error|Cuda failure|illegal memory access|ECC")


def crash_role(message: str | None) -> str:
    """The role of a rank that ended with an exception (its crash mark's text)."""
    text = message or ""
    if OWN_FAULT.search(text):
        return INITIATING
    return CONSEQUENCE if COMMUNICATION.search(text) else INITIATING


# What NCCL's watchdog prints as it takes its own process down after a collective timeout or error
# (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp): the SIGABRT that follows (exit code -6) is the
# watchdog's doing, a consequence of the timeout, not the rank's own crash.
WATCHDOG_ABORT = re.compile(
    r"Some NCCL operations have failed or timed out|we are taking the entire process down"
    r"|Terminating the process after attempting to dump debug info"
    r"|Process group watchdog thread terminated with exception|ProcessGroupNCCL's watchdog detected"
)


def abort_role(own_watchdog: bool, aborted_with_timed_out_peers: bool) -> str:
    """The role of a rank that died by SIGABRT. After a collective timeout NCCL's watchdog aborts its
    process, and (flight recorder on) every rank it signalled through the store aborts within the same
    second: a consequence when the rank's own lines show the watchdog or a timeout, or when it aborted
    together with peers whose watchdog fired. Only an abort with neither is the rank's own crash (an
    assert, ``std::terminate`` on its own exception)."""
    return CONSEQUENCE if own_watchdog or aborted_with_timed_out_peers else INITIATING
