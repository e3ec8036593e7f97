"""Multi-GPU jobs in the packing policies (issue 18): W rank members on W distinct GPUs
of one node, all or none, in plans and in refill joins (pure, fast)."""

from __future__ import annotations

from collections import Counter

import pytest

from slurm_dlrm.estimate import estimate
from slurm_dlrm.packing import (
    JobDemand,
    NodeShape,
    PackingLimits,
    PackingRequest,
    demand_from_estimate,
    plan,
)
from slurm_dlrm.packing.model import OpenGpu, RankDemand, rank_members
from slurm_dlrm.site import GIB, GpuModel
from slurm_dlrm.spec import parse_spec

H100 = GpuModel("h100", 80, 132, 3350, 67, 494, 520, 32)
POLICIES = ("exclusive", "first-fit", "mem-best-fit", "complementary")


def job(i: int, sm: float = 15, bw: float = 10, mem_gib: float = 4, cpus: float = 2, host_gib: float = 8,
        dur: float | None = 3600.0, world_size: int = 1, ranks: tuple[RankDemand, ...] = (),
        prio: float = 0.0) -> JobDemand:
    return JobDemand(job_id=i, user="alice", submit_time_s=float(i), priority=prio, gpu_mem_bytes=int(mem_gib * GIB),
                     host_mem_bytes=int(host_gib * GIB), sm_util_pct=sm, membw_util_pct=bw, host_cpu_cores=cpus,
                     est_duration_s=dur, world_size=world_size, ranks=ranks)


def rank(sm: float, bw: float, mem_gib: float) -> RankDemand:
    return RankDemand(gpu_mem_bytes=int(mem_gib * GIB), host_mem_bytes=8 * GIB, sm_util_pct=sm, membw_util_pct=bw,
                      host_cpu_cores=2)


def request(jobs: list[JobDemand], gpus: int = 4, count: int = 1, open_gpus: tuple[OpenGpu, ...] = ()) -> PackingRequest:
    return PackingRequest(jobs=tuple(jobs), gpu_models=(H100,),
                          nodes=(NodeShape("h100", gpus, 64, 512 * GIB, count=count, name="n"),),
                          limits=PackingLimits(), open_gpus=open_gpus)


def rank_placements(p, job_id: int):  # type: ignore[no-untyped-def]
    out = [(pk, m) for pk in p.packs for m in pk.members if m.job_id == job_id]
    return out


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_places_all_ranks_on_distinct_gpus_of_one_pack(policy: str):
    gang = job(1, world_size=2, ranks=(rank(40, 20, 30), rank(10, 8, 10)))
    p = plan(request([gang, *[job(i) for i in range(2, 8)]]), policy)
    got = rank_placements(p, 1)
    assert len(got) == 2
    packs = {id(pk) for pk, _ in got}
    assert len(packs) == 1  # gang: one Slurm job holds every rank
    assert sorted(m.rank for _, m in got) == [0, 1] and {m.world_size for _, m in got} == {2}
    assert len({(m.node_index, m.gpu_index) for _, m in got}) == 2
    assert p.placed_job_ids.count(1) == 1
    d = got[0][1].to_placement()
    assert d["world_size"] == 2 and "rank" in d
    single = next(m for pk in p.packs for m in pk.members if m.job_id == 2)
    assert "rank" not in single.to_placement() and "world_size" not in single.to_placement()


def test_complementary_fences_each_rank_from_its_own_estimate_and_mixes_singles():
    gang = job(1, world_size=2, ranks=(rank(40, 30, 30), rank(10, 5, 6)))
    p = plan(request([gang, *[job(i, sm=20, bw=15) for i in range(2, 10)]], gpus=2), "complementary")
    ranks = {m.rank: m for _, m in rank_placements(p, 1)}
    assert ranks[0].gpu_mem_limit_mib > 3 * ranks[1].gpu_mem_limit_mib  # its own fence, not the fullest rank's
    pack = next(pk for pk, _ in rank_placements(p, 1))
    assert pack.mps and any(m.world_size == 1 for m in pack.members)  # singles beside the ranks
    # inter-GPU balance: the light rank's GPU takes more of the single-GPU work
    on = Counter(m.gpu_index for m in pack.members if m.world_size == 1)
    assert on[ranks[1].gpu_index] > on[ranks[0].gpu_index]


