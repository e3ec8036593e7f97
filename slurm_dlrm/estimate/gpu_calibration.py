"""Figures fitted on a recorded GPU run (issue 37; docs/estimator.md "Memory as the GPU
counts it" and "Profiles from measurement").

Pure: the caller reads the run's files (`scripts/gpu-check.sh` output, e.g.
tests/data/gpu/h100-2026-11-27/) and hands the records in. Three things:

- per-process memory overheads: what NVML counts beyond torch's reserved memory
  (`nvml_overhead_mib`, the planner's room) and what the MPS pinned-memory limit counts
  beyond the allocations (`fence_overhead_mib`, from the selftest's fence check), each
  from its own measurement;
- `fit_per_id`: the CUDA-side bytes per looked-up id that a CPU trace does not see
  (the embedding backward's sort buffers, the caching allocator's split blocks);
- `ProfileCalibration`: the SM and memory-bandwidth busy shares NVML reports, from the
  estimator's GPU times and the step's kernel count (`calibrated_shares`), fitted on the
  run's alone windows (`fit_profile_calibration`).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

MIB = 1 << 20


def nvml_overhead_mib(memory_records: Sequence[Mapping[str, Any]]) -> float | None:
    """Median over the configs of NVML's process memory minus torch's reserved memory,
    both read after the run (memory.jsonl's `measured`). None when no config has both."""
    diffs = []
    for r in memory_records:
        m = r.get("measured") or {}
        nvml, reserved = m.get("nvml_process_bytes"), m.get("memory_reserved_now_bytes")
        if nvml and reserved:
            diffs.append((int(nvml) - int(reserved)) / MIB)
    return round(statistics.median(diffs), 1) if diffs else None


def fence_overhead_mib(selftest: Mapping[str, Any]) -> float | None:
    """What the MPS limit counted beyond the greedy client's allocations when it refused
    the next block: limit - allocated (an upper bound, within one 32 MiB block), from a
    passing `mps.memory_fence` check. None when the check did not pass."""
    for c in selftest.get("checks", []):
        if c.get("name") == "mps.memory_fence" and c.get("status") == "PASS":
            v = c.get("values") or {}
            if v.get("limit_mib") is not None and v.get("allocated_mib") is not None:
                return float(v["limit_mib"]) - float(v["allocated_mib"])
    return None


def measured_with(selftest: Mapping[str, Any]) -> str | None:
    """"driver X, CUDA Y" from the selftest's nvml.driver check."""
    for c in selftest.get("checks", []):
        if c.get("name") == "nvml.driver" and c.get("status") == "PASS":
            v = c.get("values") or {}
            cuda = v.get("cuda_driver_version")
            cuda_text = f"{int(cuda) // 1000}.{int(cuda) % 1000 // 10}" if cuda else "?"
            return f"driver {v.get('driver_version', '?')}, CUDA {cuda_text}"
    return None


def fit_per_id(rows: Sequence[tuple[float, float]]) -> float:
    """Least squares through 0 of residual bytes on ids per step: bytes per id (>= 0)."""
    num = sum(r * ids for r, ids in rows)
    den = sum(ids * ids for _, ids in rows)
    return max(0.0, num / den) if den > 0 else 0.0


# ---------------------------------------------------------------- profiles


@dataclass(frozen=True)
class ProfileInputs:
    """What the estimator knows of one job before it runs, and (to fit) what NVML saw."""

    name: str
    gpu_busy_s: float  # estimator: GEMM time + memory time per step (the site's measured efficiencies)
    kernels_per_step: int  # kernels (ops) one step launches
    est_sm_pct: float  # the estimator's uncalibrated shares
    est_membw_pct: float
    sm_pct: float = float("nan")  # measured alone (NVML)
    membw_pct: float = float("nan")


@dataclass(frozen=True)
class ProfileCalibration:
    """NVML's busy shares from the estimator's figures:

    busy = gpu_busy_s + kernels x gpu_us_per_kernel   (kernels also occupy the GPU)
    host = kernels x host_us_per_kernel               (the CPU dispatches each one)
    sm   = sm_busy_ceiling x busy / max(busy, host)   (a host-bound step idles the GPU)
    bw   = membw_intercept_pct + membw_per_est_membw x est_bw + membw_per_est_sm x est_sm
    """

    gpu_us_per_kernel: float
    host_us_per_kernel: float
    sm_busy_ceiling: float
    membw_intercept_pct: float
    membw_per_est_membw: float
    membw_per_est_sm: float

    def shares(self, job: ProfileInputs) -> tuple[float, float]:
        busy = job.gpu_busy_s + job.kernels_per_step * self.gpu_us_per_kernel * 1e-6
        host = job.kernels_per_step * self.host_us_per_kernel * 1e-6
        sm = 100.0 * self.sm_busy_ceiling * busy / max(busy, host, 1e-12)
        bw = (self.membw_intercept_pct + self.membw_per_est_membw * job.est_membw_pct
              + self.membw_per_est_sm * job.est_sm_pct)
        return round(min(100.0, max(0.0, sm)), 1), round(min(100.0, max(0.0, bw)), 1)

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in asdict(self).items()}


