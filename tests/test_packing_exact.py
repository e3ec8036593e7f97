"""The `exact` policy (issue 50): CP-SAT on complementary's round, feasible plans, an
objective never below the heuristic's, the true optimum on small rounds (exhaustive
search), a proven upper bound, and the fallbacks (size, budget, gangs, models)."""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from slurm_dlrm.errors import BadInput
from slurm_dlrm.packing import JobDemand, NodeShape, PackingLimits, PackingRequest, plan
from slurm_dlrm.packing.exact import _FINE_RATIO, _prices, _targets, gpu_value, solve_round
from slurm_dlrm.packing.interference import DEFAULT_PARAMS, InterferenceParams
from slurm_dlrm.packing.model import (
    OpenGpu,
    RankDemand,
    host_limit_bytes,
    live_gpu_bytes,
    member_fence_bytes,
    usable_gpu_bytes,
)
from slurm_dlrm.site import GIB, MIB, GpuModel

H100 = GpuModel("h100", 80, 132, 3350, 67, 494, 520, 32)
NO_SHRINK = [Phase.explicit, Phase.reuse, Phase.generate]


def _job(i: int, mem_gib: float, sm: float, bw: float, cpus: float = 2.0, host_gib: float = 8.0,
         dur: float | None = 3600.0, priority: float = 0.0) -> JobDemand:
    return JobDemand(job_id=i, user="u", submit_time_s=float(i), priority=priority,
                     gpu_mem_bytes=int(mem_gib * GIB), host_mem_bytes=int(host_gib * GIB), sm_util_pct=sm,
                     membw_util_pct=bw, host_cpu_cores=cpus, est_duration_s=dur)


@st.composite
def job_st(draw: st.DrawFn, i: int) -> JobDemand:
    return _job(i, draw(st.floats(0.5, 60)), draw(st.floats(1, 80)), draw(st.floats(1, 80)),
                draw(st.floats(1, 8)), draw(st.floats(1, 48)), draw(st.one_of(st.none(), st.floats(300, 20000))),
                draw(st.sampled_from([0.0, 0.0, 1.0])))


@st.composite
def round_st(draw: st.DrawFn, max_jobs: int = 14) -> PackingRequest:
    """A round as the simulator and the service send it: running pack GPUs with live
    members (some with a time limit), free GPUs on nodes, pending single-GPU jobs."""
    n = draw(st.integers(1, max_jobs))
    jobs = [draw(job_st(i)) for i in range(n)]
    next_id = 1000
    open_gpus = []
    for p in range(draw(st.integers(0, 2))):
        gpus = draw(st.integers(1, 2))
        remaining = draw(st.one_of(st.none(), st.floats(600, 40000)))
        cpus, host = draw(st.integers(0, 24)), draw(st.integers(0, 120)) * GIB
        for g in range(gpus):
            live = []
            for _ in range(draw(st.integers(0, 3))):
                live.append(draw(job_st(next_id)))
                next_id += 1
            open_gpus.append(OpenGpu(f"{p}:0:{g}", f"pn{p}", len(live), pack=True, gpu_model="h100",
                                     live=tuple(live), free_cpus=cpus, free_host_mem_bytes=host,
                                     remaining_s=remaining))
    nodes = tuple(NodeShape("h100", draw(st.integers(0, 3)), draw(st.integers(2, 64)),
                            draw(st.integers(8, 400)) * GIB, name=f"n{k}") for k in range(draw(st.integers(0, 2))))
    limits = PackingLimits(max_members_per_gpu=draw(st.integers(1, 8)), memory_margin_pct=draw(st.floats(0, 20)),
                           max_gpus_per_pack=draw(st.integers(1, 4)), refill_headroom_pct=draw(
                               st.sampled_from([None, 100.0])))
    return PackingRequest(jobs=tuple(jobs), gpu_models=(H100,), nodes=nodes, limits=limits,
                          open_gpus=tuple(open_gpus))


