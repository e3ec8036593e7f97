"""Multi-GPU jobs in the simulator (issue 18): gang placement, pace of the slowest rank,
a rank's OOM stops its siblings and the job restarts whole."""

from __future__ import annotations

import pytest

from slurm_dlrm.errors import BadInput
from slurm_dlrm.packing import POLICY_NAMES
from slurm_dlrm.sim import parse_cluster, parse_workload, simulate

CLUSTER = {"name": "c", "gpu_models": {"h100": {"memory_gib": 80, "cuda_context_mib": 512, "cublas_workspace_mib": 0}},
           "nodes": [{"name": "n", "gpu_model": "h100", "gpus": 2, "cpus": 64, "memory_gib": 512}],
           "slurm": {"submit_to_start_s": 2, "member_startup_s": 20}, "packing": {"round_seconds": 10}}


def _job(name, solo, sm=10, bw=10, mem=4, true_mem=None, world_size=1, scales=None):
    j = {"name": name, "arrival_s": 0, "solo_duration_s": solo, "world_size": world_size,
         "profile": {"sm_util_pct": sm, "membw_util_pct": bw, "gpu_mem_gib": mem, "host_mem_gib": 4,
                     "host_cpu_cores": 2}}
    if scales is not None:
        j["rank_scales"] = scales
    if true_mem is not None:
        j["true"] = {"gpu_mem_gib": true_mem}
    return j


def _run(jobs, policy):
    c = parse_cluster(CLUSTER)
    w = parse_workload({"name": "w", "jobs": jobs}, {g.name: g for g in c.gpu_models})
    return simulate(w, c, policy)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_two_rank_job_completes_beside_single_gpu_jobs(policy: str):
    r = _run([_job("g", 1000, world_size=2, scales=[1.0, 0.5]), _job("a", 1000), _job("b", 1000)], policy)
    assert r.completion_rate == 1.0 and r.ooms == 0
    gang = next(o for o in r.jobs if o.job_id == 0)
    # both ranks start together and run at about solo speed
    assert gang.end_s == pytest.approx(1022, abs=60)


def test_a_gang_runs_at_its_slowest_rank():
    # rank 1 shares its GPU with a heavy neighbour: the whole job slows, rank 0 too
    alone = _run([_job("g", 1000, sm=60, world_size=2)], "complementary")
    crowded = _run([_job("g", 1000, sm=60, world_size=2), _job("h", 5000, sm=90, bw=90)], "first-fit")
    assert alone.jobs[0].end_s == pytest.approx(1022, abs=1)
    assert crowded.jobs[0].end_s > alone.jobs[0].end_s + 100


def test_a_rank_oom_stops_its_siblings_and_the_job_restarts_whole():
    # rank 1 (scale 0.5) is fenced at 0.5 x 40 GiB + 5%; its true peak 0.5 x 48 is over
    r = _run([_job("g", 1000, mem=40, true_mem=48, world_size=2, scales=[1.0, 0.5])], "complementary")
    assert r.ooms >= 1  # counted once per rank that died, not per sibling stopped
    assert r.jobs[0].state == "COMPLETED" and r.jobs[0].ooms == r.ooms


def test_a_gang_wider_than_any_node_is_unplaceable():
    r = _run([_job("g", 1000, world_size=4), _job("a", 100)], "complementary")
    states = {o.job_id: o.state for o in r.jobs}
    assert states[0] == "UNPLACEABLE" and states[1] == "COMPLETED"


def test_generator_draws_multi_gpu_jobs_from_their_own_stream():
    c = parse_cluster(CLUSTER)
    gen = {"jobs": 200, "arrival_rate_per_h": 10, "classes": [{"profile": {"sm_util_pct": [5, 20],
                                                                        "membw_util_pct": [5, 20],
                                                                        "gpu_mem_gib": [1, 8]}}]}
    plain = parse_workload({"name": "w", "seed": 3, "generate": gen}, {g.name: g for g in c.gpu_models})
    multi = parse_workload({"name": "w", "seed": 3, "generate": dict(gen, multi_gpu_share=0.25)},
                           {g.name: g for g in c.gpu_models})
    gangs = [j for j in multi.jobs if j.world_size > 1]
    assert 30 <= len(gangs) <= 70 and {j.world_size for j in gangs} <= {2, 4}
    assert all(j.scales[0] == 1.0 and len(j.scales) == j.world_size for j in gangs)
    # the single-GPU draws are unchanged
    assert [(j.arrival_s, j.gpu_mem_bytes) for j in plain.jobs] == [(j.arrival_s, j.gpu_mem_bytes) for j in multi.jobs]
    with pytest.raises(BadInput, match="rank_scales"):
        parse_workload({"name": "w", "jobs": [_job("g", 10, world_size=2, scales=[1.0])]},
                       {g.name: g for g in c.gpu_models})
