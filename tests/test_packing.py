"""Packing policies, interference model and dispatch: unit tests (pure, fast)."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_dlrm.errors import BadInput
from slurm_dlrm.packing import (
    URGENT_PRIORITY,
    CoLocationSample,
    DispatchConfig,
    InterferenceParams,
    JobDemand,
    NodeShape,
    PackingLimits,
    PackingRequest,
    SoloProfile,
    after_round,
    aged,
    build_samples,
    demand_from_estimate,
    effective_priority,
    interference_model,
    member_fence_bytes,
    plan,
    predict_colocated_speeds,
    prediction_error,
    refit_interference,
    should_run_round,
)
from slurm_dlrm.packing.interference import predict_speeds_from_fractions
from slurm_dlrm.packing.model import OpenGpu
from slurm_dlrm.service.refill import pack_allocation
from slurm_dlrm.site import GIB, MIB, GpuModel

H100 = GpuModel("h100", 80, 132, 3350, 67, 494, 520, 32)


def job(i: int, sm: float = 15, bw: float = 10, mem_gib: float = 4, cpus: float = 2, host_gib: float = 8,
        prio: float = 0.0, dur: float | None = None) -> JobDemand:
    return JobDemand(job_id=i, user="alice", submit_time_s=float(i), priority=prio, gpu_mem_bytes=int(mem_gib * GIB),
                     host_mem_bytes=int(host_gib * GIB), sm_util_pct=sm, membw_util_pct=bw, host_cpu_cores=cpus,
                     est_duration_s=dur)


def request(jobs: list[JobDemand], gpus: int = 1, count: int = 1, cpus: int = 64, limits: PackingLimits | None = None,
            max_gpus: int | None = None) -> PackingRequest:
    return PackingRequest(jobs=tuple(jobs), gpu_models=(H100,),
                          nodes=(NodeShape("h100", gpus, cpus, 512 * GIB, count=count, name="n"),),
                          limits=limits or PackingLimits(), max_gpus=max_gpus)


# ---------------------------------------------------------------- interference model

def test_lone_member_runs_at_solo_speed():
    assert predict_colocated_speeds([SoloProfile(90, 80, GIB)]) == [1.0]


def test_complementary_pair_beats_alike_pair():
    compute = SoloProfile(60, 10)
    memory = SoloProfile(10, 60)
    mixed = sum(predict_colocated_speeds([compute, memory]))
    alike = sum(predict_colocated_speeds([compute, SoloProfile(60, 10)]))
    assert mixed > alike
    assert all(0 < s <= 1 for s in predict_colocated_speeds([compute, memory]))


def test_adding_a_corunner_never_speeds_anyone_up():
    rng = random.Random(3)
    for _ in range(200):
        n = rng.randint(1, 7)
        sm = [rng.uniform(0, 1) for _ in range(n)]
        bw = [rng.uniform(0, 1) for _ in range(n)]
        before = predict_speeds_from_fractions(sm, bw)
        after = predict_speeds_from_fractions(sm + [rng.uniform(0, 1)], bw + [rng.uniform(0, 1)])
        for b, a in zip(before, after[:n], strict=True):
            assert a <= b + 1e-9


def test_no_resource_used_beyond_capacity():
    rng = random.Random(4)
    for _ in range(200):
        n = rng.randint(2, 9)
        sm = [rng.uniform(0, 1) for _ in range(n)]
        bw = [rng.uniform(0, 1) for _ in range(n)]
        sp = predict_speeds_from_fractions(sm, bw)
        assert sum(s * v for s, v in zip(sm, sp, strict=True)) <= 1 + 1e-6
        assert sum(b * v for b, v in zip(bw, sp, strict=True)) <= 1 + 1e-6


def test_accepts_mappings_and_objects_and_checks_memory():
    as_dict = predict_colocated_speeds([{"sm_util_pct": 30, "membw_util_pct": 20, "gpu_mem_bytes": 10},
                                        {"sm_util_pct": 40, "membw_util_pct": 5, "gpu_mem_bytes": 10}])
    as_obj = interference_model([job(1, 30, 20), job(2, 40, 5)])
    assert as_dict == pytest.approx(as_obj)
    too_big = [SoloProfile(10, 10, 50 * GIB), SoloProfile(10, 10, 40 * GIB)]
    assert predict_colocated_speeds(too_big, gpu_memory_bytes=80 * GIB) == [0.0, 0.0]
    assert min(predict_colocated_speeds(too_big, gpu_memory_bytes=100 * GIB)) > 0


def test_refit_recovers_known_constants():
    truth = InterferenceParams(0.5, 1.1, 0.04)
    rng = random.Random(5)
    samples = []
    for _ in range(60):
        n = rng.randint(2, 6)
        members = tuple(SoloProfile(rng.uniform(5, 50), rng.uniform(5, 50)) for _ in range(n))
        speeds = predict_colocated_speeds(members, truth)
        samples.append(CoLocationSample(members, tuple(s * (1 + rng.uniform(-0.01, 0.01)) for s in speeds)))
    fit = refit_interference(samples)
    assert fit.sm_contention == pytest.approx(0.5, abs=0.15)
    assert fit.membw_contention == pytest.approx(1.1, abs=0.2)
    assert fit.per_client_overhead == pytest.approx(0.04, abs=0.02)
    assert prediction_error(samples, fit) < prediction_error(samples) / 2


def test_refit_without_usable_samples_keeps_start():
    start = InterferenceParams(0.1, 0.2, 0.3)
    assert refit_interference([CoLocationSample((SoloProfile(10, 10),), (1.0,))], start) == start


def test_build_samples_from_rates():
    profiles = {1: SoloProfile(20, 10), 2: SoloProfile(10, 30), 3: SoloProfile(5, 5)}
    samples = build_samples({1: 100.0, 2: 50.0}, profiles, [{1: 90.0, 2: 40.0}, {1: 80.0, 3: 10.0}])
    assert len(samples) == 1  # job 3 has no solo rate
    assert samples[0].speeds == pytest.approx((0.9, 0.8))


# ---------------------------------------------------------------- policies

def test_exclusive_one_job_per_gpu():
    p = plan(request([job(i) for i in range(6)], gpus=4), "exclusive")
    assert len(p.packs) == 4
    assert all(len(pk.members) == 1 and pk.gpu_count == 1 and not pk.mps for pk in p.packs)
    assert {d.reason for d in p.deferred} == {"no free GPU this round"}


def test_first_fit_counts_slots_and_ignores_memory():
    limits = PackingLimits(shards_per_gpu=4)
    p = plan(request([job(i, mem_gib=30) for i in range(6)], limits=limits), "first-fit")
    assert [len(pk.members) for pk in p.packs] == [4]  # 120 GiB on an 80 GiB GPU: it does not look
    assert len(p.deferred) == 2


def test_memory_aware_policies_keep_fences_within_the_gpu():
    jobs = [job(i, mem_gib=30) for i in range(6)]
    for policy in ("mem-best-fit", "complementary"):
        p = plan(request(jobs, gpus=2), policy)
        for pk in p.packs:
            for g in range(pk.gpu_count):
                fences = sum(m.gpu_mem_limit_mib for m in pk.members_on(g)) * MIB
                assert fences <= H100.memory_bytes - H100.cuda_context_bytes
        assert len(p.placed_job_ids) == 4, policy  # two 30 GiB members per 80 GiB GPU


def test_fence_is_estimate_plus_margin_plus_context():
    j = job(1, mem_gib=10)
    limits = PackingLimits(memory_margin_pct=5)
    p = plan(request([j], limits=limits))
    m = p.packs[0].members[0]
    expected = int(10 * GIB * 1.05) + H100.cuda_context_bytes + H100.cublas_workspace_bytes
    assert m.gpu_mem_limit_mib == -(-expected // MIB)
    assert member_fence_bytes(j, H100, limits) == expected


def test_too_big_job_is_deferred_for_good():
    p = plan(request([job(1, mem_gib=79)]))
    assert not p.packs
    assert "largest free GPU" in p.deferred[0].reason and p.deferred[0].permanent


def test_complementary_pairs_compute_with_memory_bound():
    jobs = [job(1, sm=60, bw=5), job(2, sm=60, bw=5), job(3, sm=5, bw=60), job(4, sm=5, bw=60)]
    p = plan(request(jobs, gpus=2, limits=PackingLimits(max_members_per_gpu=2)))
    assert len(p.packs) == 1 and p.packs[0].gpu_count == 2
    for g in range(2):
        ids = {m.job_id for m in p.packs[0].members_on(g)}
        assert len(ids & {1, 2}) == 1 and len(ids & {3, 4}) == 1, ids


def test_complementary_balances_load_over_the_gpus_of_a_pack():
    rng = random.Random(9)
    jobs = [job(i, sm=rng.uniform(5, 35), bw=rng.uniform(5, 35), mem_gib=rng.uniform(1, 8)) for i in range(20)]
    p = plan(request(jobs, gpus=4, cpus=200))
    pk = max(p.packs, key=lambda x: x.gpu_count)
    assert pk.gpu_count >= 3
    by_id = {j.job_id: j for j in jobs}
    loads = [max(sum(by_id[m.job_id].sm_util_pct for m in pk.members_on(g)),
                 sum(by_id[m.job_id].membw_util_pct for m in pk.members_on(g))) for g in range(pk.gpu_count)]
    assert max(loads) - min(loads) < 40, loads


def test_sweep_variants_under_a_stopping_rule_get_packs_of_one_gpu():
    """Issue 47: most variants pause early and a pack holds all its GPUs until its last
    member ends, so `may_pause` jobs seed one-GPU packs (the same jobs without it
    share a 4-GPU pack); every job is still placed, several on each GPU."""
    jobs = [job(i, sm=10, bw=10, mem_gib=1, cpus=1) for i in range(27)]
    p = plan(request(jobs, gpus=4, cpus=200))
    assert max(pk.gpu_count for pk in p.packs) == 4
    p = plan(request([replace(j, may_pause=True) for j in jobs], gpus=4, cpus=200))
    assert [pk.gpu_count for pk in p.packs] == [1, 1, 1, 1]
    assert sorted(m.job_id for pk in p.packs for m in pk.members) == list(range(27))
    # each pack brings its own agent (1 CPU, 512 MiB): the node's offer left one out, so
    # four packs on a node of 31 free CPUs take at most 31 - 3 for members and headroom
    p = plan(request([replace(j, may_pause=True) for j in jobs], gpus=4, cpus=31))
    assert sum(pk.alloc_cpus for pk in p.packs) + (len(p.packs) - 1) <= 31, [pk.alloc_cpus for pk in p.packs]


def test_complementary_groups_by_expected_duration():
    short = [job(i, sm=10, bw=10, dur=600) for i in range(5)]
    long = [job(10 + i, sm=10, bw=10, dur=36000) for i in range(5)]
    p = plan(request(short + long, gpus=2, limits=PackingLimits(max_members_per_gpu=5, max_gpus_per_pack=1)))
    groups = [{m.job_id for m in pk.members} for pk in p.packs]
    assert {0, 1, 2, 3, 4} in groups and {10, 11, 12, 13, 14} in groups


def test_host_cpus_limit_members():
    jobs = [job(i, sm=5, bw=5, cpus=8) for i in range(6)]
    for policy in ("first-fit", "mem-best-fit", "complementary"):
        p = plan(request(jobs, cpus=26), policy)
        assert sum(m.cpus for pk in p.packs for m in pk.members) <= 26, policy
        assert len(p.placed_job_ids) == 3, policy


def test_max_gpus_bounds_the_round():
    p = plan(request([job(i, sm=60) for i in range(8)], gpus=4, max_gpus=2))
    assert sum(pk.gpu_count for pk in p.packs) <= 2


def test_unknown_policy_and_duplicate_ids_are_bad_input():
    with pytest.raises(BadInput, match="unknown policy"):
        plan(request([job(1)]), "round-robin")
    with pytest.raises(BadInput, match="unique"):
        plan(request([job(1), job(1)]))


def test_placement_fields_match_the_contract():
    p = plan(request([job(1), job(2)]))
    keys = set(p.packs[0].members[0].to_placement())
    assert keys == {"job_id", "node_index", "gpu_index", "mps_thread_pct", "gpu_mem_limit_mib",
                    "host_mem_limit_bytes", "cpus"}
    assert p.to_dict()["packs"][0]["members"][0]["job_id"] in (1, 2)


def test_thread_percentage_caps_only_when_sms_are_oversubscribed():
    light = plan(request([job(i, sm=10, bw=5) for i in range(3)]))
    assert {m.mps_thread_pct for m in light.packs[0].members} == {100}
    heavy = plan(request([job(i, sm=45, bw=2) for i in range(3)],
                         limits=PackingLimits(target_load=2.0)))
    assert all(10 <= m.mps_thread_pct < 100 for m in heavy.packs[0].members)


# ---------------------------------------------------------------- estimates

def test_demand_from_estimate_dict_and_object():
    est = {"gpu_peak_bytes": 6 * GIB, "host_peak_bytes": 3 * GIB,
           "gpu_breakdown": {"tables": 5 * GIB, "cuda_context": GIB // 2, "cublas_workspace": GIB // 2},
           "profile": {"sm_util_pct": 12.0, "membw_util_pct": 30.0, "host_cpu_cores": 3.0, "label": "memory-bound",
                       "solo_samples_per_s": 1000.0}}
    d = demand_from_estimate(est, job_id=4, user="bob", submit_time_s=1.0, samples_to_train=3.6e6)
    assert d.gpu_mem_bytes == 5 * GIB
    assert d.est_duration_s == pytest.approx(3600.0)
    assert d.label == "memory-bound" and d.cpus == 3

    class Obj:
        gpu_peak_bytes = 6 * GIB
        host_peak_bytes = 3 * GIB
        gpu_breakdown = est["gpu_breakdown"]

        class profile:  # noqa: N801 - mimics the Estimate attribute
            sm_util_pct, membw_util_pct, host_cpu_cores, label, solo_samples_per_s = 12.0, 30.0, 3.0, "memory-bound", 0.0

    d2 = demand_from_estimate(Obj(), job_id=4, user="bob", submit_time_s=1.0)
    assert d2.gpu_mem_bytes == d.gpu_mem_bytes and d2.est_duration_s is None


# ---------------------------------------------------------------- dispatch

def test_round_triggers():
    cfg = DispatchConfig(round_seconds=10, round_batch_size=4)
    assert not should_run_round(100, 95, 0, 9, cfg)  # nothing pending
    assert should_run_round(100, None, 1, 0, cfg)  # first round
    assert not should_run_round(100, 95, 3, 3, cfg)
    assert should_run_round(100, 95, 4, 4, cfg)  # batch full
    assert should_run_round(105, 95, 1, 1, cfg)  # time window


def test_aging_in_bands_then_urgent():
    cfg = DispatchConfig(max_wait_rounds=30)
    assert effective_priority(0, 9, cfg) == 0
    assert effective_priority(0, 10, cfg) == 1
    assert effective_priority(0, 29, cfg) == 2
    assert effective_priority(0, 30, cfg) >= URGENT_PRIORITY
    assert effective_priority(0, 31, cfg) > effective_priority(5, 30, cfg)


def test_waited_rounds_count_only_rounds_that_placed_something():
    jobs = [job(i, sm=60) for i in range(3)]
    p = plan(request(jobs))
    waited = after_round({}, p)
    assert set(waited) == {d.job_id for d in p.deferred} and set(waited.values()) == {1}
    empty = plan(request(jobs, max_gpus=0))
    assert after_round(waited, empty) == {**waited, **{j.job_id: waited.get(j.job_id, 0) for j in jobs}}


def test_urgent_job_holds_the_room_it_waits_for():
    cfg = DispatchConfig(max_wait_rounds=3, fairness="rounds")
    big = job(1, cpus=16)
    small = [job(10 + i, cpus=2) for i in range(5)]
    free_now = (NodeShape("h100", 1, 10, 512 * GIB, name="n"),)  # 10 CPUs free: big must wait
    for waited, expect_small in ((0, True), (3, False)):
        req = PackingRequest(jobs=aged([big, *small], {1: waited}, cfg), gpu_models=(H100,), nodes=free_now)
        for policy in ("exclusive", "first-fit", "mem-best-fit", "complementary"):
            p = plan(req, policy)
            assert 1 not in p.placed_job_ids
            assert bool(p.placed_job_ids) == expect_small, (policy, waited)
            if not expect_small:
                assert all("holding room for job 1" in d.reason for d in p.deferred if d.job_id != 1)


# ---------------------------------------------------------------- refill

def _demand(job_id: int, sm: float, bw: float, mem_gib: int = 4, cpus: float = 2, dur: float | None = 600.0) -> JobDemand:
    return JobDemand(job_id=job_id, user="u", submit_time_s=float(job_id), priority=0.0, gpu_mem_bytes=mem_gib * GIB,
                     host_mem_bytes=4 * GIB, sm_util_pct=sm, membw_util_pct=bw, host_cpu_cores=cpus,
                     est_duration_s=dur)


def _pack_gpu(live: tuple[JobDemand, ...], free_cpus: int = 16, remaining_s: float | None = None) -> OpenGpu:
    return OpenGpu("7:0:1", "busy", len(live), pack=True, gpu_model="h100", live=live, free_cpus=free_cpus,
                   free_host_mem_bytes=64 * GIB, remaining_s=remaining_s)


def test_complementary_joins_the_job_that_complements_the_live_members():
    live = (_demand(100, sm=80, bw=10),)
    jobs = (_demand(1, sm=80, bw=10), _demand(2, sm=10, bw=80))  # 1 is first in the queue
    req = PackingRequest(jobs=jobs, gpu_models=(H100,), nodes=(), limits=PackingLimits(max_members_per_gpu=2),
                         open_gpus=(_pack_gpu(live),))
    p = plan(req, "complementary")
    assert [(j.gpu_key, j.member.job_id) for j in p.joins] == [("7:0:1", 2)]
    assert (p.joins[0].member.node_index, p.joins[0].member.gpu_index) == (0, 1)
    assert [d.job_id for d in p.deferred] == [1] and not p.packs
    assert plan(req, "exclusive").joins == ()  # exclusive never joins


def test_joins_respect_the_allocations_free_cpus_and_time_left():
    live = (_demand(100, sm=10, bw=10),)
    jobs = (_demand(1, sm=10, bw=10, cpus=6), _demand(2, sm=10, bw=10, cpus=2, dur=5000.0))
    for policy in ("complementary", "mem-best-fit"):
        req = PackingRequest(jobs=jobs, gpu_models=(H100,), nodes=(), open_gpus=(_pack_gpu(live, 4, 3600.0),))
        assert plan(req, policy).joins == ()  # job 1: 6 CPUs > 4 free; job 2: 5000 s > 3600 s left
        roomy = PackingRequest(jobs=jobs, gpu_models=(H100,), nodes=(), open_gpus=(_pack_gpu(live, 8, 7200.0),))
        assert sorted(j.member.job_id for j in plan(roomy, policy).joins) == [1, 2]


def test_an_urgent_job_that_cannot_join_holds_the_packs_room():
    live = (_demand(100, sm=10, bw=10, mem_gib=30),)
    urgent = JobDemand(**{**_demand(1, sm=10, bw=10, mem_gib=60).__dict__, "priority": URGENT_PRIORITY})
    small = _demand(2, sm=10, bw=10)
    for policy in ("complementary", "mem-best-fit"):
        req = PackingRequest(jobs=(urgent, small), gpu_models=(H100,), nodes=(), open_gpus=(_pack_gpu(live),))
        assert plan(req, policy).joins == ()  # the small job would keep the pack alive
        calm = PackingRequest(jobs=(small,), gpu_models=(H100,), nodes=(), open_gpus=(_pack_gpu(live),))
        assert [j.member.job_id for j in plan(calm, policy).joins] == [2]


def test_a_pack_whose_allocation_never_holds_a_waiting_job_drains():
    # Issue 24: the headroom is bounded and Slurm cannot grow a running job, so a pack
    # whose CPUs (even with its live member ended: 2 + 2 free) never hold a waiting
    # 6-CPU job takes no joins while it waits; its GPU then goes to a new pack.
    live = (_demand(100, sm=10, bw=10),)
    big, small = _demand(1, sm=10, bw=10, cpus=6), _demand(2, sm=10, bw=10, cpus=1)
    for policy in ("complementary", "mem-best-fit"):
        tight = PackingRequest(jobs=(big, small), gpu_models=(H100,), nodes=(), open_gpus=(_pack_gpu(live, 2),))
        assert plan(tight, policy).joins == ()
        roomy = PackingRequest(jobs=(big, small), gpu_models=(H100,), nodes=(), open_gpus=(_pack_gpu(live, 4),))
        assert sorted(j.member.job_id for j in plan(roomy, policy).joins) == [2]  # 6 CPUs once the member ends
        alone = PackingRequest(jobs=(small,), gpu_models=(H100,), nodes=(), open_gpus=(_pack_gpu(live, 2),))
        assert [j.member.job_id for j in plan(alone, policy).joins] == [2]


def test_refill_policies_give_a_pack_its_gpus_share_of_the_node_as_headroom():
    node = NodeShape("h100", 2, 26, 200 * GIB, name="n")
    req = PackingRequest(jobs=(_demand(1, sm=10, bw=10, cpus=2),), gpu_models=(H100,), nodes=(node,))
    for wide_pct in (10000.0, None):  # a bound above the share; "share"
        wide = replace(req, limits=PackingLimits(refill_headroom_pct=wide_pct))
        for policy in ("complementary", "mem-best-fit"):
            (pk,) = plan(wide, policy).packs
            assert pk.gpu_count == 1 and pk.cpus == 2
            assert pk.alloc_cpus == 13 and pk.alloc_host_mem_bytes == 100 * GIB  # half the node for one of 2 GPUs
    for policy in ("complementary", "mem-best-fit"):
        (pk,) = plan(req, policy).packs  # the default bound: as much again as the members' own
        assert pk.reserve_cpus == 2 and pk.reserve_host_mem_bytes == pk.host_mem_bytes
    for policy in ("exclusive", "first-fit"):
        (pk,) = plan(req, policy).packs
        assert (pk.alloc_cpus, pk.alloc_host_mem_bytes) == (pk.cpus, pk.host_mem_bytes)


def test_a_small_pack_asks_for_its_members_plus_bounded_headroom_not_the_gpus_share():
    # Issue 24: a one-GPU pack of members peaking at 1.5 GiB host memory asked for
    # --mem=63G -c 9 (a 4-GPU node's share). It must ask for its members plus
    # refill_headroom_pct of them (and the agent's CPU and memory).
    node = NodeShape("h100", 4, 36, 252 * GIB, name="n")
    small = JobDemand(job_id=1, user="u", submit_time_s=1.0, priority=0.0, gpu_mem_bytes=4 * GIB,
                      host_mem_bytes=int(1.5 * GIB), sm_util_pct=10, membw_util_pct=10, host_cpu_cores=1,
                      est_duration_s=600.0)
    for pct in (25.0, 0.0, 100.0):
        req = PackingRequest(jobs=(small,), gpu_models=(H100,), nodes=(node,),
                             limits=PackingLimits(refill_headroom_pct=pct))
        for policy in ("complementary", "mem-best-fit"):
            (pk,) = plan(req, policy).packs
            members = [{"node_index": m.node_index, "cpus": m.cpus, "host_mem_limit_bytes": m.host_mem_limit_bytes}
                       for m in pk.members]
            cpus, mem_mib = pack_allocation(members, 1, 36, 252 * 1024, 512, pk.reserve_cpus,
                                            pk.reserve_host_mem_bytes)
            member_mib = math.ceil(1.5 * 1024 * 1.05)  # the estimate + memory_margin_pct
            assert cpus == 1 + math.ceil(pct / 100.0) + 1  # members, headroom, the agent
            assert mem_mib == pytest.approx(member_mib * (1 + pct / 100.0) + 512, abs=2)
            assert mem_mib < 4 * 1024 and cpus < 9  # not 63G -c 9


def test_refill_headroom_pct_is_validated(tmp_path):
    from slurm_dlrm.site import ConfigError, load_site

    base = (Path(__file__).resolve().parents[1] / "site-config" / "site.toml").read_text()
    assert "refill_headroom_pct = 100.0" in base
    for bad in ("-1.0", "1001.0", '"lots"'):
        path = tmp_path / "site.toml"
        path.write_text(base.replace("refill_headroom_pct = 100.0", f"refill_headroom_pct = {bad}"))
        with pytest.raises(ConfigError, match="packing.refill_headroom_pct"):
            load_site(path)
    path.write_text(base.replace("refill_headroom_pct = 100.0", "refill_headroom_pct = 40"))
    assert load_site(path).packing.refill_headroom_pct == 40.0
    path.write_text(base.replace("refill_headroom_pct = 100.0", 'refill_headroom_pct = "share"'))
    assert load_site(path).packing.refill_headroom_pct is None
    path.write_text(base.replace("refill_headroom_pct = 100.0", 'refill_headroom_pct = "all"'))
    with pytest.raises(ConfigError, match='percentage .0..1000. or "share"'):
        load_site(path)


def test_refill_takes_a_known_length_joiner_behind_many_of_unknown_length():
    # A time-limited pack refuses joiners of unknown length (no estimate, no --time).
    # Shortest-first must not put them in front: 30 of them would use up the GPU's scan
    # and the 600 s job that fits would never join.
    def job(i: int, est: float | None) -> JobDemand:
        return JobDemand(job_id=i, user="u", submit_time_s=float(i), priority=0, gpu_mem_bytes=2 * GIB,
                         host_mem_bytes=GIB, sm_util_pct=20, membw_util_pct=10, host_cpu_cores=1,
                         est_duration_s=est)

    live = (job(1000, 600.0),)
    og = OpenGpu("7:0:0", "n1", 1, pack=True, gpu_model="h100", live=live, free_cpus=32,
                 free_host_mem_bytes=100 * GIB, remaining_s=3600.0)
    jobs = tuple(job(i, None) for i in range(1, 31)) + (job(31, 600.0),)
    p = plan(PackingRequest(jobs=jobs, gpu_models=(H100,), nodes=(), open_gpus=(og,)), "complementary")
    assert [j.member.job_id for j in p.joins] == [31]
