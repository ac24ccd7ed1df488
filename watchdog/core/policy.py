"""Thresholds, one frozen dataclass per concern, with the reason for each number beside it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StallPolicy:
    # Fixed stall timeout in seconds; None means "auto": learned from observed step times.
    timeout_s: float | None = None
    # auto: longest completed step × factor. 4× covers periodic slow steps (eval, logging bursts)
    # without waiting NCCL's 10 minutes (NVRx's heartbeat monitor uses the same longest-interval idea).
    auto_factor: float = 4.0
    # auto never goes below this: GC pauses, page-cache misses and preemption on busy hosts reach tens
    # of seconds; a false hang alarm costs an on-call page.
    auto_floor_s: float = 30.0
    # Before the first step completes (imports, compile, data warm-up, NCCL init) nothing is learned
    # yet and first steps are often 10-100× slower.
    startup_s: float = 300.0
    # Before the first step, once some ranks wait in a collective, a rank that has not arrived may go without
    # progress for the waiting ranks' own start-up (imports, model build, rendezvous) times 1 + this, at least
    # the stall timeout and at most the start-up budget. Ranks of one job start alike, but not equally fast on
    # a busy host: a rank 2x slower than its peers to start is seen (a DataLoader's workers forked while the
    # host is loaded); one 3x slower while its peers wait is blocked. The bare stall timeout (seconds) misread
    # ordinary start-up skew as hangs (pipeline and TP x DP jobs, ranks 4.6-9.8 s apart), and so did 1x
    # (a 4-rank job beside a CI run starting: one rank 5.9 s behind a peer that needed 5.8 s).
    first_step_skew: float = 2.0
    # A stopped process (SIGSTOP, state T) is reported once it stays stopped this long: short enough to
    # beat the stall timeout, long enough to skip a debugger's momentary stop.
    stopped_grace_s: float = 1.0

    def timeout_for(self, longest_step_s: float) -> float:
        if self.timeout_s is not None:
            return self.timeout_s
        return max(self.auto_floor_s, self.auto_factor * longest_step_s)

    def startup_for(self) -> float:
        # With a fixed timeout larger than the start-up budget, the fixed one wins.
        if self.timeout_s is not None:
            return max(self.timeout_s, self.startup_s)
        return self.startup_s


@dataclass(frozen=True)
class CapturePolicy:
    # py-spy on a healthy process takes ~0.1 s; a busy 2-core host can take 10×.
    pyspy_timeout_s: float = 5.0
    # the dump responder answers within a GIL switch interval unless the rank is truly wedged
    responder_timeout_s: float = 3.0
    # frames per stack kept in the verdict's stack_top
    stack_top_frames: int = 5
    # frames used for grouping ranks by stack signature (deep enough to separate call sites)
    signature_frames: int = 12
    include_locals: bool = False
    # gap between the two NCCL RAS queries of an incident: operation counts that did not move across it
    # are stuck, not just slow (one RAS round trip is ~ms; a healthy collective finishes well within 1 s)
    ras_recheck_s: float = 1.0
    # a rank that died during capture (torchrun stops the survivors of a dead rank within 0.2 s) is waited
    # for in the daemon's polls this long, so the bundle says it is gone rather than "running" with no
    # stack (several poll intervals of the default 0.5 s, on a busy host)
    vanished_settle_s: float = 3.0


@dataclass(frozen=True)
class InspectPolicy:
    """How ``rankwatch inspect`` tells a job that runs from one that is stalled before it calls anything a
    stall (``core.inspect_facts.judge_progress``): it looks at every rank twice, this far apart, and a job
    is *running* when each of its live ranks made progress between the looks — its stack's signature
    changed and its CPU time advanced, or its flight recorder's counters advanced."""

    # the looks start at least this far apart: a stepping rank of a small job runs many steps in it and
    # a large job's rank moves between functions (or completes collectives) well within it; a job whose
    # ranks stay in the same functions for longer than this (a step of minutes) needs --look-interval
    look_interval_s: float = 1.0
    # CPU time a rank must spend between the looks (a share of one core over the time between them) for a
    # changed stack to count as progress: a rank that steps runs Python between kernels and collectives
    # (tens of %); one that polls in a sleep loop, its stack flipping between the sleep and the check,
    # spends well under 1 %; a rank blocked in a wait spends none. At least one clock tick either way.
    min_cpu_share: float = 0.02
    # or, where the stack read the same, its main thread was woken from a wait this often per second
    # between the looks (the kernel's voluntary context switches of the main thread): a stepping rank
    # waits for its peers, its collectives and its DataLoader and is woken several times each step
    # (~600/s in a small gloo job), so a quick step that lands in the same function at both looks still
    # shows. A rank stuck in a wait is never woken; one spinning in C (NCCL's synchronize) or in Python
    # is woken only when another thread asks for the GIL (a few times a second at most). A rank polling in
    # a tight loop is woken often too, which is why one rank's progress never makes a job running alone:
    # its peers, waiting for it, stand still.
    min_wakeups_per_s: float = 5.0
    # further looks, each look_interval_s after the last, at the ranks whose CPU time advanced but whose
    # stack read the same: a healthy rank lands in the same functions twice by chance (a quick step spends
    # much of its time in one all-reduce), three times in a row rarely; a rank spinning in one place (a
    # busy loop, NCCL's spin in a synchronize) reads the same every time. A rank whose CPU time stood still
    # needs no further look: the job is stalled at once.
    confirm_looks: int = 2


