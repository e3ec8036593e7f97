"""How well the interference model predicts measured co-located speeds (pure).

Scores `predict_colocated_speeds` (the public interface, so a validation exercises the
same path the policy uses) on `CoLocationSample`s beside two naive baselines, per
member and per group size, and optionally the k-fold cross-validated error of a refit
(`refit_interference`) and of the learned model (`slurm_dlrm.packing.learned`), each
two ways:

- leave-groups-out: whole co-location groups dealt into K folds, fit on K-1, scored on
  the held-out fold;
- leave-jobs-out: *jobs* (a job is its solo profile: the same profile in two groups is
  the same job) dealt into K folds; for fold k every group containing a held-out job is
  left out of the fit, and each held-out job's members are scored. This is the error
  for a job the model never saw, the one the planner meets.

`slurm-dlrm interference eval` prints this; see docs/packing.md.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from slurm_dlrm.packing.interference import (
    DEFAULT_PARAMS,
    CoLocationSample,
    InterferenceParams,
    SoloProfile,
    predict_colocated_speeds,
    refit_interference,
    util_fraction,
)

Predictor = Callable[[CoLocationSample], list[float]]

FOLD_SEED = 6  # fixed: the same file always gives the same folds


def no_slowdown(sample: CoLocationSample) -> list[float]:
    """Baseline: co-location costs nothing (speed 1.0 for everyone)."""
    return [1.0] * len(sample.members)


def inverse_load(sample: CoLocationSample) -> list[float]:
    """Baseline: everyone slows by the GPU's oversubscription, min(1, 1 / sum_j max(s_j, b_j))."""
    load = sum(max(util_fraction(p.sm_util_pct), util_fraction(p.membw_util_pct)) for p in sample.members)
    return [min(1.0, 1.0 / load) if load > 0 else 1.0] * len(sample.members)


BASELINES: dict[str, Predictor] = {"baseline_speed_1": no_slowdown, "baseline_inverse_load": inverse_load}


def model_predictor(params: InterferenceParams) -> Predictor:
    return lambda sample: predict_colocated_speeds(sample.members, params)


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return 0.0
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass(frozen=True)
class ErrorStats:
    """Errors of a predicted quantity (predicted - measured) over `count` items: members'
    relative speeds, or groups' summed speeds (the GPU's throughput in solo jobs)."""

    count: int
    mae: float  # mean absolute error
    median_abs: float
    p90_abs: float
    bias: float  # mean signed error: > 0 means the predictor is optimistic
    max_abs: float

    @staticmethod
    def of(predicted: Sequence[float], measured: Sequence[float]) -> ErrorStats:
        signed = [p - m for p, m in zip(predicted, measured, strict=True)]
        absolute = sorted(abs(e) for e in signed)
        n = len(signed)
        if n == 0:
            return ErrorStats(0, 0.0, 0.0, 0.0, 0.0, 0.0)
        return ErrorStats(n, sum(absolute) / n, _quantile(absolute, 0.5), _quantile(absolute, 0.9),
                          sum(signed) / n, absolute[-1])

    def as_dict(self) -> dict[str, float | int]:
        return {"count": self.count, "mae": self.mae, "median_abs": self.median_abs,
                "p90_abs": self.p90_abs, "bias": self.bias, "max_abs": self.max_abs}


def fold_of_groups(samples: Sequence[CoLocationSample], folds: int) -> list[int]:
    """Fold index of every sample (group): a seeded shuffle, then dealt round-robin within
    each group size, so each fold holds a like mix of sizes. Deterministic."""
    order = list(range(len(samples)))
    random.Random(FOLD_SEED).shuffle(order)
    order.sort(key=lambda i: len(samples[i].members))  # stable: shuffled within a size
    fold = [0] * len(samples)
    for rank, i in enumerate(order):
        fold[i] = rank % folds
    return fold


def cross_validate(samples: Sequence[CoLocationSample], folds: int,
                   start: InterferenceParams = DEFAULT_PARAMS) -> tuple[list[list[float]], list[InterferenceParams]]:
    """Held-out predictions of every sample by a model refitted on the other folds, and
    the constants fitted for each fold (in fold order)."""
    if not 2 <= folds <= len(samples):
        raise ValueError(f"{folds} folds need at least {folds} co-location groups, there are {len(samples)}")
    fold = fold_of_groups(samples, folds)
    predicted: list[list[float]] = [[] for _ in samples]
    fitted: list[InterferenceParams] = []
    for k in range(folds):
        train = [s for s, f in zip(samples, fold, strict=True) if f != k]
        params = refit_interference(train, start=start)
        fitted.append(params)
        for i, s in enumerate(samples):
            if fold[i] == k:
                predicted[i] = predict_colocated_speeds(s.members, params)
    return predicted, fitted


