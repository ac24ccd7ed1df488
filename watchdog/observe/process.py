"""Rank processes: verified identity, state and exact exit times, all through pidfds.

A pid is a rank only once verified (DESIGN "Trust model"): a pidfd is opened first, then the process's
start time is read from ``/proc/<pid>/stat`` and its maps are checked for the record; when the pidfd has
not reported an exit after those reads, they describe the very process the pidfd pins, not a successor
that reused the pid. Unreadable evidence (``/proc/1/maps`` is unreadable even to root in many containers)
means *unverified*, never owned. PID 1, this process and its ancestors are never verified.

From then on the pidfd is the rank: its exit is timestamped the moment the kernel reports it (a watcher
thread blocks in ``poll()`` on all of them; exit order matters to the verdict and a 0.5 s poll cannot
order exits milliseconds apart), a changed start time means the rank is gone, and every signal is sent
with ``pidfd_send_signal`` so a recycled pid is never touched. Descendants (DataLoader workers,
subprocesses) are tracked the same way while the rank is alive and its ``ppid`` chain still says whose they
are, so ``--on-stall kill`` can free the node without guessing at kill time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import structlog

log = structlog.get_logger("rankwatch.process")

MAX_DESCENDANTS = 1024
"""Descendants tracked per rank (pidfds held): DataLoader workers are a handful; a fork bomb is not ours."""


@dataclass(frozen=True)
class Identity:
    """One verified process: its pid, the start time that pid had when verified (clock ticks) and the uid it
    ran as (the job owner's: nothing of another uid is ever a rank or a target)."""

    pid: int
    start_ticks: int
    uid: int = -1


@dataclass(frozen=True)
class Unverified:
    reason: str


NO_PROCESS = "no such process"  # the pid is free: whatever wrote the record has ended


class Unknown(Exception):
    """/proc could not answer (EMFILE, EACCES, a timeout): the process may well be alive. Unknown is
    never dead (DESIGN "Trust model")."""


@dataclass(frozen=True)
class ProcInfo:
    alive: bool
    status: str  # "running" | "stopped" | "zombie" | "gone" | "unknown" (could not be read: never dead)


@dataclass(frozen=True)
class ProcStat:
    state: str  # one letter, as in /proc/<pid>/stat
    ppid: int
    start_ticks: int


def read_stat(pid: int, proc_root: str = "/proc") -> ProcStat | None:
    """State, parent and start time from ``/proc/<pid>/stat``; None when gone or unreadable.

    The command name may hold spaces and parentheses, so fields are counted after its last ')'.
    """
    try:
        return stat_or_unknown(pid, proc_root)
    except Unknown:
        return None


def stat_or_unknown(pid: int, proc_root: str = "/proc") -> ProcStat | None:
    """``read_stat`` that tells gone (None) from unreadable (raises Unknown): only ENOENT/ESRCH mean gone."""
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as f:
            data = f.read(4096)
        fields = data[data.rindex(b")") + 2 :].split()
        return ProcStat(state=fields[0].decode("ascii", "replace"), ppid=int(fields[1]), start_ticks=int(fields[19]))
    except (FileNotFoundError, ProcessLookupError):
        return None
    except (OSError, ValueError, IndexError) as exc:
        raise Unknown(f"/proc/{pid}/stat unreadable: {exc}") from None


def session_members(sid: int, proc_root: str = "/proc") -> list[int]:
    """Live processes of session ``sid`` (field 6 of ``/proc/<pid>/stat``; zombies are dead already): what
    a command started in a session of its own left behind, also those in process groups of their own."""
    members = []
    try:
        names = os.listdir(proc_root)
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"{proc_root}/{name}/stat", "rb") as f:
                data = f.read(4096)
            fields = data[data.rindex(b")") + 2 :].split()
            if int(fields[3]) == sid and fields[0] != b"Z":
                members.append(int(name))
        except (OSError, ValueError, IndexError):
            continue
    return members


