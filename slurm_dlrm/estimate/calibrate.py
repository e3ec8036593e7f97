"""Calibration from history (DLRover-RM's warm start from similar jobs). Pure.

Two kinds: per fingerprint (`calibrate`, below) and site-wide for the host peak
(`site_calibrate`, at the end), used where no run of the fingerprint exists yet.

When earlier runs with the same spec fingerprint have measured peaks, the estimate is
scaled by how far off it was for them. The factor is the largest measured/estimated
ratio over the most recent runs, so the corrected estimate covers every one of them
(an under-estimate lets a neighbour run out of memory; an over-estimate only wastes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from slurm_dlrm.estimate.analytic import MIB, Estimate

MAX_RECORDS = 10  # the most recent runs; older ones may predate a code change
MIN_FACTOR = 0.5  # refuse absurd corrections (a measurement gone wrong)
MAX_FACTOR = 3.0


@dataclass(frozen=True)
class HistoryRecord:
    """One earlier run of the same structure (the same `spec_fingerprint`)."""

    fingerprint: str
    estimated_gpu_peak_bytes: int | None
    measured_gpu_peak_bytes: int | None
    estimated_host_peak_bytes: int | None = None
    measured_host_peak_bytes: int | None = None
    t: float = 0.0  # when it ran (for ordering)


def _factor(pairs: list[tuple[int, int]]) -> float | None:
    ratios = [m / e for e, m in pairs if e and m and e > 0 and m > 0]
    if not ratios:
        return None
    return min(MAX_FACTOR, max(MIN_FACTOR, max(ratios)))


def calibrate(est: Estimate, history: Sequence[HistoryRecord], fingerprint: str | None = None) -> Estimate:
    """Return `est` corrected from `history` (records of other fingerprints are ignored
    when `fingerprint` is given). The breakdown gains a `calibration` entry (the
    difference, possibly negative) and the method says `+calibrated`."""
    records = [r for r in history if fingerprint is None or r.fingerprint == fingerprint]
    records = sorted(records, key=lambda r: r.t)[-MAX_RECORDS:]
    gpu_f = _factor([(r.estimated_gpu_peak_bytes or 0, r.measured_gpu_peak_bytes or 0) for r in records])
    host_f = _factor([(r.estimated_host_peak_bytes or 0, r.measured_host_peak_bytes or 0) for r in records])
    if gpu_f is None and host_f is None:
        return est
    gpu_breakdown = dict(est.gpu_breakdown)
    host_breakdown = dict(est.host_breakdown)
    gpu_peak, host_peak = est.gpu_peak_bytes, est.host_peak_bytes
    notes = list(est.notes)
    n = len(records)
    if gpu_f is not None and gpu_peak > 0:
        new = int(round(gpu_peak * gpu_f))
        gpu_breakdown["calibration"] = new - gpu_peak
        gpu_peak = new
        notes.append(f"GPU peak calibrated from {n} earlier run(s) with the same fingerprint: x{gpu_f:.3f}")
    if host_f is not None:
        new = int(round(host_peak * host_f))
        host_breakdown["calibration"] = new - host_peak
        host_peak = new
        notes.append(f"host peak calibrated from {n} earlier run(s) with the same fingerprint: x{host_f:.3f}")
    # Every rank by the same factors (history holds the fullest rank's measured peaks).
    ranks = tuple(dataclasses.replace(
        r, gpu_peak_bytes=int(round(r.gpu_peak_bytes * gpu_f)) if gpu_f is not None else r.gpu_peak_bytes,
        host_peak_bytes=int(round(r.host_peak_bytes * host_f)) if host_f is not None else r.host_peak_bytes)
        for r in est.ranks)
    return dataclasses.replace(est, gpu_peak_bytes=gpu_peak, host_peak_bytes=host_peak, gpu_breakdown=gpu_breakdown,
                               host_breakdown=host_breakdown, method=f"{est.method}+calibrated", notes=tuple(notes),
                               ranks=ranks,
                               # the fence keeps its distance below the NVML figure
                               gpu_fence_bytes=max(0, gpu_peak - (est.gpu_peak_bytes - est.gpu_fence_bytes))
                               if est.gpu_fence_bytes else 0)


# ---------------------------------------------------------------- site-wide host calibration
#
# The host runtime term (what torch + torchrec + fbgemm + gloo cost a process before any
# tensor) is a constant in the estimate, but its resident share of mapped library pages
# depends on the page cache of the machine the job runs on: on one machine with identical
# files it measured 110 MiB apart between two sessions (issue 43 item 13, docs/estimator.md).
# So, where no run of a job's own fingerprint exists yet, the host peak is corrected by
# what the site's finished runs of any fingerprint measured: an additive term (the runtime
# is additive; a factor would scale it with the tensors) taken as the largest
# measured - estimated over the recent runs of the same device kind (a CPU-trained run's
# runtime term is not a CUDA-trained one's), so the corrected estimate covers each of them.

SITE_MAX_RUNS = 20  # the most recent finished runs of one device kind
SITE_MIN_RUNS = 3  # fewer: the runtime constant alone (the safe prior of a new site)
SITE_CLAMP_OF_RUNTIME = 0.5  # the correction stays within +-half the runtime term


@dataclass(frozen=True)
class SiteRun:
    """One finished run of any fingerprint: its host peak as estimated (before any
    calibration) and as measured (peak RSS), and the device kind its estimate took."""

    device_kind: str  # "cpu" | "cuda"
    estimated_host_peak_bytes: int
    measured_host_peak_bytes: int
    t: float = 0.0  # when it ended (for ordering)


@dataclass(frozen=True)
class SiteHostCorrection:
    device_kind: str
    correction_bytes: int  # added to the host peak; negative where the runtime term is over
    runs: int  # how many runs it is taken from
    clamped: bool  # the raw figure lay beyond +-half the runtime term


def estimate_device_kind(host_breakdown: Mapping[str, Any]) -> str | None:
    """"cpu" or "cuda": which runtime term an estimate's host breakdown took (a CPU-run
    estimate counts its `tensors` in host memory; a GPU-run one does not), None for an
    estimate without a `runtime` term (not one of ours: nothing to correct)."""
    if "runtime" not in host_breakdown:
        return None
    return "cpu" if "tensors" in host_breakdown else "cuda"


def uncalibrated_host_peak_bytes(estimate: Mapping[str, Any]) -> int | None:
    """An estimate dict's (`Estimate.to_dict()`) host peak without any calibration term."""
    peak = estimate.get("host_peak_bytes")
    if not isinstance(peak, int | float):
        return None
    bd = estimate.get("host_breakdown") or {}
    return int(peak) - int(bd.get("calibration") or 0) - int(bd.get("site_calibration") or 0)