Fitter = Callable[[Sequence[CoLocationSample]], Predictor]


def refit_fitter(start: InterferenceParams) -> Fitter:
    return lambda train: model_predictor(refit_interference(train, start=start))


def learned_fitter(prior: InterferenceParams) -> Fitter:
    def fit(train: Sequence[CoLocationSample]) -> Predictor:
        from slurm_dlrm.packing.learned import fit_learned, learned_predictor

        if not any(len(s.members) > 1 for s in train):
            return model_predictor(prior)  # nothing to learn from: the prior
        return learned_predictor(fit_learned(train, prior))
    return fit


def job_key(p: SoloProfile) -> tuple[float, ...]:
    """A job's identity in a sample file: its solo profile."""
    return (p.sm_util_pct, p.membw_util_pct, float(p.gpu_mem_bytes), p.host_cpu_cores, p.mps_thread_pct)


def fold_of_jobs(samples: Sequence[CoLocationSample], folds: int) -> dict[tuple[float, ...], int]:
    """Fold of every distinct job (seeded shuffle, dealt round-robin). Deterministic."""
    keys = sorted({job_key(p) for s in samples for p in s.members})
    random.Random(FOLD_SEED).shuffle(keys)
    return {k: i % folds for i, k in enumerate(keys)}


def cross_validate_jobs_out(samples: Sequence[CoLocationSample], folds: int,
                            fit: Fitter) -> list[list[float]]:
    """Leave-jobs-out held-out predictions of every member (see the module docstring)."""
    fold = fold_of_jobs(samples, folds)
    if len(set(fold.values())) < folds:
        raise ValueError(f"{folds} folds need at least {folds} distinct jobs, there are {len(fold)}")
    predicted: list[list[float]] = [[math.nan] * len(s.members) for s in samples]
    for k in range(folds):
        held = [any(fold[job_key(p)] == k for p in s.members) for s in samples]
        predictor = fit([s for s, h in zip(samples, held, strict=True) if not h])
        for i, s in enumerate(samples):
            if held[i]:
                speeds = predictor(s)
                for m, p in enumerate(s.members):
                    if fold[job_key(p)] == k:
                        predicted[i][m] = speeds[m]
    return predicted


def cross_validate_groups_out(samples: Sequence[CoLocationSample], folds: int, fit: Fitter) -> list[list[float]]:
    """Leave-groups-out held-out predictions of every member."""
    if not 2 <= folds <= len(samples):
        raise ValueError(f"{folds} folds need at least {folds} co-location groups, there are {len(samples)}")
    fold = fold_of_groups(samples, folds)
    predicted: list[list[float]] = [[] for _ in samples]
    for k in range(folds):
        predictor = fit([s for s, f in zip(samples, fold, strict=True) if f != k])
        for i, s in enumerate(samples):
            if fold[i] == k:
                predicted[i] = predictor(s)
    return predicted


@dataclass(frozen=True)
class Evaluation:
    """Everything `slurm-dlrm interference eval` reports."""

    params: InterferenceParams
    groups: int
    members: int
    overall: dict[str, ErrorStats]  # predictor name -> errors over all members
    throughput: dict[str, ErrorStats]  # predictor name -> errors of each group's summed speed
    by_size: dict[int, dict[str, ErrorStats]]  # group size -> predictor name -> errors
    folds: int = 0  # 0: no refit asked
    fold_params: tuple[InterferenceParams, ...] = ()
    fitted: InterferenceParams | None = None  # refitted on all the samples
    fitted_in_sample: ErrorStats | None = None
    order: tuple[str, ...] = field(default=())  # predictor names in display order

    def as_dict(self) -> dict[str, Any]:
        def p(x: InterferenceParams) -> dict[str, float]:
            return {"alpha": x.sm_contention, "beta": x.membw_contention, "gamma": x.per_client_overhead}

        out: dict[str, Any] = {
            "groups": self.groups, "members": self.members, "params": p(self.params),
            "errors": {name: self.overall[name].as_dict() for name in self.order},
            "throughput_errors": {name: self.throughput[name].as_dict() for name in self.order},
            "by_group_size": {str(size): {name: st.as_dict() for name, st in per.items()}
                              for size, per in sorted(self.by_size.items())},
        }
        if self.folds:
            out["refit"] = {"folds": self.folds, "fold_params": [p(x) for x in self.fold_params],
                            "fitted_on_all": p(self.fitted) if self.fitted else None,
                            "fitted_on_all_in_sample": self.fitted_in_sample.as_dict()
                            if self.fitted_in_sample else None}
        return out