# The grid the time constants are searched on: GPU time per kernel 0..8 us, host time per
# kernel 4..24 us (Python dispatch of one aten op is ~5-20 us), the busy ceiling 0.8..1.
_GPU_US = tuple(x / 4 for x in range(0, 33))
_HOST_US = tuple(4 + x / 2 for x in range(0, 41))
_CEILING = tuple(0.8 + x / 50 for x in range(0, 11))


def _solve3(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination for a 3x3 system (None if singular)."""
    m = [row[:] + [v] for row, v in zip(a, b, strict=True)]
    for c in range(3):
        p = max(range(c, 3), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-12:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(3):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c], strict=True)]
    return [m[i][3] / m[i][i] for i in range(3)]


def fit_profile_calibration(jobs: Sequence[ProfileInputs]) -> ProfileCalibration:
    """The time constants by grid search (least absolute SM error), the bandwidth map by
    least squares. Needs measured shares on at least 3 jobs."""
    usable = [j for j in jobs if j.sm_pct == j.sm_pct and j.membw_pct == j.membw_pct]
    if len(usable) < 3:
        raise ValueError(f"a profile calibration needs at least 3 jobs measured alone, got {len(usable)}")
    best: tuple[float, tuple[float, float, float]] | None = None
    for g, h, cap in itertools.product(_GPU_US, _HOST_US, _CEILING):
        err = 0.0
        for j in usable:
            busy = j.gpu_busy_s + j.kernels_per_step * g * 1e-6
            sm = 100.0 * cap * busy / max(busy, j.kernels_per_step * h * 1e-6, 1e-12)
            err += abs(sm - j.sm_pct)
        if best is None or err < best[0]:
            best = (err, (g, h, cap))
    assert best is not None
    g, h, cap = best[1]
    rows = [(1.0, j.est_membw_pct, j.est_sm_pct) for j in usable]
    ata = [[sum(r[i] * r[k] for r in rows) for k in range(3)] for i in range(3)]
    atb = [sum(r[i] * j.membw_pct for r, j in zip(rows, usable, strict=True)) for i in range(3)]
    coef = _solve3(ata, atb) or [statistics.mean(j.membw_pct for j in usable), 0.0, 0.0]
    return ProfileCalibration(g, h, cap, coef[0], coef[1], coef[2])


def leave_one_job_out(jobs: Sequence[ProfileInputs]) -> list[tuple[ProfileInputs, tuple[float, float]]]:
    """Each job's shares from a calibration fitted on the other jobs alone."""
    out = []
    for i, job in enumerate(jobs):
        cal = fit_profile_calibration([j for k, j in enumerate(jobs) if k != i])
        out.append((job, cal.shares(job)))
    return out
