"""DLRover-RM's three stages, as decisions over measured figures.

1. Warm start: a new job takes its profile from similar finished jobs (same spec
   fingerprint) instead of the analytic guess.
2. Warm-up: once the first measured steps are in, the profile is replaced by the
   measurement; the service re-plans if the change is large enough to matter.
3. Run time: at checkpoints, re-pack only when the predicted gain clears a threshold
   that also pays for the restart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median


@dataclass(frozen=True)
class Profile:
    sm_util_pct: float
    membw_util_pct: float
    host_cpu_cores: float
    samples_per_s: float


@dataclass(frozen=True)
class WarmStart:
    profile: Profile
    from_jobs: int  # how many similar jobs it came from (0: analytic guess kept)
    reason: str


def warm_start(analytic: Profile, similar: Sequence[Profile]) -> WarmStart:
    """Median of similar jobs' measured solo profiles; the analytic one if none."""
    if not similar:
        return WarmStart(analytic, 0, "no similar finished job; analytic profile")
    prof = Profile(
        sm_util_pct=median(p.sm_util_pct for p in similar),
        membw_util_pct=median(p.membw_util_pct for p in similar),
        host_cpu_cores=median(p.host_cpu_cores for p in similar),
        samples_per_s=median(p.samples_per_s for p in similar),
    )
    return WarmStart(prof, len(similar), f"profile from {len(similar)} similar finished job(s)")


@dataclass(frozen=True)
class WarmupUpdate:
    profile: Profile
    replan: bool
    reason: str


def update_after_warmup(predicted: Profile, measured: Profile, replan_change_pct: float = 25.0) -> WarmupUpdate:
    """Take the measured profile; ask for a re-plan if SM use or host demand moved a lot."""
    def change(a: float, b: float) -> float:
        return abs(b - a) / max(abs(a), 1e-9) * 100.0

    moved = max(
        change(predicted.sm_util_pct, measured.sm_util_pct),
        change(predicted.host_cpu_cores, measured.host_cpu_cores),
    )
    replan = moved >= replan_change_pct
    verdict = "re-plan" if replan else "keep placement"
    return WarmupUpdate(measured, replan, f"warm-up measured profile differs by {moved:.0f}% ({verdict})")


@dataclass(frozen=True)
class RepackDecision:
    repack: bool
    gain_pct: float
    reason: str


def decide_repack(
    current_samples_per_s: float,
    candidate_samples_per_s: float,
    remaining_s: float,
    restart_cost_s: float,
    threshold_pct: float = 10.0,
) -> RepackDecision:
    """Re-pack when the candidate is faster by the threshold AND the restart pays off
    within the job's remaining time."""
    if current_samples_per_s <= 0:
        return RepackDecision(True, float("inf"), "current placement makes no progress")
    gain_pct = (candidate_samples_per_s / current_samples_per_s - 1.0) * 100.0
    if gain_pct < threshold_pct:
        return RepackDecision(False, gain_pct, f"gain {gain_pct:.1f}% below the {threshold_pct:.0f}% threshold")
    # Work done by the end either way: staying vs restarting then running faster.
    stay = current_samples_per_s * remaining_s
    move = candidate_samples_per_s * max(remaining_s - restart_cost_s, 0.0)
    if move <= stay:
        return RepackDecision(False, gain_pct, f"gain {gain_pct:.1f}% does not repay a {restart_cost_s:.0f}s restart")
    return RepackDecision(True, gain_pct, f"gain {gain_pct:.1f}% clears the threshold and repays the restart")