@dataclass(frozen=True)
class KillPolicy:
    # after SIGTERM, ranks get this long to exit before SIGKILL (stopped ranks get SIGCONT first)
    term_grace_s: float = 5.0


@dataclass(frozen=True)
class ServePolicy:
    """How the daemon loop treats jobs and incidents over time."""

    # a job whose ranks are all gone is retired after this long: a death seen in the last poll can still
    # open its incident (and a dead-rank incident needs its exit order) before the job is forgotten
    retire_after_s: float = 10.0
    # retired jobs are checked for a new run's records (torchrun restart, reused run name) every this
    # many polls: a restart is rare, listing the dir every poll is not free at many jobs
    revive_check_every: int = 4
    # incidents handled at once, off the poll loop; each runs py-spy for every local rank in parallel,
    # so more would only compete for the same cores (one incident per job at a time anyway)
    incident_workers: int = 4
    # incidents one job owner may have in the pipeline at once: half the workers, so another user's incident
    # always finds one free however many of one user's jobs hang together (the rest wait for the next poll)
    incidents_in_flight_per_owner: int = 2
    # a bundle write that fails (ENOSPC, EIO) is retried this many times, this far apart, within one try
    bundle_attempts: int = 3
    bundle_retry_s: float = 0.2
    # on shutdown, in-flight incidents get this long to finish their bundles (capture ≤ pyspy timeout,
    # cross-node verdict wait ≤ CorrelationPolicy.verdict_timeout_s)
    drain_timeout_s: float = 30.0
    # a bundle that still could not be written (full or read-only disk) is retried this often until it is;
    # its verdict is in the log meanwhile. At most this many wait in memory (captures can be MBs each)...
    bundle_retry_every_s: float = 5.0
    max_unwritten_bundles: int = 32
    # ...and at most this many of one job owner's: one user's quick incidents on a full disk push out only
    # that user's oldest, never another user's (issue 42: 18 of them took the one shared queue of 16)
    max_unwritten_bundles_per_owner: int = 8
    # records of finished jobs are removed this long after the job was retired (None: never): long enough
    # for `rankwatch status --all` and a post-mortem look, short enough that /dev/shm does not fill up
    retain_finished_s: float | None = 3600.0
    # incident bundles kept under the daemon's --out, newest first (None: all); an incident storm must not
    # fill /var/lib on a GPU node
    keep_incidents: int | None = 200
    # and at most this many bytes of bundles per job owner (the newest is always kept): one incident with
    # big dumps is ~72 MiB, so one user's flood of them must not fill the disk other users' bundles need
    keep_incident_bytes: int | None = 4 << 30
    # at start, dump dirs older than this are leftovers of a daemon that was killed mid-capture
    stale_dump_age_s: float = 60.0
    # /healthz answers 503 once no poll has completed for this long, or for this many poll intervals if
    # that is longer: systemd's WatchdogSec=30s patience, so a Kubernetes liveness probe restarts a wedged
    # daemon when systemd would; a poll is bounded work (incidents run off the loop), so 10 intervals
    # without one is a wedged loop, not a slow poll
    health_max_poll_age_s: float = 30.0
    health_max_poll_intervals: int = 10
    # the state file `rankwatch status` reads is rewritten at once when what it says changes, else this
    # often, so its age tells status that the watchdog is alive (~1 KB to tmpfs per job: free)
    state_refresh_s: float = 2.0
    # status calls a state file older than this stale (its watchdog is gone or wedged): several refreshes
    # missed, and longer than one slow poll of a node with many jobs
    state_stale_after_s: float = 15.0
    # incidents listed in the state file (the newest; the bundles hold the rest)
    state_incidents: int = 20
    # a restarted daemon resumes the incident its predecessor left open only for the same run of the job:
    # the run's start is derived from the records' monotonic start and the wall clock at each look, which
    # agree to milliseconds unless the clock was stepped; a reused job id starts seconds (a restart) apart
    resume_generation_tolerance_s: float = 1.0
    # polls a restarted daemon looks for the left-open incident's stall (or the job's recovery) before it
    # drops it and detects afresh: the stall is in the records at the first poll, unless the stall timeout
    # is still being learnt from the step history
    resume_polls: int = 10
    # multi-node jobs one daemon correlates at once (each: three store connections, three threads), and per job
    # owner: a node runs a handful of jobs; a user's hundreds of job dirs claiming "node 0 of 2" must not
    # take the daemon's fds and threads, nor other users' correlation
    correlated_jobs: int = 64
    correlated_jobs_per_owner: int = 8


