"""The packing policy's input and output: frozen dataclasses, no I/O.

`PackingRequest` (pending jobs, the GPU models and node shapes on offer, limits) goes
into `plan()`, a `PackingPlan` (packs to create, jobs deferred with a reason) comes
out. A pack's members map one-to-one onto the placement file's members
(docs/interfaces.md section 3): `node_index`, `gpu_index`, `mps_thread_pct`,
`gpu_mem_limit_mib`, `host_mem_limit_bytes`, `cpus`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from slurm_dlrm.site import MIB, GpuModel, SiteConfig

# The per-node agent of a pack takes one CPU and this much host memory of its
# allocation beyond the members (service/refill.pack_allocation asks Slurm for them).
AGENT_CPUS = 1
AGENT_MEM_MIB = 512


def whole_mib_bytes(n_bytes: int) -> int:
    """`n_bytes` rounded up to whole MiB, Slurm's unit of --mem: what a pack planned to
    hold `n_bytes` of host memory is allocated (the service asks it, the simulator holds it)."""
    return -(-n_bytes // MIB) * MIB


LABELS = ("compute-bound", "memory-bound", "host-bound")


@dataclass(frozen=True)
class JobDemand:
    """One pending job as the policy sees it (from its estimate and the store row)."""

    job_id: int
    user: str
    submit_time_s: float
    priority: float  # higher goes first; the dispatcher adds the age bonus
    gpu_mem_bytes: int  # estimated peak GPU bytes *without* the CUDA context
    host_mem_bytes: int  # estimated peak host RSS
    sm_util_pct: float  # solo SM utilisation on the GPU model it was estimated for
    membw_util_pct: float  # solo memory-bandwidth utilisation
    host_cpu_cores: float  # solo host CPU demand (loader workers + main process)
    label: str = "compute-bound"
    solo_samples_per_s: float = 0.0
    est_duration_s: float | None = None  # solo run time if known (steps / rate)
    name: str = ""
    time_limit_s: float | None = None  # the job's own time limit if it has one; a refill join must fit it
    # A *live* member's measured peak GPU bytes (without the context) once it is past
    # its warm-up (DLRM allocates its tables and optimizer state in the first steps):
    # refill then counts that, not its fence (`live_gpu_bytes`). None: not measured yet.
    observed_gpu_mem_bytes: int | None = None
    # A multi-GPU job (world_size > 1, docs/packing.md "Multi-GPU jobs") is placed as
    # `world_size` rank members, all or none, on distinct GPUs of one node. `ranks`:
    # each rank's own demand (the estimate's `ranks`); empty: every rank as the job's
    # figures (its fullest rank's). `rank` is set on the rank members `rank_members` gives.
    world_size: int = 1
    ranks: tuple[RankDemand, ...] = ()
    rank: int = 0
    # When it could first start: its --begin time if later than its submission, else
    # None (= submit_time_s). Its wait, and so its slowdown, counts from here (`fairness`).
    eligible_s: float | None = None
    # A variant of a sweep with a stopping rule (issue 47): it may be paused at a rung
    # and leave its GPU. The policy packs it one GPU to a pack: a Slurm allocation never
    # shrinks, so a multi-GPU pack of such variants would hold every GPU until its last
    # survivor ends (docs/packing.md "Sweeps that stop their losers").
    may_pause: bool = False

    @property
    def cpus(self) -> int:
        return max(1, math.ceil(self.host_cpu_cores - 1e-9))

    @property
    def key(self) -> int:
        """Unique per member: the job id, or for a rank member a negative id derived from
        (job id, rank), so several ranks of one job can be told apart in a plan."""
        return self.job_id if self.world_size <= 1 else -(self.job_id * 4096 + self.rank + 1)

    @property
    def is_gang(self) -> bool:
        return self.world_size > 1


@dataclass(frozen=True)
class RankDemand:
    """One rank of a multi-GPU job, from the estimate's `ranks` (docs/interfaces.md section 2)."""

    gpu_mem_bytes: int  # without the CUDA context, as JobDemand's
    host_mem_bytes: int
    sm_util_pct: float
    membw_util_pct: float
    host_cpu_cores: float
    observed_gpu_mem_bytes: int | None = None


