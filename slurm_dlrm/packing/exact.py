"""`exact`: the round's placement solved to optimality by OR-Tools CP-SAT (issue 50).

The round problem is the one `complementary` solves greedily (docs/packing.md "Packing
at the round's optimum"): every pending single-GPU job may join a GPU of a running pack
(live members fixed) or a free GPU of a node, at most one each, such that on every GPU
the fences fit (live members at their measured peak or fence), members stay within
`members_per_gpu` (live ones counted), and on every node (a pack node's allocation, or
a free node) the CPUs and host memory fit; a time-limited pack only takes joiners that
fit its time left, at their predicted speed. The objective is refill's: the round's
*priced predicted work*, sum over GPUs and members of w_i x speed_i, where speed_i is
the interference model's prediction for the GPU's members and w_i what member i takes
of GPU memory, CPUs, SMs and bandwidth, each priced by how much of it the pending work
still needs (`refill._fill_by_gain`). Jobs the heuristic left for a reason other than
room (too big, held for an urgent job) stay where it left them; overdue and urgent jobs
it placed must be placed. The policy offers the solver the heuristic's picks and the
next `exact_window` jobs of refill's order (the whole queue took each round's optimum
but lost over whole runs: docs/packing.md); `window=None` is the round's true optimum.

Linearisation (exact up to a grid): with the analytic model and no contention terms
(the defaults) a GPU's speeds depend on its members only through one stretch D >= 1,
the smallest with sum_i u_r,i / (h_i + g_i D) <= 1 for SMs and bandwidth, and speed_i =
1 / (h_i + g_i D) falls with D. So a GPU's value is the largest, over the D that satisfy
that capacity, of sum_i w_i / (h_i + g_i D). Each GPU picks one level D_l of a grid
(1 first; the top, `members_per_gpu`, always satisfies it): under that level the
capacity holds and the value counts each member at its speed at D_l. The grid value
of a set is then its value at the grid level just at or above its true D, a lower
bound that equals it below saturation; the plan is scored with the true model. The
coarse grid's levels are 9-33% apart past 1.1, so where its search closes a second
pass solves on a fine grid (levels at most 5% apart: each GPU's value, live members
too, within 5% of the true one), seeded with the coarse plan; the higher true value
wins. The upper model (`upper=True`) counts level l at the speeds of level l-1: an
upper bound of the true optimum, so the proven gap covers the grid too.

Pure: no I/O; the solver is a computation, run single-threaded on a deterministic time
budget so the same request gives the same plan. Past the budget the heuristic's plan
is kept (it is the solver's hint and its floor: the exact plan is used only where it
scores higher), and so past `max_pairs` job-GPU pairs, with a pending multi-GPU job, or
with a speed model the grid cannot express (contention terms, a learned model).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from slurm_dlrm.packing.common import (
    NO_ROOM,
    OVERDUE_PRIORITY,
    REFILL_POLICIES,
    Gpu,
    Node,
    drain_tail,
    expand_nodes,
    finish_plan,
    gpu_budget,
    tail_first,
    thread_pcts,
)
from slurm_dlrm.packing.fairness import (
    TAIL_FACTOR as REFILL_TAIL_FACTOR,  # refill's and complementary's
)
from slurm_dlrm.packing.interference import (
    InterferenceParams,
    predict_speeds_from_fractions,
    util_fraction,
)
from slurm_dlrm.packing.model import (
    Deferred,
    JobDemand,
    Join,
    MemberPlacement,
    PackingLimits,
    PackingPlan,
    PackingRequest,
    host_limit_bytes,
    live_gpu_bytes,
    member_fence_bytes,
    usable_gpu_bytes,
)
from slurm_dlrm.packing.pack_gpus import pack_gpus
from slurm_dlrm.packing.refill import allocation_bound, join_key
from slurm_dlrm.site import MIB, GpuModel

if TYPE_CHECKING:
    from ortools.sat.python import cp_model  # lazy at run time: ortools loads in ~0.7 s

DEFAULT_BUDGET_S = 0.2  # CP-SAT deterministic time per round (about seconds)
DEFAULT_MAX_PAIRS = 600  # job-GPU pairs past which the round stays the heuristic's
_GRID = (1.0, 1.05, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0)  # stretch levels up to the GPU's cap
_FINE_RATIO = 1.05  # the refining pass's levels: 1, r, r^2, ... (and _GRID's), each at most r above the last
_LAMBDAS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)  # multipliers of the upper model's capacity cuts
_W = 10_000  # objective scale (priced work units)
_C = 100_000  # capacity scale (a GPU's SMs or bandwidth)
_EPS = 1e-9


@dataclass
class _Target:
    """One GPU the round may place onto: a running pack's (key set) or a free one."""

    key: str  # the pack GPU's key, or f"{node}#{i}" for a free GPU
    gpu: GpuModel
    node: Node
    live: list[JobDemand]
    used_bytes: int
    slots: int
    remaining_s: float | None
    fresh: bool
    cpu_cap: float  # CPUs per GPU of its node (the CPU price's unit)
    placed: list[JobDemand] = field(default_factory=list)