def test_gang_is_all_or_none():
    # a 4-rank job on a 2-GPU node: never split, deferred with the limit named
    gang = job(1, world_size=4)
    for policy in POLICIES:
        p = plan(request([gang, job(2)], gpus=2), policy)
        assert 1 not in p.placed_job_ids
        d = next(x for x in p.deferred if x.job_id == 1)
        assert "4 GPUs of one node" in d.reason
    # two 2-GPU nodes give 4 GPUs, but not on one node
    p = plan(request([gang], gpus=2, count=2), "complementary")
    assert p.placed_job_ids == ()


def test_a_rank_too_big_for_any_gpu_is_permanent():
    gang = job(1, world_size=2, ranks=(rank(10, 10, 90), rank(10, 10, 4)))
    p = plan(request([gang]), "complementary")
    d = next(x for x in p.deferred if x.job_id == 1)
    assert d.permanent and "GPU memory" in d.reason


def test_exclusive_gives_whole_gpus_and_first_fit_no_fence():
    gang = job(1, world_size=2)
    ex = plan(request([gang, job(2)]), "exclusive")
    pk = next(pk for pk, _ in rank_placements(ex, 1))
    assert pk.gpu_count == 2 and len(pk.members) == 2 and not pk.mps
    ff = plan(request([gang, *[job(i) for i in range(2, 6)]], gpus=2), "first-fit")
    for _, m in rank_placements(ff, 1):
        assert m.gpu_mem_limit_mib >= 79 * 1024  # gres/shard fences nothing


def test_two_gangs_share_gpus_within_the_load_target():
    a = job(1, sm=20, bw=10, world_size=2)
    b = job(2, sm=20, bw=10, world_size=2)
    p = plan(request([a, b], gpus=2), "complementary")
    assert sorted(p.placed_job_ids) == [1, 2]
    assert len(p.packs) == 1 and p.packs[0].gpu_count == 2


def test_refill_joins_a_gang_whole_or_not_at_all():
    live0 = (job(100, sm=20, bw=10),)
    gpus = tuple(OpenGpu(f"7:0:{k}", "n", 1, pack=True, gpu_model="h100", live=live0, free_cpus=32,
                         free_host_mem_bytes=200 * GIB) for k in range(2))
    gang = job(1, world_size=2, ranks=(rank(30, 20, 20), rank(10, 5, 8)))
    p = plan(request([gang], gpus=0, open_gpus=gpus), "complementary")
    joins = [j for j in p.joins if j.member.job_id == 1]
    assert len(joins) == 2 and {j.gpu_key for j in joins} == {"7:0:0", "7:0:1"}
    assert sorted(j.member.rank for j in joins) == [0, 1]
    # only one pack GPU: the gang does not join (and no new GPU is free)
    p = plan(request([gang], gpus=0, open_gpus=gpus[:1]), "complementary")
    assert not p.joins and 1 not in p.placed_job_ids


def test_demand_from_estimate_carries_every_rank():
    spec = parse_spec({"name": "x", "tables": [{"rows": r, "dim": 64} for r in (400_000, 300_000, 200_000, 100_000)],
                       "dense_features": 13, "bottom_mlp": [64], "top_mlp": [64, 1], "batch_size": 1024,
                       "steps": 100, "world_size": 2}, "<t>")
    est = estimate(spec, H100)
    d = demand_from_estimate(est, job_id=3, user="u", submit_time_s=0.0, samples_to_train=100 * 1024)
    assert d.world_size == 2 and len(d.ranks) == 2
    members = rank_members(d)
    assert [m.rank for m in members] == [0, 1] and len({m.key for m in members}) == 2
    assert max(m.gpu_mem_bytes for m in members) == d.gpu_mem_bytes
    assert rank_members(job(5)) == (job(5),)


def test_a_waiting_gang_reserves_pack_gpus_from_single_joins():
    # two pack GPUs loaded near the target: the gang's ranks do not fit beside them now;
    # it reserves both, so a light single does not join them (and the plan does not fail)
    live = (job(100, sm=85, bw=20),)
    gpus = tuple(OpenGpu(f"7:0:{k}", "n", 1, pack=True, gpu_model="h100", live=live, free_cpus=32,
                         free_host_mem_bytes=200 * GIB) for k in range(2))
    gang = job(1, sm=40, bw=10, world_size=2)
    p = plan(request([gang, job(2, sm=5, bw=5)], gpus=0, open_gpus=gpus), "complementary")
    assert not p.joins and p.placed_job_ids == ()
    # without the gang the single joins
    p = plan(request([job(2, sm=5, bw=5)], gpus=0, open_gpus=gpus), "complementary")
    assert [j.member.job_id for j in p.joins] == [2]