def check_feasible(req: PackingRequest, result_plan: object) -> None:
    """Every constraint complementary honours, on the plan `exact` returns."""
    p = result_plan
    limits = req.limits
    pending = {j.job_id: j for j in req.jobs}
    placed = [m.job_id for pk in p.packs for m in pk.members] + [jn.member.job_id for jn in p.joins]  # type: ignore[attr-defined]
    assert len(placed) == len(set(placed)), "a job placed twice"
    assert set(placed) <= set(pending)
    assert set(placed).isdisjoint(d.job_id for d in p.deferred)  # type: ignore[attr-defined]
    assert set(placed) | {d.job_id for d in p.deferred} == set(pending)  # type: ignore[attr-defined]
    usable = usable_gpu_bytes(H100)
    # Joins: live members (measured peak or fence) + joiners' fences fit; slots; the allocation's CPUs/memory.
    og_by_key = {o.key: o for o in req.open_gpus}
    by_gpu: dict[str, list[JobDemand]] = defaultdict(list)
    for jn in p.joins:  # type: ignore[attr-defined]
        by_gpu[jn.gpu_key].append(pending[jn.member.job_id])
        assert jn.member.gpu_mem_limit_mib == -(-member_fence_bytes(pending[jn.member.job_id], H100, limits) // MIB)
        assert 10 <= jn.member.mps_thread_pct <= 100
    group_cpu: dict[str, int] = defaultdict(int)
    group_host: dict[str, int] = defaultdict(int)
    for key, joiners in by_gpu.items():
        og = og_by_key[key]
        used = sum(live_gpu_bytes(j, H100, limits) for j in og.live)
        assert used + sum(member_fence_bytes(j, H100, limits) for j in joiners) <= usable
        assert len(og.live) + len(joiners) <= limits.members_per_gpu
        group = key.rsplit(":", 1)[0]
        group_cpu[group] += sum(j.cpus for j in joiners)
        group_host[group] += sum(host_limit_bytes(j, limits) for j in joiners)
        assert og.free_cpus is not None and og.free_host_mem_bytes is not None
        if og.remaining_s is not None:
            for j in joiners:
                assert j.time_limit_s is not None or j.est_duration_s is not None
    for key, og in og_by_key.items():
        group = key.rsplit(":", 1)[0]
        assert group_cpu[group] <= (og.free_cpus or 0) and group_host[group] <= (og.free_host_mem_bytes or 0)
    # New packs: fences per GPU, slots, one node each, the node's CPUs and host memory.
    node_of = {n.name: n for n in req.nodes}
    node_cpu: dict[str, int] = defaultdict(int)
    node_host: dict[str, int] = defaultdict(int)
    node_gpus: dict[str, int] = defaultdict(int)
    for pk in p.packs:  # type: ignore[attr-defined]
        assert pk.node_count == 1 and pk.gpu_count <= max(1, limits.max_gpus_per_pack)
        per: dict[int, list[int]] = defaultdict(list)
        for m in pk.members:
            per[m.gpu_index].append(m.job_id)
            assert m.gpu_mem_limit_mib == -(-member_fence_bytes(pending[m.job_id], H100, limits) // MIB)
        for ids in per.values():
            assert sum(member_fence_bytes(pending[i], H100, limits) for i in ids) <= usable
            assert len(ids) <= limits.members_per_gpu
        node_cpu[pk.node_name] += pk.alloc_cpus
        node_host[pk.node_name] += pk.alloc_host_mem_bytes
        node_gpus[pk.node_name] += pk.gpu_count
    for name in node_gpus:
        n = node_of[name]
        assert node_gpus[name] <= n.gpus and node_cpu[name] <= n.cpus and node_host[name] <= n.memory_bytes


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], phases=NO_SHRINK)
@given(round_st(), st.sampled_from([None, 2]))
def test_exact_plans_are_feasible_and_never_below_the_heuristic(req: PackingRequest, window: int | None) -> None:
    """The whole queue (window None: the round's optimum) or the policy's window."""
    req = replace(req, limits=replace(req.limits, exact_window=window or 8))
    heuristic = plan(req, "complementary")
    sol = solve_round(req, heuristic, DEFAULT_PARAMS, window=window)
    check_feasible(req, sol.plan)
    assert sol.plan.policy == "exact"
    assert sol.value >= sol.heuristic_value - 1e-9
    if window is not None and sol.status == "optimal":
        # Through the policy interface: the same plan (single-threaded, deterministic
        # budget; only the wall-clock net on a loaded machine could cut a search short).
        assert plan(req, "exact") == sol.plan