@dataclass(frozen=True)
class MetricsPolicy:
    """Where /metrics goes when its port is taken: metrics are optional, so a taken port never stops a job
    or the daemon (issue 42: a second `rankwatch run` on a node used to exit 2 before launching)."""

    # `rankwatch run` tries the port asked for and the ones above it, this many in all: an 8-GPU node runs
    # at most 8 one-GPU jobs, each a `rankwatch run` with the same default port, beside the node's daemon
    # and an exporter or two; twice that still finds a free port, and a range this wide all taken means
    # something holds the whole range, where scanning farther only scatters the targets Prometheus looks for
    run_port_tries: int = 16
    # the daemon tries only its own port: it is the node's fixed address (static scrape configs, the
    # Kubernetes liveness probe on /healthz), and on another port a probe would reach someone else's server
    daemon_port_tries: int = 1
    # while its port is taken the daemon watches on without metrics and tries the port again this often,
    # so /metrics and /healthz come back by themselves once the port is free: about one Prometheus scrape
    # interval, and a bind try costs one syscall (plus a lookup for a host name), off the poll loop
    daemon_retry_s: float = 10.0


@dataclass(frozen=True)
class AlertPolicy:
    """How an incident reaches people: webhooks (--notify) and a command (--on-incident)."""

    # one POST waits this long: a webhook endpoint that hangs must not hold the alert queue for long
    notify_timeout_s: float = 5.0
    # tries per webhook, backing off 1 s, 2 s, 4 s: rides out a restart of the receiver or a 5xx burst,
    # gives up within ~30 s so the next incident's alert is not stuck behind it
    notify_attempts: int = 4
    notify_backoff_s: float = 1.0
    # an --on-incident command is killed after this long (it runs off the watchdog loop, one at a time)
    command_timeout_s: float = 60.0
    # alerts waiting to be sent, per target; beyond this the oldest is dropped (logged): an incident storm
    # must not grow memory without bound while a webhook is down
    max_queued: int = 64
    # one job's share of a target's queue: a job over it loses its own oldest alert, never another job's
    max_queued_per_job: int = 16
    # one job owner's share, however many jobs they run: half the queue, so another user's alert always finds
    # room; and the sender takes owners in turn, so it never waits behind one user's backlog either
    max_queued_per_owner: int = 32
    # on shutdown, queued alerts get this long, then what is in flight is cut: SIGTERM is not held by a
    # webhook that trickles (systemd's stop timeout is longer; a healthy webhook answers in milliseconds)
    close_timeout_s: float = 5.0
    # Alertmanager: a firing alert is re-sent this often, and ends this long after the last send unless
    # re-sent (Prometheus' own rhythm: 1 min resend, 4x for endsAt), so a dead daemon's alerts expire
    am_resend_s: float = 60.0
    am_hold_s: float = 300.0
    # incidents remembered for their resolved notice (a bounded map: the oldest expire in Alertmanager)
    max_remembered: int = 1024
    # a job pages the webhooks at most once this often: the first incident at once, the rest of the window
    # held and sent as one summary at its end (the newest, with how many it stands for) — a job crash-looping
    # 25 times a minute pages once, then once a minute, not 7 times a minute (issue 42); 0: every incident
    job_page_every_s: float = 60.0


