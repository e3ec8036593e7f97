"""What the planner and the service are told of the simulated jobs: estimates, never
the truth. A job's demand as the planner gets it, its time left as the service knows
it, each member's fence from its planned memory, and each round's fence margin learned
from the estimate's error seen at members' peaks.

Apart because the simulator must keep the truth (sim/progress.py) and what the planner
is told apart (docs/simulate.md): every estimate a plan sees comes from here.
"""

from __future__ import annotations

from dataclasses import replace

from slurm_dlrm.adapt.margin import learned_margin_pct, peak_error
from slurm_dlrm.packing.interference import DEFAULT_PARAMS, predict_speeds_from_fractions
from slurm_dlrm.packing.model import (
    JobDemand,
    PackingLimits,
    RankDemand,
    member_fence_bytes,
    rank_members,
)
from slurm_dlrm.sim.files import SimJob
from slurm_dlrm.sim.state import GpuState, MemberState, NodeState, PackState, SimState
from slurm_dlrm.site import MIB


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
                     est_duration_s=est_remaining_s, name=job.name, world_size=job.world_size, ranks=ranks,
                     may_pause=job.may_pause)


def est_left_s(m: MemberState) -> float:
    job = m.job
    return (job.est_duration_s or job.solo_duration_s) * max(0.0, job.solo_duration_s - m.progress) / job.solo_duration_s


def measured_left_s(st: SimState, pk: PackState, gpu: GpuState, m: MemberState) -> float:
    """Solo-seconds of training left as the service knows them: a member that trains
    reports its steps (the runner's metrics) and its rate (samples/s); steps left over
    that rate is its wall time left here, times the speed the planner predicts for it
    here (its estimated profile) gives solo-seconds. Before it trains: the estimate."""
    if not m.ready or m.speed <= 0:
        return est_left_s(m)
    live = [x for x in gpu.members if x.ready and not x.ended]
    pred = predict_speeds_from_fractions([min(1.0, x.job.sm_util_pct * x.scale / 100.0) for x in live],
                                         [min(1.0, x.job.membw_util_pct * x.scale / 100.0) for x in live],
                                         st.plan_params or DEFAULT_PARAMS)[live.index(m)] if len(live) > 1 else 1.0
    return max(0.0, m.job.solo_duration_s - m.progress) / m.speed * min(1.0, pred)


def member_limits(st: SimState, jid: int, node: NodeState, planned_mib: int,
                  rank: int = 0) -> tuple[int | None, int | None]:
    """(hard fence or None, dmem soft limit or None) of a member the plan placed."""
    whole = st.gpu_bytes(node)
    if not st.dmem:
        fence = planned_mib * MIB
        return (None if fence >= whole else fence), None
    hard = member_fence_bytes(rank_members(st.pending[jid])[rank], st.cluster.gpu_model(node.gpu_model), st.limits)
    return (None if hard >= whole else hard), planned_mib * MIB


def observe_error(st: SimState, pack: PackState, m: MemberState) -> None:
    # The estimate's error as the agents see it at a member's peak (its NVML
    # samples); a member killed at its fence shows only that its error passed it.
    est = st.est_mem[m.job.job_id] * m.scale
    if not st.learn_margin:
        return
    fence = None if m.fence_bytes is None else m.fence_bytes - st.ctx_bytes(pack.node)
    err = peak_error(m.true_mem, est, fence)
    if err is not None:
        st.mem_errors.append(err)


def round_limits(st: SimState) -> PackingLimits:
    # Fences from the estimate's known error (docs/packing.md "Fences"): the
    # configured margin, or, once errors were observed, the largest seen scaled
    # by (n+1)/n (the unbiased bound of a uniform error), whichever is larger.
    if not st.learn_margin or not st.mem_errors:
        return st.plan_limits
    pct = learned_margin_pct(st.mem_errors, st.plan_limits.memory_margin_pct)
    return replace(st.plan_limits, memory_margin_pct=pct) if pct > st.plan_limits.memory_margin_pct else st.plan_limits