def _brute_force(req: PackingRequest) -> float:
    """The round's optimum of the same objective by trying every assignment."""
    heuristic = plan(req, "complementary")
    pool = sorted(req.jobs, key=lambda j: j.job_id)
    targets = _targets(req)
    price = _prices(pool, targets, req)
    limits = req.limits
    best = 0.0
    for assign in itertools.product(range(-1, len(targets)), repeat=len(pool)):
        per: dict[int, list[JobDemand]] = defaultdict(list)
        for j, k in zip(pool, assign, strict=True):
            if k >= 0:
                per[k].append(j)
        ok = True
        node_use: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        fresh_used = 0
        for k, ms in per.items():
            t = targets[k]
            fresh_used += t.fresh
            if (t.used_bytes + sum(member_fence_bytes(j, H100, limits) for j in ms) > usable_gpu_bytes(H100)
                    or len(ms) > t.slots):
                ok = False
                break
            node_use[id(t.node)][0] += sum(j.cpus for j in ms)
            node_use[id(t.node)][1] += sum(host_limit_bytes(j, limits) for j in ms)
            if node_use[id(t.node)][0] > t.node.free_cpus or node_use[id(t.node)][1] > t.node.free_mem_bytes:
                ok = False
                break
        if not ok:
            continue
        best = max(best, sum(gpu_value(targets[k], ms, price, req, DEFAULT_PARAMS)
                             - gpu_value(targets[k], [], price, req, DEFAULT_PARAMS) for k, ms in per.items()))
    del heuristic
    return best


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], phases=NO_SHRINK)
@given(st.data())
def test_exact_reaches_the_exhaustive_optimum_and_bounds_it(data: st.DataObject) -> None:
    """On rounds small enough to enumerate (<= 5 jobs, <= 2 GPUs, no time limits): the
    solver's plan scores the optimum (within the fine stretch grid's bound where a GPU
    saturates: `_check_exhaustive`) and its proven bound is not below it."""
    n = data.draw(st.integers(1, 5))
    jobs = tuple(data.draw(job_st(i)) for i in range(n))
    live = tuple(data.draw(job_st(100 + i)) for i in range(data.draw(st.integers(0, 2))))
    open_gpus = ((OpenGpu("0:0:0", "p0", len(live), pack=True, gpu_model="h100", live=live, free_cpus=16,
                          free_host_mem_bytes=100 * GIB),) if data.draw(st.booleans()) else ())
    nodes = (NodeShape("h100", data.draw(st.integers(0 if open_gpus else 1, 1)), 16, 100 * GIB, name="n0"),)
    req = PackingRequest(jobs=jobs, gpu_models=(H100,), nodes=nodes,
                         limits=PackingLimits(max_members_per_gpu=data.draw(st.integers(1, 6)),
                                              refill_headroom_pct=None), open_gpus=open_gpus)
    _check_exhaustive(req)


def _check_exhaustive(req: PackingRequest) -> float:
    """The grid's guarantee: each GPU's whole value (live members too) at the fine level
    just above its stretch is within _FINE_RATIO of the true one, so the plan's gain is
    at most (1 - 1/r) x (the optimum's gain + the live members' value) below the optimum
    (without live members: within 5%; with them the gain can be small beside their value)."""
    opt = _brute_force(req)
    sol = solve_round(req, plan(req, "complementary"), DEFAULT_PARAMS, budget_s=2.0, prove=True)
    targets = _targets(req)
    price = _prices(sorted(req.jobs, key=lambda j: j.job_id), targets, req)
    live_now = sum(gpu_value(t, [], price, req, DEFAULT_PARAMS) for t in targets)
    assert sol.value <= opt + 1e-6
    assert sol.value >= opt - (1 - 1 / _FINE_RATIO) * (opt + live_now) - 1e-6
    if not live_now:
        assert sol.value >= 0.95 * opt - 1e-6
    assert sol.bound >= opt - 1e-6
    return sol.value / opt if opt > 0 else 1.0


