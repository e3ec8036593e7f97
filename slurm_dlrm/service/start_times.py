"""`queue --start` (issue 31, like `squeue --start`): each waiting job's expected start,
from the simulator run forward from the store's current state (sim/start_estimate.py):
the site's GPU nodes, the running packs where they are with each member's time left
(the runner's reported steps, else the estimate less the time run) and measured peak,
the waiting jobs with their wait so far, --nice and --begin, all through the service's
policy and fairness rule."""

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


def _time_left_s(store: Any, site: Any, user: str, job: Any, run_s: float, now_s: float) -> float:
    """A running job's solo run left, as refill weighs a live member: from the runner's
    last reported step when there is one (it counts the runs before a resume and is
    not fooled by a shared GPU's slowdown), else its estimate less the time it has run."""
    from slurm_dlrm.service.submit import job_progress

    steps = (job.spec or {}).get("steps")
    if isinstance(steps, int) and steps > 0 and (step := job_progress(site, user, job.id)) is not None:
        return run_s * max(0.0, 1.0 - step / steps)
    return run_s - (now_s - (job.start_time or now_s))


def running_packs(store: Any, site: Any, user: str, live: dict[int, Any], now_s: float,
                  timing: Any) -> tuple[Any, ...]:
    """The user's packs holding (or about to hold) GPUs, one `RunningPack` per node, with
    their live members where the store placed them: their fences, CPUs and host memory,
    start-up left and measured peaks. The allocation counts the members' CPUs and memory
    (the refill headroom it may hold beyond them is not in the store)."""
    from slurm_dlrm.service.measured import member_peaks
    from slurm_dlrm.service.recovery_state import RecoveryConfig
    from slurm_dlrm.sim.snapshot import RunningMember, RunningPack
    from slurm_dlrm.site import expand_hostlist
    from slurm_dlrm.store.states import PackState

    out = []
    for pack in store.packs([PackState.SUBMITTING, PackState.QUEUED, PackState.RUNNING], user=user):
        rows = [p for p in store.placements(pack_id=pack.id) if p.job_id in live and p.end_time is None]
        if not rows:
            continue
        started = pack.state == PackState.RUNNING
        # Slurm starts a queued pack about submit_to_start_s after its submission
        start_in = 0.0 if started else max(0.0, (pack.submit_time or now_s) + timing.submit_to_start_s - now_s)
        peaks = (member_peaks(store, site, pack, sorted({p.job_id for p in rows}), RecoveryConfig().warmup_s)
                 if started else {})
        hosts = expand_hostlist(pack.nodes) if pack.nodes else []
        per_node = max(1, pack.n_gpus // max(1, pack.n_nodes))
        for node_index in sorted({p.node_index for p in rows}):
            here = [p for p in rows if p.node_index == node_index]
            name = here[0].node or (hosts[node_index] if node_index < len(hosts) else None)
            if name is None:
                continue  # not placed on a node yet: no GPU is held
            members = []
            for p in here:
                # a member with a start time trains; one without starts up when its pack does
                ready_in = 0.0 if started and p.start_time is not None else start_in + timing.member_startup_s
                members.append(RunningMember(p.job_id, p.gpu_index, p.rank or 0, p.gpu_mem_limit_bytes, p.cpus or 1,
                                             p.host_mem_limit_bytes or 0, ready_in,
                                             peaks.get((p.job_id, p.gpu_index))))
            out.append(RunningPack(name, max(per_node, 1 + max(p.gpu_index for p in here)),
                                   sum(m.cpus for m in members), sum(m.host_mem_bytes for m in members),
                                   True, start_in, tuple(members)))
    return tuple(out)


def expected_start_times(store: Any, site: Any, user: str, now_s: float, policy: str | None = None) -> dict[int, float]:
    """Job id -> expected start (epoch seconds) of the user's waiting packed jobs."""
    from slurm_dlrm.sim.snapshot import Snapshot
    from slurm_dlrm.sim.start_estimate import expected_starts
    from slurm_dlrm.store.states import JobState

    cluster = site_cluster(site)
    with store.read():
        waiting = [j for j in store.jobs([JobState.PENDING], user=user) if not j.no_pack]
        running = [j for j in store.jobs([JobState.PLANNED, JobState.RUNNING], user=user) if not j.no_pack]
        if not waiting:
            return {}
        jobs = {j.id: _sim_job(j, now_s) for j in waiting + running}
        run = [(j.id, max(60.0, _time_left_s(store, site, user, j, jobs[j.id].solo_duration_s, now_s)),
                jobs[j.id].gpu_mem_bytes) for j in running]
        packs = running_packs(store, site, user, {j.id: j for j in running}, now_s, cluster.slurm)
    # a pack on a node that is not one of the site's GPU nodes holds none of their GPUs
    known = {n.name: n.gpus for n in cluster.nodes}
    elsewhere = {m.job_id for pk in packs if pk.gpu_count > known.get(pk.node_name, -1) for m in pk.members}
    packs = tuple(pk for pk in packs if pk.gpu_count <= known.get(pk.node_name, -1))
    # a running job the store has on no node (its pack not placed yet) waits with the others
    on_nodes = {m.job_id for pk in packs for m in pk.members} | elsewhere
    wait = [(j.id, jobs[j.id].solo_duration_s, jobs[j.id].gpu_mem_bytes) for j in waiting]
    wait += [r for r in run if r[0] not in on_nodes]
    placed = {m.job_id for pk in packs for m in pk.members}
    snap = Snapshot(now_s, tuple(wait), tuple(r for r in run if r[0] in placed), packs=packs)
    starts = expected_starts(snap, jobs, cluster, policy or site.packing.policy)
    return {jid: t for jid, t in starts.items() if jid in {j.id for j in waiting}}
