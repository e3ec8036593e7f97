"""Warm start (DLRover-RM's stage 1, docs/recovery.md "The three stages"): the demand
the policy sees for a job, raised from the history of its spec fingerprint (the
largest needed/estimated ratio of its recent runs and OOM raises; the measured
profile of similar finished jobs), or, for a fingerprint without runs, its host
figure from the site-wide host calibration (`site_runs`,
`estimate.calibrate.site_host_correction`).

Apart from `service/recovery.py` because it is where a newcomer looks for "why was my
job planned with more (or less) memory than its estimate"; it acts on no running
pack. `WarmStart` is one of `Recovery`'s bases: it shares the recovery's memory
(`RecoveryState`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from slurm_dlrm.adapt import Profile, warm_start
from slurm_dlrm.service.recovery_state import ADAPT, LEARNED, RecoveryState
from slurm_dlrm.site import MIB

MAX_FACTOR = 3.0  # as the estimator's calibration: refuse absurd corrections
HISTORY = 10  # the most recent runs of a fingerprint; older ones may predate a code change


def site_runs(rows: list[Any], device_kind: str, ran_on_cache: dict[int, str | None] | None = None) -> list[Any]:
    """The site-wide host calibration's runs (`SiteRun`) from `Store.site_host_runs` rows
    of `device_kind`. A run whose runner recorded another device (a GPU-run estimate of a
    member that trained on the CPU, as on fake GPUs: its tables were in host memory) is
    left out: its RSS says nothing about that estimate's runtime term. Unknown (no
    metrics): kept. `ran_on_cache`: job id -> device, kept across calls (a finished run's
    metrics do not change); trimmed to `rows`."""
    from slurm_dlrm.estimate.calibrate import site_run
    from slurm_dlrm.store.report import ran_on

    cache = {} if ran_on_cache is None else ran_on_cache
    out = []
    for row in rows:
        if row.job_id not in cache:
            cache[row.job_id] = ran_on(row.pack_dir, row.job_id)
        if cache[row.job_id] not in (None, device_kind):
            continue
        r = site_run(row.estimate, row.meas_host_peak_bytes, row.end_time or 0.0)
        if r is not None:
            out.append(r)
    if ran_on_cache is not None and len(cache) > 4 * len(rows) + 64:
        for job_id in set(cache) - {row.job_id for row in rows}:
            del cache[job_id]
    return out


class WarmStart(RecoveryState):
    """The warm start of `Recovery`: `adapt_demand` and what it reads."""

    def learned_factors(self, fingerprint: str) -> tuple[float, float, int]:
        """(GPU factor, host factor, runs) learned for a fingerprint: the largest
        needed/estimated ratio over its recent OOM raises and finished runs; >= 1
        (a smaller figure is not trusted: under a fence an under-estimate kills)."""
        gpu, host = [], []
        for r in self.store.calibration(fingerprint, limit=HISTORY):
            if r.est_gpu_peak_bytes and r.meas_gpu_peak_bytes:
                gpu.append(r.meas_gpu_peak_bytes / r.est_gpu_peak_bytes)
            if r.est_host_peak_bytes and r.meas_host_peak_bytes:
                host.append(r.meas_host_peak_bytes / r.est_host_peak_bytes)
        self._fresh()
        if self._learned_events is None:
            self._learned_events = self.store.events(kind=LEARNED)[-10 * HISTORY:]
        for ev in self._learned_events:
            d = ev.get("data") or {}
            if d.get("fingerprint") == fingerprint:
                if d.get("gpu_factor"):
                    gpu.append(float(d["gpu_factor"]))
                if d.get("host_factor"):
                    host.append(float(d["host_factor"]))
        runs = max(len(gpu), len(host))
        return (min(MAX_FACTOR, max([1.0, *gpu])), min(MAX_FACTOR, max([1.0, *host])), runs)

    # ------------------------------------------------------------ warm start

    def adapt_demand(self, job: Any, demand: Any) -> Any:
        """The demand the policy sees for `job`, adapted from measurements."""
        if job.attempt == 0:
            return self._warm_start(job, demand)
        usage = self.store.usage(job.id)
        if usage is None or not usage.sm_util_mean:
            return demand
        # A requeued job is planned with what it was measured to use.
        return replace(demand, sm_util_pct=float(usage.sm_util_mean),
                       host_cpu_cores=max(demand.host_cpu_cores, (usage.host_cpu_mean or 0.0) / 100.0))

    def _warm_start(self, job: Any, demand: Any) -> Any:
        self._fresh()
        fp = job.spec_fingerprint
        if fp not in self._history:
            self._history[fp] = (self.learned_factors(fp), self._similar_profiles(job))
        (gpu_f, host_f, runs), similar = self._history[fp]
        notes = []
        if gpu_f > 1.0 and job.est_gpu_peak_bytes:
            extra = int(job.est_gpu_peak_bytes * (gpu_f - 1.0))
            need = (job.gpu_mem_request_bytes or 0) - job.est_gpu_peak_bytes
            if extra > need:
                demand = replace(demand, gpu_mem_bytes=demand.gpu_mem_bytes + extra - max(0, need))
                notes.append(f"GPU x{gpu_f:.2f}")
        if host_f > 1.0 and job.est_host_peak_bytes:
            want = int(job.est_host_peak_bytes * host_f)
            if want > demand.host_mem_bytes:
                demand = replace(demand, host_mem_bytes=want)
                notes.append(f"host x{host_f:.2f}")
        if runs == 0:
            demand = self._site_host(job, demand)
        if similar:
            analytic = Profile(demand.sm_util_pct, demand.membw_util_pct, demand.host_cpu_cores,
                               demand.solo_samples_per_s)
            ws = warm_start(analytic, similar)
            demand = replace(demand, sm_util_pct=ws.profile.sm_util_pct, host_cpu_cores=ws.profile.host_cpu_cores)
            notes.append(ws.reason)
        if notes and self._once("warm", job):
            self.store.add_event(ADAPT, f"warm start from {max(runs, len(similar))} run(s) of spec "
                                 f"{job.spec_fingerprint[:12]}: {'; '.join(notes)}", job_id=job.id,
                                 data={"gpu_factor": gpu_f, "host_factor": host_f, "similar": len(similar)})
        return demand

    def _site_host(self, job: Any, demand: Any) -> Any:
        """A job whose fingerprint has no history: its host demand corrected by the site's
        finished runs of any spec with the same device kind (issue 43 item 13: the runtime
        term's resident pages depend on the site's page cache). Not where the store holds a
        request other than the estimate (an OOM raise): that one is a measurement."""
        from slurm_dlrm.estimate.calibrate import (
            SITE_MAX_RUNS,
            estimate_device_kind,
            site_host_correction,
        )

        est = job.estimate or {}
        bd = est.get("host_breakdown") or {}
        kind = estimate_device_kind(bd)
        if kind is None or not job.est_host_peak_bytes or "calibration" in bd or "site_calibration" in bd:
            return demand
        if job.host_mem_request_bytes not in (None, job.est_host_peak_bytes):
            return demand
        if kind not in self._site_runs:
            self._site_runs[kind] = site_runs(self.store.site_host_runs(kind, limit=SITE_MAX_RUNS), kind,
                                              self._ran_on)
        corr = site_host_correction(self._site_runs[kind], kind, int(bd["runtime"]))
        if corr is None or corr.correction_bytes == 0:
            return demand
        delta = corr.correction_bytes
        before = demand.host_mem_bytes
        demand = replace(demand, host_mem_bytes=max(1, before + delta),
                         ranks=tuple(replace(r, host_mem_bytes=max(1, r.host_mem_bytes + delta))
                                     for r in demand.ranks))
        if self._once("site-host", job):
            self.store.add_event(
                ADAPT, f"warm start from the site's host calibration: spec {job.spec_fingerprint[:12]} has no "
                f"finished run; host peak {before / MIB:.0f} -> {demand.host_mem_bytes / MIB:.0f} MiB "
                f"({delta / MIB:+.0f} MiB, the largest measured - estimated of the {corr.runs} most recent "
                f"finished {kind} run(s) of any spec" + (", clamped to half the runtime term)" if corr.clamped else ")"),
                job_id=job.id, data={"site_host_correction_bytes": delta, "runs": corr.runs, "device_kind": kind,
                                     "clamped": corr.clamped})
        return demand

    def _similar_profiles(self, job: Any) -> list[Profile]:
        from slurm_dlrm.store.states import JobState

        out = []
        for r in self.store.calibration(job.spec_fingerprint, limit=HISTORY):
            if r.job_id == job.id or r.state != JobState.COMPLETED:
                continue
            u = self.store.usage(r.job_id)
            if u is None or not u.sm_util_mean:
                continue
            out.append(Profile(sm_util_pct=float(u.sm_util_mean), membw_util_pct=0.0,
                               host_cpu_cores=max(0.1, (u.host_cpu_mean or 100.0) / 100.0),
                               samples_per_s=float(u.samples_per_s_mean or 0.0)))
        return out  # bandwidth is not measured per member: only SM and host figures are taken
