"""Asynchronous successive halving (ASHA) for a sweep: who goes on at a rung, who pauses.

A sweep's variants are judged at "rungs", steps min_steps * reduction**k below the
spec's last step. A variant that reaches a rung goes on only if its held-out metric
is among the best `keep = max(1, reached // reduction)` of the variants that have
reached that rung so far (Li et al., "A System for Massively Parallel Hyperparameter
Tuning", MLSys 2020; the max(1, ...) is Optuna's flavour: the first arrivals are not
held back for want of rivals). A variant that does not go on is paused, not killed:
when later arrivals make `keep` larger it may fall within the top again and is then
promoted (`promotable`).

One departure from the rule as published: a variant outside the top `keep` still goes
on when its metric is within its own eval noise of the cut (`margin`: two standard
deviations of the difference of two of its evals, the noise measured from its own
successive evals up to the rung, `eval_noise_sd`). Curves that cross late and noisy
evals cut the full sweep's best in 10 % of 300 of the simulator's development sweeps on
one GPU without it, 6 % with it (benchmarks/sweep_sim.py; docs/sweeps.md has the figures).

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
    noise_sd: float = 0.0  # sd of one of the variant's evals (eval_noise_sd of its evals up to `step`); 0: unknown


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
    margin: float = 0.0  # how far past the cut the variant may be and still go on (its eval noise)


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


# A variant outside the top goes on while within this many sds of the difference of two
# of its evals (sqrt(2) x its eval's sd) of the cut: a gap that size is the evals' noise.
MARGIN_SDS = 2.0


def eval_noise_sd(evals: Sequence[tuple[int, float]]) -> float:
    """The sd of one eval of a variant, from its own (step, value) evals in step order.

    Each eval is compared with the line through its two neighbours (the curve's trend
    cancels to first order); the residual's variance is sd**2 * (1 + w**2 + (1-w)**2)
    with w the eval's place between them. 0.0 with fewer than three distinct steps.
    """
    by_step = {int(s): float(v) for s, v in evals if not math.isnan(v)}
    pts = sorted(by_step.items())
    acc = []
    for (s0, y0), (s1, y1), (s2, y2) in zip(pts, pts[1:], pts[2:], strict=False):
        w = (s1 - s0) / (s2 - s0)
        r = y1 - (y0 + (y2 - y0) * w)
        acc.append(r * r / (1.0 + w * w + (1.0 - w) ** 2))
    return math.sqrt(sum(acc) / len(acc)) if acc else 0.0


def noise_margin(noise_sd: float) -> float:
    """How far below (auc) or above (ne, loss) the cut a variant with this eval noise still goes on."""
    return MARGIN_SDS * math.sqrt(2.0) * noise_sd if noise_sd > 0 else 0.0


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
    """Asynchronous successive halving: `variant` goes on iff among the best `keep` at `rung`
    so far, or within its eval noise of the cut (`noise_margin` of its result's noise_sd).

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
    own = ranked[rank - 1]
    margin = noise_margin(own.noise_sd)
    go_on = rank <= keep
    if not go_on and cut is not None and margin > 0 and not math.isnan(own.value):
        go_on = own.value >= cut - margin if METRICS[rule.metric] else own.value <= cut + margin
    return Verdict(variant, rung, go_on, own.value, cut, rank, reached, keep, margin)


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