def rank_members(job: JobDemand) -> tuple[JobDemand, ...]:
    """The members a job is placed as: itself (one rank), or one per rank, each with its
    rank's demand (`JobDemand.ranks`; the job's own figures where it has none)."""
    if job.world_size <= 1:
        return (job,)
    out = []
    for r in range(job.world_size):
        rd = job.ranks[r] if r < len(job.ranks) else None
        if rd is None:
            out.append(replace(job, rank=r, ranks=()))
        else:
            out.append(replace(job, rank=r, ranks=(), gpu_mem_bytes=rd.gpu_mem_bytes, host_mem_bytes=rd.host_mem_bytes,
                               sm_util_pct=rd.sm_util_pct, membw_util_pct=rd.membw_util_pct,
                               host_cpu_cores=rd.host_cpu_cores, observed_gpu_mem_bytes=rd.observed_gpu_mem_bytes))
    return tuple(out)


@dataclass(frozen=True)
class NodeShape:
    """Nodes of one shape the user may get; `count` of them (free capacity in the
    simulator, the whole group for the service)."""

    gpu_model: str
    gpus: int
    cpus: int
    memory_bytes: int
    count: int = 1
    name: str = ""


@dataclass(frozen=True)
class PackingLimits:
    max_members_per_gpu: int = 8
    mps_client_limit: int = 48
    memory_margin_pct: float = 5.0  # added to each member's GPU estimate for its fence
    max_gpus_per_pack: int = 4
    shards_per_gpu: int = 8  # the count-based slots of `first-fit` (gres/shard)
    target_load: float = 1.0  # `complementary` keeps summed SM and bandwidth use below this
    min_gain: float = 0.05  # a member beyond the load target must add this much throughput
    # A refilling pack's headroom for later joiners, as a percentage of its members' own
    # CPUs and host memory (at most its GPUs' share of the node): bounded so that a pack
    # of small members does not hold the node's share it will never use (issue 24).
    # None: the whole share, for nodes nothing but packs use (`refill_headroom = "share"`).
    refill_headroom_pct: float | None = 100.0
    # `exact` (issue 50): the CP-SAT solver's deterministic time per round (about
    # seconds) and the job-GPU pairs past which the round stays the heuristic's.
    exact_budget_s: float = 0.2
    exact_max_pairs: int = 600
    # ... and the pending jobs it may choose from beyond the heuristic's own picks: the
    # first `exact_window` of the rest in refill's order (issue 50: the whole queue
    # took the round's optimum but lost over whole runs).
    exact_window: int = 8

    @property
    def members_per_gpu(self) -> int:
        return max(1, min(self.max_members_per_gpu, self.mps_client_limit))


@dataclass(frozen=True)
class OpenGpu:
    """A busy GPU a pending job may join.

    `pack=False` (the default): a GPU running per-job shard allocations (gres/shard),
    only `first-fit` uses these; the GPU's node must be among the request's `nodes`
    (with `gpus=0` if it has no idle GPU left) so that its free CPUs and host memory
    are known.

    `pack=True`: a GPU of one of our running packs (refill, docs/packing.md). `live`
    holds the members running there now (their fences, client slots and profiles
    count), `free_cpus` / `free_host_mem_bytes` what the allocation holds on that node
    beyond its live members, `remaining_s` the allocation's time left. Its node need
    not be among the request's `nodes`. The service's key is
    f"{pack_id}:{node_index}:{gpu_index}".
    """

    key: str
    node_name: str
    members: int  # members running there now
    pack: bool = False  # True: a GPU of one of our packs (refill)
    gpu_model: str = ""
    live: tuple[JobDemand, ...] = ()  # the members running there (their fences and profiles count)
    free_cpus: int | None = None  # the allocation's CPUs on that node not held by live members
    free_host_mem_bytes: int | None = None  # likewise host memory
    remaining_s: float | None = None  # allocation time left; a joiner's time limit must fit


