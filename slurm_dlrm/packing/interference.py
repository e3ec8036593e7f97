"""The co-location interference model: solo profiles in, relative speeds out.

Pure and cheap (it is called for every GPU of every plan). The form and where its
constants come from are documented in docs/packing.md; in short:

For member i with solo SM utilisation s_i and memory-bandwidth utilisation b_i (as
fractions of the GPU), g_i = max(s_i, b_i) is the share of its solo step time that is
GPU-bound; the rest (1 - g_i) is host time (data loading, Python, launch overhead)
that a co-runner does not slow down. Its GPU part is stretched by

    I_i = 1 + alpha * w_sm_i * O_sm_i + beta * w_bw_i * O_bw_i + gamma * (n - 1)

where O_r,i is the co-runners' summed use of resource r and w_r,i = u_r,i / (s_i + b_i)
is how much i itself leans on r (sensitivity x pressure), and by a common factor
D >= 1, the smallest that keeps every resource within capacity without contention,
sum_j u_r,j / ((1 - g_j) + g_j * D) <= 1 (processor sharing once the GPU saturates). Then

    speed_i = 1 / ((1 - g_i) + g_i * I_i * D).

GPU memory does not change speed; it only decides whether the members fit at all
(when ``gpu_memory_bytes`` is given and the members' sum exceeds it, every speed is 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class SoloProfile:
    """What a job does alone on the GPU (the estimator's or the agent's figures)."""

    sm_util_pct: float
    membw_util_pct: float
    gpu_mem_bytes: int = 0
    # Optional (0 = unknown): the learned model uses them when every training sample has them.
    host_cpu_cores: float = 0.0
    mps_thread_pct: float = 0.0  # the MPS thread cap it ran under when fenced


class SpeedModel(Protocol):
    """Anything that predicts co-located speeds from solo SM and bandwidth fractions:
    the learned model (`slurm_dlrm.packing.learned`) or a simulator's truth
    (`slurm_dlrm.truth`). Must be cheap: the policies call it in their inner loops."""

    @property
    def name(self) -> str: ...

    def speeds_from_fractions(self, sm: Sequence[float], bw: Sequence[float]) -> list[float]: ...


@dataclass(frozen=True)
class InterferenceParams:
    """The model's three constants (see docs/packing.md for their provenance), and
    optionally a `speed_model` that predicts instead of the formula (the learned model,
    with these constants as its prior and fallback). Every policy takes this one value."""

    # Defaults 0: on the public measured pairs (docs/packing.md, "Constants") every
    # contention term refits to 0; only saturation (processor sharing) is left.
    sm_contention: float = 0.0  # alpha: kernel stretch per unit of co-runner SM use
    membw_contention: float = 0.0  # beta: per unit of co-runner memory-bandwidth use
    per_client_overhead: float = 0.0  # gamma: MPS/scheduler cost per extra client
    # Compared by identity (a model object): a learned model never equals the defaults.
    speed_model: SpeedModel | None = field(default=None, repr=False)

    @property
    def model_name(self) -> str:
        return self.speed_model.name if self.speed_model is not None else "analytic"

    def analytic(self) -> InterferenceParams:
        """The constants alone (the formula, without any speed model)."""
        return InterferenceParams(self.sm_contention, self.membw_contention, self.per_client_overhead)

    def as_tuple(self) -> tuple[float, float, float]:
        return (self.sm_contention, self.membw_contention, self.per_client_overhead)


DEFAULT_PARAMS = InterferenceParams()


@dataclass(frozen=True)
class CoLocationSample:
    """One measurement: the members' solo profiles and their measured relative speeds
    (co-located samples/s divided by solo samples/s)."""

    members: tuple[SoloProfile, ...]
    speeds: tuple[float, ...]


def util_fraction(pct: float) -> float:
    if not math.isfinite(pct):
        return 0.0
    return min(max(pct / 100.0, 0.0), 1.0)


# GPU memory may come in any of these units (a validator's data may carry any of them);
# the first one present wins, bytes first.
_MEM_KEYS: tuple[tuple[str, int], ...] = (("gpu_mem_bytes", 1), ("gpu_mem_mib", 1 << 20), ("gpu_mem_gib", 1 << 30))


def _mem_bytes_of(get: Callable[[str], Any]) -> int:
    for key, scale in _MEM_KEYS:
        value = get(key)
        if value is not None and value != "":
            return int(round(float(value) * scale))
    return 0


def _profile_of(member: Any) -> SoloProfile:
    if isinstance(member, SoloProfile):
        return member
    if isinstance(member, Mapping):
        return SoloProfile(float(member["sm_util_pct"]), float(member["membw_util_pct"]), _mem_bytes_of(member.get))
    return SoloProfile(float(member.sm_util_pct), float(member.membw_util_pct),
                       _mem_bytes_of(lambda key: getattr(member, key, None)))


def predict_speeds_from_fractions(sm: Sequence[float], bw: Sequence[float],
                                  params: InterferenceParams = DEFAULT_PARAMS) -> list[float]:
    """The model on utilisations given as fractions in [0, 1] (the fast inner form)."""
    n = len(sm)
    if n == 0:
        return []
    if params.speed_model is not None:
        return params.speed_model.speeds_from_fractions(sm, bw)
    alpha, beta, gamma = params.sm_contention, params.membw_contention, params.per_client_overhead
    total_sm = sum(sm)
    total_bw = sum(bw)
    base: list[float] = []  # (1 - g_i, g_i * I_i)
    host: list[float] = []
    for i in range(n):
        s, b = sm[i], bw[i]
        g = s if s > b else b
        both = s + b
        if both > 0.0:
            stretch = 1.0 + (alpha * s * (total_sm - s) + beta * b * (total_bw - b)) / both + gamma * (n - 1)
        else:
            stretch = 1.0 + gamma * (n - 1)
        host.append(1.0 - g)
        base.append(g * stretch)

    busy = [1.0 - h for h in host]

    def stretch_for(use: Sequence[float]) -> float:
        # The smallest D >= 1 with sum_i use_i / (host_i + busy_i * D) <= 1. Saturation
        # alone decides D (the contention stretch I_i only wastes capacity), so adding a
        # member can never speed anyone up. The sum is convex and decreasing in D, so
        # Newton's method from D = 1 climbs to the root without overshooting (a few
        # steps, where bisection took 30: this is the plan's hot path, plan_scale.py).
        d = 1.0
        for _ in range(60):
            f = -1.0
            slope = 0.0
            for i in range(n):
                u = use[i]
                if u > 0.0:
                    t = 1.0 / (host[i] + busy[i] * d)
                    f += u * t
                    slope += u * busy[i] * t * t
            if f <= 1e-12 or slope <= 0.0:
                break
            step = f / slope
            d += step
            if step <= 1e-12 * d:
                break
        return d

    d = max(stretch_for(sm), stretch_for(bw))
    return [1.0 / (host[i] + base[i] * d) for i in range(n)]


def predict_colocated_speeds(members: Sequence[Any], params: InterferenceParams | None = None,
                             gpu_memory_bytes: int | None = None) -> list[float]:
    """Each member's predicted speed relative to running alone on the GPU.

    `members`: solo profiles of the jobs sharing one GPU, as `SoloProfile`, any object
    with `sm_util_pct`, `membw_util_pct` (and optionally `gpu_mem_bytes`, `gpu_mem_mib`
    or `gpu_mem_gib`) attributes, or a mapping with those keys. Returns one float in (0, 1] per member, in order (a lone
    member gets 1.0). If `gpu_memory_bytes` is given and the members' memory does not
    fit in it, nobody runs: every speed is 0.0.
    """
    profiles = [_profile_of(m) for m in members]
    if gpu_memory_bytes is not None and sum(p.gpu_mem_bytes for p in profiles) > gpu_memory_bytes:
        return [0.0] * len(profiles)
    if len(profiles) == 1:
        return [1.0]
    return predict_speeds_from_fractions([util_fraction(p.sm_util_pct) for p in profiles],
                                         [util_fraction(p.membw_util_pct) for p in profiles],
                                         params or DEFAULT_PARAMS)


def build_samples(solo_samples_per_s: Mapping[int, float], profiles: Mapping[int, SoloProfile],
                  groups: Iterable[Mapping[int, float]]) -> list[CoLocationSample]:
    """Turn measured rates into samples for `refit_interference`.

    `solo_samples_per_s[job]` is the job's rate alone, `profiles[job]` its solo profile;
    each item of `groups` maps the job ids that shared one GPU to their measured
    co-located rates. Groups with a job lacking a solo rate or profile are skipped.
    """
    out: list[CoLocationSample] = []
    for group in groups:
        ids = sorted(group)
        if not ids or any(j not in solo_samples_per_s or j not in profiles or solo_samples_per_s[j] <= 0 for j in ids):
            continue
        out.append(CoLocationSample(tuple(profiles[j] for j in ids),
                                    tuple(group[j] / solo_samples_per_s[j] for j in ids)))
    return out


def refit_interference(samples: Sequence[CoLocationSample],
                       start: InterferenceParams | None = None) -> InterferenceParams:
    """Least-squares fit of (alpha, beta, gamma) to measured relative speeds.

    Minimises the squared error of every member's predicted speed, with all three
    constants kept in [0, 10]. Single-member samples carry no information and are
    ignored; with no usable sample the start values are returned unchanged.
    """
    usable = [s for s in samples if len(s.members) > 1 and len(s.members) == len(s.speeds)]
    first = start or DEFAULT_PARAMS
    if not usable:
        return first
    from scipy.optimize import least_squares  # lazy: scipy is slow to import, pure otherwise

    fracs = [([util_fraction(p.sm_util_pct) for p in s.members], [util_fraction(p.membw_util_pct) for p in s.members], s.speeds)
             for s in usable]

    def residuals(x: Any) -> list[float]:
        params = InterferenceParams(float(x[0]), float(x[1]), float(x[2]))
        res: list[float] = []
        for sm, bw, measured in fracs:
            pred = predict_speeds_from_fractions(sm, bw, params)
            res.extend(p - m for p, m in zip(pred, measured, strict=True))
        return res

    # Start strictly inside the bounds: from a constant at 0 (the defaults) the
    # trust-region solver stalls on the bound.
    x0 = [min(max(v, 0.05), 9.95) for v in first.as_tuple()]
    fit = least_squares(residuals, x0, bounds=([0.0, 0.0, 0.0], [10.0, 10.0, 10.0]))
    return InterferenceParams(float(fit.x[0]), float(fit.x[1]), float(fit.x[2]))


def prediction_error(samples: Sequence[CoLocationSample], params: InterferenceParams | None = None) -> float:
    """Mean absolute error of the predicted relative speeds over all members."""
    errs = [abs(p - m) for s in samples
            for p, m in zip(predict_colocated_speeds(s.members, params), s.speeds, strict=True)]
    return sum(errs) / len(errs) if errs else 0.0
