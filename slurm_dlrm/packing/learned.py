"""The learned co-location model: gradient-boosted trees over each member's solo profile
and its co-runners' aggregates, on top of the analytic model (pure: no file I/O).

Per member i of a group of n (utilisations as fractions of the GPU):

- its own solo profile: SM share s_i, memory-bandwidth share b_i;
- its co-runners' aggregates: sum and max of their s and b, their count n - 1;
- the group's load sum_j max(s_j, b_j), and the analytic model's speed for i (the prior);
- when every training sample carries them (measured files often do not): its GPU memory
  (GiB), host cores and MPS thread percentage, and the co-runners' summed GPU memory.

Sums, maxima and counts make the features invariant to the members' order and defined
for any group size. The trees learn the measured speed itself with the analytic prior as
one feature (learning the prior's *residual* instead needs no monotone constraint to be
wrong: the residual of a monotone prior is not monotone; on the synthetic generator the
residual fit under constraints stalled at 3x the error). The prediction is clipped to
(0, 1]. Monotone constraints where the physics is clear: more co-runner SM or bandwidth
(sum or max), more co-runners or more group load never makes a member faster, a higher
analytic prior never makes it slower; since the prior itself never rises with co-runner
load, adding load to a group never speeds a member up (tested). Two tree sets when the optional features are present: the full one (used by
`predict_profiles`, i.e. `interference predict/eval`) and a core one on SM and bandwidth
alone (used by the policies, which see only those).

Fitting needs scikit-learn (`HistGradientBoostingRegressor`, imported lazily: never on
the submit path or at CLI start-up). Prediction does not: the fitted trees are plain
numbers (`to_dict` / `from_dict`, no pickle, so a model file cannot run code), compiled
once into a Python function, because the policies call the model thousands of times
per plan on groups of 2-8 members, where scikit-learn's per-call overhead (about 1 ms,
more on a loaded machine) would dominate; repeated members are memoised.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from slurm_dlrm.packing.interference import (
    DEFAULT_PARAMS,
    CoLocationSample,
    InterferenceParams,
    SoloProfile,
    predict_speeds_from_fractions,
    util_fraction,
)

SCHEMA_VERSION = 1
KIND = "slurm-dlrm-interference-model"

CORE_FEATURES = ("sm", "bw", "others_sm_sum", "others_bw_sum", "others_sm_max", "others_bw_max",
                 "others_count", "group_load", "prior_speed")
# +1: the speed never falls as the feature grows; -1: never rises; 0: free.
CORE_MONOTONE = (0, 0, -1, -1, -1, -1, -1, -1, 1)
OPTIONAL_FEATURES = ("gpu_mem_gib", "others_gpu_mem_gib", "host_cpu_cores", "mps_thread_pct")
OPTIONAL_MONOTONE = (0, 0, 0, 1)

MIN_SPEED = 1e-3  # (0, 1]: a prediction is never 0 (0 means "does not fit", decided by memory)
_CACHE_LIMIT = 500_000


def _optional_values(p: SoloProfile, others: Sequence[SoloProfile]) -> tuple[float, ...]:
    return (p.gpu_mem_bytes / (1 << 30), sum(o.gpu_mem_bytes for o in others) / (1 << 30),
            p.host_cpu_cores, p.mps_thread_pct)


def optional_present(samples: Sequence[CoLocationSample]) -> tuple[str, ...]:
    """The optional features every member of every sample carries (a value > 0)."""
    names = []
    for k, name in enumerate(OPTIONAL_FEATURES):
        if name == "others_gpu_mem_gib":
            k = 0  # follows gpu_mem_gib
        if samples and all(_optional_values(p, ())[k] > 0 for s in samples for p in s.members):
            names.append(name)
    return tuple(names)


def core_rows(sm: Sequence[float], bw: Sequence[float], prior: InterferenceParams) -> list[tuple[float, ...]]:
    """The core feature rows of one group, in member order."""
    n = len(sm)
    speeds = predict_speeds_from_fractions(sm, bw, prior.analytic()) if n > 1 else [1.0] * n
    total_sm, total_bw = sum(sm), sum(bw)
    load = float(sum(s if s > b else b for s, b in zip(sm, bw, strict=True)))
    rows: list[tuple[float, ...]] = []
    for i in range(n):
        max_sm = max((sm[j] for j in range(n) if j != i), default=0.0)
        max_bw = max((bw[j] for j in range(n) if j != i), default=0.0)
        # Rounded: sums in another member order differ in the last bits, and a tree
        # threshold (a quantile of the training values) may sit exactly on a value.
        rows.append((round(sm[i], 9), round(bw[i], 9), round(total_sm - sm[i], 9), round(total_bw - bw[i], 9),
                     round(max_sm, 9), round(max_bw, 9), float(n - 1), round(load, 9), round(speeds[i], 9)))
    return rows


def sample_rows(sample: CoLocationSample, prior: InterferenceParams,
                optional: Sequence[str] = ()) -> list[tuple[float, ...]]:
    """Feature rows (core, then the chosen optional ones) of one sample's members."""
    members = sample.members
    rows = core_rows([util_fraction(p.sm_util_pct) for p in members],
                     [util_fraction(p.membw_util_pct) for p in members], prior)
    if not optional:
        return rows
    pick = [OPTIONAL_FEATURES.index(name) for name in optional]
    out = []
    for i, row in enumerate(rows):
        extra = _optional_values(members[i], [m for j, m in enumerate(members) if j != i])
        out.append(row + tuple(extra[k] for k in pick))
    return out