@dataclass(frozen=True)
class RoundSolution:
    """What the solver found for one round (for the benchmark's ceiling)."""

    status: str  # "optimal", "feasible", "fallback: <why>"
    value: float  # priced predicted work of the chosen plan (true model)
    heuristic_value: float  # the same of the heuristic's plan
    bound: float  # proven upper bound on the round's optimum (upper model), or the value
    seconds: float
    pairs: int
    plan: PackingPlan


def grid_ok(params: InterferenceParams) -> bool:
    """Whether the stretch grid expresses the model exactly (analytic, saturation only)."""
    return params.speed_model is None and params.as_tuple() == (0.0, 0.0, 0.0)


def _levels(top: int, fine: bool = False) -> list[float]:
    """The stretch levels below a GPU's cap `top`, then `top`. `fine`: _GRID's levels
    plus the powers of _FINE_RATIO (so a coarse solution stays a solution at its level)."""
    out = [d for d in _GRID if d < top - _EPS] or [1.0]
    if fine:
        d = _FINE_RATIO
        while d < top - _EPS:
            out.append(d)
            d *= _FINE_RATIO
        out = sorted({round(v, 9) for v in out})
    return out + [float(top)] if top > 1 else out


def _speed(job: JobDemand, d: float) -> float:
    g = max(util_fraction(job.sm_util_pct), util_fraction(job.membw_util_pct))
    return 1.0 / ((1.0 - g) + g * d)


def _targets(request: PackingRequest) -> list[_Target]:
    limits = request.limits
    out: list[_Target] = []
    pgs = pack_gpus(request)
    bound = set() if limits.refill_headroom_pct is None else allocation_bound(pgs, list(request.jobs), limits)
    groups: dict[int, int] = {}
    cpus: dict[int, int] = {}
    for pg in pgs:
        groups[id(pg.node)] = groups.get(id(pg.node), 0) + 1
        cpus[id(pg.node)] = cpus.get(id(pg.node), pg.node.free_cpus) + sum(j.cpus for j in pg.live)
    for pg in pgs:
        if pg.key in bound:
            continue
        out.append(_Target(pg.key, pg.gpu, pg.node, list(pg.live), pg.used_bytes, pg.slots, pg.remaining_s,
                           False, max(1.0, cpus[id(pg.node)] / groups[id(pg.node)])))
    for node in expand_nodes(request):
        for i in range(node.free_gpus):
            out.append(_Target(f"{node.name}#{i}", node.gpu, node, [], 0, limits.members_per_gpu, None, True,
                               max(1.0, node.free_cpus / max(1, node.free_gpus))))
    return out


