"""Discrete-event replay of a workload on a cluster through one packing policy (pure).

The mechanism is the same for every policy, only `plan()` differs:

- Jobs arrive; a dispatch round runs when `round_batch_size` jobs arrived since the
  last one or every `round_seconds` while jobs are pending and a GPU is free (a round
  with no free GPU could only defer). Each round asks the policy with the pending jobs
  (aged priorities) and the free capacity of every node.
- Each planned pack is one Slurm job: its GPUs, CPUs and host memory are taken at once;
  it starts `submit_to_start_s` later (scheduler pass + prolog); every member then
  spends `member_startup_s` (imports, CUDA context) before it trains; a joiner of a
  running pack starts `join_start_s` after the round that planned it (the agent looks
  at its joins folder), then spends `member_startup_s` too. A pack gives its GPUs back
  only when its last member has ended (a Slurm allocation does not shrink), and
  `pack_release_s` after that (the agent's join grace, its exit, the epilog; a joiner
  planned meanwhile keeps the pack).
- Members of one GPU progress at the speeds the *truth* gives for their true profiles
  (`true_params`: the analytic model by default, or any `speed_model` such as the
  synthetic generator of slurm_dlrm/truth.py); the policies plan with `plan_params`.
- At `peak_at_frac` of its run a member reaches its true peak memory. With a fence
  (mem-best-fit, complementary: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT) it dies if its own
  peak passes its fence; without one (exclusive, first-fit) it dies if the GPU's
  members together pass the GPU's memory. A killed job resumes from its last checkpoint
  in a later round, its estimate raised by `mem_bump_pct`, at most `max_retries` times.
- `dmem=True` (issue 22, cgroup dmem): the policy packs on the estimates (margin 0) and
  each member keeps its usual fence as the hard limit (dmem.max); its estimate is the
  soft limit (dmem.min). A member dies past its hard limit; when the GPU's members
  together pass its memory, the member furthest above its soft limit is evicted (the
  kernel protects usage below dmem.min and reclaims from those above it).

Over 600 lines: `simulate` is one event loop whose handlers (arrival, tick, pack
start, member ready, node faults, resubmission) share its local state; splitting them
would pass that state around instead of reading it.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace

from slurm_dlrm.adapt.margin import learned_margin_pct, peak_error
from slurm_dlrm.packing.common import REFILL_POLICIES
from slurm_dlrm.packing.dispatch import after_round, aged, should_run_round
from slurm_dlrm.packing.interference import (
    DEFAULT_PARAMS,
    InterferenceParams,
    predict_speeds_from_fractions,
)
from slurm_dlrm.packing.model import (
    AGENT_CPUS,
    AGENT_MEM_MIB,
    FairConfig,
    JobDemand,
    Join,
    NodeShape,
    OpenGpu,
    PackingLimits,
    PackingRequest,
    RankDemand,
    member_fence_bytes,
    rank_members,
)
from slurm_dlrm.packing.policies import plan as make_plan
from slurm_dlrm.sim.faults import FaultRuntime, KillAction
from slurm_dlrm.sim.files import SimCluster, SimJob, Workload
from slurm_dlrm.sim.results import JobOutcome, SimResult
from slurm_dlrm.sim.snapshot import RunningMember, RunningPack, Snapshot
from slurm_dlrm.site import MIB

_ARRIVAL, _TICK, _PACK_START, _MEMBER_READY = 0, 1, 2, 3
_NODE_FAIL, _NODE_BACK, _OBSERVE = 4, 5, 6  # only with `faults` (sim/faults.py)
_RESUBMIT = 7  # a user resubmits a failed job (retry.user_resubmits)
_SNAPSHOT = 8  # snapshot_at_s: the loop stops there to record one
_PACK_RELEASE = 9  # slurm.pack_release_s after a pack's last member ended: its GPUs are free
_EPS = 1e-9
# The agent stops a member this far past its host share ([agent] host_mem_tolerance_pct's
# default); the kernel kills it where the pack's --mem runs out. Both are OOM_HOST.
HOST_MEM_TOLERANCE_PCT = 10.0


@dataclass
class _NodeState:
    name: str
    gpu_model: str
    gpus: int
    cpus: int
    memory_bytes: int
    free_gpus: int
    free_cpus: int
    free_mem: int
    down: bool = False  # failed, until repaired (faults only)


@dataclass
class _Member:
    job: SimJob
    fence_bytes: int | None  # None: no fence (the whole GPU is reachable)
    progress_start: float
    progress: float
    ready_at: float = math.inf
    cpus: int = 0
    host_mem: int = 0
    ready: bool = False
    peaked: bool = False
    peak_progress: float = 0.0
    speed: float = 0.0
    ended: bool = False
    soft_bytes: int | None = None  # dmem: the soft limit (dmem.min), the estimate it was packed on
    rank: int = 0  # a multi-GPU job's rank (its siblings are members of the same job)
    raw_speed: float = 0.0  # its GPU's speed for it; a rank runs at its slowest sibling's (`speed`)

    @property
    def scale(self) -> float:
        return self.job.scales[self.rank] if self.rank < len(self.job.scales) else 1.0

    @property
    def true_mem(self) -> int:
        return int(self.job.true_gpu_mem_bytes * self.scale)

    @property
    def true_sm(self) -> float:
        return self.job.true_sm_util_pct * self.scale

    @property
    def true_bw(self) -> float:
        return self.job.true_membw_util_pct * self.scale


@dataclass
class _Gpu:
    members: list[_Member] = field(default_factory=list)


@dataclass
class _Pack:
    pack_id: int
    node: _NodeState
    gpu_count: int
    cpus: int
    host_mem: int
    mps: bool
    gpus: list[_Gpu]
    start_s: float = math.nan
    live: int = 0
    asked_cpus: int = 0  # what the pack asked Slurm for at its start (refill: its allocation)
    asked_mem: int = 0
    idle_since_s: float | None = None  # its last member ended (slurm.pack_release_s pending)
    agent_cpus: int = 0  # the pack's agent (AGENT_CPUS, AGENT_MEM_MIB), held beside its members
    agent_mem: int = 0


def job_demand(job: SimJob, gpu_mem_bytes: int, est_remaining_s: float | None) -> JobDemand:
    """What the planner is told of `job`: its estimated GPU memory and time left (the
    truth stays in the simulator), rank by rank for a multi-GPU job."""
    ranks: tuple[RankDemand, ...] = ()
    if job.world_size > 1:
        ranks = tuple(RankDemand(gpu_mem_bytes=int(gpu_mem_bytes * x), host_mem_bytes=job.host_mem_bytes,
                                 sm_util_pct=job.sm_util_pct * x, membw_util_pct=job.membw_util_pct * x,
                                 host_cpu_cores=job.host_cpu_cores) for x in job.scales)
    submitted = job.arrival_s if job.submitted_s is None else job.submitted_s
    return JobDemand(job_id=job.job_id, user=job.user, submit_time_s=submitted, priority=job.priority,
                     gpu_mem_bytes=gpu_mem_bytes, host_mem_bytes=job.host_mem_bytes, sm_util_pct=job.sm_util_pct,
                     membw_util_pct=job.membw_util_pct, host_cpu_cores=job.host_cpu_cores, label=job.label,
                     est_duration_s=est_remaining_s, name=job.name, world_size=job.world_size, ranks=ranks)


def simulate(workload: Workload, cluster: SimCluster, policy: str,
             true_params: InterferenceParams | None = None, plan_params: InterferenceParams | None = None,
             max_sim_s: float = 365 * 86400.0, faults: FaultRuntime | None = None, dmem: bool = False,
             margin_from_errors: bool = True, fairness: str | None = None,
             fair_config: FairConfig | None = None, snapshot_at_s: tuple[float, ...] = (),
             resume: Snapshot | None = None) -> SimResult:
    """Replay `workload` on `cluster` through `policy`; see the module docstring.

    With `faults`, node failures and straggler checks are injected and OOMs, node
    failures and stragglers are handled by its recovery decisions (sim/faults.py).
    `margin_from_errors` (fenced policies): each round's memory margin is the larger of
    the configured one and the estimate's error observed at members' peaks so far.
    `fairness`: "slowdown" or "rounds" (DispatchConfig.fairness; None: the cluster's).
    `snapshot_at_s`: times (from the first arrival) at which to record a `Snapshot`.
    `resume` (issue 31, `queue --start`): start from that snapshot's state instead of an
    empty cluster: its packs on their nodes (each member's job in `workload` carries its
    time left as its run), its waiting jobs pending, the dispatcher's counters; the
    workload's other jobs arrive as usual."""
    truth = true_params or DEFAULT_PARAMS
    limits, dispatch, slurm, retry = cluster.limits, cluster.dispatch, cluster.slurm, cluster.retry
    if fairness is not None:
        dispatch = replace(dispatch, fairness=fairness)
    if fair_config is not None:
        dispatch = replace(dispatch, fair_config=fair_config)
    nodes = [_NodeState(n.name, n.gpu_model, n.gpus, n.cpus, n.memory_bytes, n.gpus, n.cpus, n.memory_bytes)
             for n in cluster.nodes]
    by_name = {n.name: n for n in nodes}
    jobs = {j.job_id: j for j in workload.jobs}
    events: list[tuple[float, int, int, object]] = []
    seq = 0

    def push(t: float, kind: int, payload: object) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, payload))
        seq += 1

    resumed = ({m.job_id for pk in resume.packs for m in pk.members}
               | {jid for jid, _, _ in resume.pending if jobs[jid].arrival_s <= resume.now_s}) if resume else set()
    for j in workload.jobs:
        if j.job_id not in resumed:
            push(j.arrival_s, _ARRIVAL, j.job_id)
    for t in snapshot_at_s:
        push((workload.jobs[0].arrival_s if workload.jobs else 0.0) + t, _SNAPSHOT, None)

    pending: dict[int, JobDemand] = {}
    waited: dict[int, int] = {}
    progress_saved: dict[int, float] = {}
    attempts: dict[int, int] = {}
    resubmits: dict[int, int] = {}
    est_mem: dict[int, int] = {j.job_id: j.gpu_mem_bytes for j in workload.jobs}
    outcome_end: dict[int, float] = {}
    first_start: dict[int, float] = {}
    snapshots: list[Snapshot] = []
    snap_times = sorted(snapshot_at_s)
    outcome_state: dict[int, str] = {}
    oom_of: dict[int, int] = {}
    running_packs: list[_Pack] = []
    next_pack_id = 0
    now = workload.jobs[0].arrival_s if workload.jobs else 0.0
    if resume is not None:
        now = resume.now_s
    first_arrival = now
    observe_armed = False
    if faults is not None:
        for n in nodes:
            fail_in = faults.next_failure_in_s()
            if fail_in is not None:
                push(first_arrival + fail_in, _NODE_FAIL, (n.name, True))
        for at_s, name in faults.faults.node_failures_at:
            push(at_s, _NODE_FAIL, (name, False))
    last_round: float | None = None
    arrived_since = 0
    tick_at: float | None = None
    dirty = False
    rounds = ooms = packs_made = evictions = 0
    alloc_gpu_s = busy_gpu_s = member_s = 0.0
    held_cpu_s = held_mem_byte_s = 0.0
    backlog_s = backlog_work_s = 0.0  # time with jobs waiting, and solo work done then
    fenced = policy in ("mem-best-fit", "complementary")
    # first-fit models gres/shard: each job is its own Slurm job on a shard of a GPU, so
    # a busy GPU with a free shard takes new jobs (the other policies own whole GPUs).
    shard_mode = policy == "first-fit"
    # Each pack's agent (one per node of a pack); first-fit's members are Slurm jobs of their own.
    agent_cpus, agent_mem = (0, 0) if shard_mode else (AGENT_CPUS, AGENT_MEM_MIB * MIB)
    shard_gpus: dict[str, tuple[_Pack, int]] = {}  # f"{pack_id}:{gpu_index}" -> its pack and GPU
    # mem-best-fit and complementary refill their running packs: pending jobs join pack
    # GPUs with room (OpenGpu.pack, docs/packing.md), as the live service does.
    refill = policy in REFILL_POLICIES
    # dmem: plan on the estimates; the usual fence stays as each member's hard limit.
    dmem = dmem and fenced
    plan_limits = replace(limits, memory_margin_pct=0.0) if dmem else limits

    def member_limits(jid: int, node: _NodeState, planned_mib: int, rank: int = 0) -> tuple[int | None, int | None]:
        """(hard fence or None, dmem soft limit or None) of a member the plan placed."""
        whole = gpu_bytes(node)
        if not dmem:
            fence = planned_mib * MIB
            return (None if fence >= whole else fence), None
        hard = member_fence_bytes(rank_members(pending[jid])[rank], cluster.gpu_model(node.gpu_model), limits)
        return (None if hard >= whole else hard), planned_mib * MIB
    mem_errors: list[float] = []
    # Fences follow the estimate's observed error (round_limits); dmem plans on the
    # estimates by design, so it keeps its own limits.
    learn_margin = fenced and margin_from_errors and not dmem

    def gpu_bytes(node: _NodeState) -> int:
        return cluster.gpu_model(node.gpu_model).memory_bytes

    def ctx_bytes(node: _NodeState) -> int:
        g = cluster.gpu_model(node.gpu_model)
        return g.cuda_context_bytes + g.cublas_workspace_bytes

    def set_speeds(gpu: _Gpu) -> None:
        live = [m for m in gpu.members if m.ready and not m.ended]
        if not live:
            return
        if len(live) == 1:
            live[0].speed = live[0].raw_speed = 1.0
            return
        sp = predict_speeds_from_fractions([min(1.0, m.true_sm / 100.0) for m in live],
                                           [min(1.0, m.true_bw / 100.0) for m in live], truth)
        for m, s in zip(live, sp, strict=True):
            m.speed = m.raw_speed = s

    def sync_gangs() -> None:
        # The ranks of a job step together (all-to-all every step): each runs at the
        # slowest sibling's speed, none before all are ready.
        ranks: dict[int, list[_Member]] = {}
        for pk in running_packs:
            for gpu in pk.gpus:
                for m in gpu.members:
                    if not m.ended and m.job.world_size > 1:
                        ranks.setdefault(m.job.job_id, []).append(m)
        for group in ranks.values():
            complete = len(group) == group[0].job.world_size
            pace = min(x.raw_speed if x.ready else 0.0 for x in group) if complete else 0.0
            for x in group:
                x.speed = pace

    def siblings(m: _Member) -> list[tuple[_Pack, _Gpu, _Member]]:
        if m.job.world_size <= 1:
            return []
        return [(pk, gpu, x) for pk in running_packs for gpu in pk.gpus for x in gpu.members
                if x is not m and not x.ended and x.job.job_id == m.job.job_id]

    def end_gang(m: _Member) -> None:
        """A rank ended (OOM, fault, done): its siblings stop too (the agent's gang stop)."""
        for pk, gpu, x in siblings(m):
            end_member(pk, gpu, x)

    def end_member(pack: _Pack, gpu: _Gpu, m: _Member) -> None:
        m.ended = True
        m.speed = m.raw_speed = 0.0
        pack.live -= 1
        if shard_mode:
            # Each first-fit member is its own Slurm job: its CPUs and memory come back now.
            pack.cpus -= m.cpus
            pack.host_mem -= m.host_mem
            pack.node.free_cpus += m.cpus
            pack.node.free_mem += m.host_mem
        set_speeds(gpu)
        schedule_tick()  # a freed shard (first-fit) or, below, freed GPUs
        if pack.live == 0:
            pack.idle_since_s = now
            if slurm.pack_release_s > 0 and not shard_mode:
                push(now + slurm.pack_release_s, _PACK_RELEASE, pack)  # a join may still come meanwhile
            else:
                release_pack(pack)

    def release_pack(pack: _Pack) -> None:
        if pack.live == 0 and pack in running_packs:
            nonlocal alloc_gpu_s, held_cpu_s, held_mem_byte_s
            alloc_gpu_s += pack.gpu_count * (now - pack.start_s)
            held_cpu_s += (pack.asked_cpus + pack.agent_cpus) * (now - pack.start_s)
            held_mem_byte_s += (pack.asked_mem + pack.agent_mem) * (now - pack.start_s)
            pack.node.free_gpus += pack.gpu_count
            pack.node.free_cpus += pack.cpus + pack.agent_cpus
            pack.node.free_mem += pack.host_mem + pack.agent_mem
            running_packs.remove(pack)
            for gi in range(pack.gpu_count):
                shard_gpus.pop(f"{pack.pack_id}:{gi}", None)
            schedule_tick()

    def apply_kill(pack: _Pack, gpu: _Gpu, m: _Member, act: KillAction) -> None:
        # A fault ended the member: requeue it from its checkpoint, or fail it. A rank
        # takes its siblings with it; the job is requeued whole.
        if m.ended:
            return
        jid = m.job.job_id
        end_member(pack, gpu, m)
        end_gang(m)
        progress_saved[jid] = act.saved_progress_s
        if act.requeue and act.demand is not None:
            est_mem[jid] = act.demand.gpu_mem_bytes
            pending[jid] = act.demand
            schedule_tick()
        else:
            outcome_state[jid] = "FAILED"

    def kill_packs(name: str, packs: list[_Pack]) -> None:
        assert faults is not None
        victims = [(pk, gpu, m) for pk in packs for gpu in pk.gpus for m in gpu.members if not m.ended]
        firsts = list({m.job.job_id: m for _, _, m in reversed(victims)}.values())  # one entry per job
        acts = faults.on_node_fail(now, name, [(m.job, m.progress, m.progress_start, est_mem[m.job.job_id])
                                               for m in firsts])
        for pk, gpu, m in victims:
            apply_kill(pk, gpu, m, acts[m.job.job_id])

    def observe_round() -> None:
        assert faults is not None
        where = {}
        groups = []
        for pk in running_packs:
            for gpu in pk.gpus:
                live = [m for m in gpu.members if m.ready and not m.ended]
                for m in live:
                    where[m.job.job_id] = (pk, gpu, m)
                if live:
                    groups.append([(m.job, m.speed, m.progress) for m in live])
        for jid, act in faults.observe(now, groups):
            apply_kill(*where[jid], act)

    def schedule_tick() -> None:
        nonlocal tick_at, dirty
        dirty = True  # something changed: a round may place what the last one could not
        if pending and tick_at is None:
            base = now if last_round is None else max(now, last_round + dispatch.round_seconds)
            tick_at = base
            push(base, _TICK, None)

    def requeue(jid: int) -> None:
        # Back to pending from its last checkpoint, with what is left of its run.
        job = jobs[jid]
        left = job.solo_duration_s - progress_saved.get(jid, 0.0)
        est_left = (job.est_duration_s or job.solo_duration_s) * left / job.solo_duration_s
        pending[jid] = job_demand(job, est_mem[jid], est_left)
        schedule_tick()

    def oom_check(pack: _Pack, gpu: _Gpu, m: _Member) -> bool:
        node = pack.node
        own = m.true_mem
        if m.fence_bytes is not None and own + ctx_bytes(node) > m.fence_bytes:
            return True
        # The GPU as a whole, fenced or not: refill counts a member past its peak at its
        # measured peak (below its fence), so fences may add up to more than the GPU.
        total = (ctx_bytes(node) if pack.mps else 0) + sum(
            x.true_mem + ctx_bytes(node) for x in gpu.members if not x.ended and (x.peaked or x is m))
        total += sum(ctx_bytes(node) for x in gpu.members if not x.ended and not x.peaked and x is not m)
        return total > gpu_bytes(node)

    def observe_error(pack: _Pack, m: _Member) -> None:
        # The estimate's error as the agents see it at a member's peak (its NVML
        # samples); a member killed at its fence shows only that its error passed it.
        est = est_mem[m.job.job_id] * m.scale
        if not learn_margin:
            return
        fence = None if m.fence_bytes is None else m.fence_bytes - ctx_bytes(pack.node)
        err = peak_error(m.true_mem, est, fence)
        if err is not None:
            mem_errors.append(err)

    def round_limits() -> PackingLimits:
        # Fences from the estimate's known error (docs/packing.md "Fences"): the
        # configured margin, or, once errors were observed, the largest seen scaled
        # by (n+1)/n (the unbiased bound of a uniform error), whichever is larger.
        if not learn_margin or not mem_errors:
            return plan_limits
        pct = learned_margin_pct(mem_errors, plan_limits.memory_margin_pct)
        return replace(plan_limits, memory_margin_pct=pct) if pct > plan_limits.memory_margin_pct else plan_limits

    def oom_victim(pack: _Pack, gpu: _Gpu, m: _Member) -> _Member | None:
        """The member that dies when `m` reaches its peak, if any (dmem: module docstring)."""
        if not dmem or m.soft_bytes is None:
            return m if oom_check(pack, gpu, m) else None
        ctx = ctx_bytes(pack.node)
        if m.fence_bytes is not None and m.true_mem + ctx > m.fence_bytes:
            return m  # dmem.max: the allocation fails
        live = [x for x in gpu.members if not x.ended]
        total = (ctx if pack.mps else 0) + sum(x.true_mem + ctx if (x.peaked or x is m) else ctx
                                               for x in live)
        if total <= gpu_bytes(pack.node):
            return None
        over = [x for x in live if (x.peaked or x is m) and x.soft_bytes is not None
                and x.true_mem + ctx > x.soft_bytes]
        if not over:
            return None
        return max(over, key=lambda x: x.true_mem + ctx - (x.soft_bytes or 0))

    def pack_gpus() -> tuple[OpenGpu, ...]:
        # Refill: every GPU of a running pack, with its live members and what the
        # allocation holds beyond them (it never shrinks, docs/simulate.md).
        out = []
        for pk in sorted(running_packs, key=lambda p: p.pack_id):
            if not joinable(pk):
                continue
            members = [m for gpu in pk.gpus for m in gpu.members if not m.ended]
            free_cpus = pk.cpus - sum(m.cpus for m in members)
            free_mem = pk.host_mem - sum(m.host_mem for m in members)
            for gpu_index, gpu in enumerate(pk.gpus):
                # A member past its peak reports it (the agent's NVML samples).
                live = tuple(replace(rank_members(job_demand(m.job, est_mem[m.job.job_id], est_left_s(m)))[m.rank],
                                     observed_gpu_mem_bytes=m.true_mem if m.peaked else None)
                             for m in gpu.members if not m.ended)
                out.append(OpenGpu(f"{pk.pack_id}:0:{gpu_index}", pk.node.name, len(live), pack=True,
                                   gpu_model=pk.node.gpu_model, live=live, free_cpus=free_cpus,
                                   free_host_mem_bytes=free_mem, remaining_s=None))
        return tuple(out)

    def joinable(pk: _Pack) -> bool:
        # An idle pack takes joiners for the agent's join grace (two rounds, as the
        # service's default agent.join_grace_s), not for the rest of its release.
        if pk.node.down:
            return False
        return pk.live > 0 or (pk.idle_since_s is not None and now - pk.idle_since_s < 2.0 * dispatch.round_seconds)

    def est_left_s(m: _Member) -> float:
        job = m.job
        return (job.est_duration_s or job.solo_duration_s) * max(0.0, job.solo_duration_s - m.progress) / job.solo_duration_s

    def apply_join(jn: Join) -> None:
        # The joiner starts inside the running allocation: no Slurm submission, only its
        # own start-up; the allocation's CPUs and memory were taken when the pack started.
        pack_id, _node_index, gpu_index = (int(x) for x in jn.gpu_key.split(":"))
        pack = next(pk for pk in running_packs if pk.pack_id == pack_id)
        job = jobs[jn.member.job_id]
        start = progress_saved.get(job.job_id, 0.0)
        fence, soft = member_limits(job.job_id, pack.node, jn.member.gpu_mem_limit_mib, jn.member.rank)
        member = _Member(job, fence, start, start, ready_at=now + slurm.join_start_s + slurm.member_startup_s,
                         cpus=jn.member.cpus, host_mem=jn.member.host_mem_limit_bytes, soft_bytes=soft,
                         rank=jn.member.rank)
        pack.gpus[gpu_index].members.append(member)
        pack.live += 1
        pack.idle_since_s = None
        placed(job.job_id)
        push(member.ready_at, _MEMBER_READY, pack)

    def measured_left_s(pk: _Pack, gpu: _Gpu, m: _Member) -> float:
        """Solo-seconds of training left as the service knows them: a member that trains
        reports its steps (the runner's metrics) and its rate (samples/s); steps left over
        that rate is its wall time left here, times the speed the planner predicts for it
        here (its estimated profile) gives solo-seconds. Before it trains: the estimate."""
        if not m.ready or m.speed <= 0:
            return est_left_s(m)
        live = [x for x in gpu.members if x.ready and not x.ended]
        pred = predict_speeds_from_fractions([min(1.0, x.job.sm_util_pct * x.scale / 100.0) for x in live],
                                             [min(1.0, x.job.membw_util_pct * x.scale / 100.0) for x in live],
                                             plan_params or DEFAULT_PARAMS)[live.index(m)] if len(live) > 1 else 1.0
        return max(0.0, m.job.solo_duration_s - m.progress) / m.speed * min(1.0, pred)

    def take_snapshot() -> Snapshot:
        running: dict[int, tuple[int, float, int]] = {}
        planned: dict[int, float] = {}
        packs = []
        starting = {p.pack_id: t for t, _, k, p in events if k == _PACK_START and isinstance(p, _Pack)}
        submitted = [p for _, _, k, p in events if k == _PACK_START and isinstance(p, _Pack)]
        for pk in sorted(running_packs + submitted, key=lambda p: p.pack_id):
            members = []
            for gi, gpu in enumerate(pk.gpus):
                for m in gpu.members:
                    if m.ended:
                        continue
                    jid = m.job.job_id
                    left = measured_left_s(pk, gpu, m)
                    # a gang's ranks step together at the slowest one's pace: the job's
                    # solo-seconds left are the least of its ranks' (wall time x predicted pace)
                    running[jid] = (jid, min(left, running[jid][1]) if jid in running else left, est_mem[jid])
                    planned[jid] = est_left_s(m)
                    # a member not past its peak reaches it that far into its run (a job
                    # property: DLRM jobs peak in their first steps); not yet started: its
                    # share of the run it has left
                    peak_in = (max(0.0, m.peak_progress - m.progress) if m.ready
                               else m.job.peak_at_frac * m.job.solo_duration_s)
                    members.append(RunningMember(jid, gi, m.rank, m.fence_bytes, m.cpus, m.host_mem,
                                                 0.0 if m.ready else max(0.0, m.ready_at - now),
                                                 m.true_mem if m.peaked else None,
                                                 0.0 if m.peaked else peak_in * left / max(1e-9, m.job.solo_duration_s - m.progress)))
            packs.append(RunningPack(pk.node.name, pk.gpu_count, pk.cpus, pk.host_mem, pk.mps,
                                     max(0.0, starting.get(pk.pack_id, now) - now), tuple(members), pk.pack_id,
                                     None if pk.live > 0 or pk.idle_since_s is None else now - pk.idle_since_s))
        waiting = tuple((jid, d.est_duration_s if d.est_duration_s is not None else jobs[jid].solo_duration_s,
                         d.gpu_mem_bytes) for jid, d in sorted(pending.items()))
        return Snapshot(now, waiting, tuple(running[k] for k in sorted(running)), round_limits().memory_margin_pct,
                        packs=tuple(packs), waited_rounds=tuple(sorted(waited.items())), last_round_s=last_round,
                        arrived_since_round=arrived_since, planned_left_s=tuple(sorted(planned.items())),
                        round_due=dirty)

    def placed(jid: int) -> None:
        # The first member of a job placed this round leaves the queue (a gang has several).
        first_start.setdefault(jid, now)
        if jid in pending:
            if faults is not None:
                faults.on_placed(pending[jid], now)
            del pending[jid]

    def run_round() -> None:
        nonlocal rounds, last_round, arrived_since, waited, next_pack_id, packs_made, dirty
        rounds += 1
        dirty = False
        last_round = now
        arrived_since = 0
        open_gpus = tuple(OpenGpu(key, pk.node.name, sum(1 for m in pk.gpus[gi].members if not m.ended))
                          for key, (pk, gi) in sorted(shard_gpus.items(), key=lambda kv: (kv[1][0].pack_id, kv[1][1])))
        with_open = {o.node_name for o in open_gpus}
        if refill:
            open_gpus += pack_gpus()
        # A new pack's agent takes a CPU and some memory beside its members (not first-fit's shards).
        free = tuple(NodeShape(gpu_model=n.gpu_model, gpus=n.free_gpus, cpus=max(0, n.free_cpus - agent_cpus),
                               memory_bytes=max(0, n.free_mem - agent_mem),
                               count=1, name=n.name) for n in nodes
                     if (n.free_gpus > 0 or n.name in with_open) and not n.down)
        request = PackingRequest(jobs=aged(sorted(pending.values(), key=lambda d: d.job_id), waited, dispatch),
                                 gpu_models=cluster.gpu_models, nodes=free, limits=round_limits(), open_gpus=open_gpus,
                                 fair=dispatch.fair, now_s=now)
        result = make_plan(request, policy, plan_params)
        waited = after_round(waited, result)
        for jn in result.joins:
            if refill:
                apply_join(jn)
                continue
            pack, gi = shard_gpus[jn.gpu_key]
            job = jobs[jn.member.job_id]
            start = progress_saved.get(job.job_id, 0.0)
            member = _Member(job, None, start, start, ready_at=now + slurm.submit_to_start_s + slurm.member_startup_s,
                             cpus=jn.member.cpus, host_mem=jn.member.host_mem_limit_bytes, rank=jn.member.rank)
            pack.gpus[gi].members.append(member)
            pack.live += 1
            pack.cpus += jn.member.cpus
            pack.host_mem += jn.member.host_mem_limit_bytes
            pack.node.free_cpus -= jn.member.cpus
            pack.node.free_mem -= jn.member.host_mem_limit_bytes
            placed(job.job_id)
            push(member.ready_at, _MEMBER_READY, pack)
        for pk in result.packs:
            node = by_name[pk.node_name]
            # The allocation takes the members' CPUs and memory plus the policy's refill
            # headroom (Pack.reserve_*), and keeps them until its last member ends.
            node.free_gpus -= pk.gpu_count
            node.free_cpus -= pk.alloc_cpus + agent_cpus
            node.free_mem -= pk.alloc_host_mem_bytes + agent_mem
            gpus = [_Gpu() for _ in range(pk.gpu_count)]
            pack = _Pack(next_pack_id, node, pk.gpu_count, pk.alloc_cpus, pk.alloc_host_mem_bytes, pk.mps, gpus,
                         asked_cpus=pk.alloc_cpus, asked_mem=pk.alloc_host_mem_bytes, agent_cpus=agent_cpus,
                         agent_mem=agent_mem)
            next_pack_id += 1
            packs_made += 1
            for mp in pk.members:
                job = jobs[mp.job_id]
                fence, soft = (member_limits(job.job_id, node, mp.gpu_mem_limit_mib, mp.rank) if fenced
                               else (None, None))
                start = progress_saved.get(job.job_id, 0.0)
                ready_at = now + slurm.submit_to_start_s + slurm.member_startup_s
                gpus[mp.gpu_index].members.append(_Member(job, fence, start, start, ready_at=ready_at, cpus=mp.cpus,
                                                          host_mem=mp.host_mem_limit_bytes, soft_bytes=soft,
                                                          rank=mp.rank))
                pack.live += 1
            for mp in pk.members:
                placed(mp.job_id)
            if shard_mode:
                for gi in range(pk.gpu_count):
                    shard_gpus[f"{pack.pack_id}:{gi}"] = (pack, gi)
            push(now + slurm.submit_to_start_s, _PACK_START, pack)
        for d in result.deferred:
            reason = d.reason
            if reason.startswith("needs "):
                # Too big for any free node: if the cluster's empty nodes cannot take it
                # either, it never will.
                job = jobs[d.job_id]
                if not any(_could_ever_fit(job, est_mem[d.job_id], n, cluster) for n in cluster.nodes):
                    del pending[d.job_id]
                    outcome_state[d.job_id] = "UNPLACEABLE"

    def resume_state(snap: Snapshot) -> None:
        # The running packs stay where they are, with what their allocations hold; the
        # waiting jobs are pending with the rounds they were passed over.
        nonlocal next_pack_id, waited, last_round, arrived_since
        for rp in snap.packs:
            node = by_name[rp.node_name]
            node.free_gpus -= rp.gpu_count
            node.free_cpus -= rp.cpus + agent_cpus
            node.free_mem -= rp.host_mem_bytes + agent_mem
            pid = rp.pack_id if rp.pack_id >= 0 else next_pack_id
            pack = _Pack(pid, node, rp.gpu_count, rp.cpus, rp.host_mem_bytes, rp.mps,
                         [_Gpu() for _ in range(rp.gpu_count)], asked_cpus=rp.cpus, asked_mem=rp.host_mem_bytes,
                         agent_cpus=agent_cpus, agent_mem=agent_mem)
            next_pack_id = max(next_pack_id, pid) + 1
            if rp.idle_for_s is not None:  # its last member ended: Slurm frees it pack_release_s after
                pack.idle_since_s = now - rp.idle_for_s
                push(max(now, pack.idle_since_s + slurm.pack_release_s), _PACK_RELEASE, pack)
            for rm in rp.members:
                m = _Member(jobs[rm.job_id], rm.fence_bytes, 0.0, 0.0, ready_at=now + rm.ready_in_s, cpus=rm.cpus,
                            host_mem=rm.host_mem_bytes, rank=rm.rank)
                m.peaked = rm.peak_bytes is not None  # seen at its peak: no OOM ahead of it
                m.peak_progress = rm.peak_in_s
                pack.gpus[rm.gpu_index].members.append(m)
                pack.live += 1
                first_start[rm.job_id] = now
                if rm.ready_in_s <= 0:
                    m.ready = True
                elif rp.start_in_s <= 0:
                    push(m.ready_at, _MEMBER_READY, pack)
            if shard_mode:
                for gi in range(rp.gpu_count):
                    shard_gpus[f"{pack.pack_id}:{gi}"] = (pack, gi)
            if rp.start_in_s > 0:
                push(now + rp.start_in_s, _PACK_START, pack)
                continue
            pack.start_s = now
            running_packs.append(pack)
            for gpu in pack.gpus:
                set_speeds(gpu)
        for jid, left, gpu_mem in snap.pending:
            if jid in resumed:
                pending[jid] = job_demand(jobs[jid], gpu_mem, left)
                est_mem[jid] = gpu_mem
        waited = dict(snap.waited_rounds)
        last_round, arrived_since = snap.last_round_s, snap.arrived_since_round
        if snap.round_due:
            schedule_tick()

    if resume is not None:
        resume_state(resume)
    gangs = any(j.world_size > 1 for j in workload.jobs)
    while True:
        if gangs:
            sync_gangs()
        # Next thing to happen: a heap event or a member reaching a milestone.
        t_next = events[0][0] if events else math.inf
        for pack in running_packs:
            for gpu in pack.gpus:
                for m in gpu.members:
                    if m.ready and not m.ended and m.speed > 0:
                        goal = m.peak_progress if not m.peaked else m.job.solo_duration_s
                        t_next = min(t_next, now + max(0.0, goal - m.progress) / m.speed)
        if t_next == math.inf or t_next - first_arrival > max_sim_s:
            break
        dt = t_next - now
        if dt > 0 and pending:
            backlog_s += dt
            for pack in running_packs:
                for gpu in pack.gpus:
                    for m in gpu.members:
                        if m.ready and not m.ended:
                            backlog_work_s += m.speed * dt
        if dt > 0:
            for pack in running_packs:
                if pack.start_s <= now:
                    for gpu in pack.gpus:
                        use = 0.0
                        for m in gpu.members:
                            if m.ready and not m.ended:
                                member_s += dt
                                m.progress += m.speed * dt
                                use += min(1.0, m.true_sm / 100.0) * m.speed
                        busy_gpu_s += min(1.0, use) * dt
        now = t_next
        # Milestones.
        for pack in list(running_packs):
            for gpu in pack.gpus:
                for m in list(gpu.members):
                    if not m.ready or m.ended:
                        continue
                    if not m.peaked and m.progress >= m.peak_progress - 1e-6:
                        m.peaked = True
                        true_host = m.job.true_host_mem_bytes
                        if (faults is not None and true_host is not None and m.host_mem > 0
                                and true_host > m.host_mem * (1.0 + HOST_MEM_TOLERANCE_PCT / 100.0)):
                            # out of host memory at its peak (issue 43): retried like a GPU OOM
                            ooms += 1
                            jid = m.job.job_id
                            oom_of[jid] = oom_of.get(jid, 0) + 1
                            node_mem = max(n.memory_bytes for n in cluster.nodes)
                            apply_kill(pack, gpu, m, faults.on_oom(m.job, now, m.progress, m.progress_start,
                                                                   est_mem[jid], m.host_mem, node_mem, kind="host"))
                            continue
                        observe_error(pack, m)
                        victim = oom_victim(pack, gpu, m)
                        if victim is not None and victim is not m:
                            evictions += 1  # dmem: a neighbour above its soft limit goes instead
                            m = victim
                        if victim is not None:
                            ooms += 1
                            jid = m.job.job_id
                            oom_of[jid] = oom_of.get(jid, 0) + 1
                            if faults is not None:
                                ctx, whole = ctx_bytes(pack.node), gpu_bytes(pack.node)
                                limit = (m.fence_bytes if m.fence_bytes is not None else whole) - ctx
                                capacity = int((whole - 2 * ctx) / (1.0 + limits.memory_margin_pct / 100.0))
                                apply_kill(pack, gpu, m, faults.on_oom(m.job, now, m.progress, m.progress_start,
                                                                       est_mem[jid], limit, capacity))
                                continue
                            attempts[jid] = attempts.get(jid, 0) + 1
                            every = retry.checkpoint_every_frac * m.job.solo_duration_s
                            progress_saved[jid] = math.floor(m.progress / every) * every if every > 0 else 0.0
                            est_mem[jid] = math.ceil(est_mem[jid] * (1.0 + retry.mem_bump_pct / 100.0))
                            end_member(pack, gpu, m)
                            end_gang(m)  # a rank's OOM stops its siblings; the job goes back whole
                            if attempts[jid] <= retry.max_retries:
                                requeue(jid)
                            elif resubmits.get(jid, 0) < retry.user_resubmits:
                                # Failed; its user submits it again (a fresh job: the
                                # automatic retries and the memory bumps start over), its
                                # JCT still counted from the first submission, and it
                                # keeps its place in the queue (in the user's favour).
                                resubmits[jid] = resubmits.get(jid, 0) + 1
                                attempts[jid] = 0
                                est_mem[jid] = m.job.gpu_mem_bytes  # the same spec, estimated again
                                push(now + retry.user_resubmit_delay_s, _RESUBMIT, jid)
                            else:
                                outcome_state[jid] = "FAILED"
                            continue
                    if m.peaked and m.progress >= m.job.solo_duration_s - 1e-6:
                        outcome_end[m.job.job_id] = now
                        outcome_state[m.job.job_id] = "COMPLETED"
                        if faults is not None:
                            faults.on_complete(m.job, now)
                        end_member(pack, gpu, m)
                        end_gang(m)
        # Heap events at this instant.
        while events and events[0][0] <= now + _EPS:
            _, _, kind, payload = heapq.heappop(events)
            if kind == _ARRIVAL:
                assert isinstance(payload, int)
                job = jobs[payload]
                pending[payload] = job_demand(job, job.gpu_mem_bytes, job.est_duration_s)
                if faults is not None:
                    pending[payload] = faults.arrival_demand(job, now)
                    est_mem[payload] = pending[payload].gpu_mem_bytes
                arrived_since += 1
                schedule_tick()
            elif kind == _RESUBMIT:
                assert isinstance(payload, int)
                requeue(payload)
            elif kind == _SNAPSHOT:
                pass  # recorded below, once this instant's events are handled
            elif kind == _PACK_RELEASE:
                assert isinstance(payload, _Pack)
                release_pack(payload)  # unless a joiner came during the grace
            elif kind == _TICK:
                tick_at = None
            elif kind == _PACK_START:
                assert isinstance(payload, _Pack)
                payload.start_s = now
                running_packs.append(payload)
                if payload.node.down:
                    kill_packs(payload.node.name, [payload])  # its node failed before it started
                    continue
                push(now + slurm.member_startup_s, _MEMBER_READY, payload)
                if faults is not None and not observe_armed and faults.recovery.enabled and faults.recovery.stragglers:
                    observe_armed = True
                    push(now + faults.recovery.observe_s, _OBSERVE, None)
            elif kind == _MEMBER_READY:
                assert isinstance(payload, _Pack)
                for gpu in payload.gpus:
                    for m in gpu.members:
                        if not m.ended and not m.ready and m.ready_at <= now + _EPS:
                            m.ready = True
                            m.peak_progress = min(m.progress_start + m.job.peak_at_frac * m.job.solo_duration_s,
                                                  m.job.solo_duration_s)
                    set_speeds(gpu)
            elif kind == _NODE_FAIL:
                assert isinstance(payload, tuple) and faults is not None
                name, rearm = payload  # rearm: a random failure, the next is drawn when it is back
                if len(outcome_state) < len(jobs) and not by_name[name].down:  # all done: stop injecting
                    by_name[name].down = True
                    kill_packs(name, [pk for pk in running_packs if pk.node.name == name])
                    push(now + faults.faults.node_repair_s, _NODE_BACK, (name, rearm))
                elif rearm and len(outcome_state) < len(jobs):
                    fail_in = faults.next_failure_in_s()
                    if fail_in is not None:
                        push(now + faults.faults.node_repair_s + fail_in, _NODE_FAIL, (name, True))
            elif kind == _NODE_BACK:
                assert isinstance(payload, tuple) and faults is not None
                name, rearm = payload
                by_name[name].down = False
                fail_in = faults.next_failure_in_s() if rearm else None
                if fail_in is not None:
                    push(now + fail_in, _NODE_FAIL, (name, True))
                schedule_tick()
            elif kind == _OBSERVE:
                assert faults is not None
                observe_armed = False
                observe_round()
                if running_packs:
                    observe_armed = True
                    push(now + faults.recovery.observe_s, _OBSERVE, None)
        while snap_times and now - first_arrival >= snap_times[0] - _EPS:
            snap_times.pop(0)
            snapshots.append(take_snapshot())
        # Dispatch.
        slots = max(1, min(limits.shards_per_gpu, limits.members_per_gpu))
        any_free = (any(n.free_gpus > 0 and not n.down for n in nodes)
                    or any(sum(1 for m in pk.gpus[gi].members if not m.ended) < slots for pk, gi in shard_gpus.values())
                    or (refill and any(joinable(pk) for pk in running_packs)))
        if dirty and any_free and should_run_round(now, last_round, len(pending), arrived_since, dispatch):
            run_round()
        if dirty and pending and tick_at is None and any_free:
            schedule_tick()
        if not events and not running_packs and not pending:
            break
        if not events and not running_packs and pending and not any_free:
            break  # nothing can ever free up (cannot happen with a consistent cluster)

    # Packs still holding GPUs at the time limit count up to now.
    for pack in running_packs:
        if pack.start_s <= now:
            alloc_gpu_s += pack.gpu_count * (now - pack.start_s)
            held_cpu_s += (pack.asked_cpus + pack.agent_cpus) * (now - pack.start_s)
            held_mem_byte_s += (pack.asked_mem + pack.agent_mem) * (now - pack.start_s)
    outcomes = []
    for j in workload.jobs:
        state = outcome_state.get(j.job_id, "PENDING")
        outcomes.append(JobOutcome(j.job_id, j.arrival_s, j.solo_duration_s, outcome_end.get(j.job_id), state,
                                   oom_of.get(j.job_id, 0), first_start.get(j.job_id)))
    return SimResult(policy=policy, workload=workload.name, cluster=cluster.name, gpus=cluster.gpu_count,
                     jobs=tuple(outcomes), first_arrival_s=first_arrival, end_s=now, alloc_gpu_s=alloc_gpu_s,
                     busy_gpu_s=busy_gpu_s, ooms=ooms, rounds=rounds, packs=packs_made, member_s=member_s,
                     backlog_s=backlog_s, backlog_work_s=backlog_work_s, resubmits=sum(resubmits.values()),
                     evictions=evictions, held_cpu_s=held_cpu_s, held_mem_byte_s=held_mem_byte_s,
                     snapshots=tuple(snapshots))


def _could_ever_fit(job: SimJob, gpu_mem_bytes: int, node: object, cluster: SimCluster) -> bool:
    from slurm_dlrm.packing.model import host_limit_bytes, member_fence_bytes, usable_gpu_bytes

    gpu = cluster.gpu_model(node.gpu_model)  # type: ignore[attr-defined]
    ranks = rank_members(job_demand(job, gpu_mem_bytes, None))
    return (len(ranks) <= node.gpus  # type: ignore[attr-defined]
            and sum(d.cpus for d in ranks) <= node.cpus  # type: ignore[attr-defined]
            and sum(host_limit_bytes(d, cluster.limits) for d in ranks) <= node.memory_bytes  # type: ignore[attr-defined]
            and all(member_fence_bytes(d, gpu, cluster.limits) <= usable_gpu_bytes(gpu) for d in ranks))


def with_noise_free_truth(workload: Workload) -> Workload:
    """The same workload with the estimates exactly right (for sanity checks)."""
    return replace(workload, jobs=tuple(replace(j, true_gpu_mem_bytes=j.gpu_mem_bytes, true_sm_util_pct=j.sm_util_pct,
                                                true_membw_util_pct=j.membw_util_pct) for j in workload.jobs))
