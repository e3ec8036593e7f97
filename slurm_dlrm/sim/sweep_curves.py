"""Learning curves of a sweep's variants for the simulator (issue 47 item 5), fitted to
curves that real runs of the project's runner recorded (tests/data/sweep_curves.json,
written by benchmarks/sim/record_sweep_curves.py).

The family: a variant's held-out AUC at step s is

    auc(s) = a - b * s ** -c        (a: where it levels off, b, c: how fast it gets there)

a power law in the steps, as learning curves of SGD-trained models are commonly fitted
(Domhan et al., IJCAI 2015, list it among their parametric curves). Each recorded
variant gets its own (a, b, c) by least squares; what a variant does beyond its
curve (the held-out set's own noise) is the fit's residual.

A seeded sweep draws its variants from the recorded ones: a kernel density estimate over
(a - the best a of its recorded sweep, log b, log c, log of its batch size against its
sweep's median) -- a recorded variant picked at random, moved by a Gaussian of
Silverman's bandwidth in each coordinate -- so the draws keep what the records show
together (a fast start with a low plateau, a slow start with a high one, the larger
batch's longer run: the same steps, more samples) without assuming a shape for it. The
recorded step times are not used: the recording machine is shared, its step times
swing with its load (4x between two runs of one spec). The observed metric at a step is
the drawn curve plus Gaussian noise of the fits' residual, a pure function of
(seed, variant, step): both plays of one sweep (every variant to the end, and with the
rule) see the same numbers. The residual is split (`residual_parts`): most of it is a
curve's own slow wander around the power law (it correlates between neighbouring
evals), drawn as an AR(1) path per variant, and the rest the eval's independent noise.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Where a fitted parameter may go (a: an AUC; c: no faster than 1/s^3 nor flatter than 1/s^0.02).
_A_BOUNDS = (0.5, 1.0)
_B_BOUNDS = (1e-6, 50.0)
_C_BOUNDS = (0.02, 3.0)
# A model's AUC before it has learnt anything: a drawn curve taken below the first
# recorded eval (a slow starter's a - b*s^-c at step 20) reached 0.07, which no model
# scores (reversed predictions would score 0.93); the curve is held at this floor there.
AUC_FLOOR = 0.5


@dataclass(frozen=True)
class CurveFit:
    a: float
    b: float
    c: float
    rmse: float  # over the points it was fitted on
    points: int

    def __call__(self, step: float) -> float:
        return power_law(step, self.a, self.b, self.c)


def power_law(step: float, a: float, b: float, c: float) -> float:
    return a - b * max(step, 1.0) ** -c


def fit_curve(points: Sequence[tuple[int, float]]) -> CurveFit:
    """Least-squares (a, b, c) of `points` (step, auc); at least 3 points."""
    import numpy as np
    from scipy.optimize import curve_fit

    if len(points) < 3:
        raise ValueError(f"a curve needs at least 3 points to fit 3 parameters, got {len(points)}")
    s = np.array([max(1.0, float(p[0])) for p in points])
    y = np.array([float(p[1]) for p in points])

    def f(x: Any, a: float, b: float, c: float) -> Any:
        return a - b * x ** -c

    best: tuple[float, tuple[float, float, float]] | None = None
    top = float(y.max())
    for c0 in (0.3, 1.0, 2.0):  # a few starts: the least-squares surface has shallow valleys in c
        a0 = min(_A_BOUNDS[1] - 1e-3, max(_A_BOUNDS[0] + 1e-3, top + 0.002))
        b0 = min(_B_BOUNDS[1], max(_B_BOUNDS[0] * 10, (a0 - float(y[0])) * float(s[0]) ** c0))
        try:
            params, _ = curve_fit(f, s, y, p0=(a0, b0, c0), bounds=tuple(zip(_A_BOUNDS, _B_BOUNDS, _C_BOUNDS, strict=True)),
                                  maxfev=20000)
        except (RuntimeError, ValueError):
            continue
        err = float(np.sqrt(np.mean((f(s, *params) - y) ** 2)))
        if best is None or err < best[0]:
            best = (err, (float(params[0]), float(params[1]), float(params[2])))
    if best is None:
        raise ValueError("the power law did not fit these points")
    err, (a, b, c) = best
    return CurveFit(a, b, c, err, len(points))


@dataclass(frozen=True)
class RecordedVariant:
    sweep: str
    values: Mapping[str, Any]  # what it set (`--set` fields)
    curve: tuple[tuple[int, float], ...]  # (step, held-out AUC)
    step_s: float  # its median step time on the recording machine (a shared one: noisy, not used)
    batch_size: int  # samples per step: its run time relative to its sweep's (same steps, same model)
    steps: int  # its sweep's last step


def recorded_variants(data: Mapping[str, Any]) -> list[RecordedVariant]:
    """The variants of a sweep_curves.json document (record_sweep_curves.py's format)."""
    out = []
    for sw in data["sweeps"]:
        for v in sw["variants"]:
            batch = int(v["set"].get("batch_size", sw["base"].get("batch_size", 1)))
            out.append(RecordedVariant(str(sw["name"]), dict(v["set"]),
                                       tuple((int(p[0]), float(p[1])) for p in v["curve"]), float(v["step_s"]), batch,
                                       int(sw["steps"])))
    return out


@dataclass(frozen=True)
class VariantDraw:
    a: float
    b: float
    c: float
    work_ratio: float  # its run time against the sweep's median (its batch size's ratio: same steps)


@dataclass(frozen=True)
class CurveFamily:
    """The fitted family and the spread of its parameters across recorded variants."""

    # per recorded variant: (a - its sweep's best a, ln b, ln c, ln of its batch size / its sweep's median)
    kernel: tuple[tuple[float, float, float, float], ...]
    bandwidth: tuple[float, float, float, float]
    noise_sd: float  # the fits' residual (rmse over every recorded point)
    fits: tuple[CurveFit, ...]
    # The residual split (`residual_parts`): independent noise at each eval, and a slow
    # wander around the power law, AR(1) with this marginal sd and per-step correlation.
    white_sd: float = 0.0
    wander_sd: float = 0.0
    wander_phi: float = 0.0

    def draw(self, n: int, seed: int, top_auc: float = 0.78) -> list[VariantDraw]:
        """`n` variants of one seeded sweep, the kernel's a shifted so that 0 is `top_auc`."""
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            base = self.kernel[rng.randrange(len(self.kernel))]
            x = [base[i] + rng.gauss(0.0, self.bandwidth[i]) for i in range(4)]
            a = min(_A_BOUNDS[1], max(_A_BOUNDS[0], top_auc + x[0]))
            b = min(_B_BOUNDS[1], max(_B_BOUNDS[0], math.exp(x[1])))
            c = min(_C_BOUNDS[1], max(_C_BOUNDS[0], math.exp(x[2])))
            out.append(VariantDraw(a, b, c, math.exp(x[3])))
        return out


def fit_family(variants: Sequence[RecordedVariant]) -> CurveFamily:
    """Fit every variant's curve; the kernel density over their parameters (module docstring)."""
    fits = [fit_curve(v.curve) for v in variants]
    by_sweep: dict[str, list[int]] = {}
    for i, v in enumerate(variants):
        by_sweep.setdefault(v.sweep, []).append(i)
    kernel: list[tuple[float, float, float, float]] = []
    for idx in by_sweep.values():
        top = max(fits[i].a for i in idx)
        med = statistics.median(variants[i].batch_size for i in idx)
        for i in idx:
            f = fits[i]
            kernel.append((f.a - top, math.log(f.b), math.log(f.c), math.log(variants[i].batch_size / med)))
    n = len(kernel)
    # Silverman's rule per coordinate (d = 4): h = sd * (4 / ((d + 2) n)) ** (1 / (d + 4))
    factor = (4.0 / (6.0 * n)) ** (1.0 / 8.0) if n > 1 else 1.0
    bw = tuple(statistics.pstdev([k[i] for k in kernel]) * factor if n > 1 else 0.0 for i in range(4))
    residual = math.sqrt(sum(f.rmse ** 2 * f.points for f in fits) / max(1, sum(f.points for f in fits)))
    white, wander, phi = residual_parts(variants, fits)
    return CurveFamily(tuple(kernel), (bw[0], bw[1], bw[2], bw[3]), residual, tuple(fits), white, wander, phi)


def residual_parts(variants: Sequence[RecordedVariant], fits: Sequence[CurveFit]) -> tuple[float, float, float]:
    """(white sd, wander sd, wander's per-step correlation) of the recorded curves'
    residuals around their fits. The residuals are not independent noise: next to each
    other they correlate (lag-1 +0.45..+0.89 on the curves that miss the power law most,
    the sgd ones), i.e. most of them is a curve's own slow departure from the power law,
    which shows at a rung and at the end alike, and only the rest is the eval's noise.
    The white part is half the variance of the differences of successive residuals (a
    slow part nearly cancels in them); the wander is the rest of the variance, its
    per-step correlation the median over the curves of (lag-1 correlation) ** (1 / the
    eval interval)."""
    diffs: list[float] = []
    resid: list[float] = []
    phis: list[float] = []
    for v, f in zip(variants, fits, strict=True):
        pts = list(v.curve)
        r = [y - f(s) for s, y in pts]
        resid += r
        diffs += [b - a for a, b in zip(r, r[1:], strict=False)]
        if len(r) >= 3 and statistics.pstdev(r) > 0:
            lag = statistics.correlation(r[:-1], r[1:])
            gap = statistics.median(b[0] - a[0] for a, b in zip(pts, pts[1:], strict=False))
            phis.append(max(0.0, lag) ** (1.0 / max(1.0, gap)))
    if not diffs:
        return 0.0, 0.0, 0.0
    white_var = statistics.fmean(d * d for d in diffs) / 2.0
    total_var = statistics.fmean(x * x for x in resid)
    return math.sqrt(white_var), math.sqrt(max(0.0, total_var - white_var)), statistics.median(phis) if phis else 0.0


def observed_metric(draw: VariantDraw, noise_sd: float, seed: int, variant: int, wander_sd: float = 0.0,
                    wander_phi: float = 0.0) -> Callable[[int], float]:
    """The variant's held-out AUC at a step as the rule sees it: its curve, plus a slow
    wander around it (AR(1) over the steps, `wander_sd` marginal, `wander_phi` per step),
    plus the eval's own noise (`noise_sd`), a pure function of (seed, variant, step)."""
    path = [0.0]  # the wander at step k (drawn on first use, from (seed, variant) alone)
    if wander_sd > 0:
        walk = random.Random(f"{seed}:{variant}:wander")
        path[0] = walk.gauss(0.0, wander_sd)
        step_sd = wander_sd * math.sqrt(max(0.0, 1.0 - wander_phi ** 2))

    def wander(step: int) -> float:
        if wander_sd <= 0:
            return 0.0
        while len(path) <= step:
            path.append(wander_phi * path[-1] + walk.gauss(0.0, step_sd))
        return path[step]

    def at(step: int) -> float:
        rng = random.Random(f"{seed}:{variant}:{step}")
        return max(AUC_FLOOR, power_law(step, draw.a, draw.b, draw.c)) + wander(step) + rng.gauss(0.0, noise_sd)

    return at


def family_metric(family: CurveFamily, draw: VariantDraw, seed: int, variant: int) -> Callable[[int], float]:
    """`observed_metric` with the family's residual parts."""
    return observed_metric(draw, family.white_sd, seed, variant, family.wander_sd, family.wander_phi)


@dataclass(frozen=True)
class HeldOutError:
    """How well the family fits points it was not fitted on (AUC units)."""

    interp_rmse: float  # fitted on every other eval, judged on the ones between
    extrap_rmse: float  # fitted on the first third of the steps, judged on the last third
    extrap_max_abs: float
    curves: int


def held_out_error(variants: Sequence[RecordedVariant]) -> HeldOutError:
    inter: list[float] = []
    extra: list[float] = []
    for v in variants:
        pts = list(v.curve)
        fit = fit_curve(pts[0::2])
        inter += [(fit(s) - y) ** 2 for s, y in pts[1::2]]
        last = pts[-1][0]
        early = [p for p in pts if p[0] <= last / 3]
        late = [p for p in pts if p[0] > 2 * last / 3]
        if len(early) >= 3 and late:
            fe = fit_curve(early)
            extra += [fe(s) - y for s, y in late]
    return HeldOutError(math.sqrt(statistics.fmean(inter)) if inter else math.nan,
                        math.sqrt(statistics.fmean([e * e for e in extra])) if extra else math.nan,
                        max((abs(e) for e in extra), default=math.nan), len(variants))


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Rank correlation (no ties expected in real-valued metrics)."""

    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    if n < 2:
        return math.nan
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return num / den if den > 0 else math.nan


__all__ = ["CurveFamily", "CurveFit", "HeldOutError", "RecordedVariant", "VariantDraw", "fit_curve",
           "family_metric", "fit_family", "held_out_error", "observed_metric", "power_law", "recorded_variants",
           "residual_parts", "spearman"]
