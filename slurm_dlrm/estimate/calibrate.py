"""Calibration from history (DLRover-RM's warm start from similar jobs). Pure.

When earlier runs with the same spec fingerprint have measured peaks, the estimate is
scaled by how far off it was for them. The factor is the largest measured/estimated
ratio over the most recent runs, so the corrected estimate covers every one of them
(an under-estimate lets a neighbour run out of memory; an over-estimate only wastes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from slurm_dlrm.estimate.analytic import Estimate

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