def _prices(pool: Sequence[JobDemand], targets: list[_Target], request: PackingRequest) -> list[float]:
    """refill's prices: each resource's duration-weighted pending demand, the largest 1."""
    if not targets:
        return [1.0, 0.0, 0.0, 0.0]
    g0 = targets[0].gpu
    u0 = usable_gpu_bytes(g0)
    caps = {id(t.node): t.cpu_cap for t in targets}
    c0 = sum(caps.values()) / len(caps)
    dem = [0.0, 0.0, 0.0, 0.0]
    for j in pool:
        d = j.est_duration_s or 1.0
        dem[0] += d * member_fence_bytes(j, g0, request.limits) / u0
        dem[1] += d * j.cpus / c0
        dem[2] += d * util_fraction(j.sm_util_pct)
        dem[3] += d * util_fraction(j.membw_util_pct)
    top = max(dem) or 1.0
    return [x / top for x in dem]


def _weight(job: JobDemand, t: _Target, price: list[float], request: PackingRequest, live: bool) -> float:
    mem = (live_gpu_bytes(job, t.gpu, request.limits) if live else member_fence_bytes(job, t.gpu, request.limits))
    return (price[0] * mem / usable_gpu_bytes(t.gpu) + price[1] * job.cpus / t.cpu_cap
            + price[2] * util_fraction(job.sm_util_pct) + price[3] * util_fraction(job.membw_util_pct))


def gpu_value(t: _Target, members: list[JobDemand], price: list[float], request: PackingRequest,
              params: InterferenceParams) -> float:
    """Priced predicted work of a GPU holding `t.live` + `members` (the true model)."""
    allm = t.live + members
    if not allm:
        return 0.0
    speeds = ([1.0] if len(allm) == 1 else predict_speeds_from_fractions(
        [util_fraction(j.sm_util_pct) for j in allm], [util_fraction(j.membw_util_pct) for j in allm], params))
    return sum(_weight(j, t, price, request, k < len(t.live)) * s for k, (j, s) in enumerate(zip(allm, speeds, strict=True)))


def _stretch_cap(t: _Target, cands: list[JobDemand], limits: PackingLimits) -> int:
    """An integer >= the stretch D of any set this GPU can hold: D <= sum_i u_r,i / g_i
    over its members for the binding resource r (each term of the capacity sum is at
    most u / (g D)), over the live members and the most candidates that fit its free
    memory and slots. 1 when no such set saturates: the grid is then the single level."""
    usable = usable_gpu_bytes(t.gpu) - t.used_bytes
    n, room = 0, usable
    for f in sorted(member_fence_bytes(j, t.gpu, limits) for j in cands):
        if f > room or n >= t.slots:
            break
        room -= f
        n += 1
    top = 1.0
    for r in (0, 1):
        def ratio(j: JobDemand, r: int = r) -> float:
            s, b = util_fraction(j.sm_util_pct), util_fraction(j.membw_util_pct)
            return (s if r == 0 else b) / max(s, b) if max(s, b) > 0 else 0.0

        def use(j: JobDemand, r: int = r) -> float:
            return util_fraction(j.sm_util_pct if r == 0 else j.membw_util_pct)

        if sum(use(j) for j in t.live) + sum(sorted((use(j) for j in cands), reverse=True)[:n]) <= 1.0:
            continue
        top = max(top, sum(ratio(j) for j in t.live) + sum(sorted((ratio(j) for j in cands), reverse=True)[:n]))
    return max(1, min(math.ceil(top), len(t.live) + n))


def _need_s(job: JobDemand, speed: float, joiner: bool) -> float | None:
    if joiner and job.time_limit_s is not None:
        return job.time_limit_s
    if job.est_duration_s is not None:
        return job.est_duration_s / max(speed, 1e-6)
    return None


def _heuristic_assignment(h: PackingPlan, targets: list[_Target], jobs: dict[int, JobDemand]) -> dict[int, int]:
    """job id -> target index of the heuristic's plan (its new packs onto its node's free GPUs in order)."""
    by_key = {t.key: k for k, t in enumerate(targets)}
    out: dict[int, int] = {}
    for jn in h.joins:
        if jn.gpu_key in by_key and jn.member.job_id in jobs:
            out[jn.member.job_id] = by_key[jn.gpu_key]
    next_free: dict[str, int] = {}
    for pk in h.packs:
        base = next_free.get(pk.node_name, 0)
        for m in pk.members:
            if m.job_id in jobs:
                out[m.job_id] = by_key.get(f"{pk.node_name}#{base + m.gpu_index}", -1)
        next_free[pk.node_name] = base + pk.gpu_count
    return {j: k for j, k in out.items() if k >= 0}


