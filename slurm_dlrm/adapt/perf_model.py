"""Resource-performance model of one job: samples/s from SM share and CPU cores.

DLRover-RM fits job throughput as a function of the resources it is given with
non-negative least squares, so each coefficient stays a physical cost. For a DLRM
member under MPS the resources are the SM share `s` (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE,
percent) and host CPU cores `c` (the data loader and the optimizer's host part).
Time per sample is modelled as the sum of a fixed part, a GPU part that shrinks with
the SM share, and a host part that shrinks with cores:

    seconds_per_sample(s, c) = a0 + a1 * (100 / s) + a2 / c,   a0, a1, a2 >= 0

The form is linear in the coefficients, so NNLS on measured (s, c, samples/s) points
fits it exactly; rows are weighted by the measured speed so the fit minimises
relative, not absolute, error (fast and slow jobs count the same).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PerfModel:
    fixed_s: float  # a0: seconds per sample that no resource removes
    gpu_s_at_full_share: float  # a1: GPU seconds per sample with 100% of the SMs
    host_core_s: float  # a2: host core-seconds per sample
    points: int  # measurements the fit used

    def seconds_per_sample(self, sm_share_pct: float, cpu_cores: float) -> float:
        share = min(max(sm_share_pct, 1e-3), 100.0)
        cores = max(cpu_cores, 1e-3)
        return self.fixed_s + self.gpu_s_at_full_share * 100.0 / share + self.host_core_s / cores

    def samples_per_s(self, sm_share_pct: float, cpu_cores: float) -> float:
        t = self.seconds_per_sample(sm_share_pct, cpu_cores)
        return 1.0 / t if t > 0 else float("inf")

    def cores_for(self, sm_share_pct: float, max_cores: int, target_fraction: float = 0.95) -> int:
        """Fewest whole cores giving `target_fraction` of the speed `max_cores` would."""
        best = self.samples_per_s(sm_share_pct, max_cores)
        for cores in range(1, max_cores + 1):
            if self.samples_per_s(sm_share_pct, cores) >= target_fraction * best:
                return cores
        return max_cores


def fit_perf_model(points: Sequence[tuple[float, float, float]]) -> PerfModel | None:
    """Fit from (sm_share_pct, cpu_cores, samples_per_s) measurements.

    Returns None with fewer than 2 usable points: one point cannot tell the GPU
    part from the host part, and a wrong model is worse than none.
    """
    from scipy.optimize import nnls  # scipy only here; the module stays cheap to import

    rows = [(s, c, v) for s, c, v in points if s > 0 and c > 0 and v > 0]
    if len(rows) < 2:
        return None
    arr = np.asarray(rows, dtype=float)
    share, cores, speed = arr[:, 0], arr[:, 1], arr[:, 2]
    features = np.column_stack([np.ones_like(share), 100.0 / share, 1.0 / cores])
    # Weight each row by its speed: residual = speed * t_pred - 1, a relative error.
    coef, _ = nnls(features * speed[:, None], np.ones_like(speed))
    return PerfModel(float(coef[0]), float(coef[1]), float(coef[2]), len(rows))


def allocate_shares(
    models: Sequence[PerfModel],
    total_pct: int = 100,
    min_pct: int = 5,
    step_pct: int = 5,
    cpu_cores: Sequence[float] | None = None,
) -> list[int]:
    """Split a GPU's SM share among members to maximise summed normalised speed.

    Each member's speed is normalised by its speed with the whole GPU, so a fast
    job cannot starve a slow one. Greedy on marginal gain is optimal here because
    each member's normalised speed is concave in its share.
    """
    n = len(models)
    if n == 0:
        return []
    if n * min_pct > total_pct:
        raise ValueError(f"{n} members x {min_pct}% exceeds {total_pct}%")
    cores = list(cpu_cores) if cpu_cores is not None else [1.0] * n
    full = [m.samples_per_s(100.0, c) for m, c in zip(models, cores, strict=True)]
    shares = [min_pct] * n
    left = total_pct - n * min_pct

    def norm(i: int, pct: int) -> float:
        return models[i].samples_per_s(pct, cores[i]) / full[i]

    while left >= step_pct:
        gains = [
            (norm(i, shares[i] + step_pct) - norm(i, shares[i]), -i) for i in range(n) if shares[i] < 100
        ]
        if not gains:
            break
        gain, neg_i = max(gains)
        if gain <= 1e-9:
            break
        shares[-neg_i] += step_pct
        left -= step_pct
    # Hand out what is left evenly: MPS shares are caps, idle share costs nothing.
    i = 0
    while left > 0:
        add = min(step_pct, left)
        if shares[i % n] + add <= 100:
            shares[i % n] += add
            left -= add
        i += 1
        if i > 100 * n:
            break
    return shares