MODEL = "model"
MODEL_CV = "model_refit_cv"  # refitted on the other folds, scored on the held-out one
MODEL_JOBS_OUT = "model_refit_jobs_out"
LEARNED_CV = "learned_cv"
LEARNED_JOBS_OUT = "learned_jobs_out"


def evaluate(samples: Sequence[CoLocationSample], params: InterferenceParams = DEFAULT_PARAMS,
             folds: int = 0, learned: bool = False) -> Evaluation:
    """Score the model with `params` (and, with `folds` >= 2, a cross-validated refit
    started from `params`, both leave-groups-out and leave-jobs-out; with `learned`
    too, the learned model the same two ways) and the baselines on multi-member samples."""
    usable = [s for s in samples if len(s.members) > 1 and len(s.members) == len(s.speeds)]
    predictions: dict[str, list[list[float]]] = {MODEL: [model_predictor(params)(s) for s in usable]}
    fold_params: list[InterferenceParams] = []
    fitted = fitted_stats = None
    if folds:
        predictions[MODEL_CV], fold_params = cross_validate(usable, folds, params)
        fitted = refit_interference(usable, start=params)
        if len({job_key(p) for s in usable for p in s.members}) >= folds:
            predictions[MODEL_JOBS_OUT] = cross_validate_jobs_out(usable, folds, refit_fitter(params))
        if learned:
            predictions[LEARNED_CV] = cross_validate_groups_out(usable, folds, learned_fitter(params))
            if MODEL_JOBS_OUT in predictions:
                predictions[LEARNED_JOBS_OUT] = cross_validate_jobs_out(usable, folds, learned_fitter(params))
    for name, baseline in BASELINES.items():
        predictions[name] = [baseline(s) for s in usable]

    def stats(name: str, which: Sequence[int]) -> ErrorStats:
        return ErrorStats.of([v for i in which for v in predictions[name][i]],
                             [v for i in which for v in usable[i].speeds])

    everyone = range(len(usable))
    overall = {name: stats(name, everyone) for name in predictions}
    throughput = {name: ErrorStats.of([sum(p) for p in predictions[name]], [sum(s.speeds) for s in usable])
                  for name in predictions}
    by_size: dict[int, dict[str, ErrorStats]] = {}
    for size in sorted({len(s.members) for s in usable}):
        which = [i for i, s in enumerate(usable) if len(s.members) == size]
        by_size[size] = {name: stats(name, which) for name in predictions}
    if fitted is not None:
        fitted_stats = ErrorStats.of([v for s in usable for v in predict_colocated_speeds(s.members, fitted)],
                                     [v for s in usable for v in s.speeds])
    return Evaluation(params=params, groups=len(usable), members=sum(len(s.members) for s in usable),
                      overall=overall, throughput=throughput, by_size=by_size, folds=folds, fold_params=tuple(fold_params),
                      fitted=fitted, fitted_in_sample=fitted_stats, order=tuple(predictions))


def learned_cross_validation(samples: Sequence[CoLocationSample], params: InterferenceParams,
                             folds: int) -> dict[str, Any]:
    """The learned model's K-fold errors beside the analytic model (with `params`) and
    the better naive baseline on the same samples: what a model file records and what
    the service compares before it plans with a learned model."""
    usable = [s for s in samples if len(s.members) > 1 and len(s.members) == len(s.speeds)]
    measured = [v for s in usable for v in s.speeds]

    def mae(pred: Sequence[Sequence[float]]) -> float:
        return ErrorStats.of([v for p in pred for v in p], measured).mae

    fitter = learned_fitter(params)
    groups_out = mae(cross_validate_groups_out(usable, folds, fitter))
    jobs = len({job_key(p) for s in usable for p in s.members})
    jobs_out = mae(cross_validate_jobs_out(usable, folds, fitter)) if jobs >= folds else None
    naive = min(mae([b(s) for s in usable]) for b in BASELINES.values())
    return {"folds": folds, "groups": len(usable), "learned_groups_out_mae": groups_out,
            "learned_jobs_out_mae": jobs_out if jobs_out is not None else groups_out,
            "jobs_out": jobs_out is not None,
            "analytic_mae": mae([model_predictor(params)(s) for s in usable]), "naive_mae": naive}
