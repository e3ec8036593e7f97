"""Asynchronous successive halving (ASHA) for a sweep: who goes on at a rung, who pauses.

A sweep's variants are judged at "rungs", steps min_steps * reduction**k below the
spec's last step. A variant that reaches a rung goes on only if its held-out metric
is among the best `keep = max(1, reached // reduction)` of the variants that have
reached that rung so far (Li et al., "A System for Massively Parallel Hyperparameter
Tuning", MLSys 2020; the max(1, ...) is Optuna's flavour: the first arrivals are not
held back for want of rivals). A variant that does not go on is paused, not killed:
when later arrivals make `keep` larger it may fall within the top again and is then
promoted (`promotable`).

Pure: callers pass the rung results they hold (in arrival order) and act on the
verdicts. Ties rank the earlier arrival first; a NaN metric ranks last.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

METRICS = {"auc": True, "ne": False, "loss": False}  # name -> higher is better


@dataclass(frozen=True)
class StopRule:
    metric: str = "auc"
    min_steps: int = 0  # first rung's step (> 0 once resolved)
    reduction: int = 3  # eta >= 2
    max_steps: int = 0  # the spec's steps


@dataclass(frozen=True)
class RungResult:
    variant: str  # job id as text ("12", "12_3")
    rung: int  # index into rung_steps
    step: int
    value: float  # the metric at that step (held-out eval)


@dataclass(frozen=True)
class Verdict:
    variant: str
    rung: int
    go_on: bool
    value: float
    cut: float | None  # the value a variant must reach (>= for auc) to go on; None while nobody is cut
    rank: int  # 1 = best among those that reached this rung
    reached: int  # how many variants reached this rung so far
    keep: int  # how many of them go on: max(1, reached // reduction) (ASHA)


def rule_problem(rule: StopRule) -> str | None:
    """Why `rule` cannot be used, as '<what>: <why>', or None when it can."""
    if rule.metric not in METRICS:
        return f"sweep metric {rule.metric!r}: unknown (one of {', '.join(sorted(METRICS))})"
    if rule.reduction < 2:
        return f"sweep reduction {rule.reduction}: must be at least 2 (1 stops nobody)"
    if rule.max_steps <= 0:
        return f"sweep steps {rule.max_steps}: must be positive"
    if rule.min_steps <= 0:
        return f"sweep min_steps {rule.min_steps}: must be positive"
    if rule.min_steps >= rule.max_steps:
        return f"sweep min_steps {rule.min_steps}: must be below the spec's steps ({rule.max_steps})"
    return None


def rung_steps(rule: StopRule) -> tuple[int, ...]:
    """min_steps * reduction**k for k = 0.. while below max_steps (the last step is the end, not a rung)."""
    if rule.min_steps <= 0 or rule.reduction < 2:
        return ()
    out = []
    step = rule.min_steps
    while step < rule.max_steps:
        out.append(step)
        step *= rule.reduction
    return tuple(out)


# Rungs by default: three below the end, the last at half the steps, so min_steps =
# steps // (2 * reduction**2). Curves cross late (a slow start to the highest plateau):
# with the last rung at a third of the steps (steps // reduction**3) the best variant
# was cut in 15 % of the simulator's seeded sweeps even without eval noise, at half in
# 7 % (benchmarks/sweep_sim.py, chosen on development seeds, measured on held-out ones).
DEFAULT_RUNGS = 3


def default_first_rung(steps: int, reduction: int) -> int:
    """The default min_steps, before the service puts it on the eval schedule."""
    return max(1, steps // (2 * reduction ** (DEFAULT_RUNGS - 1)))


def rung_of_step(rule: StopRule, step: int) -> int | None:
    """The rung index whose step is `step`, or None when `step` is no rung."""
    steps = rung_steps(rule)
    return steps.index(step) if step in steps else None


def _sort_key(higher_is_better: bool, value: float, arrival: int) -> tuple[int, float, int]:
    if math.isnan(value):
        return (1, 0.0, arrival)
    return (0, -value if higher_is_better else value, arrival)


def _ranked(rule: StopRule, results: Sequence[RungResult], rung: int) -> list[RungResult]:
    """The latest result of each variant at `rung`, best first (ties: earlier first arrival)."""
    latest: dict[str, RungResult] = {}
    first_seen: dict[str, int] = {}
    for i, r in enumerate(results):
        if r.rung != rung:
            continue
        first_seen.setdefault(r.variant, i)
        latest[r.variant] = r
    higher = METRICS[rule.metric]
    return sorted(latest.values(), key=lambda r: _sort_key(higher, r.value, first_seen[r.variant]))


def _keep(rule: StopRule, reached: int) -> int:
    return max(1, reached // rule.reduction)


def judge(rule: StopRule, results: Sequence[RungResult], variant: str, rung: int) -> Verdict:
    """Asynchronous successive halving: `variant` goes on iff among the best `keep` at `rung` so far.

    `results` must hold `variant`'s own result at `rung` (ValueError otherwise).
    """
    ranked = _ranked(rule, results, rung)
    names = [r.variant for r in ranked]
    if variant not in names:
        raise ValueError(f"variant {variant} has no result at rung {rung}")
    rank = names.index(variant) + 1
    reached = len(ranked)
    keep = _keep(rule, reached)
    cut = ranked[keep - 1].value if reached > keep else None
    return Verdict(variant, rung, rank <= keep, ranked[rank - 1].value, cut, rank, reached, keep)


def promotable(rule: StopRule, results: Sequence[RungResult], paused: Mapping[str, int]) -> list[str]:
    """Paused variants (-> the rung they paused at) now within their rung's top `keep`, best first."""
    found: list[tuple[tuple[int, float, int], str]] = []
    higher = METRICS[rule.metric]
    for rung in sorted(set(paused.values())):
        ranked = _ranked(rule, results, rung)
        keep = _keep(rule, len(ranked))
        for rank, r in enumerate(ranked[:keep]):
            if paused.get(r.variant) == rung:
                found.append((_sort_key(higher, r.value, rank), r.variant))
    # Best first: a higher rung's survivor before a lower one's, then by value.
    rung_of = paused
    found.sort(key=lambda kv: (-rung_of[kv[1]], kv[0]))
    return [name for _, name in found]