@dataclass(frozen=True)
class CorrelationPolicy:
    """Cross-node exchange through the TCPStore."""

    # the leader waits this long for every node's evidence: each node captures in parallel (≤ the py-spy
    # timeout) before publishing, so a few seconds beyond it
    evidence_timeout_s: float = 10.0
    # a follower waits this long for the leader's verdict (evidence wait + the leader's own decision)
    verdict_timeout_s: float = 15.0
    # each TCPStore connect does a reverse DNS lookup (5 s resolver default): a slow DNS must not fail it
    connect_timeout_s: float = 10.0
    # clock difference between nodes tolerated when a claim's issue time is checked against the job
    # generation's start: NTP keeps nodes within milliseconds, and a restarted job starts seconds (the kill's
    # grace period, torchrun's restart) after the claim that killed the previous run
    claim_skew_s: float = 1.0
    # above this many ranks the published verdict drops non-initiating ranks' entries (~450 bytes each),
    # so 256 nodes do not each download megabytes; every node adds its own ranks back
    slim_verdict_above_ranks: int = 512
    # steps per rank shared for the leader's end-of-run summary: the straggler window, bounded for the store
    history_steps_shared: int = 200
    # host-signal samples per rank shared with those steps (``straggler_cause.thin_samples``), and per node: the
    # leader sets a rank's TCP, GPU and pressure counters against its peers' on other nodes. A sample is ~300
    # bytes of JSON, so a node's share stays under 1.5 MB of the store's 4 MB a value; 256 over a 200-step window
    # are more polls than the window holds at 0.5 s polls for steps up to 0.6 s, and every TCP dump is kept first
    history_samples_per_rank: int = 256
    history_samples_per_node: int = 4096
    # at the end of `rankwatch run` the leader waits this long for the other nodes' step rings
    summary_wait_s: float = 15.0
    # without a store secret, another node's claim is captured for only once a local rank has made no
    # progress for this fraction of its stall allowance: in a real hang every rank stops within a step of
    # the initiator (auto timeouts are ≥ 4 steps, so half leaves 2 steps of margin), while a healthy rank
    # progresses at every phase — a forged claim cannot make a healthy node write a bundle
    unauthenticated_claim_stall_fraction: float = 0.5
    # each node's flight-recorder entries shared with the leader for one incident, newest per process
    # group: ranks' progress comes from pg_status (always whole), so the entries only have to overlap
    # where the ranks stopped — a mismatch or a missing rank sits at the newest seqs (DDP: a handful of
    # bucket all-reduces and a buffer broadcast per step); halved while a node's share passes the bound
    fr_shared_per_pg: int = 16
    # bytes of flight-recorder entries one node adds to its evidence: ~250 bytes an entry for DDP, a few
    # KiB for an FSDP coalesced op over 64 tensors; the leader parses every node's share (~15 ms per
    # 256 KiB on a loaded core), so 512 KiB keeps 64 nodes near a second (benchmarks/bench_fr_share.py)
    fr_shared_bytes: int = 512 << 10
    # a value under a key the leader or a node publishes was rejected (hostile or torn): the store cannot
    # wake anyone when it is replaced, so that key alone is re-read this often (valid values wake at once)
    rejected_value_retry_s: float = 0.1
    # -- live: every node's recent steps and signals for the leader's live straggler diagnosis (``cluster.live_share``)
    # a node publishes its recent history this often, from a thread and a store connection of its own (never the
    # poll loop's): the leader's live look runs every ``LiveStragglerPolicy.every_s`` (2 s) and reports a straggler
    # named twice, so a straggler on another node is reported ~2 shares (8-10 s) after it shows in the window;
    # at the bounds below a node writes ≤ ~0.5 MB per share, ~0.1 MB/s
    live_share_every_s: float = 4.0
    # steps per rank shared live: the span the live diagnosis reads (2 × ``LiveStragglerPolicy.window_steps``,
    # so ranks a few steps apart still share a whole window)
    live_steps_shared: int = 200
    # host-signal samples shared live per rank and per node (``straggler_cause.thin_samples``, every TCP dump kept
    # first): 64 over a 200-step window hold every TCP dump of a 40 s window (one per 2 s, ``NET_EVERY_S``) and
    # 32 evenly spread polls; a sample is ~300 bytes of JSON, so 1,024 a node stay near 0.3 MB
    live_samples_per_rank: int = 64
    live_samples_per_node: int = 1024
    # ranks of other nodes the leader merges into its live diagnosis, nodes taken in order: every share the leader
    # parses each node's value (~0.27 MB for 8 ranks: 80-120 ms at load ~20 on 2 cores) and diagnoses the merged
    # ranks (64 ranks: ~0.3 s there), all on the share thread (``benchmarks/bench_live_share.py``); 64 ranks keep
    # that near a quarter of a loaded core every 4 s (a few % on a quiet one). The nodes after them are compared
    # in the end-of-run summary only
    live_ranks_merged: int = 64
    # bytes of other nodes' live values the leader reads in one look, on the share thread's own connection: the
    # 64 ranks above at their bounds (~0.3 MB per 8 ranks) with room
    live_read_budget_bytes: int = 4 << 20
    # a node whose live value the leader has not seen change for this long is left out of the live diagnosis
    # (its watchdog stopped, or its job ended there): three shares missed
    live_stale_s: float = 12.0
    # the leader's job-wide live diagnosis, published under ``live/diagnosis`` for the followers' status and metrics
    # (``cluster.live_share``): its label, ranks, phase and four lines of at most 512 characters (``store.MAX_STR``,
    # ≤ 3 KiB each JSON-escaped at 6 bytes a character) and at most ``live_diagnosis_ranks`` named ranks with their
    # nodes' names (≤ 128 characters): ~20 KiB at worst, ~1 KiB in practice. A follower reads it every share and
    # refuses a larger value unparsed, so a hostile one costs it one bounded read
    live_diagnosis_bytes: int = 32 << 10
    # ranks the shared diagnosis names (straggler ranks, each with its node): a straggler is one rank or a few;
    # a diagnosis naming more is cut to these (the leader's own status lists them all)
    live_diagnosis_ranks: int = 64


