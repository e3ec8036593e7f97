"""The named packing policies behind one entry point, `plan(request, policy)`.

Every policy sees the same `PackingRequest` and returns a `PackingPlan`, so the
baselines are measured by the same code as ours:

- `exclusive`: one job per GPU (Slurm today).
- `first-fit`: count-based slots like gres/shard: up to `shards_per_gpu` members per GPU
  in queue order, no memory awareness (no fence either: gres/shard fences nothing).
- `mem-best-fit`: memory only: each job onto the open GPU whose memory it fills best.
- `complementary` (ours): memory-safe fences, members chosen so that their bottlenecks
  differ (SM with bandwidth, GPU with host CPU), members balanced over the GPUs of a
  multi-GPU pack, packs sized from the queue and grouped by expected duration.
- `exact` (issue 50): complementary's round (refill and new packs), then the round's
  placement solved by CP-SAT on the same objective and constraints (`exact`); the
  heuristic's plan where the solver does not beat it in its time budget.

Each policy lives in its own module (`exclusive`, `first_fit`, `mem_best_fit`,
`complementary`), refill (joins onto running packs) in `refill`, and what they share
(node and GPU bookkeeping, fit checks, the plan's finish) in `common`.

Deterministic: the same request gives the same plan (ties break on job id).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from slurm_dlrm.errors import BadInput
from slurm_dlrm.packing.common import (
    EXACT_POLICY,
    POLICY_NAMES,
    REFILL_POLICIES,
)
from slurm_dlrm.packing.complementary import plan_complementary
from slurm_dlrm.packing.exclusive import plan_exclusive
from slurm_dlrm.packing.fairness import apply_fairness, backfill_jobs
from slurm_dlrm.packing.first_fit import plan_first_fit
from slurm_dlrm.packing.interference import (
    DEFAULT_PARAMS,
    InterferenceParams,
)
from slurm_dlrm.packing.mem_best_fit import plan_mem_best_fit
from slurm_dlrm.packing.model import (
    Deferred,
    PackingPlan,
    PackingRequest,
)
from slurm_dlrm.packing.refill import refill_joins

_POLICIES: dict[str, Callable[[PackingRequest, InterferenceParams], PackingPlan]] = {
    "exclusive": plan_exclusive,
    "first-fit": plan_first_fit,
    "mem-best-fit": plan_mem_best_fit,
    "complementary": plan_complementary,
}


def plan(request: PackingRequest, policy: str = "complementary", params: InterferenceParams | None = None) -> PackingPlan:
    """Decide which pending jobs share which GPUs this round (pure, deterministic)."""
    fn = _POLICIES.get(policy) if policy != EXACT_POLICY else plan_complementary
    if fn is None:
        raise BadInput(f"policy: unknown policy {policy!r} (one of {', '.join(POLICY_NAMES + (EXACT_POLICY,))})")
    ids = [j.job_id for j in request.jobs]
    if len(set(ids)) != len(ids):
        raise BadInput("jobs: job ids must be unique")
    params = params or DEFAULT_PARAMS
    if request.fair is not None and request.now_s is not None:
        return _plan_fair(request, fn, policy, params)
    return _plan(request, fn, policy, params)


def _plan_fair(request: PackingRequest, fn: Callable[[PackingRequest, InterferenceParams], PackingPlan],
               policy: str, params: InterferenceParams) -> PackingPlan:
    """The slowdown bound (slurm_dlrm.packing.fairness): overdue jobs first, and a
    reservation for the most overdue multi-GPU job nothing can take now; the held
    node's free GPUs then take only jobs that end before it (backfill)."""
    main, hold, backfill = apply_fairness(request)
    result = _plan(main, fn, policy, params)
    if hold is None:
        return result
    packs, joins = result.packs, result.joins
    deferred = {d.job_id: d for d in result.deferred}
    assert main.fair is not None
    if backfill is not None:
        short = backfill_jobs(tuple(j for j in main.jobs if j.job_id in deferred and not deferred[j.job_id].permanent),
                              hold, main.fair)
        if short:
            extra = _plan(replace(backfill, jobs=short), fn, policy, params)
            packs += extra.packs
            for jid in extra.placed_job_ids:
                deferred.pop(jid, None)
    if hold.job_id in deferred:
        deferred[hold.job_id] = Deferred(hold.job_id, hold.reason)
    return PackingPlan(result.policy, packs, tuple(sorted(deferred.values(), key=lambda d: d.job_id)), joins)


def _plan(request: PackingRequest, fn: Callable[[PackingRequest, InterferenceParams], PackingPlan],
          policy: str, params: InterferenceParams) -> PackingPlan:
    if policy == EXACT_POLICY:
        from slurm_dlrm.packing.exact import solve_round  # lazy: ortools loads in ~0.7 s

        heuristic = _plan(request, plan_complementary, "complementary", params)
        limits = request.limits
        return solve_round(request, heuristic, params, limits.exact_budget_s, limits.exact_max_pairs,
                           window=limits.exact_window).plan
    if policy not in REFILL_POLICIES or not any(o.pack for o in request.open_gpus):
        return fn(request, params)
    # Refill first (docs/packing.md "Refilling running packs"); the rest of the queue goes
    # to the policy as usual, which sees no pack GPU. `exclusive` never joins.
    joins, rest = refill_joins(request, policy, params)
    rest_request = replace(request, jobs=tuple(rest), open_gpus=tuple(o for o in request.open_gpus if not o.pack))
    result = fn(rest_request, params)
    return PackingPlan(result.policy, result.packs, result.deferred, tuple(joins) + result.joins)
