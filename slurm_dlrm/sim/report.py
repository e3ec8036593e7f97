"""Figures beside the simulated ones: the ideal bound and the comparison table (pure)."""

from __future__ import annotations

from collections.abc import Sequence

from slurm_dlrm.packing.model import PackingLimits
from slurm_dlrm.sim.files import SimCluster, Workload
from slurm_dlrm.sim.results import SimResult


def ideal_makespan_s(workload: Workload, cluster: SimCluster, limits: PackingLimits | None = None) -> float:
    """A lower bound on the makespan: perfect packing, no interference, no start-up.

    The largest of `ideal_makespan_bounds_s`."""
    return max(ideal_makespan_bounds_s(workload, cluster, limits).values(), default=0.0)


def ideal_makespan_bounds_s(workload: Workload, cluster: SimCluster,
                            limits: PackingLimits | None = None) -> dict[str, float]:
    """The makespan lower bounds, one per resource (all with the *true* profiles):
    `arrivals` the latest (arrival + solo duration); `sm` and `membw` total SM and
    memory-bandwidth work over the cluster's GPUs; `slots` member-slot time;
    `gpu_mem` GPU-memory-time over the cluster's GPU memory; `cpus` CPU-time over its
    CPUs. The largest one binds: it says which resource caps any policy."""
    lim = limits or cluster.limits
    jobs = workload.jobs
    if not jobs:
        return {}
    first = min(j.arrival_s for j in jobs)
    gpus = cluster.gpu_count
    gpu_mem = sum(n.gpus * cluster.gpu_model(n.gpu_model).memory_bytes for n in cluster.nodes)
    ctx = min(cluster.gpu_model(n.gpu_model).cuda_context_bytes for n in cluster.nodes)
    cpus = sum(n.cpus for n in cluster.nodes)
    # A multi-GPU job counts every rank (its scale of the job's figures; CPUs per rank).
    return {
        "arrivals": max(j.arrival_s + j.solo_duration_s for j in jobs) - first,
        "sm": sum(j.true_sm_util_pct / 100.0 * sum(j.scales) * j.solo_duration_s for j in jobs) / gpus,
        "membw": sum(j.true_membw_util_pct / 100.0 * sum(j.scales) * j.solo_duration_s for j in jobs) / gpus,
        "slots": sum(len(j.scales) * j.solo_duration_s for j in jobs) / (gpus * lim.members_per_gpu),
        "gpu_mem": sum(sum(j.true_gpu_mem_bytes * x + ctx for x in j.scales) * j.solo_duration_s
                       for j in jobs) / gpu_mem,
        "cpus": sum(len(j.scales) * max(1.0, j.host_cpu_cores) * j.solo_duration_s for j in jobs) / cpus,
    }


def ideal_throughput_bounds_jobs_per_h(workload: Workload, cluster: SimCluster) -> dict[str, float]:
    """`ideal_makespan_bounds_s` as throughputs (jobs/h): the lowest is the ideal bound
    and names the resource that caps every policy."""
    n = len(workload.jobs)
    return {k: n / (v / 3600.0) for k, v in ideal_makespan_bounds_s(workload, cluster).items() if v > 0}


def ideal_throughput_jobs_per_h(workload: Workload, cluster: SimCluster) -> float:
    t = ideal_makespan_s(workload, cluster)
    n = len(workload.jobs)
    return n / (t / 3600.0) if t > 0 else 0.0


def comparison_table(results: Sequence[SimResult], ideal_jobs_per_h: float | None = None,
                     baseline: str = "exclusive") -> str:
    """A fixed-width table, one row per policy, throughput also relative to `baseline`."""
    base = next((r for r in results if r.policy == baseline), None)
    head = (f"{'policy':<14} {'tput/h':>8} {'x' + baseline[:4]:>7} {'avgJCT_h':>9} {'p95JCT_h':>9} {'makespan_h':>10} "
            f"{'GPU_h':>8} {'util%':>6} {'OOMs':>5} {'done%':>6}")
    lines = [head]
    for r in results:
        rel = r.throughput_jobs_per_h / base.throughput_jobs_per_h if base and base.throughput_jobs_per_h > 0 else float("nan")
        lines.append(f"{r.policy:<14} {r.throughput_jobs_per_h:>8.2f} {rel:>7.2f} {r.avg_jct_s / 3600:>9.2f} "
                     f"{r.p95_jct_s / 3600:>9.2f} {r.makespan_s / 3600:>10.2f} {r.gpu_hours:>8.1f} "
                     f"{r.mean_gpu_util_pct:>6.1f} {r.ooms:>5d} {100 * r.completion_rate:>6.1f}")
    if ideal_jobs_per_h is not None:
        rel = ideal_jobs_per_h / base.throughput_jobs_per_h if base and base.throughput_jobs_per_h > 0 else float("nan")
        lines.append(f"{'ideal bound':<14} {ideal_jobs_per_h:>8.2f} {rel:>7.2f} {'(perfect packing, no interference)':>52}")
    return "\n".join(lines)