def solve_round(request: PackingRequest, heuristic: PackingPlan, params: InterferenceParams,
                budget_s: float = DEFAULT_BUDGET_S, max_pairs: int = DEFAULT_MAX_PAIRS,
                prove: bool = False, window: int | None = None) -> RoundSolution:
    """The round's exact plan next to the heuristic's (see the module docstring).
    `prove`: also solve the upper model for a proven bound (the benchmark's ceiling).
    `window`: besides the jobs the heuristic placed, only the first `window` of the
    others in its refill order (priority band, drain tail, shortest first) are
    candidates (None: every pending job; the round's true optimum)."""
    t0 = time.perf_counter()
    limits = request.limits

    def fallback(why: str, value: float = 0.0, pairs: int = 0) -> RoundSolution:
        plan = PackingPlan("exact", heuristic.packs, heuristic.deferred, heuristic.joins)
        return RoundSolution(f"fallback: {why}", value, value, value, time.perf_counter() - t0, pairs, plan)

    if not grid_ok(params):
        return fallback("speed model with contention terms or learned (the grid is exact only for saturation)")
    if any(j.is_gang for j in request.jobs):
        return fallback("a pending multi-GPU job (gangs stay the heuristic's)")
    deferred = {d.job_id: d for d in heuristic.deferred}
    placed_ids = set(heuristic.placed_job_ids)
    pool = [j for j in request.jobs if j.job_id in placed_ids
            or (j.job_id in deferred and not deferred[j.job_id].permanent
                and deferred[j.job_id].reason.startswith(("no room", "no free GPU")))]
    if window is not None:
        tail = drain_tail(request, REFILL_TAIL_FACTOR)
        rest = sorted((j for j in pool if j.job_id not in placed_ids), key=lambda j: tail_first(j, tail, join_key(j)))
        keep = placed_ids | {j.job_id for j in rest[:window]}
        pool = [j for j in pool if j.job_id in keep]
    pool.sort(key=lambda j: j.job_id)
    targets = _targets(request)
    if not pool or not targets:
        return fallback("nothing to place")
    if len(pool) * len(targets) > 100 * max_pairs:  # (10k jobs on 1k GPUs: not even counted)
        return fallback(f"{len(pool)} jobs x {len(targets)} GPUs past {100 * max_pairs} candidate pairs")
    jobs = {j.job_id: j for j in pool}
    price = _prices(pool, targets, request)
    h_assign = _heuristic_assignment(heuristic, targets, jobs)

    def plan_value(assign: dict[int, int]) -> float:
        per: dict[int, list[JobDemand]] = {}
        for jid, k in assign.items():
            per.setdefault(k, []).append(jobs[jid])
        return sum(gpu_value(targets[k], ms, price, request, params) - gpu_value(targets[k], [], price, request, params)
                   for k, ms in per.items())

    h_value = plan_value(h_assign)
    # Candidate pairs: the job fits the target alone (memory, slots, node room, time).
    pairs: dict[tuple[int, int], None] = {}
    fences: dict[tuple[int, str], int] = {}
    for k, t in enumerate(targets):
        if t.slots <= 0:
            continue
        usable = usable_gpu_bytes(t.gpu)
        for i, j in enumerate(pool):
            f = fences.setdefault((j.job_id, t.gpu.name), member_fence_bytes(j, t.gpu, limits))
            if (t.used_bytes + f > usable or j.cpus > t.node.free_cpus
                    or host_limit_bytes(j, limits) > t.node.free_mem_bytes):
                continue
            if t.remaining_s is not None:
                need = _need_s(j, 1.0, True)
                if need is None or need > t.remaining_s + _EPS:
                    continue
            pairs[(i, k)] = None
        if len(pairs) > max_pairs:
            break
    if len(pairs) > max_pairs:
        return fallback(f"more than {max_pairs} job-GPU pairs", h_value, len(pairs))
    if not pairs:
        return fallback("no job fits any GPU", h_value)
    paired = {i for i, _k in pairs}
    if any(pool[i].priority >= OVERDUE_PRIORITY / 2 and j.job_id in h_assign and i not in paired
           for i, j in enumerate(pool)):
        return fallback("an overdue job the heuristic placed fits no GPU on its own", h_value, len(pairs))
    best = _solve(request, targets, pool, list(pairs), price, h_assign, budget_s, params, upper=False)
    value = plan_value(best[0]) if best is not None else -math.inf
    if best is not None and best[1] == "optimal":
        # Refine on the fine grid (module docstring): the coarse optimum scored 0.90 of the
        # true one on a round (tests/test_packing_exact.py). Only where the search closed:
        # elsewhere its own gap dominates, and the fine model (3x the level variables)
        # found less in the same budget (a 20-job round: 10.46 against 10.59).
        fine = _solve(request, targets, pool, list(pairs), price, h_assign, budget_s, params, upper=False,
                      fine=True, seed=best[0])
        fine_value = plan_value(fine[0]) if fine is not None else -math.inf
        if fine is not None and fine_value > value + 1e-9:
            best, value = fine, fine_value
    bound = value
    status = best[1] if best is not None else "fallback: no solution within the budget"
    if prove:
        up = _solve_upper(request, targets, pool, list(pairs), price, budget_s, params)
        bound = up if up is not None else math.inf
    if best is None or value <= h_value + 1e-6:
        # The heuristic's plan scores as high (or the solver found nothing better): keep it.
        plan = PackingPlan("exact", heuristic.packs, heuristic.deferred, heuristic.joins)
        return RoundSolution(status, max(value, h_value), h_value, max(bound, h_value), time.perf_counter() - t0,
                             len(pairs), plan)
    plan = _build_plan(request, targets, jobs, best[0], heuristic, params)
    return RoundSolution(status, value, h_value, max(bound, value), time.perf_counter() - t0, len(pairs), plan)


