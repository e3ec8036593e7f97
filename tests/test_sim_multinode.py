"""Whole-node multi-node jobs in the simulator (issue 48 item 8, sim/multinode.py): not
packed, they wait for whole nodes, which take no new pack or joiner meanwhile, and hold
them whole for their run."""

from __future__ import annotations

import pytest

from slurm_dlrm.errors import BadInput
from slurm_dlrm.sim import parse_cluster, parse_workload, simulate

CLUSTER = {"name": "c", "gpu_models": {"h100": {"memory_gib": 80, "cuda_context_mib": 512, "cublas_workspace_mib": 0}},
           "nodes": [{"name": f"n{i}", "gpu_model": "h100", "gpus": 2, "cpus": 64, "memory_gib": 512}
                     for i in range(3)],
           "slurm": {"submit_to_start_s": 2, "member_startup_s": 20}, "packing": {"round_seconds": 10}}
STARTUP_S = 22.0  # submit_to_start_s + member_startup_s


def _job(name, arrival, solo, world_size=1, nodes=None, mem_gib=4):
    j = {"name": name, "arrival_s": arrival, "solo_duration_s": solo, "world_size": world_size,
         "profile": {"sm_util_pct": 20, "membw_util_pct": 20, "gpu_mem_gib": mem_gib, "host_mem_gib": 4,
                     "host_cpu_cores": 2}}
    if nodes is not None:
        j["nodes"] = nodes
    return j


def _run(jobs, policy="complementary", cluster=CLUSTER):
    c = parse_cluster(cluster)
    w = parse_workload({"name": "w", "jobs": jobs}, {g.name: g for g in c.gpu_models})
    return simulate(w, c, policy), w


@pytest.mark.parametrize("policy", ["complementary", "exclusive", "mem-best-fit"])
def test_a_multi_node_job_waits_for_whole_nodes_and_packs_plan_around_it(policy: str):
    # six 1000 s jobs of 60 GiB fill the three nodes' six GPUs; the 2-node job arrives at
    # 100 s; later arrivals may use only the node it does not hold
    jobs = [_job(f"a{i}", 0, 1000, mem_gib=60) for i in range(6)]
    jobs.append(_job("mn", 100, 2000, world_size=4, nodes=2))
    jobs += [_job(f"b{i}", 200 + i, 300) for i in range(8)]
    r, w = _run(jobs, policy)
    assert r.completion_rate == 1.0
    by_id = {o.job_id: o for o in r.jobs}
    mn = next(j for j in w.jobs if j.name == "mn")
    out = by_id[mn.job_id]
    # it starts when two nodes have drained (the first jobs end after their 1000 s run)
    assert 1000 <= out.start_s <= 1200 and out.end_s == pytest.approx(out.start_s + STARTUP_S + 2000, abs=1)
    # no later job ran on its nodes meanwhile: at most one node's GPUs (2) for them, so
    # the eight 300 s jobs that came after it end only well after its start
    later = [by_id[j.job_id] for j in w.jobs if j.name.startswith("b")]
    during = [o for o in later if o.start_s is not None and out.start_s <= o.start_s < out.end_s]
    assert during, "the node it does not hold keeps packing"
    # GPU-seconds allocated include its two whole nodes for its run
    assert r.alloc_gpu_s >= 4 * (2000 + STARTUP_S)


def test_multi_node_jobs_queue_first_come_first_served_and_one_too_wide_is_unplaceable():
    jobs = [_job("m1", 0, 500, world_size=4, nodes=2), _job("m2", 10, 500, world_size=4, nodes=2),
            _job("wide", 20, 500, world_size=8, nodes=4), _job("a", 30, 100)]
    r, w = _run(jobs)
    by_name = {j.name: o for j, o in zip(w.jobs, sorted(r.jobs, key=lambda o: o.job_id), strict=True)}
    assert by_name["wide"].state == "UNPLACEABLE"  # 4 nodes on a 3-node cluster
    assert by_name["m2"].start_s >= by_name["m1"].end_s  # 2 + 2 nodes > 3: it waits for m1's
    assert by_name["a"].state == "COMPLETED" and by_name["a"].end_s < by_name["m1"].end_s  # the third node packs


def test_nodes_must_divide_world_size():
    with pytest.raises(BadInput, match=r"nodes: 2 does not divide world_size 3"):
        _run([_job("m", 0, 100, world_size=3, nodes=2)])
