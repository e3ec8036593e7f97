"""What "really" happens on a shared GPU, apart from the planner's model: the one
co-location truth of the simulator (`sim/`) and of the emulated GPU node's stand-in members
(`emulated/standin`), both reaching it through `interference_io.parse_truth`. It sits apart
from both so that neither imports the other's internals, and above the planner (it takes
`packing.interference`'s types), which is why it is not inside `emulated/`: the agent
imports the emulated node's fakes, so that package sits below the agent and the planner.

`simulate --truth` picks one of (pure; the CLI reads the files):

- `analytic[:A,B,G]`: the analytic formula with these constants (default: the defaults);
- `learned:FILE`: a learned model file (`interference fit`);
- `table:FILE`: measured co-locations (the eval format); a group's speeds are those of
  the measured group nearest to it (`NearestTable`); a group of a size the file has not
  measured composes the measured pairs: each member keeps, in turn, the share its
  nearest measured pair with each neighbour leaves it (the product of its pair speeds;
  `composed_speeds`, its error on measured groups: `composition_error`);
- `synthetic[:SEED]`: `SyntheticColocation` below, a generator whose shape is *not* the
  analytic formula, so a model fit or judged on it is not judged on its own prior.

`SyntheticColocation`: a roofline with contention, solved as a fixed point. Member i
with solo SM share s and bandwidth share b spends h = 1 - g of its solo step on the host
(g = max(s, b) + 0.25 * min(s, b) * (1 - max(s, b)): compute and memory overlap only
partly), and splits its GPU time g into a compute part and a memory part in proportion
to s and b. Co-located:

- compute queues behind the others' active compute: the part is stretched by
  1 + rho_c^2 / (1 - min(rho_c, 0.9)) (an M/M/1-like wait, not linear), rho_c the
  co-runners' SM use at their current speeds, and by max(1, U_c) once SMs saturate;
- the L2 cache thrashes: the memory part's traffic grows by (1 + kappa * b_others *
  (0.5 + s_i)) (compute-heavy kernels reuse more, so lose more to a shared cache), and
  the bandwidth saturates as max(1, U_b) with that inflated traffic;
- kernel launches queue: each co-runner adds tau * (1 - h_j) * (n - 1) ** 0.5 of a launch
  slot to the host part, saturating (the MPS server serialises launches).

Speeds are iterated to the fixed point (damped), then times a per-group multiplicative
noise (seeded by the group's profiles, so the same group always gives the same speeds).
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from slurm_dlrm.packing.interference import CoLocationSample, SoloProfile, util_fraction


@dataclass(frozen=True)
class SyntheticColocation:
    """The synthetic generator (see the module docstring). Implements `SpeedModel`."""

    kappa: float = 0.8  # L2 thrash: traffic growth per unit of co-runner bandwidth share
    tau: float = 0.06  # launch queuing per co-runner, in solo step time
    noise_pct: float = 2.0  # multiplicative noise on each member's speed (deterministic per group)
    seed: int = 0
    name: str = "synthetic"

    def speeds_from_fractions(self, sm: Sequence[float], bw: Sequence[float]) -> list[float]:
        n = len(sm)
        if n <= 1:
            return [1.0] * n
        g = [max(s, b) + 0.25 * min(s, b) * (1.0 - max(s, b)) for s, b in zip(sm, bw, strict=True)]
        g = [min(x, 1.0) for x in g]
        host = [1.0 - x for x in g]
        comp = [gi * (s / (s + b)) if s + b > 0 else 0.0 for gi, s, b in zip(g, sm, bw, strict=True)]
        mem = [gi - c for gi, c in zip(g, comp, strict=True)]
        total_bw = sum(bw)
        traffic = [mem[i] * (1.0 + self.kappa * (total_bw - bw[i]) * (0.5 + sm[i])) for i in range(n)]
        launch = [self.tau * sum(g[j] for j in range(n) if j != i) * math.sqrt(n - 1) for i in range(n)]
        x = [1.0] * n
        for _ in range(60):
            use_c = [sm[j] * x[j] for j in range(n)]
            use_b = [bw[j] * x[j] * (traffic[j] / mem[j] if mem[j] > 0 else 1.0) for j in range(n)]
            total_c, total_b = sum(use_c), sum(use_b)
            sat_c, sat_b = max(1.0, total_c), max(1.0, total_b)
            new = []
            for i in range(n):
                rho = min(total_c - use_c[i], 0.9)
                queue = 1.0 + rho * rho / (1.0 - rho)
                t = host[i] + launch[i] + comp[i] * queue * sat_c + traffic[i] * sat_b
                new.append(min(1.0, 1.0 / t))
            step = max(abs(a - b) for a, b in zip(x, new, strict=True))
            x = [0.5 * a + 0.5 * b for a, b in zip(x, new, strict=True)]
            if step < 1e-5:
                break
        if self.noise_pct > 0:
            group = struct.pack(f"<q{2 * n}d", self.seed, *sorted(sm), *sorted(bw))
            x = [min(1.0, v * (1.0 + random.Random(_seed_of(group, s, b)).gauss(0.0, self.noise_pct / 100.0)))
                 for v, s, b in zip(x, sm, bw, strict=True)]
        return [max(v, 1e-3) for v in x]


def _seed_of(group: bytes, s: float, b: float) -> int:
    """A member's noise seed: its group and its own profile (not its position)."""
    return int.from_bytes(hashlib.blake2b(group + struct.pack("<2d", s, b), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class NearestTable:
    """Measured groups as the truth: a group of n members gets, member by member, the
    speeds of the measured group of n members nearest to it (members matched in order of
    SM share; distance the summed absolute profile difference). A size with no measured
    group composes the measured pairs (`composed_speeds`). Implements `SpeedModel`."""

    groups: tuple[CoLocationSample, ...]
    name: str = "table"
    # The simulator asks for the same group again and again: answers kept (not compared).
    _seen: dict[tuple[tuple[float, ...], tuple[float, ...]], tuple[float, ...]] = field(
        default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not any(len(g.members) == 2 for g in self.groups):
            raise ValueError("table truth: no measured pair (a pair is what groups of other sizes are composed of)")

    def sizes(self) -> set[int]:
        return {len(g.members) for g in self.groups}

    def speeds_from_fractions(self, sm: Sequence[float], bw: Sequence[float]) -> list[float]:
        n = len(sm)
        if n <= 1:
            return [1.0] * n
        key = (tuple(sm), tuple(bw))
        hit = self._seen.get(key)
        if hit is None:
            hit = tuple(self.composed_speeds(sm, bw) if n not in self.sizes() else self.nearest_speeds(sm, bw))
            if len(self._seen) > 100_000:
                self._seen.clear()
            self._seen[key] = hit
        return list(hit)

    def composed_speeds(self, sm: Sequence[float], bw: Sequence[float]) -> list[float]:
        """Each member's speed is the product, over its neighbours, of its speed in the
        nearest measured pair with that neighbour."""
        n = len(sm)
        out = [1.0] * n
        for i in range(n):
            for j in range(i + 1, n):
                a, b = self.nearest_speeds([sm[i], sm[j]], [bw[i], bw[j]])
                out[i] *= a
                out[j] *= b
        return [min(1.0, max(v, 1e-3)) for v in out]

    def nearest_speeds(self, sm: Sequence[float], bw: Sequence[float]) -> list[float]:
        n = len(sm)
        order = sorted(range(n), key=lambda i: (sm[i], bw[i]))
        best: tuple[float, tuple[float, ...]] | None = None
        for s in self.groups:
            if len(s.members) != n:
                continue
            ranked = sorted(zip(s.members, s.speeds, strict=True),
                            key=lambda m: (util_fraction(m[0].sm_util_pct), util_fraction(m[0].membw_util_pct)))
            dist = sum(abs(util_fraction(p.sm_util_pct) - sm[i]) + abs(util_fraction(p.membw_util_pct) - bw[i])
                       for (p, _), i in zip(ranked, order, strict=True))
            if best is None or dist < best[0]:
                best = (dist, tuple(v for _, v in ranked))
        if best is None:
            raise ValueError(f"table truth: no measured group of {n} members")
        out = [0.0] * n
        for rank, i in enumerate(order):
            out[i] = min(1.0, max(best[1][rank], 1e-3))
        return out


def composition_error(groups: Sequence[CoLocationSample]) -> dict[int, float]:
    """Mean absolute error of the composed speeds (from the pairs in `groups`) on each
    measured group size above 2: what `table:FILE` costs on the sizes it measured."""
    table = NearestTable(tuple(g for g in groups if len(g.members) == 2))
    errs: dict[int, list[float]] = {}
    for g in groups:
        if len(g.members) < 3:
            continue
        pred = table.composed_speeds([util_fraction(p.sm_util_pct) for p in g.members],
                                     [util_fraction(p.membw_util_pct) for p in g.members])
        errs.setdefault(len(g.members), []).extend(abs(p - m) for p, m in zip(pred, g.speeds, strict=True))
    return {n: sum(v) / len(v) for n, v in sorted(errs.items())}


def synthetic_groups(count: int, seed: int = 0, jobs: int = 600, sizes: Sequence[int] = (2, 2, 3, 3, 4, 5, 6),
                     truth: SyntheticColocation | None = None) -> tuple[list[CoLocationSample], list[tuple[int, ...]]]:
    """`count` co-location groups drawn from a pool of `jobs` distinct job profiles (so
    jobs recur across groups, as on a real cluster), with the generator's speeds; and
    each group's job indices."""
    rng = random.Random(seed)
    truth = truth or SyntheticColocation(seed=seed)
    pool = []
    for _ in range(jobs):
        kind = rng.random()
        if kind < 0.35:  # compute-leaning
            s, b = rng.uniform(0.3, 0.95), rng.uniform(0.05, 0.4)
        elif kind < 0.7:  # memory-leaning
            s, b = rng.uniform(0.05, 0.45), rng.uniform(0.3, 0.9)
        else:  # light (host-bound, small embeddings)
            s, b = rng.uniform(0.02, 0.3), rng.uniform(0.02, 0.3)
        pool.append(SoloProfile(round(100 * s, 2), round(100 * b, 2), int(rng.uniform(1, 20) * (1 << 30))))
    samples, ids = [], []
    for _ in range(count):
        n = rng.choice(list(sizes))
        members = tuple(sorted(rng.sample(range(jobs), n)))
        profiles = tuple(pool[j] for j in members)
        speeds = truth.speeds_from_fractions([util_fraction(p.sm_util_pct) for p in profiles],
                                             [util_fraction(p.membw_util_pct) for p in profiles])
        samples.append(CoLocationSample(profiles, tuple(speeds)))
        ids.append(members)
    return samples, ids
