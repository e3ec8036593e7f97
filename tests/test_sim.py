"""Simulator sanity: files, timing arithmetic, OOMs, determinism, ideal bound."""

from __future__ import annotations

import pytest

from slurm_dlrm.errors import BadInput
from slurm_dlrm.packing import POLICY_NAMES
from slurm_dlrm.sim import ideal_throughput_jobs_per_h, parse_cluster, parse_workload, simulate
from slurm_dlrm.site import GIB

CLUSTER = {"name": "c", "gpu_models": {"h100": {"memory_gib": 80, "cuda_context_mib": 512, "cublas_workspace_mib": 0}},
           "nodes": [{"name": "n", "gpu_model": "h100", "gpus": 1, "cpus": 32, "memory_gib": 256}],
           "slurm": {"submit_to_start_s": 2, "member_startup_s": 20}, "packing": {"round_seconds": 10}}


def _job(name, arrival, solo, sm=10, bw=10, mem=4, true_mem=None, cpus=2):
    j = {"name": name, "arrival_s": arrival, "solo_duration_s": solo,
         "profile": {"sm_util_pct": sm, "membw_util_pct": bw, "gpu_mem_gib": mem, "host_mem_gib": 4, "host_cpu_cores": cpus}}
    if true_mem is not None:
        j["true"] = {"gpu_mem_gib": true_mem}
    return j


def _run(jobs, policy, cluster=CLUSTER):
    c = parse_cluster(cluster)
    w = parse_workload({"name": "w", "jobs": jobs}, {g.name: g for g in c.gpu_models})
    return w, c, simulate(w, c, policy)


def test_exclusive_runs_jobs_one_after_another():
    _, _, r = _run([_job("a", 0, 1000), _job("b", 0, 500)], "exclusive")
    ends = sorted(o.end_s for o in r.jobs)
    # a: round at 0, +2 s start, +20 s startup, 1000 s; b: next round <= 10 s after a ends.
    assert ends[0] == pytest.approx(1022)
    assert 1022 + 522 <= ends[1] <= 1022 + 522 + 10
    assert r.completion_rate == 1.0 and r.ooms == 0


def test_packing_two_light_jobs_runs_them_together():
    _, _, r = _run([_job("a", 0, 1000), _job("b", 0, 1000)], "complementary")
    assert r.packs == 1
    assert max(o.end_s for o in r.jobs) < 1022 + 1000 * 1.2  # both at near solo speed
    assert r.mean_members_per_gpu > 1.5


def test_underestimate_beyond_the_margin_ooms_and_retries():
    jobs = [_job("a", 0, 1000, mem=10, true_mem=12)]
    _, _, r = _run(jobs, "complementary")
    assert r.ooms >= 1  # fenced at 10 GiB + 5%: 12 GiB is over
    assert r.jobs[0].state == "COMPLETED"  # the estimate is raised by 25% per retry


def test_first_fit_without_memory_awareness_ooms():
    jobs = [_job(str(i), 0, 1000, mem=30) for i in range(3)]  # 90 GiB on an 80 GiB GPU
    _, _, r = _run(jobs, "first-fit")
    assert r.ooms >= 1
    _, _, safe = _run(jobs, "mem-best-fit")
    assert safe.ooms == 0 and safe.completion_rate == 1.0


def test_a_failed_job_is_resubmitted_by_its_user_when_asked():
    # first-fit puts both 50 GiB jobs on one 80 GiB GPU: the second to peak dies each time
    # while the first runs. Without user resubmission it ends FAILED; with it, it completes
    # after the first and its JCT counts from its first submission.
    jobs = [_job("a", 0, 1000, mem=50), _job("b", 0, 1000, mem=50)]
    cluster = dict(CLUSTER, retry={"max_retries": 0})
    _, _, once = _run(jobs, "first-fit", cluster)
    assert sorted(o.state for o in once.jobs) == ["COMPLETED", "FAILED"]
    cluster = dict(CLUSTER, retry={"max_retries": 0, "user_resubmits": 5, "user_resubmit_delay_s": 600})
    _, _, again = _run(jobs, "first-fit", cluster)
    assert [o.state for o in again.jobs] == ["COMPLETED", "COMPLETED"]
    first, second = sorted(again.jobs, key=lambda o: o.end_s)
    assert second.ooms >= 1 and second.arrival_s == 0
    assert second.end_s >= first.end_s + 20 + 1000 * 0.9  # restarted, from a checkpoint at best
    assert again.resubmits == second.ooms
    assert again.avg_jct_s > once.avg_jct_s  # the failed job no longer drops out of the average