@dataclass(frozen=True)
class VerdictPolicy:
    """Thresholds of the live verdict (``core.verdict.decide``)."""

    # Two exits closer than this (seconds) are not ordered with confidence: exit ages come from each
    # node's daemon polling /proc, whose poll jitter and cross-node skew are tens of milliseconds.
    exit_order_tolerance_s: float = 0.05
    # GPU utilisation (%) that counts as idle: NVML's sampled utilisation of a GPU with no kernel
    # running reads 0-2 %, a few percent more with monitoring tools or a display attached.
    gpu_idle_pct: float = 5.0
    # GPU utilisation (%) that counts as busy: a rank spinning in an NCCL kernel reads ~100 %; half
    # leaves room for sampling windows that straddle the start of the wait.
    gpu_busy_pct: float = 50.0
    # A live rank that made progress (a phase, a step) less than this long ago is mid-step, not a rank holding
    # the others: an incident on a death or a silent node fires at once, while the live ranks are still
    # finishing their step (a step is 0.05–0.5 s in the demo jobs, a stall needs the stall timeout, seconds).
    # Where the ranks the others wait for are only such ranks and some ranks are silent, the silent ones are
    # the sinks (the node-loss race: rank 1 named 0.1 s into backward).
    in_motion_s: float = 1.0