def _assignment_model(request: PackingRequest, targets: list[_Target], pool: list[JobDemand],
                      pairs: list[tuple[int, int]], hint: dict[int, int] | None,
                      seed: dict[int, int] | None = None) -> tuple[cp_model.CpModel, dict[tuple[int, int], cp_model.IntVar], dict[int, list[int]]]:
    """What both models share: x_i,k (job i on target k) for `pairs`, each job at most
    once, each node's CPUs and host memory, new GPUs within the budget; (model, x, target
    -> its jobs). With the heuristic's `hint` (the grid model): its assignment hinted and
    an overdue job it placed kept placed; without (the bound's relaxation) neither.
    `seed`: the assignment hinted instead of the heuristic's (the refining pass)."""
    from ortools.sat.python import cp_model

    limits = request.limits
    m = cp_model.CpModel()
    ws = cp_model.LinearExpr.weighted_sum
    x = {p: m.new_bool_var(f"x{p[0]}_{p[1]}") for p in pairs}
    by_job: dict[int, list[tuple[int, int]]] = {}
    by_target: dict[int, list[int]] = {}
    for i, k in pairs:
        by_job.setdefault(i, []).append((i, k))
        by_target.setdefault(k, []).append(i)
    for i, ps in by_job.items():
        if hint is not None and pool[i].priority >= OVERDUE_PRIORITY / 2 and hint.get(pool[i].job_id) is not None:
            m.add(sum(x[p] for p in ps) == 1)  # overdue/urgent and placed by the heuristic: stays placed
        else:
            m.add_at_most_one(x[p] for p in ps)
    nodes: dict[int, list[int]] = {}
    for k in by_target:
        nodes.setdefault(id(targets[k].node), []).append(k)
    for ks in nodes.values():
        node = targets[ks[0]].node
        vs = [x[(i, k)] for k in ks for i in by_target[k]]
        m.add(ws(vs, [pool[i].cpus for k in ks for i in by_target[k]]) <= node.free_cpus)
        m.add(ws(vs, [host_limit_bytes(pool[i], limits) for k in ks for i in by_target[k]]) <= node.free_mem_bytes)
    fresh = [k for k in by_target if targets[k].fresh]
    if fresh:
        used = {k: m.new_bool_var(f"open{k}") for k in fresh}
        for k in fresh:
            for i in by_target[k]:
                m.add_implication(x[(i, k)], used[k])
            if hint is not None:
                start = hint if seed is None else seed
                m.add_hint(used[k], any(start.get(pool[i].job_id) == k for i in by_target[k]))
        m.add(sum(used.values()) <= gpu_budget(request, expand_nodes(request)))
    return m, x, by_target