@dataclass(frozen=True)
class TreeSet:
    """Fitted boosted trees as numbers: each node [feature, threshold, left, right, value, is_leaf]."""

    features: tuple[str, ...]
    baseline: float
    trees: tuple[tuple[tuple[float, ...], ...], ...]

    def compile(self) -> Callable[..., float]:
        """A Python function of the feature values returning the summed raw prediction.

        The source is built only from validated ints and float reprs (`check`), so
        nothing from a model file reaches it as text."""
        self.check()
        args = ", ".join(f"x{k}" for k in range(len(self.features)))
        lines = [f"def f({args}):", f"    v = {self.baseline!r}"]
        for nodes in self.trees:
            lines.append(f"    v += {_expr(nodes, 0)}")
        lines.append("    return v")
        scope: dict[str, Any] = {}
        exec(compile("\n".join(lines), "<interference-trees>", "exec"), {"__builtins__": {}}, scope)  # noqa: S102
        fn: Callable[..., float] = scope["f"]
        return fn

    def check(self) -> None:
        """Raise ValueError unless every node is well formed (types, ranges, links)."""
        if not math.isfinite(self.baseline):
            raise ValueError("baseline is not a finite number")
        width = len(self.features)
        for t, nodes in enumerate(self.trees):
            if not nodes:
                raise ValueError(f"tree {t} is empty")
            for k, node in enumerate(nodes):
                if len(node) != 6 or not all(isinstance(v, int | float) and math.isfinite(v) for v in node):
                    raise ValueError(f"tree {t} node {k}: six finite numbers expected")
                feature, _, left, right, _, leaf = node
                if leaf not in (0, 1):
                    raise ValueError(f"tree {t} node {k}: is_leaf must be 0 or 1")
                if not leaf and not (0 <= feature < width and k < left < len(nodes) and k < right < len(nodes)
                                     and int(feature) == feature and int(left) == left and int(right) == right):
                    raise ValueError(f"tree {t} node {k}: bad feature index or child link")

    def as_dict(self) -> dict[str, Any]:
        return {"features": list(self.features), "baseline": self.baseline,
                "trees": [[list(node) for node in nodes] for nodes in self.trees]}

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> TreeSet:
        try:
            features = tuple(str(f) for f in data["features"])
            baseline = float(data["baseline"])
            trees = tuple(tuple(tuple(float(v) if isinstance(v, float) else int(v) for v in node) for node in nodes)
                          for nodes in data["trees"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"tree set: {exc}") from None
        ts = TreeSet(features, baseline, trees)
        ts.check()
        return ts


def _expr(nodes: Sequence[Sequence[float]], k: int) -> str:
    feature, threshold, left, right, value, leaf = nodes[k]
    if leaf:
        return repr(float(value))
    return (f"({_expr(nodes, int(left))} if x{int(feature)} <= {float(threshold)!r} "
            f"else {_expr(nodes, int(right))})")


class LearnedInterference:
    """The fitted model. Implements `SpeedModel` (`speeds_from_fractions`), so
    `InterferenceParams(..., speed_model=model)` makes every policy plan with it; the
    constants of that `InterferenceParams` are the prior (`model.prior`)."""

    name = "learned"

    def __init__(self, prior: InterferenceParams, core: TreeSet, full: TreeSet | None = None,
                 info: Mapping[str, Any] | None = None) -> None:
        if core.features != CORE_FEATURES:
            raise ValueError(f"core tree set: features {list(core.features)}, expected {list(CORE_FEATURES)}")
        if full is not None and (full.features[:len(CORE_FEATURES)] != CORE_FEATURES
                                 or any(f not in OPTIONAL_FEATURES for f in full.features[len(CORE_FEATURES):])):
            raise ValueError(f"full tree set: unknown features {list(full.features)}")
        self.prior = prior.analytic()
        self.core = core
        self.full = full
        self.info: dict[str, Any] = dict(info or {})
        self._core_fn = core.compile()
        self._full_fn = full.compile() if full is not None else None
        self._cache: dict[tuple[float, ...], float] = {}

    @property
    def optional_features(self) -> tuple[str, ...]:
        return self.full.features[len(CORE_FEATURES):] if self.full is not None else ()

    def params(self) -> InterferenceParams:
        """The value the policies take: the prior's constants with this model attached."""
        p = self.prior
        return InterferenceParams(p.sm_contention, p.membw_contention, p.per_client_overhead, speed_model=self)

    def speeds_from_fractions(self, sm: Sequence[float], bw: Sequence[float]) -> list[float]:
        n = len(sm)
        if n <= 1:
            return [1.0] * n
        cache = self._cache
        if len(cache) > _CACHE_LIMIT:
            cache.clear()
        fn = self._core_fn
        out = []
        for row in core_rows(sm, bw, self.prior):
            v = cache.get(row)
            if v is None:
                v = _clip(fn(*row))
                cache[row] = v
            out.append(v)
        return out

    def predict_profiles(self, members: Sequence[SoloProfile]) -> list[float]:
        """Speeds of one group from full profiles (the optional features when the model has them)."""
        if len(members) <= 1:
            return [1.0] * len(members)
        if self._full_fn is not None:
            sample = CoLocationSample(tuple(members), tuple(1.0 for _ in members))
            rows = sample_rows(sample, self.prior, self.optional_features)
            if all(v > 0 for row in rows for v in row[len(CORE_FEATURES):]):  # every optional feature known
                fn = self._full_fn
                return [_clip(fn(*row)) for row in rows]
        return self.speeds_from_fractions([util_fraction(p.sm_util_pct) for p in members],
                                          [util_fraction(p.membw_util_pct) for p in members])

    def as_dict(self) -> dict[str, Any]:
        p = self.prior
        return {"kind": KIND, "schema_version": SCHEMA_VERSION,
                "features": list(self.full.features if self.full is not None else self.core.features),
                "prior": {"alpha": p.sm_contention, "beta": p.membw_contention, "gamma": p.per_client_overhead},
                **self.info,
                "core": self.core.as_dict(), "full": self.full.as_dict() if self.full is not None else None}

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> LearnedInterference:
        """Raises ValueError naming the problem (foreign kind, other schema, bad trees)."""
        if not isinstance(data, Mapping) or data.get("kind") != KIND:
            raise ValueError(f"not a slurm-dlrm interference model (kind {data.get('kind') if isinstance(data, Mapping) else None!r})")
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"schema version {data.get('schema_version')!r}, this slurm-dlrm reads {SCHEMA_VERSION}")
        try:
            pr = data["prior"]
            prior = InterferenceParams(float(pr["alpha"]), float(pr["beta"]), float(pr["gamma"]))
            if list(data["core"]["features"]) != list(CORE_FEATURES):
                raise ValueError(f"core features {data['core']['features']}, expected {list(CORE_FEATURES)}")
            core = TreeSet.from_dict(data["core"])
            full = TreeSet.from_dict(data["full"]) if data.get("full") is not None else None
        except (KeyError, TypeError) as exc:
            raise ValueError(f"missing or malformed field: {exc}") from None
        info = {k: data[k] for k in ("training_groups", "training_members", "groups_given", "cv", "fitted_from")
                if k in data}
        return LearnedInterference(prior, core, full, info)