@dataclass(frozen=True)
class FairConfig:
    """The slowdown bound (docs/packing.md "Every job gets its turn", slurm_dlrm.packing.fairness).

    A pending job's slowdown if it started now is (wait + expected run) / expected run.
    Past `overdue_slowdown` the job is *overdue*: it goes ahead of every job that is not
    (within its user's nice), the most overdue first. A multi-GPU job past
    `gang_reserve_slowdown` that no node can take now gets a reservation: the packs on
    the node that frees its GPUs soonest take only joiners that end before then, and
    that node's free GPUs only new packs that do (backfill)."""

    # 100: the band is a backstop against starvation, not an order. At 10 it reordered
    # most of a backlog and cost the one-GPU mixes 7-10% of their throughput for little
    # (docs/packing.md "Fair by default"); a site may lower it (`[packing] overdue_slowdown`).
    overdue_slowdown: float = 100.0
    gang_reserve_slowdown: float = 2.0
    # ... or this times the waiting one-GPU jobs' median slowdown so far, if higher: 3, as a
    # waiting job's slowdown so far is well below its final one (docs/packing.md, the table)
    gang_vs_single: float = 3.0
    min_wait_s: float = 600.0  # nobody is overdue before waiting this long
    unknown_duration_s: float = 3600.0  # a job of unknown length counts as this long
    backfill_speed: float = 0.8  # a backfilled job must end by the reservation at this speed
    # A gang past its reservation point (`gang_reserve_slowdown`, `gang_vs_single`) is in
    # the overdue band too, below `overdue_slowdown`: the most overdue gang then leads
    # the queue and keeps the GPUs it reserved from round to round.
    gang_in_band: bool = True
    tail_in_band: bool = False  # measured worse (docs/packing.md); True: the drain tail goes first in the overdue band (fairness.apply_fairness)


@dataclass(frozen=True)
class PackingRequest:
    jobs: tuple[JobDemand, ...]
    gpu_models: tuple[GpuModel, ...]
    nodes: tuple[NodeShape, ...]
    limits: PackingLimits = field(default_factory=PackingLimits)
    max_gpus: int | None = None  # GPUs this round may use in total (None: what nodes offer)
    open_gpus: tuple[OpenGpu, ...] = ()
    gang_joins: bool = True  # multi-GPU jobs may join running packs (refill); False: new packs only
    # The slowdown bound (None: off, as before issue 31: round-based aging only); it
    # needs `now_s`, the round's time on the clock of the jobs' submit_time_s.
    fair: FairConfig | None = None
    now_s: float | None = None

    def gpu_model(self, name: str) -> GpuModel:
        for g in self.gpu_models:
            if g.name == name:
                return g
        raise KeyError(name)


@dataclass(frozen=True)
class MemberPlacement:
    job_id: int
    node_index: int  # position in the pack's node list (SLURM_NODEID)
    gpu_index: int  # index within that node's allocated GPUs
    mps_thread_pct: int
    gpu_mem_limit_mib: int  # CUDA_MPS_PINNED_DEVICE_MEM_LIMIT for this member
    host_mem_limit_bytes: int
    cpus: int
    predicted_speed: float  # relative to solo, from the interference model
    rank: int = 0  # a multi-GPU job's rank member (world_size > 1); one entry per rank
    world_size: int = 1

    def to_placement(self) -> dict[str, Any]:
        """The policy's part of one placement-file member (docs/interfaces.md section 3);
        a rank member adds `rank` and `world_size` (absent: 0 and 1)."""
        out: dict[str, Any] = {
            "job_id": self.job_id, "node_index": self.node_index, "gpu_index": self.gpu_index,
            "mps_thread_pct": self.mps_thread_pct, "gpu_mem_limit_mib": self.gpu_mem_limit_mib,
            "host_mem_limit_bytes": self.host_mem_limit_bytes, "cpus": self.cpus}
        if self.world_size > 1:
            out["rank"] = self.rank
            out["world_size"] = self.world_size
        return out


@dataclass(frozen=True)
class Pack:
    """One Slurm job to submit: `gpu_count` GPUs of `gpu_model` on `node_count` nodes."""

    gpu_model: str
    gpu_count: int
    node_count: int
    members: tuple[MemberPlacement, ...]
    node_name: str = ""  # the NodeShape it was sized for (the simulator places it there)
    mps: bool = True
    # Refill headroom (mem-best-fit, complementary): CPUs and host memory the allocation
    # takes beyond its members, up to its GPUs' share of the node, so that joiners
    # (OpenGpu.pack) find room when a small member ends. Allocate `alloc_*`.
    reserve_cpus: int = 0
    reserve_host_mem_bytes: int = 0

    @property
    def cpus(self) -> int:
        return sum(m.cpus for m in self.members)

    @property
    def host_mem_bytes(self) -> int:
        return sum(m.host_mem_limit_bytes for m in self.members)

    @property
    def alloc_cpus(self) -> int:
        return self.cpus + self.reserve_cpus

    @property
    def alloc_host_mem_bytes(self) -> int:
        return self.host_mem_bytes + self.reserve_host_mem_bytes

    def members_on(self, gpu_index: int, node_index: int = 0) -> tuple[MemberPlacement, ...]:
        return tuple(m for m in self.members if m.gpu_index == gpu_index and m.node_index == node_index)

    @property
    def predicted_throughput(self) -> float:
        """Solo-equivalent jobs running at once (sum of predicted relative speeds)."""
        return sum(m.predicted_speed for m in self.members)


