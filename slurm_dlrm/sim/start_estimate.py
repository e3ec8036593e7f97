"""Expected start times (`queue --start`, like `squeue --start`): the simulator run
forward from the current state (issue 31). Pure.

The state is a `Snapshot`: the waiting jobs and the running ones, as the service knows
them. The forward run starts from it (`simulate(resume=...)`): every running pack stays
on its node with its allocation, every member on its GPU with its time left (measured:
steps left at its reported rate, once it trains; else the estimate; the policy still
weighs it by its estimate's share left, as the live one does), the members past
their peak at their measured peak; packs Slurm has not started yet start when it would;
the waiting jobs are pending with their wait so far (the slowdown bound and its gang
reservations count it) and the rounds they were passed over; a later --begin arrives
then. Everything else (waiting jobs' run times, memory and interference) is the
estimate taken as the truth. Jobs not yet submitted are unknown, as to Slurm's own
estimate, so a later short job that overtakes makes it late.
"""

from __future__ import annotations

from dataclasses import replace

from slurm_dlrm.sim.engine import simulate
from slurm_dlrm.sim.files import SimCluster, SimJob, Workload
from slurm_dlrm.sim.snapshot import Snapshot


def forward_workload(snapshot: Snapshot, jobs: dict[int, SimJob]) -> Workload:
    """The snapshot's jobs with what is known of them as the truth: a running job's run
    is its time left; a waiting job's, its estimate."""
    now = snapshot.now_s
    peaks: dict[int, float] = {}  # job id -> its true GPU bytes as measured (at rank scale 1)
    peak_in: dict[int, float] = {}  # job id -> training left before its peak, not yet reached
    for pk in snapshot.packs:
        for m in pk.members:
            if m.peak_bytes is None:
                peak_in[m.job_id] = max(peak_in.get(m.job_id, 0.0), m.peak_in_s)
            if m.peak_bytes is not None:
                scales = jobs[m.job_id].scales
                scale = scales[m.rank] if m.rank < len(scales) else 1.0
                peaks[m.job_id] = max(peaks.get(m.job_id, 0.0), m.peak_bytes / scale)
    out = []

    def as_known(job: SimJob, left_s: float, gpu_bytes: int, peak_at_frac: float) -> SimJob:
        left = max(1.0, left_s)
        true_bytes = int(peaks.get(job.job_id, gpu_bytes))
        # a job with a later --begin arrives then; its wait counts from its submission
        submitted = job.arrival_s if job.submitted_s is None else job.submitted_s
        return replace(job, arrival_s=max(now, job.arrival_s), submitted_s=min(submitted, now),
                       solo_duration_s=left, est_duration_s=left,
                       gpu_mem_bytes=gpu_bytes, true_gpu_mem_bytes=true_bytes, true_sm_util_pct=job.sm_util_pct,
                       true_membw_util_pct=job.membw_util_pct, peak_at_frac=min(1.0, peak_at_frac))

    planned = dict(snapshot.planned_left_s)
    for jid, left, gpu_bytes in snapshot.running:
        # it runs for its measured time left; the policy weighs it, as the live one does,
        # by its estimate's share left (refill's and the gang reservations' view)
        known = as_known(jobs[jid], left, gpu_bytes, peak_in.get(jid, 0.0) / max(1.0, left))
        out.append(replace(known, arrival_s=now, est_duration_s=max(1.0, planned.get(jid, left))))
    for jid, left, gpu_bytes in snapshot.pending:
        # its memory peaks as far into its run as the job's does (DLRM: the first steps)
        out.append(as_known(jobs[jid], left, gpu_bytes, jobs[jid].peak_at_frac))
    out.sort(key=lambda j: (j.arrival_s, j.job_id))
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
    result = simulate(workload, cluster, policy, fairness=fairness, margin_from_errors=False, resume=snapshot)
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