def _solve(request: PackingRequest, targets: list[_Target], pool: list[JobDemand], pairs: list[tuple[int, int]],
           price: list[float], hint: dict[int, int], budget_s: float, params: InterferenceParams,
           upper: bool, fine: bool = False, seed: dict[int, int] | None = None,
           ) -> tuple[dict[int, int], str, float] | None:
    """CP-SAT on the grid model; (job id -> target, status, proven bound in priced work) or None.
    `fine`: the fine levels; `seed`: the assignment hinted (default the heuristic's `hint`).

    Per GPU k one level z_k,l; y_i,k,l: job i on k at level l (sum over l is x_i,k, each
    <= z_k,l), so the capacity sum_i c_i,l y_i,k,l <= (1 - live's) z_k,l and the value
    are linear, and the LP relaxation stays tight (no big-M)."""
    from ortools.sat.python import cp_model

    limits = request.limits
    m, x, by_target = _assignment_model(request, targets, pool, pairs, hint, seed)
    start = hint if seed is None else seed
    ws = cp_model.LinearExpr.weighted_sum
    # Per job: (SM, bandwidth, g = the larger) fractions, computed once (the hot loop).
    prof = [(util_fraction(j.sm_util_pct), util_fraction(j.membw_util_pct),
             max(util_fraction(j.sm_util_pct), util_fraction(j.membw_util_pct))) for j in pool]
    obj_vars: list[cp_model.IntVar] = []
    obj_coefs: list[int] = []
    rnd = math.ceil if upper else math.floor
    for k, idx in by_target.items():
        t = targets[k]
        usable = usable_gpu_bytes(t.gpu)
        xs = [x[(i, k)] for i in idx]
        m.add(ws(xs, [member_fence_bytes(pool[i], t.gpu, limits) for i in idx]) <= usable - t.used_bytes)
        m.add(sum(xs) <= t.slots)
        grid = _levels(_stretch_cap(t, [pool[i] for i in idx], limits), fine)
        z = [m.new_bool_var(f"z{k}_{lv}") for lv in range(len(grid))]
        m.add_exactly_one(z)
        y = ([[x[(i, k)]] for i in idx] if len(grid) == 1
             else [[m.new_bool_var(f"y{i}_{k}_{lv}") for lv in range(len(grid))] for i in idx])
        if len(grid) > 1:
            for a, i in enumerate(idx):
                m.add(sum(y[a]) == x[(i, k)])
                for lv in range(len(grid)):
                    m.add_implication(y[a][lv], z[lv])
        # The heuristic's members here, and the levels they satisfy (the hint's level:
        # the first; a complete hint gives the search a solution at once).
        mine = [a for a, i in enumerate(idx) if start.get(pool[i].job_id) == k]
        hint_ok = [True] * len(grid)
        live_w = [_weight(j, t, price, request, True) for j in t.live]
        joiner_w = [_weight(pool[i], t, price, request, False) for i in idx]
        live_now = gpu_value(t, [], price, request, params) if t.live else 0.0  # before the round
        for lv, d in enumerate(grid):
            d_obj = grid[lv - 1] if upper and lv > 0 else d
            ylv = [y[a][lv] for a in range(len(idx))]
            sp = [1.0 / (1.0 - prof[i][2] + prof[i][2] * d) for i in idx]
            for r in (0, 1):
                live_use = sum(math.ceil(_C * (util_fraction(j.sm_util_pct if r == 0 else j.membw_util_pct))
                                         * _speed(j, d) - _EPS) for j in t.live)
                coefs = [math.ceil(_C * prof[i][r] * v - _EPS) for i, v in zip(idx, sp, strict=True)]
                if live_use > _C:
                    m.add(z[lv] == 0)
                    hint_ok[lv] = False
                else:
                    m.add(ws(ylv, coefs) <= (_C - live_use) * z[lv])
                    hint_ok[lv] = hint_ok[lv] and live_use + sum(coefs[a] for a in mine) <= _C
            # Time left: the live members' rest and the joiners' runs at this level's speeds.
            if t.remaining_s is not None:
                if any((_need_s(j, _speed(j, d), False) or 0.0) > t.remaining_s + _EPS for j in t.live):
                    m.add(z[lv] == 0)
                    hint_ok[lv] = False
                for a, i in enumerate(idx):
                    need = _need_s(pool[i], sp[a], True)
                    if need is None or need > t.remaining_s + _EPS:
                        m.add(y[a][lv] == 0)
                        hint_ok[lv] = hint_ok[lv] and a not in mine
            obj_vars.append(z[lv])
            obj_coefs.append(rnd(_W * (sum(w * _speed(j, d_obj) for w, j in zip(live_w, t.live, strict=True))
                                       - live_now)))
            obj_vars.extend(ylv)
            obj_coefs.extend(rnd(_W * w / (1.0 - prof[i][2] + prof[i][2] * d_obj)) for w, i in zip(joiner_w, idx, strict=True))
        level = next((lv for lv, ok in enumerate(hint_ok) if ok), None)
        if level is not None:
            for lv in range(len(grid)):
                m.add_hint(z[lv], lv == level)
                if len(grid) > 1:
                    for a in range(len(idx)):
                        m.add_hint(y[a][lv], lv == level and a in mine)
    m.maximize(ws(obj_vars, obj_coefs))
    for (i, k), b in x.items():
        m.add_hint(b, 1 if start.get(pool[i].job_id) == k else 0)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = budget_s
    solver.parameters.random_seed = 0
    # Presolve spent the whole budget on the level constraints of a 90-job round and
    # found nothing; without it the heuristic's hint seeds the search at once.
    solver.parameters.cp_model_presolve = False
    # A wall-clock net far past the deterministic budget (a loaded machine); only it
    # could make two identical requests differ.
    solver.parameters.max_time_in_seconds = max(2.0, 10.0 * budget_s)
    st = solver.solve(m)
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    assign = {pool[i].job_id: k for (i, k), b in x.items() if solver.boolean_value(b)}
    return assign, "optimal" if st == cp_model.OPTIMAL else "feasible", solver.best_objective_bound / _W