@dataclass(frozen=True)
class Deferred:
    job_id: int
    reason: str
    permanent: bool = False  # True: too big for every GPU the request offers, waiting will not help


@dataclass(frozen=True)
class Join:
    """A job placed on an `OpenGpu`: a free shard (first-fit) or a pack GPU with room
    (refill; `member.node_index`/`gpu_index` as in its pack, the service fills them from
    the key)."""

    gpu_key: str
    member: MemberPlacement


@dataclass(frozen=True)
class PackingPlan:
    policy: str
    packs: tuple[Pack, ...]
    deferred: tuple[Deferred, ...]
    joins: tuple[Join, ...] = ()

    @property
    def placed_job_ids(self) -> tuple[int, ...]:
        """Each placed job once (a multi-GPU job has a member per rank)."""
        ids = [m.job_id for p in self.packs for m in p.members] + [j.member.job_id for j in self.joins]
        return tuple(dict.fromkeys(ids))

    @property
    def predicted_throughput(self) -> float:
        return sum(p.predicted_throughput for p in self.packs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "packs": [{"gpu_model": p.gpu_model, "gpu_count": p.gpu_count, "node_count": p.node_count,
                       "node_name": p.node_name, "mps": p.mps, "cpus": p.cpus, "host_mem_bytes": p.host_mem_bytes,
                       "reserve_cpus": p.reserve_cpus, "reserve_host_mem_bytes": p.reserve_host_mem_bytes,
                       "members": [dict(m.to_placement(), predicted_speed=round(m.predicted_speed, 4))
                                   for m in p.members]}
                      for p in self.packs],
            "deferred": [{"job_id": d.job_id, "reason": d.reason, "permanent": d.permanent} for d in self.deferred],
            "joins": [{"gpu_key": j.gpu_key, **j.member.to_placement()} for j in self.joins],
        }


def member_fence_bytes(job: JobDemand, gpu: GpuModel, limits: PackingLimits) -> int:
    """GPU bytes reserved for one member: estimate + margin + CUDA context + cuBLAS workspace."""
    return (math.ceil(job.gpu_mem_bytes * (1.0 + limits.memory_margin_pct / 100.0))
            + gpu.cuda_context_bytes + gpu.cublas_workspace_bytes)


def dmem_soft_limit_bytes(own_gpu_bytes: int, gpu: GpuModel | None, fence_bytes: int) -> int:
    """A member's dmem soft limit (dmem.min, docs/agent.md "Fences"): what it is expected
    to use, its own estimate (the raised request after an OOM) plus the CUDA context and
    cuBLAS workspace its fence holds, never above its fence. No margin is in it: the
    margin, configured or learned from measured errors (service/measured.py), widens the
    hard fence only, so a larger margin never loosens the soft limit. (Subtracting the
    configured margin from a fence sized with a larger learned one did, issue 43.)"""
    ctx = 0 if gpu is None else gpu.cuda_context_bytes + gpu.cublas_workspace_bytes
    return max(0, min(fence_bytes, own_gpu_bytes + ctx))


# Headroom over a live member's measured peak when refill counts it (allocator
# fragmentation, a larger batch late in an epoch); the OOM recovery is the safety net.
OBSERVED_MARGIN_PCT = 2.0


def live_gpu_bytes(job: JobDemand, gpu: GpuModel, limits: PackingLimits) -> int:
    """GPU bytes refill counts for a live member: its fence, or, once its peak was
    measured, that peak + `OBSERVED_MARGIN_PCT` + context (never more than its fence).
    The fence stays the member's cap; a member past its warm-up does not grow, so the
    memory between its peak and its fence can take a joiner."""
    fence = member_fence_bytes(job, gpu, limits)
    if job.observed_gpu_mem_bytes is None:
        return fence
    seen = (math.ceil(job.observed_gpu_mem_bytes * (1.0 + OBSERVED_MARGIN_PCT / 100.0))
            + gpu.cuda_context_bytes + gpu.cublas_workspace_bytes)
    return min(fence, seen)


def fence_mib(job: JobDemand, gpu: GpuModel, limits: PackingLimits) -> int:
    return math.ceil(member_fence_bytes(job, gpu, limits) / MIB)