@dataclass(frozen=True)
class OfflinePolicy:
    """Thresholds of the offline log diagnosis (``diagnose.reasoning.diagnose_evidence``)."""

    # Failures closer than this (seconds, same clock) are not ordered: NCCL/gloo report to the second
    # or millisecond, but the printing order across processes is only that precise.
    tie_s: float = 1.0
    # Evidence lines quoted per rank, and overall, so a verdict stays readable.
    evidence_per_rank: int = 4
    max_evidence: int = 24
    # A rank that dies by one of these, unasked, failed by itself (SIGTERM is torchrun's closing signal).
    fatal_signals: frozenset[str] = frozenset({"SIGKILL", "SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT"})
    # SeqNums of no stated process group (the old "[Rank N]" prefix every group printed alike) are compared
    # only this close: in one group a rank stuck in a hang is a few collectives behind (DDP: a handful of
    # buckets per step, and every rank stops within a step of the initiator), while counters of different
    # groups drift apart by thousands (a real log's 32k gap between a TP and a DP group)
    unknown_pg_max_gap: int = 64


@dataclass(frozen=True)
class ObservePolicy:
    """How records and rank processes are read."""

    # a rank that could not be verified is tried again this often (polls): a record planted for a pid
    # must not cost a /proc maps scan every poll, and a real rank is verified on its first look anyway
    reverify_every_polls: int = 10
    # descendants (DataLoader workers, subprocesses) are pinned this often (seconds), so --on-stall kill
    # knows them even after the rank died and they were reparented; one scan reads every /proc/<pid>/stat
    descendants_every_s: float = 2.0
    track_descendants: bool = True
    # records read per job and poll: a node hosts a few dozen ranks of one job at most; a dir of 1,100
    # planted records is a flood, and what it costs is bounded here (and by the owner's reader budget)
    max_records_per_job: int = 256
    # host-signal samples (``observe.signals``) kept per job, one per poll: 2,400 polls of 0.5 s are 20 min,
    # longer than the straggler window of 200 steps for steps up to 6 s; ~200 bytes per rank each
    signal_samples_kept: int = 2_400
    # sample the ranks' host signals at every poll (a handful of /proc and cgroup reads per rank: ~0.1 % of a
    # core for 8 ranks at 0.5 s, ``benchmarks/bench_signals.py``); off: no cause is given
    sample_signals: bool = True


@dataclass(frozen=True)
class GroupingPolicy:
    """Thresholds of grouping sources into jobs."""

    # Two time spans this close still overlap: a rank's console tee and its own per-rank file are
    # written by one clock; across nodes NTP keeps clocks within a second; report times are whole seconds.
    time_slack_s: float = 2.0
    # A source without ranks (dmesg, a scheduler log) fits a job whose span is this close to its own: a
    # kernel OOM kill or an Xid comes first and the ranks' timeouts follow up to one collective timeout
    # later (torch's NCCL default 10 min, gloo's 30 min).
    rankless_slack_s: float = 1800.0
    # How much of each source is searched for its job keys: launch config, rendezvous result, environment
    # dumps and Slurm's job lines come first.
    head_bytes: int = 1 << 20