def _solve_upper(request: PackingRequest, targets: list[_Target], pool: list[JobDemand],
                 pairs: list[tuple[int, int]], price: list[float], budget_s: float,
                 params: InterferenceParams) -> float | None:
    """A proven upper bound on the round's optimum, without the grid: for any set of
    members and any multipliers ls, lb >= 0 the GPU's value sum_i w_i s_i is at most
    ls + lb + sum_i max(0, w_i - ls u_sm,i - lb u_bw,i) (speeds are in (0, 1] and the
    capacity sum_i u_r,i s_i <= 1 holds at the model's stretch), so each pair of
    `_LAMBDAS` gives a linear cut. The solver's best bound on that relaxation (the same
    assignment constraints) bounds the true optimum."""
    from ortools.sat.python import cp_model

    limits = request.limits
    m, x, by_target = _assignment_model(request, targets, pool, pairs, None)
    ws = cp_model.LinearExpr.weighted_sum
    total = []
    for k, idx in by_target.items():
        t = targets[k]
        xs = [x[(i, k)] for i in idx]
        m.add(ws(xs, [member_fence_bytes(pool[i], t.gpu, limits) for i in idx]) <= usable_gpu_bytes(t.gpu) - t.used_bytes)
        m.add(sum(xs) <= t.slots)
        live_now = gpu_value(t, [], price, request, params) if t.live else 0.0
        v = m.new_int_var(-_W * 8 * (len(t.live) + 1), _W * 8 * (len(t.live) + len(idx) + 1), f"v{k}")
        for ls in _LAMBDAS:
            for lb in _LAMBDAS:
                def cut(j: JobDemand, live: bool, t: _Target = t, ls: float = ls, lb: float = lb) -> float:
                    w = _weight(j, t, price, request, live)
                    return max(0.0, w - ls * util_fraction(j.sm_util_pct) - lb * util_fraction(j.membw_util_pct))
                const = ls + lb + sum(cut(j, True) for j in t.live) - live_now
                m.add(v <= math.ceil(_W * const) + ws(xs, [math.ceil(_W * cut(pool[i], False)) for i in idx]))
        total.append(v)
    m.maximize(sum(total))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = budget_s
    solver.parameters.max_time_in_seconds = max(2.0, 10.0 * budget_s)
    st = solver.solve(m)
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return float(solver.best_objective_bound) / _W


