"""Fault injection and DLRover-RM's recovery mechanisms for the simulator (pure).

Three kinds of fault, injected into a workload and a run:

- **OOM from under-estimates**: jobs come in spec families (repeated submissions of one
  spec, as in a sweep); for a fraction of the families the estimator is biased low
  (e.g. a custom module it does not count), so their true peak is the estimate plus
  `bias_pct`, beyond the fence's margin.
- **Host OOM from under-estimates** (issue 43): for `host_oom_family_frac` of the
  families the host-memory estimate is low by `host_oom_bias_pct`; past its share of the
  pack's `--mem` (plus the agent's tolerance) a member is stopped by the agent or killed
  by the kernel's OOM killer, both `OOM_HOST`, and retried with more host memory.
- **Node failures**: each node fails after an exponential time with mean
  `node_mtbf_h`; every pack on it ends (Slurm's NODE_FAIL) and the node is back after
  `node_repair_s`.
- **Interference beyond the model**: a fraction of families use far more of the GPU
  than estimated (their true SM/bandwidth use is the estimate times
  `straggler_util_factor`), so they and their neighbours run below the planned speed.

The recovery side makes the same decisions as the service, through `slurm_dlrm.adapt`:
`decide_after_oom` (raise from the failed fence and measured peak, retry limit),
`members_to_requeue` (NODE_FAIL -> unfinished members rerun from checkpoints),
`find_stragglers` (sustained speed below `straggler_ratio` of the prediction -> the
member whose measured profile departs from its estimate is checkpointed and moved with
its measured profile). What was learned is kept per spec fingerprint (the family):
a memory correction and a profile correction, so later jobs of the family start right.
With `RecoveryConfig.enabled` False an OOM or a node failure ends the job as FAILED
and stragglers are left where they are.

`FaultRuntime` is the stateful object the engine calls at a few hooks; it does no I/O.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from slurm_dlrm.adapt import (
    MemberOutcome,
    SpeedSample,
    choose_moves,
    decide_after_oom,
    find_stragglers,
    members_to_requeue,
)
from slurm_dlrm.packing.interference import (
    DEFAULT_PARAMS,
    InterferenceParams,
    predict_speeds_from_fractions,
)
from slurm_dlrm.packing.model import JobDemand
from slurm_dlrm.sim.files import SimJob, Workload


@dataclass(frozen=True)
class FaultConfig:
    seed: int = 11
    families: int = 60  # distinct specs in the workload (job i belongs to one at random)
    oom_family_frac: float = 0.0  # share of families whose memory estimate is biased low
    oom_bias_pct: tuple[float, float] = (10.0, 40.0)  # true peak = estimate x (1 + this)
    host_oom_family_frac: float = 0.0  # share of families whose host-memory estimate is biased low
    host_oom_bias_pct: tuple[float, float] = (20.0, 60.0)  # true host peak = estimate x (1 + this)
    node_mtbf_h: float = 0.0  # mean time between failures of one node; 0: none
    node_repair_s: float = 1800.0  # a failed node is back after this
    node_failures_at: tuple[tuple[float, str], ...] = ()  # extra failures at fixed (time_s, node)
    straggler_family_frac: float = 0.0  # share of families using far more GPU than estimated
    straggler_util_factor: tuple[float, float] = (3.0, 5.0)  # true SM/bandwidth = estimate x this


@dataclass(frozen=True)
class RecoveryConfig:
    enabled: bool = True
    max_attempts: int = 4  # OOMs of one job before it fails (decide_after_oom's limit)
    checkpoint_every_s: float = 300.0  # training seconds between checkpoints (what a kill loses at most)
    learn: bool = True  # keep corrections per spec fingerprint for later jobs of the family
    stragglers: bool = True
    observe_s: float = 30.0  # how often the agent's speed samples arrive
    straggler_ratio: float = 0.7
    straggler_sustained_s: float = 120.0
    profile_change_pct: float = 25.0  # a member is the cause if its measured use departs by this


def as_spec_families(workload: Workload, families: int, seed: int) -> tuple[Workload, dict[int, int]]:
    """The workload with each job turned into a repeated submission of one of
    `families` specs: a job takes its family's first member's estimate and truth
    (memory, profile, host demand) and keeps its own arrival and duration."""
    rng = random.Random(seed)
    fam_of: dict[int, int] = {}
    first: dict[int, SimJob] = {}
    out = []
    for j in workload.jobs:
        f = rng.randrange(max(1, families))
        fam_of[j.job_id] = f
        proto = first.setdefault(f, j)
        out.append(replace(j, gpu_mem_bytes=proto.gpu_mem_bytes, host_mem_bytes=proto.host_mem_bytes,
                           sm_util_pct=proto.sm_util_pct, membw_util_pct=proto.membw_util_pct,
                           host_cpu_cores=proto.host_cpu_cores, label=proto.label,
                           true_gpu_mem_bytes=min(proto.true_gpu_mem_bytes, proto.gpu_mem_bytes),
                           true_sm_util_pct=proto.true_sm_util_pct, true_membw_util_pct=proto.true_membw_util_pct))
    return replace(workload, jobs=tuple(out)), fam_of


def inject_faults(workload: Workload, fam_of: dict[int, int], cfg: FaultConfig) -> Workload:
    """The same jobs with the injected under-estimates and hidden heavy profiles."""
    rng = random.Random(cfg.seed)
    fams = sorted(set(fam_of.values()))
    oom_bias = {f: rng.uniform(*cfg.oom_bias_pct) / 100.0 for f in fams if rng.random() < cfg.oom_family_frac}
    heavy = {f: rng.uniform(*cfg.straggler_util_factor) for f in fams if rng.random() < cfg.straggler_family_frac}
    # its own generator: the GPU faults above stay what they were for a seed
    host_rng = random.Random(cfg.seed + 7919)
    host_bias = {f: host_rng.uniform(*cfg.host_oom_bias_pct) / 100.0 for f in fams
                 if host_rng.random() < cfg.host_oom_family_frac}
    jobs = []
    for j in workload.jobs:
        f = fam_of[j.job_id]
        if f in oom_bias:
            j = replace(j, true_gpu_mem_bytes=int(j.gpu_mem_bytes * (1.0 + oom_bias[f])))
        if f in host_bias:
            j = replace(j, true_host_mem_bytes=int(j.host_mem_bytes * (1.0 + host_bias[f])))
        if f in heavy:
            j = replace(j, true_sm_util_pct=min(95.0, j.sm_util_pct * heavy[f]),
                        true_membw_util_pct=min(95.0, j.membw_util_pct * heavy[f]))
        jobs.append(j)
    return replace(workload, jobs=tuple(jobs))


def label_of(sm: float, bw: float, cpus: float) -> str:
    # Same rule as the workload generator's (sim/files.py _label).
    if max(sm, bw) < 12.0 and cpus >= 4:
        return "host-bound"
    return "memory-bound" if bw >= sm else "compute-bound"


@dataclass(frozen=True)
class KillAction:
    requeue: bool
    saved_progress_s: float  # training seconds kept (the checkpoint it resumes from)
    demand: JobDemand | None  # what the next round is asked with (None: FAILED)
    reason: str


@dataclass
class FaultStats:
    ooms: int = 0
    host_ooms: int = 0  # of `ooms`, those out of host memory
    oom_requeues: int = 0
    oom_failures: int = 0
    node_failures: int = 0
    node_requeues: int = 0
    node_failed_jobs: int = 0
    straggler_moves: int = 0
    lost_work_s: float = 0.0  # training seconds thrown away (progress past the last checkpoint)
    events: list[tuple[float, int, str]] = field(default_factory=list)  # (time, job, reason)


class FaultRuntime:
    """State of the injected faults and of the recovery during one `simulate()` run."""

    def __init__(self, fam_of: dict[int, int], faults: FaultConfig, recovery: RecoveryConfig,
                 plan_params: InterferenceParams | None = None) -> None:
        self.fam_of = fam_of
        self.faults = faults
        self.recovery = recovery
        self.plan_params = plan_params or DEFAULT_PARAMS
        self.rng = random.Random(faults.seed + 1)
        self.stats = FaultStats()
        self.mem_correction: dict[int, float] = {}  # family -> needed / estimated GPU bytes
        self.host_correction: dict[int, float] = {}  # family -> needed / estimated host bytes
        self.host_req: dict[int, int] = {}  # job -> host bytes asked for after a host OOM
        self.profile_seen: dict[int, tuple[float, float]] = {}  # family -> measured / estimated (sm, bw)
        self.oom_count: dict[int, int] = defaultdict(int)
        self.planned: dict[int, JobDemand] = {}  # job -> demand it was placed with
        self.speeds: dict[int, deque[SpeedSample]] = {}
        self.moved: set[int] = set()

    # ------------------------------------------------------------ helpers

    def _log(self, t: float, job_id: int, reason: str) -> None:
        self.stats.events.append((t, job_id, reason))

    def _checkpoint(self, progress_s: float, start_s: float) -> float:
        every = self.recovery.checkpoint_every_s
        saved = math.floor(progress_s / every) * every if every > 0 else 0.0
        return max(saved, start_s)  # never behind the checkpoint this attempt resumed from

    def demand(self, job: SimJob, gpu_mem_bytes: int, progress_s: float, sm: float | None = None,
               bw: float | None = None) -> JobDemand:
        host = self.host_req.get(job.job_id, job.host_mem_bytes)
        left = job.solo_duration_s - progress_s
        est_left = (job.est_duration_s or job.solo_duration_s) * left / job.solo_duration_s
        s = job.sm_util_pct if sm is None else sm
        b = job.membw_util_pct if bw is None else bw
        return JobDemand(job_id=job.job_id, user=job.user, submit_time_s=job.arrival_s, priority=job.priority,
                         gpu_mem_bytes=gpu_mem_bytes, host_mem_bytes=host, sm_util_pct=s,
                         membw_util_pct=b, host_cpu_cores=job.host_cpu_cores,
                         label=job.label if sm is None and bw is None else label_of(s, b, job.host_cpu_cores),
                         est_duration_s=est_left, name=job.name, may_pause=job.may_pause)

    # ------------------------------------------------------------ hooks the engine calls

    def arrival_demand(self, job: SimJob, now: float) -> JobDemand:
        """Warm start: a family's learned memory and profile corrections apply to a new job."""
        mem = job.gpu_mem_bytes
        sm, bw = job.sm_util_pct, job.membw_util_pct
        fam = self.fam_of.get(job.job_id)
        warm = False
        if self.recovery.enabled and self.recovery.learn and fam is not None:
            corr = self.mem_correction.get(fam)
            if corr is not None and corr > 1.0:
                mem = math.ceil(mem * corr)
                warm = True
            host_corr = self.host_correction.get(fam)
            if host_corr is not None and host_corr > 1.0:
                self.host_req[job.job_id] = math.ceil(job.host_mem_bytes * host_corr)
                warm = True
            prof = self.profile_seen.get(fam)
            if prof is not None:
                sm, bw = min(100.0, sm * prof[0]), min(100.0, bw * prof[1])
                warm = True
        if warm:
            self._log(now, job.job_id, f"warm start from spec family {fam}: {mem >> 20} MiB, sm {sm:.0f}%, bw {bw:.0f}%")
            return self.demand(job, mem, 0.0, sm, bw)
        return self.demand(job, mem, 0.0)

    def on_placed(self, demand: JobDemand, now: float) -> None:
        self.planned[demand.job_id] = demand
        self.speeds.pop(demand.job_id, None)

    def on_oom(self, job: SimJob, now: float, progress_s: float, start_s: float, est_bytes: int,
               limit_bytes: int, capacity_bytes: int, kind: str = "gpu") -> KillAction:
        """An OOM (`kind` "gpu": at its GPU fence; "host": past its host share, `limit_bytes`
        then the host limit it had and `capacity_bytes` a node's memory): raise and requeue
        from the checkpoint, as the service's `after_oom`, or fail."""
        jid = job.job_id
        self.stats.ooms += 1
        if kind == "host":
            self.stats.host_ooms += 1
        self.oom_count[jid] += 1
        saved = self._checkpoint(progress_s, start_s)
        self.stats.lost_work_s += progress_s - saved
        if not self.recovery.enabled:
            self.stats.oom_failures += 1
            reason = f"out of {'host' if kind == 'host' else 'GPU'} memory; recovery off: FAILED"
            self._log(now, jid, reason)
            return KillAction(False, saved, None, reason)
        host_req = self.host_req.get(jid, job.host_mem_bytes)
        # The agent's samples show the member's peak: it died at its limit.
        true_peak = (job.true_host_mem_bytes or job.host_mem_bytes) if kind == "host" else job.true_gpu_mem_bytes
        d = decide_after_oom("host" if kind == "host" else "gpu", est_bytes, host_req, limit_bytes,
                             min(true_peak, limit_bytes), self.oom_count[jid],
                             self.recovery.max_attempts, capacity_bytes)
        self._log(now, jid, d.reason)
        if d.action == "fail":
            self.stats.oom_failures += 1
            return KillAction(False, saved, None, d.reason)
        self.stats.oom_requeues += 1
        fam = self.fam_of.get(jid)
        if kind == "host":
            self.host_req[jid] = d.host_mem_bytes
            if self.recovery.learn and fam is not None:
                self.host_correction[fam] = max(self.host_correction.get(fam, 1.0),
                                                d.host_mem_bytes / max(1, job.host_mem_bytes))
        elif self.recovery.learn and fam is not None:
            self.mem_correction[fam] = max(self.mem_correction.get(fam, 1.0), d.gpu_mem_bytes / job.gpu_mem_bytes)
        planned = self.planned.get(jid)
        sm = planned.sm_util_pct if planned else None
        bw = planned.membw_util_pct if planned else None
        return KillAction(True, saved, self.demand(job, d.gpu_mem_bytes, saved, sm, bw), d.reason)

    def on_node_fail(self, now: float, node: str, members: Sequence[tuple[SimJob, float, float, int]]) -> dict[int, KillAction]:
        """`members`: (job, progress_s, attempt start progress, GPU estimate) of each
        unfinished member of the packs on `node`."""
        self.stats.node_failures += 1
        outcomes = [MemberOutcome(j.job_id, "RUNNING") for j, _, _, _ in members]
        rerun = dict(members_to_requeue("NODE_FAIL", outcomes)) if self.recovery.enabled else {}
        out = {}
        for job, progress, start, est in members:
            saved = self._checkpoint(progress, start)
            self.stats.lost_work_s += progress - saved
            reason = rerun.get(job.job_id)
            if reason is None:
                self.stats.node_failed_jobs += 1
                reason = f"node {node} failed (NODE_FAIL); recovery off: FAILED"
                out[job.job_id] = KillAction(False, saved, None, reason)
            else:
                self.stats.node_requeues += 1
                reason = f"node {node} failed: {reason} at {saved:.0f}s"
                planned = self.planned.get(job.job_id)
                out[job.job_id] = KillAction(True, saved, self.demand(
                    job, est, saved, planned.sm_util_pct if planned else None,
                    planned.membw_util_pct if planned else None), reason)
            self._log(now, job.job_id, reason)
        return out

    def next_failure_in_s(self) -> float | None:
        if self.faults.node_mtbf_h <= 0:
            return None
        return self.rng.expovariate(1.0 / (self.faults.node_mtbf_h * 3600.0))

    def on_complete(self, job: SimJob, now: float) -> None:
        """The finished job's measured peak and profile are learned for its family."""
        fam = self.fam_of.get(job.job_id)
        if fam is None or not (self.recovery.enabled and self.recovery.learn):
            return
        need = job.true_gpu_mem_bytes / max(1, job.gpu_mem_bytes)
        if need > 1.0 or fam in self.mem_correction:
            self.mem_correction[fam] = max(need, 1.0)
        host_need = (job.true_host_mem_bytes or job.host_mem_bytes) / max(1, job.host_mem_bytes)
        if host_need > 1.0 or fam in self.host_correction:
            self.host_correction[fam] = max(host_need, self.host_correction.get(fam, 1.0))
        if job.sm_util_pct > 0 and job.membw_util_pct > 0:
            ratio = (job.true_sm_util_pct / job.sm_util_pct, job.true_membw_util_pct / job.membw_util_pct)
            if max(ratio) > 1.0 + self.recovery.profile_change_pct / 100.0:
                self.profile_seen[fam] = ratio

    def observe(self, now: float, gpus: Iterable[Sequence[tuple[SimJob, float, float]]]) -> list[tuple[int, KillAction]]:
        """Speed samples of every running member, grouped by GPU: (job, relative speed,
        progress). Returns the members to checkpoint and move, each with its action."""
        if not (self.recovery.enabled and self.recovery.stragglers):
            return []
        window = self.recovery.straggler_sustained_s + 2 * self.recovery.observe_s
        predicted: dict[int, float] = {}
        progress: dict[int, tuple[SimJob, float]] = {}
        groups = []
        for gpu in gpus:
            plans = [self.planned.get(j.job_id) for j, _, _ in gpu]
            if any(p is None for p in plans):
                continue
            groups.append(gpu)
            sp = predict_speeds_from_fractions([min(1.0, p.sm_util_pct / 100.0) for p in plans if p],
                                               [min(1.0, p.membw_util_pct / 100.0) for p in plans if p],
                                               self.plan_params)
            for (job, speed, prog), pred in zip(gpu, sp, strict=True):
                q = self.speeds.setdefault(job.job_id, deque())
                q.append(SpeedSample(job.job_id, now, speed))
                while q and q[0].t < now - window:
                    q.popleft()
                predicted[job.job_id] = pred
                progress[job.job_id] = (job, prog)
        samples = [s for jid in predicted for s in self.speeds[jid]]
        found = find_stragglers(samples, predicted, now, self.recovery.straggler_ratio,
                                self.recovery.straggler_sustained_s)
        change: dict[int, float] = {}
        gpu_of: dict[int, int] = {}
        for gi, gpu in enumerate(groups):
            for job, _, _ in gpu:
                planned = self.planned[job.job_id]
                gpu_of[job.job_id] = gi
                # The agent measures each member's own SM and bandwidth use.
                change[job.job_id] = max(job.true_sm_util_pct / max(planned.sm_util_pct, 1e-9),
                                         job.true_membw_util_pct / max(planned.membw_util_pct, 1e-9))
        out = []
        for jid, why in choose_moves(found, change, gpu_of, 1.0 + self.recovery.profile_change_pct / 100.0):
            job, prog = progress[jid]
            planned = self.planned[jid]
            self.stats.straggler_moves += 1
            reason = (f"straggler: {why}; measured sm {job.true_sm_util_pct:.0f}% bw "
                      f"{job.true_membw_util_pct:.0f}% (planned {planned.sm_util_pct:.0f}%/"
                      f"{planned.membw_util_pct:.0f}%): checkpoint and move")
            self._log(now, jid, reason)
            fam = self.fam_of.get(jid)
            if self.recovery.learn and fam is not None and job.sm_util_pct > 0 and job.membw_util_pct > 0:
                self.profile_seen[fam] = (job.true_sm_util_pct / job.sm_util_pct,
                                          job.true_membw_util_pct / job.membw_util_pct)
            # Checkpointed on the signal: nothing is lost.
            out.append((jid, KillAction(True, prog, self.demand(
                job, planned.gpu_mem_bytes, prog, job.true_sm_util_pct, job.true_membw_util_pct), reason)))
        return out


def with_right_estimates(faulted: Workload) -> Workload:
    """The fault-free reference for `faulted`: the same true work, but every estimate
    covers the true peak and profile (no OOM, no mis-placed heavy job)."""
    return replace(faulted, jobs=tuple(replace(
        j, gpu_mem_bytes=max(j.gpu_mem_bytes, j.true_gpu_mem_bytes),
        host_mem_bytes=max(j.host_mem_bytes, j.true_host_mem_bytes or 0),
        sm_util_pct=max(j.sm_util_pct, j.true_sm_util_pct), membw_util_pct=max(j.membw_util_pct, j.true_membw_util_pct),
        label=label_of(max(j.sm_util_pct, j.true_sm_util_pct), max(j.membw_util_pct, j.true_membw_util_pct),
                       j.host_cpu_cores)) for j in faulted.jobs))
