"""Expected start times (`queue --start`, like `squeue --start`): the simulator run
forward from the current state (issue 31). Pure.

The state is a `Snapshot`: the waiting jobs and the running ones, with their estimates
only (the service knows no more). The forward run replays them on the cluster through
the same policy: the running jobs arrive first and at top priority with their expected
time left (so they hold their GPUs about as long as they will), the waiting ones with
their wait so far (the slowdown bound counts it). Jobs not yet submitted are unknown,
as to Slurm's own estimate, so a later short job that overtakes makes it late.
"""

from __future__ import annotations

from dataclasses import replace

from slurm_dlrm.sim.engine import Snapshot, simulate
from slurm_dlrm.sim.files import SimCluster, SimJob, Workload

# Above the overdue band and below the urgent one (slurm_dlrm.packing.common): the jobs
# already running are placed before anything waiting.
RUNNING_PRIORITY = 1e13


def forward_workload(snapshot: Snapshot, jobs: dict[int, SimJob]) -> Workload:
    """The snapshot as a workload arriving at its time: estimates as the truth."""
    now = snapshot.now_s
    out = []

    def as_known(job: SimJob, left_s: float, gpu_bytes: int) -> SimJob:
        left = max(1.0, left_s)
        # a job with a later --begin arrives then
        return replace(job, arrival_s=max(now, job.arrival_s), solo_duration_s=left, est_duration_s=left, gpu_mem_bytes=gpu_bytes,
                       true_gpu_mem_bytes=gpu_bytes, true_sm_util_pct=job.sm_util_pct,
                       true_membw_util_pct=job.membw_util_pct, peak_at_frac=0.0)

    for jid, left, gpu_bytes in snapshot.running:
        out.append(replace(as_known(jobs[jid], left, gpu_bytes), priority=RUNNING_PRIORITY, submitted_s=now))
    for jid, left, gpu_bytes in snapshot.pending:
        job = jobs[jid]
        waited_from = job.arrival_s if job.submitted_s is None else job.submitted_s
        out.append(replace(as_known(job, left, gpu_bytes), submitted_s=min(waited_from, now)))
    out.sort(key=lambda j: (j.arrival_s, -j.priority, j.job_id))
    return Workload(name="forward", jobs=tuple(out))


def expected_starts(snapshot: Snapshot, jobs: dict[int, SimJob], cluster: SimCluster, policy: str,
                    fairness: str | None = None, repeat_recent_s: float = 0.0) -> dict[int, float]:
    """Job id -> expected start (the time a plan places it) for every waiting job of the
    snapshot that the forward run places. `repeat_recent_s` > 0: the jobs submitted in
    that long before the snapshot are assumed to come again as long after it (the
    stream goes on at its recent pace), so later jobs that would overtake are counted."""
    if not snapshot.pending:
        return {}
    waiting = {jid for jid, _, _ in snapshot.pending}
    workload = forward_workload(snapshot, jobs)
    if repeat_recent_s > 0:
        top = max(jobs) + 1
        again = [replace(j, job_id=top + k, arrival_s=j.arrival_s + repeat_recent_s, submitted_s=None,
                         true_gpu_mem_bytes=j.gpu_mem_bytes, true_sm_util_pct=j.sm_util_pct,
                         true_membw_util_pct=j.membw_util_pct,
                         solo_duration_s=j.est_duration_s or j.solo_duration_s, peak_at_frac=0.0)
                 for k, j in enumerate(sorted(jobs.values(), key=lambda j: j.job_id))
                 if snapshot.now_s - repeat_recent_s < j.arrival_s <= snapshot.now_s]
        workload = Workload(workload.name, tuple(sorted(workload.jobs + tuple(again),
                                                        key=lambda j: (j.arrival_s, -j.priority, j.job_id))))
    if snapshot.memory_margin_pct is not None:  # fences as wide as they are now (learned from errors seen)
        cluster = replace(cluster, limits=replace(cluster.limits, memory_margin_pct=snapshot.memory_margin_pct))
    result = simulate(workload, cluster, policy, fairness=fairness, margin_from_errors=False)
    return {o.job_id: o.start_s for o in result.jobs if o.job_id in waiting and o.start_s is not None}


def within_share(predicted: dict[int, float], actual: dict[int, float], now_s: float, tolerance: float = 0.25) -> tuple[int, int]:
    """(jobs whose predicted start is within `tolerance` of the actual wait from `now_s`,
    jobs compared): |predicted - actual| <= tolerance x (actual - now)."""
    ok = n = 0
    for jid, start in actual.items():
        if jid not in predicted:
            n += 1
            continue
        n += 1
        wait = max(0.0, start - now_s)
        if abs(predicted[jid] - start) <= tolerance * wait + 1e-6:
            ok += 1
    return ok, n