def test_exact_refines_the_grid_where_a_saturated_gpu_hides_the_optimum() -> None:
    """A round Hypothesis found (pinned: CI derandomizes): one pack GPU with a live
    member, four pending jobs. {2, 3} is the optimum (1.789 priced work); on the coarse
    grid its stretch (about 1.55) is valued at 1.75 and {0, 3} (stretch under 1.5, 1.617)
    looked better: the coarse solve chose 0.904 of the optimum. The fine pass takes {2, 3}."""
    def job(i: int, mem: int, host: int, sm: float, bw: float, cores: float, dur: float | None) -> JobDemand:
        return JobDemand(job_id=i, user="u", submit_time_s=float(i), priority=0.0, gpu_mem_bytes=mem,
                         host_mem_bytes=host, sm_util_pct=sm, membw_util_pct=bw, host_cpu_cores=cores,
                         est_duration_s=dur)

    small = (15_464_280_177, 50_465_865_728, 22.05085066496764, 62.47793442874767, 3.657557879371158,
             13366.827048507375)
    jobs = (job(0, 57_369_631_948, 39_465_497_126, 2.00001, 13.086917444670322, 6.568968579307523, 2779.527104378551),
            job(1, *small),
            job(2, 61_093_706_780, 46_323_625_347, 66.66106647274034, 21.993177818576715, 6.528659827731918,
                13366.827048507375),
            job(3, *small))
    live = (job(100, 536_870_912, 24_175_447_255, 40.48717198282564, 47.0, 2.00001, None),)
    og = OpenGpu("0:0:0", "p0", 1, pack=True, gpu_model="h100", live=live, free_cpus=16,
                 free_host_mem_bytes=100 * GIB)
    req = PackingRequest(jobs=jobs, gpu_models=(H100,), nodes=(NodeShape("h100", 0, 16, 100 * GIB, name="n0"),),
                         limits=PackingLimits(max_members_per_gpu=4, refill_headroom_pct=None), open_gpus=(og,))
    assert _check_exhaustive(req) > 0.999
    sol = solve_round(req, plan(req, "complementary"), DEFAULT_PARAMS, budget_s=2.0)
    assert sorted(jn.member.job_id for jn in sol.plan.joins) in ([1, 2], [2, 3])
    check_feasible(req, sol.plan)