def proc_uids(pid: int) -> tuple[int, ...] | None:
    """Real, effective, saved and filesystem uid of ``pid`` (``/proc/<pid>/status``); None when unreadable."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f.read(8192).splitlines():
                if line.startswith(b"Uid:"):
                    return tuple(int(x) for x in line.split()[1:5])
    except (OSError, ValueError):
        return None
    return None


def maps_inode(pid: int, dev: int, ino: int) -> bool | None:
    """Whether ``pid`` maps the file with device ``dev`` and inode ``ino`` (True), provably not (False), or
    cannot tell (None). Matched on the numbers, never on the path a job chose (a name proves nothing)."""
    want = (os.major(dev), os.minor(dev))
    want_ino = str(ino).encode()
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            for line in f:
                # address perms offset major:minor(hex) inode [path]
                parts = line.split(None, 5)
                if len(parts) >= 5 and parts[4] == want_ino:
                    major, _, minor = parts[3].partition(b":")
                    if (int(major, 16), int(minor, 16)) == want:
                        return True
        return False
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        return None


def maps_file(pid: int, path: str) -> bool | None:
    """Whether ``pid`` has ``path`` mapped (True), provably not (False), or cannot tell (None)."""
    try:
        needle = os.path.realpath(path).encode()
        with open(f"/proc/{pid}/maps", "rb") as f:
            return any(needle in line for line in f)
    except FileNotFoundError:
        return False
    except OSError:
        return None


def protected_pids() -> frozenset[int]:
    """PID 1, this process and every ancestor of it: never a target, whatever a record says."""
    out = {0, 1, os.getpid()}
    pid = os.getppid()
    while pid > 1 and pid not in out:
        out.add(pid)
        st = read_stat(pid)
        pid = st.ppid if st is not None else 0
    return frozenset(out)


def _exited(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


class ProcessTable:
    """Verified rank processes and their descendants, one pidfd each, held from verification on."""

    def __init__(self, protected: Iterable[int] | None = None) -> None:
        self._lock = threading.Lock()
        self._protected = frozenset(protected) if protected is not None else protected_pids()
        self._fd: dict[Identity, int] = {}
        self._by_fd: dict[int, Identity] = {}
        self._ranks: set[Identity] = set()  # exits of these are ordered; descendants' are not
        self._children: dict[Identity, set[Identity]] = {}
        self._exits: dict[Identity, int] = {}  # identity -> exit monotonic ns
        self._order: list[Identity] = []
        self._poller = select.poll()
        self._wake_r, self._wake_w = os.pipe()
        self._poller.register(self._wake_r, select.POLLIN)
        self._stop = False
        # descendants pinned per uid at most (None: no cap; the daemon sets
        # ``FairnessPolicy.descendant_pidfds_per_owner``): one user's thousand children never take the fds
        # another user's jobs need
        self.descendants_per_owner: int | None = None
        self._over_cap_logged: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="rankwatch-exit-watcher", daemon=True)
        self._thread.start()

    # -- verification -----------------------------------------------------------------------------
    def verify(self, pid: int, dev: int, ino: int, owner_uid: int) -> Identity | Unverified:
        """A rank identity for ``pid`` once it is proven to map the record (device ``dev``, inode ``ino``)
        and to run as ``owner_uid``, the job dir's owner. Every call checks anew: a pid already verified for
        one record proves nothing about another (no per-pid shortcut)."""
        if pid in self._protected or pid <= 1:
            return Unverified(f"pid {pid} is init, rankwatch or one of its ancestors")
        pinned = self._pin(pid)
        if isinstance(pinned, Unverified):
            return pinned
        ident, fd = pinned
        uids = proc_uids(pid)
        if uids is None or set(uids) != {owner_uid}:
            os.close(fd)
            if uids is None:
                return Unverified("its /proc status is unreadable, so its owner is unknown")
            return Unverified(f"it runs as uid {uids[1]}, not as the job dir's owner (uid {owner_uid})")
        owns = maps_inode(pid, dev, ino)
        if owns is not True or _exited(fd):
            os.close(fd)
            if owns is None:
                return Unverified("its memory maps are unreadable, so it cannot be proven to write the record")
            return Unverified("it does not map the record (another process holds this pid)")
        ident = dataclasses.replace(ident, uid=owner_uid)
        self._register(ident, fd, rank=True)
        return ident

    def _pin(self, pid: int) -> tuple[Identity, int] | Unverified:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return Unverified(NO_PROCESS)
        except (OSError, AttributeError) as exc:
            return Unverified(f"no pidfd: {getattr(exc, 'strerror', exc)}")
        try:
            st = stat_or_unknown(pid)
        except Unknown:
            st = None
        if st is None:
            os.close(fd)
            return Unverified("its /proc stat is unreadable")
        return Identity(pid, st.start_ticks), fd

    def _register(self, ident: Identity, fd: int, *, rank: bool) -> None:
        with self._lock:
            old = self._fd.get(ident)
            if old is not None:
                os.close(fd)
            else:
                self._fd[ident] = fd
                self._by_fd[fd] = ident
                self._poller.register(fd, select.POLLIN)
            if rank:
                self._ranks.add(ident)
        os.write(self._wake_w, b"x")

    # -- descendants ------------------------------------------------------------------------------
    def track_descendants(self, ranks: Iterable[Identity], proc_root: str = "/proc") -> int:
        """Pin every current descendant of the live ``ranks`` (one /proc scan); returns how many are tracked."""
        live = [r for r in ranks if self.exit_ns(r) is None and r in self._ranks]
        if not live:
            return 0
        kids: dict[int, list[int]] = {}
        try:
            names = os.listdir(proc_root)
        except OSError:
            names = []
        for name in names:
            if name.isdigit():
                st = read_stat(int(name), proc_root)
                if st is not None:
                    kids.setdefault(st.ppid, []).append(int(name))
        total = 0
        for rank in live:
            self._track_tree(rank, kids)
            with self._lock:
                total += len(self._children.get(rank, ()))
        return total

    def _track_tree(self, rank: Identity, kids: dict[int, list[int]]) -> None:
        found: list[int] = []
        todo = list(kids.get(rank.pid, ()))
        while todo and len(found) < MAX_DESCENDANTS:
            pid = todo.pop()
            found.append(pid)  # parents before their children
            todo.extend(kids.get(pid, ()))
        with self._lock:
            family = {rank.pid} | {i.pid for i in self._children.setdefault(rank, set())}
            held = sum(len(c) for r, c in self._children.items() if r.uid == rank.uid)
        cap = self.descendants_per_owner
        for pid in found:
            if pid in family or pid in self._protected:
                continue
            if cap is not None and held >= cap:
                if rank.uid not in self._over_cap_logged:
                    self._over_cap_logged.add(rank.uid)
                    log.warning("descendants_over_budget", owner_uid=rank.uid, budget=cap,
                                detail="this user's processes hold their share of the daemon's pidfds: "
                                       "the rest of their descendants are not tracked for --on-stall kill")
                break
            pinned = self._pin(pid)
            if isinstance(pinned, Unverified):
                continue
            child, fd = pinned
            st = read_stat(pid)
            uids = proc_uids(pid)
            # still in this rank's tree after the pidfd pinned it (not reparented, not a reused pid), and of the
            # rank's uid (a setuid helper the rank ran is not the owner's to kill)
            if st is None or _exited(fd) or st.ppid not in family or uids is None or set(uids) != {rank.uid}:
                os.close(fd)
                continue
            child = dataclasses.replace(child, uid=rank.uid)
            self._register(child, fd, rank=False)
            with self._lock:
                self._children.setdefault(rank, set()).add(child)
            family.add(pid)
            held += 1

    def descendants(self, ident: Identity) -> list[Identity]:
        """Live tracked descendants (an exited one is dropped the moment it exits)."""
        with self._lock:
            return list(self._children.get(ident, ()))

    # -- state ------------------------------------------------------------------------------------
    def info(self, ident: Identity) -> ProcInfo:
        """State of a verified rank; a changed start time means the pid now belongs to someone else."""
        if self.exit_ns(ident) is not None:
            return ProcInfo(alive=False, status="gone")
        try:
            st = stat_or_unknown(ident.pid)
        except Unknown:
            # EMFILE, EACCES...: the pidfd has not reported an exit, so the process is there; its state is not
            return ProcInfo(alive=True, status="unknown")
        if st is None or st.start_ticks != ident.start_ticks:
            return ProcInfo(alive=False, status="gone")
        if st.state in ("Z", "X", "x"):
            return ProcInfo(alive=False, status="zombie")
        if st.state == "T":  # SIGSTOP; "t" is a tracing stop (py-spy, a debugger): the rank itself runs on
            return ProcInfo(alive=True, status="stopped")
        return ProcInfo(alive=True, status="running")

    def exit_ns(self, ident: Identity) -> int | None:
        with self._lock:
            return self._exits.get(ident)

    def exit_index(self, ident: Identity) -> int | None:
        with self._lock:
            ranks = [i for i in self._order if i in self._ranks]
            return ranks.index(ident) if ident in ranks else None

    # -- action -----------------------------------------------------------------------------------
    def send_signal(self, ident: Identity, sig: int) -> bool:
        """Signal exactly the verified process (through its pidfd), only while it still runs as the uid it was
        verified with; False when it is gone, unknown or of another uid."""
        with self._lock:
            fd = self._fd.get(ident)
        if fd is None or ident.pid in self._protected or ident.uid < 0:
            return False
        uids = proc_uids(ident.pid)
        if uids is None or set(uids) != {ident.uid} or _exited(fd):
            log.warning("signal_refused", pid=ident.pid, uid=ident.uid, now=uids)
            return False
        try:
            signal.pidfd_send_signal(fd, sig)
        except OSError:
            return False
        return True

    def forget(self, ident: Identity) -> None:
        with self._lock:
            for i in [ident, *self._children.pop(ident, ())]:
                self._exits.pop(i, None)
                self._ranks.discard(i)
                if i in self._order:
                    self._order.remove(i)
                fd = self._fd.pop(i, None)
                if fd is not None:
                    self._close(fd)

    def _close(self, fd: int) -> None:
        self._by_fd.pop(fd, None)
        with contextlib.suppress(KeyError, ValueError):
            self._poller.unregister(fd)
        with contextlib.suppress(OSError):
            os.close(fd)

    def _run(self) -> None:
        while not self._stop:
            try:
                events = self._poller.poll(1000)
            except InterruptedError:
                continue
            now = time.monotonic_ns()
            for fd, _ in events:
                if fd == self._wake_r:
                    with contextlib.suppress(OSError):
                        os.read(self._wake_r, 4096)
                    continue
                with self._lock:
                    ident = self._by_fd.get(fd)
                    if ident is None:
                        continue
                    # the pid may be reused from now on: drop the pidfd, so nothing can signal through it
                    self._fd.pop(ident, None)
                    self._close(fd)
                    if ident not in self._ranks:
                        for kids in self._children.values():
                            kids.discard(ident)
                        continue
                    self._exits[ident] = now
                    self._order.append(ident)
                log.info("rank_process_exited", pid=ident.pid)

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._thread.join(timeout=2)
        with self._lock:
            for fd in list(self._by_fd):
                self._close(fd)
            self._fd.clear()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