def site_run(estimate: Mapping[str, Any], measured_host_peak_bytes: int | None, t: float = 0.0) -> SiteRun | None:
    """A finished run's `SiteRun` from its stored estimate dict and measured peak RSS;
    None where either is missing or the estimate has no runtime term."""
    kind = estimate_device_kind(estimate.get("host_breakdown") or {})
    est = uncalibrated_host_peak_bytes(estimate)
    if kind is None or est is None or est <= 0 or not measured_host_peak_bytes or measured_host_peak_bytes <= 0:
        return None
    return SiteRun(kind, est, int(measured_host_peak_bytes), t)


def site_host_correction(runs: Sequence[SiteRun], device_kind: str, runtime_bytes: int,
                         max_runs: int = SITE_MAX_RUNS, min_runs: int = SITE_MIN_RUNS) -> SiteHostCorrection | None:
    """The additive host-peak correction learned from the site's runs of `device_kind`:
    the largest measured - estimated over the `max_runs` most recent, clamped to
    +-`SITE_CLAMP_OF_RUNTIME` of `runtime_bytes`; None with fewer than `min_runs` runs."""
    mine = sorted((r for r in runs if r.device_kind == device_kind), key=lambda r: r.t)[-max_runs:]
    if len(mine) < max(1, min_runs) or runtime_bytes <= 0:
        return None
    raw = max(r.measured_host_peak_bytes - r.estimated_host_peak_bytes for r in mine)
    bound = int(runtime_bytes * SITE_CLAMP_OF_RUNTIME)
    correction = min(bound, max(-bound, raw))
    return SiteHostCorrection(device_kind, correction, len(mine), correction != raw)


def site_calibrate(est: Estimate, runs: Sequence[SiteRun], max_runs: int = SITE_MAX_RUNS,
                   min_runs: int = SITE_MIN_RUNS) -> Estimate:
    """Return `est` with its host peak corrected from the site's runs of its device kind
    (`site_host_correction`): the host breakdown gains a `site_calibration` entry
    (possibly negative) and a note says from how many runs. Unchanged where the
    per-fingerprint calibration already corrected the host peak (it wins), where the
    estimate has no runtime term, or with too few runs."""
    if "calibration" in est.host_breakdown or "site_calibration" in est.host_breakdown:
        return est
    kind = estimate_device_kind(est.host_breakdown)
    if kind is None:
        return est
    corr = site_host_correction(runs, kind, int(est.host_breakdown["runtime"]), max_runs, min_runs)
    if corr is None:
        return est
    host_breakdown = {**est.host_breakdown, "site_calibration": corr.correction_bytes}
    note = (f"host peak calibrated from {corr.runs} finished {kind} run(s) of this site (any spec): "
            f"{corr.correction_bytes / MIB:+.0f} MiB, the largest measured - estimated"
            + (f", clamped to +-{SITE_CLAMP_OF_RUNTIME:.0%} of the runtime term" if corr.clamped else ""))
    ranks = tuple(dataclasses.replace(r, host_peak_bytes=max(0, r.host_peak_bytes + corr.correction_bytes))
                  for r in est.ranks)
    return dataclasses.replace(est, host_peak_bytes=max(0, est.host_peak_bytes + corr.correction_bytes),
                               host_breakdown=host_breakdown, notes=(*est.notes, note), ranks=ranks)