@dataclass(frozen=True)
class ReaderPolicy:
    """What one owner's reader (``privsep``: a worker running as the job's owner) may cost the daemon."""

    # a reader answers in microseconds; one that does not within this is stopped or wedged (its user can
    # SIGSTOP it): that owner's poll loses at most this much before the reader is written off
    request_timeout_s: float = 1.0
    # a written-off reader is respawned no sooner than this, so a user killing theirs in a loop costs the
    # daemon one deadline per period, not per poll
    respawn_backoff_s: float = 10.0
    # records open per reader (each holds an fd in the reader): a job has one per local rank, a node a few
    # hundred at most; more is a flood, refused with one log line
    max_records: int = 512
    # torn reads retried per record per poll (no sleeps): a record held odd costs microseconds, not 60 ms
    torn_retries: int = 32
    # the most a py-spy dump may print (a real one of a rank is tens of KB; 100 MB would cost GBs to parse)
    pyspy_max_bytes: int = 8 << 20  # = capture.MAX_PYSPY_BYTES


@dataclass(frozen=True)
class FairnessPolicy:
    """Each job owner's share of the daemon (issue 42): one user's volume — job dirs, records, torn records,
    a stopped reader, children, incidents, bundles, alerts — slows or drops only that user's own."""

    # the loop waits this long at most for the owners' rounds of one poll (they run in parallel, one thread
    # per owner): a healthy round takes milliseconds (a few exchanges per job with the owner's reader), a
    # reader's request deadline is 1 s (``ReaderPolicy``). An owner still busy after it is *lagging*: its
    # jobs keep their last state, the loop and every other owner's next round go on, and a lagging owner is
    # not waited for again until its round is done — so a stopped reader costs the loop this once, not per
    # poll, and another user's hang is seen at most this much later (the 2x target: 0.25 s of a 2 s timeout)
    round_wait_s: float = 0.25
    # start-up (and an explicit ``Daemon.discover``) waits this long for every owner's first look, so the
    # first poll sees every job already there; a stopped reader costs at most this, once
    discover_wait_s: float = 5.0
    # while the loop waits for its only owner's round (nobody else to be fair to), it lists the shared dir
    # this often for a second owner's job: a new user's first look then waits at most this (half a poll)
    new_owner_look_s: float = 0.1
    # job dirs an owner's round looks at for the first time (each: a dir handed to the reader, its names,
    # job.json, and one exchange per record): 5,000 planted dirs are taken in over many rounds of *that
    # owner's* lane, while anyone else's new job is looked at in its own owner's next round
    new_jobs_per_round: int = 16
    # job dirs held per owner (an fd in root and one in the reader each, records' fds besides): a user runs
    # a handful of jobs on a node, a few dozen at most; beyond this their new dirs wait (logged once) until
    # one of theirs is retired, so one user cannot take the fds every other user's jobs need
    jobs_per_owner: int = 64
    # names of the shared dir looked at (one lstat, no open) for the first time per poll: a rename of 5,000
    # dirs costs ~10 ms of lstats once, then nothing; a name already seen is not examined again until it
    # changes (its inode or ctime: a re-check of this many remembered names per poll, in turn)
    examine_per_poll: int = 8192
    recheck_per_poll: int = 512
    # owners listed with their lag on /metrics, laggiest first (the series budget: one series per owner;
    # a node has a handful of users, a shared login node a few dozen)
    owner_series: int = 16
    # pidfds of descendants (DataLoader workers, subprocesses) held for ``--on-stall kill`` per job owner:
    # 1,024 per rank already (``process.MAX_DESCENDANTS``); 4,096 per user covers 8 ranks with 16 workers
    # each many times over, and leaves the daemon's other 60,000 fds (LimitNOFILE=65536) to everyone else
    descendant_pidfds_per_owner: int = 4096