def _build_plan(request: PackingRequest, targets: list[_Target], jobs: dict[int, JobDemand], assign: dict[int, int],
                heuristic: PackingPlan, params: InterferenceParams) -> PackingPlan:
    limits = request.limits
    per: dict[int, list[JobDemand]] = {}
    for jid in sorted(assign):
        per.setdefault(assign[jid], []).append(jobs[jid])
    joins: list[Join] = []
    fresh_by_node: dict[str, list[Gpu]] = {}
    nodes: dict[str, Node] = {}
    for k, t in enumerate(targets):
        ms = per.get(k, [])
        if not ms:
            continue
        if t.fresh:
            node = nodes.setdefault(t.node.name, t.node)
            g = Gpu(node=node, usable_bytes=usable_gpu_bytes(t.gpu), slots=limits.members_per_gpu)
            for j in ms:
                f = member_fence_bytes(j, t.gpu, limits)
                g.members.append(j)
                g.fences.append(f)
                g.used_bytes += f
                node.free_cpus -= j.cpus
                node.free_mem_bytes -= host_limit_bytes(j, limits)
            fresh_by_node.setdefault(t.node.name, []).append(g)
            continue
        allm = t.live + ms
        speeds = [1.0] if len(allm) == 1 else predict_speeds_from_fractions(
            [util_fraction(j.sm_util_pct) for j in allm], [util_fraction(j.membw_util_pct) for j in allm], params)
        pcts = thread_pcts([util_fraction(j.sm_util_pct) for j in allm])
        parts = t.key.split(":")
        node_index, gpu_index = (int(parts[-2]), int(parts[-1])) if len(parts) >= 3 and all(
            p.isdigit() for p in parts[-2:]) else (0, 0)
        for j, speed, pct in list(zip(allm, speeds, pcts, strict=True))[len(t.live):]:
            joins.append(Join(t.key, MemberPlacement(
                job_id=j.job_id, node_index=node_index, gpu_index=gpu_index, mps_thread_pct=pct,
                gpu_mem_limit_mib=math.ceil(member_fence_bytes(j, t.gpu, limits) / MIB),
                host_mem_limit_bytes=host_limit_bytes(j, limits), cpus=j.cpus, predicted_speed=speed,
                rank=j.rank, world_size=j.world_size)))
    packs: list[list[Gpu]] = []
    for name in sorted(fresh_by_node):
        gpus = fresh_by_node[name]
        step = max(1, limits.max_gpus_per_pack)
        packs.extend(gpus[a:a + step] for a in range(0, len(gpus), step))
    assert "complementary" in REFILL_POLICIES
    built = finish_plan("complementary", packs, [], limits, params, fenced=True, thread_caps=True)
    placed = set(assign)
    deferred = [d for d in heuristic.deferred if d.job_id not in placed]
    deferred += [Deferred(jid, NO_ROOM) for jid in heuristic.placed_job_ids if jid not in placed]
    return PackingPlan("exact", built.packs, tuple(sorted(deferred, key=lambda d: d.job_id)), tuple(joins))