def _big_round(n: int, gpus: int) -> PackingRequest:
    jobs = tuple(_job(i, 1 + (i * 7) % 40, 5 + (i * 13) % 35, 3 + (i * 11) % 40, 2 + i % 5, 4 + i % 20,
                      1800 + 300 * (i % 9)) for i in range(n))
    return PackingRequest(jobs=jobs, gpu_models=(H100,), nodes=(NodeShape("h100", 4, 104, 800 * GIB, count=max(
        1, gpus // 4), name="n"),), limits=PackingLimits(refill_headroom_pct=None))


def test_fallback_past_the_size_and_the_budget() -> None:
    req = _big_round(40, 4)
    heuristic = plan(req, "complementary")
    # Past the size: the heuristic's plan, unchanged, labelled exact.
    small = solve_round(req, heuristic, DEFAULT_PARAMS, max_pairs=10)
    assert small.status.startswith("fallback: more than 10 job-GPU pairs")
    assert (small.plan.packs, small.plan.joins, small.plan.deferred) == (heuristic.packs, heuristic.joins,
                                                                         heuristic.deferred)
    # Through the site limit, via the policy interface.
    via = plan(replace(req, limits=replace(req.limits, exact_max_pairs=10)), "exact")
    assert (via.packs, via.deferred) == (heuristic.packs, heuristic.deferred) and via.policy == "exact"
    # A budget too small to prove anything: still feasible, never below the heuristic.
    tiny = solve_round(req, heuristic, DEFAULT_PARAMS, budget_s=0.001)
    check_feasible(req, tiny.plan)
    assert tiny.value >= tiny.heuristic_value - 1e-9
    # 10k jobs on 1k GPUs: not even enumerated.
    huge = _big_round(10000, 1000)
    assert solve_round(huge, PackingPlanStub.empty(), DEFAULT_PARAMS).status.startswith("fallback: ")


class PackingPlanStub:
    @staticmethod
    def empty() -> object:
        from slurm_dlrm.packing.model import Deferred, PackingPlan
        return PackingPlan("complementary", (), tuple(Deferred(i, "no room left this round") for i in range(10000)))


def test_fallback_for_gangs_and_models_the_grid_cannot_express() -> None:
    req = _big_round(6, 4)
    gang = replace(req.jobs[0], job_id=99, world_size=2, ranks=(RankDemand(GIB, GIB, 20, 20, 2),
                                                                 RankDemand(GIB, GIB, 20, 20, 2)))
    with_gang = replace(req, jobs=req.jobs + (gang,))
    h = plan(with_gang, "complementary")
    assert solve_round(with_gang, h, DEFAULT_PARAMS).status.startswith("fallback: a pending multi-GPU job")
    assert plan(with_gang, "exact").packs == h.packs
    contention = InterferenceParams(0.3, 0.6, 0.02)
    assert solve_round(req, plan(req, "complementary", contention), contention).status.startswith("fallback: speed model")


def test_exact_beats_the_greedy_refill_on_a_knapsack_round() -> None:
    """A pack GPU with 30 GiB free: the greedy refill takes the best single job first
    (the 20 GiB one, if its priced gain is highest); two 14 GiB jobs together are worth
    more. The exact plan takes them."""
    live = (_job(100, 45, 10, 10),)
    og = OpenGpu("0:0:0", "p0", 1, pack=True, gpu_model="h100", live=live, free_cpus=20,
                 free_host_mem_bytes=200 * GIB)
    jobs = (_job(1, 20, 15, 15, dur=600), _job(2, 13, 10, 10, dur=3600), _job(3, 13, 10, 10, dur=3600))
    req = PackingRequest(jobs=jobs, gpu_models=(H100,), nodes=(), open_gpus=(og,),
                         limits=PackingLimits(refill_headroom_pct=None))
    h = plan(req, "complementary")
    sol = solve_round(req, h, DEFAULT_PARAMS, budget_s=1.0, prove=True)
    assert sorted(jn.member.job_id for jn in sol.plan.joins) == [2, 3]
    assert sol.value > sol.heuristic_value or sorted(jn.member.job_id for jn in h.joins) == [2, 3]
    assert sol.status == "optimal" and sol.bound >= sol.value - 1e-9


def test_exact_is_a_policy_of_the_simulator() -> None:
    from slurm_dlrm.sim import parse_cluster, parse_workload, simulate

    with pytest.raises(BadInput, match="unknown policy 'exactly'"):
        plan(_big_round(2, 4), "exactly")
    cluster = parse_cluster({"name": "c", "gpu_models": {"h100": {"memory_gib": 80, "sm_count": 132,
                                                                   "mem_bandwidth_gbps": 3350, "fp32_tflops": 67,
                                                                   "tf32_tflops": 494, "cuda_context_mib": 520,
                                                                   "cublas_workspace_mib": 32}},
                             "nodes": [{"name": "g", "gpu_model": "h100", "gpus": 2, "cpus": 32, "memory_gib": 256}],
                             "packing": {"exact_budget_s": 0.05, "exact_max_pairs": 500}})
    assert cluster.limits.exact_budget_s == 0.05 and cluster.limits.exact_max_pairs == 500
    wl = parse_workload({"name": "w", "seed": 3, "generate": {
        "jobs": 12, "arrival_rate_per_h": 30, "duration": {"dist": "lognormal", "median_s": 900, "sigma": 0.5},
        "classes": [{"name": "a", "weight": 1, "profile": {"sm_util_pct": [5, 30], "membw_util_pct": [5, 30],
                                                           "gpu_mem_gib": [2, 30], "host_mem_gib": [2, 8],
                                                           "host_cpu_cores": [1, 4]}}]}},
                        {g.name: g for g in cluster.gpu_models})
    res = simulate(wl, cluster, "exact")
    assert res.completion_rate == 1.0 and res.ooms == 0


def test_site_takes_the_exact_policy_and_its_keys(tmp_path: Path) -> None:
    from service_harness import make_site

    from slurm_dlrm.errors import ConfigError
    from slurm_dlrm.packing.model import limits_from_site

    site = make_site(tmp_path, policy="exact", exact_budget_s=0.05, exact_max_pairs=300, exact_window=5)
    assert site.packing.policy == "exact"
    limits = limits_from_site(site)
    assert (limits.exact_budget_s, limits.exact_max_pairs, limits.exact_window) == (0.05, 300, 5)
    with pytest.raises(ConfigError, match="exact_budget_s"):
        make_site(tmp_path, exact_budget_s=0)
