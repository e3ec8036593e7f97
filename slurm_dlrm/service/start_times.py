"""`queue --start` (issue 31, like `squeue --start`): each waiting job's expected start,
from the simulator run forward from the store's current state (sim/start_estimate.py):
the site's GPU nodes, the running jobs with their expected time left, the waiting ones
with their wait so far, --nice and --begin, all through the service's policy."""

from __future__ import annotations

from typing import Any

from slurm_dlrm.site import MIB

DEFAULT_RUN_S = 3600.0  # a job whose estimate gives no run time (no steps) counts as this long


def _sim_job(job: Any, now_s: float) -> Any:
    from slurm_dlrm.packing.model import demand_from_estimate
    from slurm_dlrm.sim.files import SimJob

    spec = job.spec
    steps = spec.get("steps") or 0
    samples = float(steps * int(spec.get("batch_size") or 0)) if steps else None
    d = demand_from_estimate(job.estimate or {}, job_id=job.id, user=job.user, submit_time_s=job.submit_time,
                             name=job.name, samples_to_train=samples)
    run_s = d.est_duration_s or DEFAULT_RUN_S
    scales = tuple(r.gpu_mem_bytes / d.gpu_mem_bytes if d.gpu_mem_bytes else 1.0 for r in d.ranks)
    # the memory it is packed by: the request raised after an OOM, as the service does
    gpu = d.gpu_mem_bytes + max(0, (job.gpu_mem_request_bytes or 0) - (job.est_gpu_peak_bytes or 0))
    return SimJob(job_id=job.id, name=job.name, arrival_s=max(job.submit_time, job.begin_time or 0.0),
                  solo_duration_s=run_s, gpu_mem_bytes=gpu, host_mem_bytes=d.host_mem_bytes,
                  sm_util_pct=d.sm_util_pct, membw_util_pct=d.membw_util_pct, host_cpu_cores=d.host_cpu_cores,
                  label=d.label, true_gpu_mem_bytes=gpu, true_sm_util_pct=d.sm_util_pct,
                  true_membw_util_pct=d.membw_util_pct, est_duration_s=run_s, priority=-float(job.nice or 0),
                  user=job.user, world_size=d.world_size, rank_scales=scales if d.world_size > 1 else (),
                  submitted_s=job.submit_time)


def site_cluster(site: Any) -> Any:
    """The site's GPU nodes as a simulator cluster (its packing limits and dispatch)."""
    from slurm_dlrm.packing.dispatch import DispatchConfig
    from slurm_dlrm.packing.model import limits_from_site
    from slurm_dlrm.sim.files import SimCluster, SimNode

    nodes = tuple(SimNode(h, g.gpu_model, g.gpus, g.cpus, g.memory_mib * MIB)
                  for g in site.nodes if g.gpus > 0 for h in g.hostnames)
    return SimCluster(name="site", gpu_models=tuple(site.gpu_models.values()), nodes=nodes,
                      limits=limits_from_site(site), dispatch=DispatchConfig.from_site(site))


def expected_start_times(store: Any, site: Any, user: str, now_s: float, policy: str | None = None) -> dict[int, float]:
    """Job id -> expected start (epoch seconds) of the user's waiting packed jobs."""
    from slurm_dlrm.sim.engine import Snapshot
    from slurm_dlrm.sim.start_estimate import expected_starts
    from slurm_dlrm.store.states import JobState

    with store.read():
        waiting = [j for j in store.jobs([JobState.PENDING], user=user) if not j.no_pack]
        running = [j for j in store.jobs([JobState.PLANNED, JobState.RUNNING], user=user) if not j.no_pack]
    if not waiting:
        return {}
    jobs = {j.id: _sim_job(j, now_s) for j in waiting + running}
    run = [(j.id, max(60.0, jobs[j.id].solo_duration_s - (now_s - (j.start_time or now_s))),
            jobs[j.id].gpu_mem_bytes) for j in running]
    wait = [(j.id, jobs[j.id].solo_duration_s, jobs[j.id].gpu_mem_bytes) for j in waiting]
    snap = Snapshot(now_s, tuple(wait), tuple(run))
    return expected_starts(snap, jobs, site_cluster(site), policy or site.packing.policy)