def _clip(v: float) -> float:
    return 1.0 if v > 1.0 else (MIN_SPEED if not v > MIN_SPEED else v)


# ---------------------------------------------------------------- fitting (scikit-learn, lazily)

# Small trees: the policies evaluate the model in pure Python (see the module docstring),
# so the ensemble's size is its plan-time cost. Measured on the synthetic generator
# (benchmarks/interference_accuracy.py), more or deeper trees gained < 0.002 MAE.
HGB_PARAMS: dict[str, Any] = {"max_iter": 100, "learning_rate": 0.15, "max_leaf_nodes": 15, "max_depth": 6,
                              "min_samples_leaf": 20, "l2_regularization": 1.0, "max_bins": 127,
                              "early_stopping": False}


def _fit_trees(rows: list[tuple[float, ...]], target: list[float], features: tuple[str, ...],
               monotone: tuple[int, ...], seed: int) -> TreeSet:
    import numpy as np
    from sklearn.ensemble import HistGradientBoostingRegressor  # lazy: slow to import, fit only

    x = np.asarray(rows, dtype=np.float64)
    y = np.asarray(target, dtype=np.float64)
    from threadpoolctl import threadpool_limits  # a dependency of scikit-learn

    model = HistGradientBoostingRegressor(monotonic_cst=list(monotone), random_state=seed, **HGB_PARAMS)
    # One OpenMP thread: the trees are small, and on a shared machine the threads'
    # synchronisation per split cost 3x the work (13 s -> 4 s for 5,000 groups).
    with threadpool_limits(limits=1):
        model.fit(x, y)
    trees = []
    # scikit-learn's fitted predictors (private attributes, checked below against
    # model.predict so a change in scikit-learn fails here, not silently).
    for (predictor,) in model._predictors:
        nodes = predictor.nodes
        trees.append(tuple((int(nd["feature_idx"]), float(nd["num_threshold"]), int(nd["left"]), int(nd["right"]),
                            float(nd["value"]), int(nd["is_leaf"])) for nd in nodes))
    ts = TreeSet(features, float(np.ravel(model._baseline_prediction)[0]), tuple(trees))
    fn = ts.compile()
    probe = x[:: max(1, len(x) // 200)]
    want = model.predict(probe)
    got = [fn(*map(float, r)) for r in probe]
    if max(abs(a - b) for a, b in zip(got, want, strict=True)) > 1e-6:
        raise RuntimeError("the exported trees disagree with scikit-learn's predict (scikit-learn version?)")
    return ts


# A fit sees at most this many groups (a seeded sample): a bound on memory and time
# for a huge store (100,000 groups fit in about 10 s on one core; on the synthetic
# generator 20,000 groups already gave the same error).
MAX_FIT_GROUPS = 200_000


def fit_learned(samples: Sequence[CoLocationSample], prior: InterferenceParams = DEFAULT_PARAMS,
                seed: int = 0, info: Mapping[str, Any] | None = None,
                optional: Sequence[str] | None = None, max_groups: int = MAX_FIT_GROUPS) -> LearnedInterference:
    """Fit on multi-member samples (ValueError if there are none). `optional`: the
    optional features to use (default: every one all samples carry)."""
    usable = [s for s in samples if len(s.members) > 1 and len(s.members) == len(s.speeds)]
    if not usable:
        raise ValueError("no co-location group with two or more members to learn from")
    seen = len(usable)
    usable = subsample(usable, max_groups, seed)
    prior = prior.analytic()
    opt = tuple(optional_present(usable) if optional is None else optional)
    rows: list[tuple[float, ...]] = []
    target: list[float] = []
    for s in usable:
        for row, speed in zip(sample_rows(s, prior, opt), s.speeds, strict=True):
            rows.append(row)
            target.append(min(speed, 1.5))
    n_core = len(CORE_FEATURES)
    core = _fit_trees([r[:n_core] for r in rows], target, CORE_FEATURES, CORE_MONOTONE, seed)
    full = None
    if opt:
        mono = CORE_MONOTONE + tuple(OPTIONAL_MONOTONE[OPTIONAL_FEATURES.index(f)] for f in opt)
        full = _fit_trees(rows, target, CORE_FEATURES + opt, mono, seed)
    meta = {"training_groups": len(usable), "training_members": len(rows), "groups_given": seen, **(info or {})}
    return LearnedInterference(prior, core, full, meta)


def learned_predictor(model: LearnedInterference) -> Callable[[CoLocationSample], list[float]]:
    return lambda sample: model.predict_profiles(sample.members)


def subsample(samples: Sequence[CoLocationSample], limit: int, seed: int = 0) -> list[CoLocationSample]:
    """At most `limit` samples, a seeded choice (fits on huge stores stay bounded)."""
    if len(samples) <= limit:
        return list(samples)
    return random.Random(seed).sample(list(samples), limit)