def test_deterministic_and_below_the_ideal_bound():
    data = {"name": "g", "seed": 3, "generate": {
        "jobs": 40, "arrival_rate_per_h": 30, "duration": {"dist": "lognormal", "median_s": 900, "sigma": 0.8},
        "mem_noise_pct": 5, "util_noise_pct": 10, "duration_estimate_noise_pct": 20,
        "classes": [{"weight": 1, "profile": {"sm_util_pct": [5, 35], "membw_util_pct": [5, 35], "gpu_mem_gib": [1, 20],
                                              "host_mem_gib": [2, 8], "host_cpu_cores": [1, 6]}}]}}
    c = parse_cluster(CLUSTER)
    w = parse_workload(data, {g.name: g for g in c.gpu_models})
    ideal = ideal_throughput_jobs_per_h(w, c)
    for policy in POLICY_NAMES:
        r = simulate(w, c, policy)
        assert r.metrics() == simulate(w, c, policy).metrics()
        assert r.throughput_jobs_per_h <= ideal * 1.0001, policy
        if policy != "first-fit":
            assert r.ooms == 0 and r.completion_rate == 1.0, policy


def test_generator_poisson_and_heavy_tail():
    data = {"generate": {"jobs": 3000, "arrival_rate_per_h": 60,
                         "duration": {"dist": "pareto", "alpha": 1.5, "scale_s": 600, "min_s": 600, "max_s": 1e6},
                         "classes": [{"profile": {"sm_util_pct": 10, "membw_util_pct": 10, "gpu_mem_gib": 1}}]}}
    w = parse_workload(data, {})
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(w.jobs, w.jobs[1:], strict=False)]
    assert sum(gaps) / len(gaps) == pytest.approx(60.0, rel=0.1)  # 60 jobs/h -> 60 s mean gap
    durs = sorted(j.solo_duration_s for j in w.jobs)
    assert durs[0] >= 600 and durs[-1] > 10 * durs[len(durs) // 2]  # a heavy tail
    assert all(j.true_gpu_mem_bytes == j.gpu_mem_bytes == GIB for j in w.jobs)


@pytest.mark.parametrize(("patch", "key"), [
    ({"nodes": []}, "cluster.nodes"),
    ({"nodes": [{"name": "n", "gpu_model": "v100", "gpus": 1, "cpus": 4, "memory_gib": 8}]}, "cluster.nodes[0].gpu_model"),
    ({"packing": {"max_members_per_gpu": 0}}, "cluster.packing.max_members_per_gpu"),
    ({"bogus": 1}, "cluster.bogus"),
])
def test_bad_cluster_files_name_the_key(patch, key):
    with pytest.raises(BadInput, match=key.replace("[", r"\[").replace("]", r"\]")):
        parse_cluster({**CLUSTER, **patch})


def test_bad_workload_names_the_key():
    with pytest.raises(BadInput, match=r"workload.jobs\[0\].profile.sm_util_pct"):
        parse_workload({"jobs": [{"solo_duration_s": 10, "profile": {"sm_util_pct": 140, "membw_util_pct": 1,
                                                                      "gpu_mem_gib": 1}}]}, {})
    with pytest.raises(BadInput, match="no jobs"):
        parse_workload({"jobs": []}, {})


@pytest.mark.parametrize("policy", ["complementary", "mem-best-fit"])
def test_a_running_pack_is_refilled_when_a_member_ends(policy):
    # a and b fill most of the GPU's memory; c arrives later and does not fit beside
    # them. When b ends, c joins the running pack (refill) instead of waiting for a.
    jobs = [_job("a", 0, 1000, mem=35), _job("b", 0, 200, mem=35), _job("c", 50, 300, mem=35)]
    _, _, r = _run(jobs, policy)
    a, b, c = sorted(r.jobs, key=lambda o: o.job_id)
    assert r.packs == 1 and r.ooms == 0 and r.completion_rate == 1.0
    assert c.end_s < a.end_s  # c ran inside a's allocation, not after it
    # c starts within a round of b's end, after its own start-up (no Slurm submission).
    assert b.end_s + 20 + 300 <= c.end_s <= b.end_s + 10 + 20 + 300 * 1.2
    # The allocation ends with its last member: one GPU from pack start to a's end.
    assert r.alloc_gpu_s == pytest.approx(a.end_s - 2)


def test_exclusive_never_joins_a_running_pack():
    jobs = [_job("a", 0, 1000, mem=35), _job("b", 0, 200, mem=35), _job("c", 50, 300, mem=35)]
    _, _, r = _run(jobs, "exclusive")
    assert r.packs == 3


def test_resubmissions_start_the_estimate_over():
    # Estimated at 10 GiB, it peaks at 90 on an 80 GiB GPU: it can never run. Each OOM
    # raises the estimate by 25%; a user's resubmission starts from the spec's estimate
    # again, so thousands of attempts do not compound it to infinity.
    jobs = [_job("a", 0, 1000, mem=10, true_mem=90)]
    cluster = dict(CLUSTER, retry={"max_retries": 100, "user_resubmits": 40})
    _, _, r = _run(jobs, "first-fit", cluster)
    assert r.jobs[0].state == "FAILED" and r.resubmits == 40 and r.ooms == 41 * 101


def test_dmem_packs_on_estimates_and_evicts_the_member_above_its_soft_limit():
    # 3 x 25.5 GiB: with 5% margin fences only 2 fit an 80 GiB GPU; on estimates all 3 do.
    exact = [_job(str(i), 0, 1000, mem=25.5) for i in range(3)]
    c = parse_cluster(CLUSTER)
    w = parse_workload({"name": "w", "jobs": exact}, {g.name: g for g in c.gpu_models})
    fence_only, dmem = simulate(w, c, "complementary"), simulate(w, c, "complementary", dmem=True)
    assert fence_only.ooms == 0 and dmem.ooms == 0 and dmem.evictions == 0
    assert len([o for o in fence_only.jobs if o.end_s and o.end_s < 1200]) == 2  # the third waited
    assert all(o.end_s and o.end_s < 1300 for o in dmem.jobs)  # all three ran together
    # two members 1 GiB over their estimate (still under their hard fence): together the GPU
    # is over its memory when the third peaks, and one of the two goes (not the exact one).
    over = [_job("a", 0, 1000, mem=25.5, true_mem=26.5), _job("b", 0, 1000, mem=25.5, true_mem=26.5),
            _job("c", 0, 1000, mem=25.5)]
    w = parse_workload({"name": "w", "jobs": over}, {g.name: g for g in c.gpu_models})
    r = simulate(w, c, "complementary", dmem=True)
    assert r.evictions == 1 and r.ooms == 1 and r.completion_rate == 1.0
    assert {o.ooms for o in r.jobs if o.job_id != r.jobs[2].job_id} == {0, 1} and r.jobs[2].ooms == 0
    assert simulate(w, c, "complementary").evictions == 0  # fences alone never evict


@pytest.mark.parametrize("policy", ["complementary", "mem-best-fit"])
def test_a_pack_too_small_for_a_waiting_job_drains_and_a_new_pack_takes_its_gpu(policy):
    # Issue 24: a's pack asks for its 2 CPUs plus 100 % (4); c (8 CPUs) never fits it,
    # so the small d does not join either (it would keep the pack alive for ever): both
    # start in a new pack once a ends. With the whole share as headroom, both join a's.
    jobs = [_job("a", 0, 2000, cpus=2), _job("c", 50, 300, cpus=8), _job("d", 60, 300, cpus=1)]
    _, _, r = _run(jobs, policy)
    a, c, d = sorted(r.jobs, key=lambda o: o.job_id)
    assert r.packs == 2 and r.completion_rate == 1.0
    assert c.end_s > a.end_s and d.end_s > a.end_s
    # What the packs held of the node: a's 4 CPUs while it ran, then the second pack's.
    assert r.held_cpu_s >= 4 * (a.end_s - 2)
    wide = dict(CLUSTER, packing={"round_seconds": 10, "refill_headroom_pct": 1000})
    _, _, r = _run(jobs, policy, wide)
    a, c, d = sorted(r.jobs, key=lambda o: o.job_id)
    assert r.packs == 1 and c.end_s < a.end_s and d.end_s < a.end_s
    assert r.held_cpu_s == pytest.approx(23 * (a.end_s - 2))  # 2 + 1000 % of 2 + the agent: 23 of 32


@pytest.mark.parametrize("policy", ["complementary", "mem-best-fit"])
def test_share_headroom_holds_the_gpus_whole_share_and_never_drains(policy):
    # `refill_headroom_pct: share` (the benchmarks' dedicated nodes): a's pack holds the
    # GPU's whole share of the node (32 CPUs), so c and d join it instead of waiting.
    jobs = [_job("a", 0, 2000, cpus=2), _job("c", 50, 300, cpus=8), _job("d", 60, 300, cpus=1)]
    share = dict(CLUSTER, packing={"round_seconds": 10, "refill_headroom_pct": "share"})
    _, _, r = _run(jobs, policy, share)
    a, c, d = sorted(r.jobs, key=lambda o: o.job_id)
    assert r.packs == 1 and c.end_s < a.end_s and d.end_s < a.end_s
    assert r.held_cpu_s == pytest.approx(32 * (a.end_s - 2))


def test_headroom_key_in_a_cluster_file_is_a_percentage_or_share():
    assert parse_cluster(dict(CLUSTER, packing={"refill_headroom_pct": "share"})).limits.refill_headroom_pct is None
    assert parse_cluster(dict(CLUSTER, packing={"refill_headroom_pct": 40})).limits.refill_headroom_pct == 40.0
    for bad in ("lots", -1, 1001, True):
        with pytest.raises(BadInput, match="cluster.packing.refill_headroom_pct"):
            parse_cluster(dict(CLUSTER, packing={"refill_headroom_pct": bad}))


def test_a_pack_holds_its_gpus_pack_release_s_after_its_last_member():
    # The live agent waits for joiners, exits, and the epilog runs before Slurm frees the
    # GPUs (issue 29 item 4): the next exclusive job starts that much later, and the GPU
    # time counts it.
    slow = dict(CLUSTER, slurm={"submit_to_start_s": 2, "member_startup_s": 20, "pack_release_s": 30})
    _, _, base = _run([_job("a", 0, 1000), _job("b", 0, 500)], "exclusive")
    _, _, held = _run([_job("a", 0, 1000), _job("b", 0, 500)], "exclusive", slow)
    b_base = max(o.start_s for o in base.jobs)
    b_held = max(o.start_s for o in held.jobs)
    assert b_held - b_base == pytest.approx(30, abs=10)  # one round period of slack
    assert held.alloc_gpu_s - base.alloc_gpu_s == pytest.approx(2 * 30)
    # A job arriving within the agent's join grace (two rounds) after the pack's last
    # member ended joins the idle pack, as the live service offers it; later, a new pack.
    _, _, joined = _run([_job("a", 0, 100), _job("b", 130, 100)], "complementary", slow)
    assert joined.packs == 1 and joined.completion_rate == 1.0
    assert [o.start_s for o in joined.jobs] == [0.0, 130.0]
    _, _, late = _run([_job("a", 0, 100), _job("b", 150, 100)], "complementary", slow)
    assert late.packs == 2


def test_a_joiner_starts_join_start_s_after_the_round_that_planned_it():
    late = dict(CLUSTER, slurm={"submit_to_start_s": 2, "member_startup_s": 20, "join_start_s": 5})
    _, _, base = _run([_job("a", 0, 1000), _job("b", 100, 100)], "complementary")
    _, _, held = _run([_job("a", 0, 1000), _job("b", 100, 100)], "complementary", late)
    assert base.packs == held.packs == 1  # b joined a's pack
    b_base, b_held = (max(r.jobs, key=lambda o: o.job_id) for r in (base, held))
    assert b_held.end_s - b_base.end_s == pytest.approx(5)


def test_a_pack_holds_host_memory_in_whole_mib_as_slurm_allocates_it():
    # a's pack holds a's memory + as much again for a joiner (refill_headroom_pct 100),
    # rounded up to whole MiB by Slurm (service/refill.pack_allocation asks it so). b asks
    # 0.1 MiB more than that reserve, within the rounding: it joins live, so here too
    # (counted in bytes, b waited for a's end and the simulator drifted from the live service).
    a = _job("a", 0, 1000)
    a["profile"]["host_mem_gib"] = 4 + 0.1 / 1024
    b = _job("b", 50, 300)
    b["profile"]["host_mem_gib"] = 4 + 0.2 / 1024
    _, _, r = _run([a, b], "complementary")
    assert r.packs == 1 and r.completion_rate == 1.0
    assert max(r.jobs, key=lambda o: o.job_id).start_s == 50.0