def usable_gpu_bytes(gpu: GpuModel) -> int:
    """GPU memory left for members once the MPS server's own context is taken."""
    return gpu.memory_bytes - gpu.cuda_context_bytes


def host_limit_bytes(job: JobDemand, limits: PackingLimits) -> int:
    return math.ceil(job.host_mem_bytes * (1.0 + limits.memory_margin_pct / 100.0))


def limits_from_site(site: SiteConfig) -> PackingLimits:
    p = site.packing
    return PackingLimits(max_members_per_gpu=p.max_members_per_gpu, mps_client_limit=site.mps.client_limit,
                         memory_margin_pct=p.memory_margin_pct, max_gpus_per_pack=p.max_gpus_per_pack,
                         shards_per_gpu=site.mps.shards_per_gpu or p.max_members_per_gpu,
                         refill_headroom_pct=p.refill_headroom_pct, exact_budget_s=p.exact_budget_s,
                         exact_max_pairs=p.exact_max_pairs, exact_window=p.exact_window)


def nodes_from_site(site: SiteConfig) -> tuple[NodeShape, ...]:
    return tuple(NodeShape(gpu_model=g.gpu_model, gpus=g.gpus, cpus=g.cpus, memory_bytes=g.memory_mib * MIB,
                           count=len(g.hostnames), name=g.names)
                 for g in site.nodes if g.gpus > 0)


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _context_bytes(breakdown: Any) -> int:
    """The CUDA context (and other per-process runtime) part of a GPU breakdown."""
    if not isinstance(breakdown, dict):
        return 0
    return sum(int(v) for k, v in breakdown.items()
               if any(word in k.lower() for word in ("context", "cublas", "workspace")))


def own_gpu_bytes(estimate: Any) -> int:
    """An estimate's peak GPU bytes without the CUDA context (`JobDemand.gpu_mem_bytes`)."""
    return max(0, int(_get(estimate, "gpu_peak_bytes", 0) or 0) - _context_bytes(_get(estimate, "gpu_breakdown")))


def demand_from_estimate(estimate: Any, *, job_id: int, user: str, submit_time_s: float, priority: float = 0.0,
                         name: str = "", samples_to_train: float | None = None) -> JobDemand:
    """A `JobDemand` from an estimator `Estimate` (docs/interfaces.md section 2).

    The estimate's GPU peak includes the CUDA context; the policy adds the context of
    the GPU it places the job on, so the context part of the breakdown is taken out.
    `samples_to_train` (steps * batch) gives the solo duration from the solo rate.
    Works on the `Estimate` object or its `to_dict()` form.
    """
    profile = _get(estimate, "profile")
    gpu_peak = int(_get(estimate, "gpu_peak_bytes"))
    own = max(0, gpu_peak - _context_bytes(_get(estimate, "gpu_breakdown")))
    rate = float(_get(profile, "solo_samples_per_s", 0.0) or 0.0)
    ranks = []
    for r in _get(estimate, "ranks", None) or ():
        rp = _get(r, "profile")
        ranks.append(RankDemand(
            gpu_mem_bytes=max(0, int(_get(r, "gpu_peak_bytes")) - _context_bytes(_get(r, "gpu_breakdown"))),
            host_mem_bytes=int(_get(r, "host_peak_bytes")), sm_util_pct=float(_get(rp, "sm_util_pct")),
            membw_util_pct=float(_get(rp, "membw_util_pct")), host_cpu_cores=float(_get(rp, "host_cpu_cores"))))
        # the ranks step together: the slowest sets the job's pace
        rate = min(rate, float(_get(rp, "solo_samples_per_s", rate) or rate)) if rate > 0 else rate
    duration = samples_to_train / rate if samples_to_train and rate > 0 else None
    label = str(_get(profile, "label", "compute-bound"))
    return JobDemand(job_id=job_id, user=user, submit_time_s=submit_time_s, priority=priority,
                     gpu_mem_bytes=own, host_mem_bytes=int(_get(estimate, "host_peak_bytes")),
                     sm_util_pct=float(_get(profile, "sm_util_pct")), membw_util_pct=float(_get(profile, "membw_util_pct")),
                     host_cpu_cores=float(_get(profile, "host_cpu_cores")), label=label,
                     solo_samples_per_s=rate, est_duration_s=duration, name=name,
                     world_size=max(1, len(ranks)), ranks=tuple(ranks))
