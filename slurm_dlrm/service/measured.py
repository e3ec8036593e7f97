"""What the agents measured, turned into what the policy plans with: the two mechanisms
of docs/packing.md "Closer to the bound" that the simulator credits, run live too.

- `member_peaks`: a live member past its warm-up counts in refill at its measured GPU
  peak (`JobDemand.observed_gpu_mem_bytes`), not its fence. "Past its warm-up": its
  samples in this pack span `warmup_s` (the service's warm-up window, RecoveryConfig):
  a DLRM job allocates its tables and optimizer state in its first steps, as the
  simulator's members reach their peak early (`peak_progress`).
- `learned_limits`: each round's memory margin from the estimate's error observed at
  this user's measured peaks (`adapt.margin`, the simulator's rule).

NVML's per-process bytes include the CUDA context and cuBLAS workspace; the figures the
policy takes do not, so the GPU model's context is taken off.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from slurm_dlrm.adapt.margin import learned_margin_pct, peak_error
from slurm_dlrm.packing.model import PackingLimits, own_gpu_bytes
from slurm_dlrm.site import SiteConfig

# The most recent measured jobs the margin learns from: enough to see the estimator's
# spread, few enough that a round stays cheap on a store of years.
MARGIN_HISTORY_JOBS = 500


def context_bytes(site: SiteConfig, gpu_model: str | None) -> int:
    """The per-process CUDA context + cuBLAS workspace of a GPU model (0 if unknown)."""
    g = site.gpu_models.get(gpu_model or "")
    return 0 if g is None else g.cuda_context_bytes + g.cublas_workspace_bytes


def member_peaks(store: Any, site: SiteConfig, pack: Any, job_ids: list[int],
                 warmup_s: float) -> dict[tuple[int, int], int]:
    """(job id, GPU index) -> measured peak GPU bytes without the context, of the live
    members of `pack` whose samples there span at least `warmup_s`. A job never runs
    twice in one pack (refill.open_gpus), so its samples there are this run's."""
    if not job_ids:
        return {}
    ctx = context_bytes(site, pack.gpu_model)
    rows = store.query("member_peaks", {"job_ids": json.dumps(sorted(job_ids)), "pack_id": pack.id})
    return {(int(r["job_id"]), int(r["gpu_index"] or 0)): max(0, int(r["gpu_mem_peak_bytes"]) - ctx)
            for r in rows if float(r["last_t"]) - float(r["first_t"]) >= warmup_s}


def peak_errors(store: Any, site: SiteConfig, user: str, warmup_s: float) -> list[float]:
    """|measured / estimated - 1| of GPU peaks (both without the context) over this user's
    most recent measured jobs whose samples span the warm-up (past their peak)."""
    out = []
    for r in store.query("peak_errors", {"user": user, "limit": MARGIN_HISTORY_JOBS}):
        if float(r["last_t"]) - float(r["first_t"]) < warmup_s:
            continue
        try:
            estimate = json.loads(r["estimate_json"] or "null")
        except ValueError:
            continue
        if not isinstance(estimate, dict):
            continue
        measured = int(r["gpu_mem_peak_bytes"]) - context_bytes(site, r["gpu_model"])
        if measured <= 0:
            continue  # no memory beyond a context (none, e.g. a member that never used CUDA): nothing learnt
        err = peak_error(measured, own_gpu_bytes(estimate))
        if err is not None:
            out.append(err)
    return out


def learned_limits(limits: PackingLimits, errors: list[float]) -> PackingLimits:
    """`limits` with the round's margin learned from `errors` (never below the configured)."""
    pct = learned_margin_pct(errors, limits.memory_margin_pct)
    return replace(limits, memory_margin_pct=pct) if pct > limits.memory_margin_pct else limits
