"""The neighbour model, the naive rule as a model, and which one the planner uses (issue 37).

Pure. On the H100 pairs (tests/data/gpu/h100-2026-11-27) what decides a member's
slowdown is its neighbour's SM busy share, not its own and not the sum: a job beside a
wide-MLP job (long kernels that fill the GPU, SM busy 87-93%) runs at 0.42-0.66 of its
solo speed while the MLP job keeps 0.82-0.98, whatever the first job's own share; beside
a job of SM busy 27-42% nobody loses more than 20%. The naive rule (everyone slowed by
the GPU's oversubscription, min(1, 1 / sum_j max(s_j, b_j))) cannot see that asymmetry.

**Neighbour model**: member i's speed beside neighbour j is 1 - scale x s_j ^ power
(s_j: j's solo SM busy fraction); in a group each neighbour takes its share in turn
(the product over neighbours: the composition of pair slowdowns, the rule the measured
truth uses for sizes it has not measured, `slurm_dlrm.truth`). Two constants fitted by
least absolute error on a grid (power 0.5..4, scale 0..1.5; coarse, then fine around the best).

**Which model plans** (`choose_planner_model`): every candidate is scored held out
(leave-one-job-out when the samples have enough distinct jobs, else leave-groups-out;
more than 10 jobs are dealt into 10 folds, more than 2,000 groups are a seeded choice of 2,000; the analytic model and the naive rule fit nothing, so their error is on all samples);
the best plans only if its error is at most `CLEARLY` x the naive rule's, otherwise the
naive rule plans, and the reason says so.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from slurm_dlrm.packing.interference import (
    CoLocationSample,
    InterferenceParams,
    predict_colocated_speeds,
    util_fraction,
)

# A model must beat the naive rule by 10% of its error to plan.
CLEARLY = 0.9
MAX_JOB_FOLDS = 10
MAX_GROUPS = 2000
MIN_SPEED = 0.02
_POWERS = tuple(0.5 + 0.05 * k for k in range(71))  # 0.5 .. 4.0
_SCALES = tuple(0.01 * k for k in range(151))  # 0 .. 1.5


@dataclass(frozen=True)
class NeighbourModel:
    """speed_i = prod_{j != i} (1 - scale * s_j ** power). Implements `SpeedModel`."""

    scale: float
    power: float
    name: str = "neighbour"

    def pair_slowdown(self, neighbour_sm: float) -> float:
        return min(1.0 - MIN_SPEED, max(0.0, self.scale * max(0.0, neighbour_sm) ** self.power))

    def speeds_from_fractions(self, sm: Sequence[float], bw: Sequence[float]) -> list[float]:
        n = len(sm)
        if n <= 1:
            return [1.0] * n
        keep = [1.0 - self.pair_slowdown(s) for s in sm]
        out = []
        for i in range(n):
            v = 1.0
            for j in range(n):
                if j != i:
                    v *= keep[j]
            out.append(min(1.0, max(MIN_SPEED, v)))
        return out


@dataclass(frozen=True)
class NaiveModel:
    """The naive rule as a speed model: min(1, 1 / sum_j max(s_j, b_j)) for everyone."""

    name: str = "naive"

    def speeds_from_fractions(self, sm: Sequence[float], bw: Sequence[float]) -> list[float]:
        load = sum(max(s, b) for s, b in zip(sm, bw, strict=True))
        v = min(1.0, 1.0 / load) if load > 0 else 1.0
        return [v] * len(sm)


def _fractions(s: CoLocationSample) -> list[float]:
    return [util_fraction(p.sm_util_pct) for p in s.members]


def fit_neighbour(samples: Sequence[CoLocationSample]) -> NeighbourModel:
    """Least absolute error over every member of every multi-member sample: a coarse grid
    (power by 0.25, scale by 0.05), then a fine one (0.05, 0.01) around the best."""
    usable = [(_fractions(s), s.speeds) for s in samples if len(s.members) > 1 and len(s.members) == len(s.speeds)]
    if not usable:
        raise ValueError("the neighbour model needs co-location samples of two or more members")

    def error(scale: float, power: float) -> float:
        model = NeighbourModel(scale, power)
        return sum(abs(p - m) for sm, speeds in usable
                   for p, m in zip(model.speeds_from_fractions(sm, sm), speeds, strict=True))

    def search(scales: Sequence[float], powers: Sequence[float]) -> tuple[float, float, float]:
        return min((error(c, p), c, p) for p in powers for c in scales)

    _, scale, power = search(_SCALES[::5], _POWERS[::5])
    fine_s = [c for c in _SCALES if abs(c - scale) <= 0.05 + 1e-9]
    fine_p = [p for p in _POWERS if abs(p - power) <= 0.25 + 1e-9]
    _, scale, power = search(fine_s, fine_p)
    return NeighbourModel(round(scale, 4), round(power, 4))


def neighbour_fitter(train: Sequence[CoLocationSample]) -> Callable[[CoLocationSample], list[float]]:
    model = fit_neighbour(train)
    return lambda s: predict_colocated_speeds(s.members, InterferenceParams(speed_model=model))


@dataclass(frozen=True)
class PlannerChoice:
    name: str  # "neighbour" | "learned" | "analytic" | "naive"
    params: InterferenceParams  # what the policies plan with
    held_out_mae: dict[str, float]  # candidate -> its error (held out where it is fitted)
    how: str  # "leave-one-job-out" | "leave-groups-out"
    reason: str


def choose_planner_model(samples: Sequence[CoLocationSample], analytic: InterferenceParams,
                         learned: bool = False) -> PlannerChoice:
    """Score the candidates on `samples` and say which one plans, and why."""
    from slurm_dlrm.packing.interference_eval import (
        BASELINES,
        ErrorStats,
        cross_validate_groups_out,
        cross_validate_jobs_out,
        job_key,
        learned_fitter,
        model_predictor,
    )

    usable = [s for s in samples if len(s.members) > 1 and len(s.members) == len(s.speeds)]
    if not usable:
        raise ValueError("no co-location sample of two or more members to choose a model on")
    if len(usable) > MAX_GROUPS:  # a seeded choice: the choice stays seconds on a large store
        usable = random.Random(0).sample(usable, MAX_GROUPS)
    measured = [v for s in usable for v in s.speeds]

    def mae(pred: Sequence[Sequence[float]]) -> float:
        return ErrorStats.of([v for p in pred for v in p], measured).mae

    jobs = len({job_key(p) for s in usable for p in s.members})
    # Leave-one-job-out needs a job's groups out and something left to fit on; past
    # MAX_JOB_FOLDS jobs, the jobs are dealt into that many folds.
    if jobs >= 4:
        folds = min(jobs, MAX_JOB_FOLDS)
        how = "leave-one-job-out" if folds == jobs else f"leave-jobs-out, {folds} folds"

        def held_out(fit: Callable[[Sequence[CoLocationSample]], Callable[[CoLocationSample], list[float]]]
                     ) -> list[list[float]]:
            return cross_validate_jobs_out(usable, folds, fit)
    else:
        how = "leave-groups-out"

        def held_out(fit: Callable[[Sequence[CoLocationSample]], Callable[[CoLocationSample], list[float]]]
                     ) -> list[list[float]]:
            return cross_validate_groups_out(usable, min(5, len(usable)), fit)

    errors: dict[str, float] = {"naive": mae([BASELINES["baseline_inverse_load"](s) for s in usable]),
                                "analytic": mae([model_predictor(analytic)(s) for s in usable])}
    candidates: dict[str, InterferenceParams] = {"analytic": analytic,
                                                 "naive": InterferenceParams(speed_model=NaiveModel())}
    if len(usable) >= 2:
        errors["neighbour"] = mae(held_out(neighbour_fitter))
        candidates["neighbour"] = InterferenceParams(speed_model=fit_neighbour(usable))
        if learned:
            from slurm_dlrm.packing.learned import fit_learned

            errors["learned"] = mae(held_out(learned_fitter(analytic)))
            candidates["learned"] = fit_learned(usable, analytic).params()
    naive = errors["naive"]
    best = min((n for n in errors if n != "naive"), key=lambda n: errors[n])
    if errors[best] <= CLEARLY * naive:
        reason = (f"{best} plans: its {how if best in ('neighbour', 'learned') else 'not held out'} error "
                  f"{errors[best]:.3f} is {errors[best] / naive:.2f}x the naive rule's {naive:.3f} "
                  f"(it must be <= {CLEARLY:.2f}x)")
        return PlannerChoice(best, candidates[best], errors, how, reason)
    reason = (f"naive rule plans: no model beats it clearly on these {len(usable)} groups (best: {best} "
              f"{errors[best]:.3f} vs naive {naive:.3f}; a model must be <= {CLEARLY:.2f}x)")
    return PlannerChoice("naive", candidates["naive"], errors, how, reason)
