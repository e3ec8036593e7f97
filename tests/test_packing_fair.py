"""The slowdown bound (issue 31, slurm_dlrm.packing.fairness): overdue jobs go first with
their user's order kept, and a waiting gang gets a reservation that drains only the
GPUs it needs, with short jobs backfilled; in the simulator a gang behind a steady
stream of one-GPU jobs no longer starves."""

from __future__ import annotations

from dataclasses import replace

import pytest

import slurm_dlrm.packing.refill as refill
from slurm_dlrm.packing import POLICY_NAMES, JobDemand, NodeShape, PackingRequest, plan
from slurm_dlrm.packing.common import OVERDUE_PRIORITY, URGENT_PRIORITY, is_overdue_priority
from slurm_dlrm.packing.fairness import (
    apply_fairness,
    fair_priority,
    gang_hold,
    is_overdue,
    slowdown_now,
)
from slurm_dlrm.packing.model import FairConfig, OpenGpu
from slurm_dlrm.sim import parse_cluster, parse_workload, simulate
from slurm_dlrm.site import GIB, GpuModel

H100 = GpuModel("h100", 80, 132, 3350, 67, 494, 520, 32)
FAIR = FairConfig(overdue_slowdown=3.0)  # a low bound: small numbers in the tests


def job(i: int, *, submit: float = 0.0, dur: float | None = 1800.0, prio: float = 0.0, world: int = 1,
        mem_gib: float = 4, sm: float = 10) -> JobDemand:
    return JobDemand(job_id=i, user="u", submit_time_s=submit, priority=prio, gpu_mem_bytes=int(mem_gib * GIB),
                     host_mem_bytes=2 * GIB, sm_util_pct=sm, membw_util_pct=10, host_cpu_cores=2,
                     est_duration_s=dur, world_size=world)


def pack_gpu(pack: int, live_rest_s: float, node: str = "n", members: int = 1) -> OpenGpu:
    live = tuple(replace(job(9000 + pack * 10 + k, dur=live_rest_s), rank=0) for k in range(members))
    return OpenGpu(f"{pack}:0:0", node, members, pack=True, gpu_model="h100", live=live, free_cpus=16,
                   free_host_mem_bytes=64 * GIB)


# ---------------------------------------------------------------- the bound

def test_slowdown_counts_from_begin_and_overdue_needs_both_bounds():
    j = job(1, submit=0.0, dur=600.0)
    assert slowdown_now(j, 1200.0, FAIR) == pytest.approx(3.0)
    assert is_overdue(j, 1200.0, FAIR)  # slowdown 3 after 20 min >= min_wait 10 min
    assert not is_overdue(j, 1199.0, FAIR)
    assert slowdown_now(replace(j, eligible_s=600.0), 1200.0, FAIR) == pytest.approx(2.0)  # --begin: waits from then
    short = job(2, dur=60.0)
    assert slowdown_now(short, 300.0, FAIR) > 3 and not is_overdue(short, 300.0, FAIR)  # under min_wait_s
    unknown = job(3, dur=None)
    assert slowdown_now(unknown, 3600.0, FAIR) == pytest.approx(2.0)  # counted as unknown_duration_s


def test_overdue_band_keeps_the_users_nice_order_then_the_most_overdue_first():
    now = 10 * 3600.0
    nice0_a = job(1, dur=3600.0)  # slowdown 11
    nice0_b = job(2, dur=600.0)  # slowdown 61: more overdue
    nice10 = job(3, dur=60.0, prio=-10.0)  # far more overdue, but the user put it later
    fresh = job(4, submit=now - 60, dur=3600.0, prio=5.0)  # not overdue: below the band whatever its nice
    p = {j.job_id: fair_priority(j, now, FAIR) for j in (nice0_a, nice0_b, nice10, fresh)}
    assert OVERDUE_PRIORITY - 2**31 < p[3] < p[1] < p[2] < URGENT_PRIORITY
    assert p[4] == 5.0 and is_overdue_priority(p[3]) and not is_overdue_priority(p[4])
    urgent = job(5, prio=URGENT_PRIORITY + 1)
    assert fair_priority(urgent, now, FAIR) == urgent.priority


def test_a_gang_past_its_reservation_point_is_in_the_band_below_the_bound():
    # Issue 40: the band is at 100 by default, a backstop; a gang past its own point
    # (max(gang_reserve_slowdown, gang_vs_single x the waiting one-GPU median)) is lifted
    # into it, so the most overdue gang leads and keeps the GPUs it reserved.
    cfg = FairConfig()
    now = 3 * 3600.0
    gang = job(1, dur=3600.0, world=2)  # slowdown 4 > max(2, 3 x 1.0)
    single = job(2, dur=3600.0)  # slowdown 4 too, but not a gang: below the band (100)
    fresh = [job(i, submit=now - 1, dur=3600.0) for i in (3, 4)]  # slowdown ~1: the one-GPU median
    point = 3.0
    assert is_overdue_priority(fair_priority(gang, now, cfg, point))
    assert not is_overdue_priority(fair_priority(single, now, cfg, point))
    assert not is_overdue_priority(fair_priority(gang, now, cfg))  # no point given: the band's bound only
    assert not is_overdue_priority(fair_priority(gang, now, replace(cfg, gang_in_band=False), point))
    assert not is_overdue_priority(fair_priority(gang, 2 * 3600.0 - 1, cfg, 3.0))  # slowdown just under 3 ...
    assert is_overdue_priority(fair_priority(gang, 2 * 3600.0, cfg, 3.0))  # ... at the point it is
    # apply_fairness computes the point from the waiting one-GPU jobs and lifts the gang.
    req = PackingRequest(jobs=(gang, single, *fresh), gpu_models=(H100,),
                         nodes=(NodeShape("h100", 4, 64, 512 * GIB, name="n"),), fair=cfg, now_s=now)
    lifted = {j.job_id: j.priority for j in apply_fairness(req)[0].jobs}
    assert is_overdue_priority(lifted[1]) and lifted[2] == lifted[3] == lifted[4] == 0.0


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_places_the_overdue_job_first(policy: str):
    # One GPU, room for one 60 GiB job: the overdue one gets it (complementary would
    # otherwise start the shortest first).
    now = 5 * 3600.0
    early = [job(i, submit=now - 60, dur=300.0, mem_gib=60) for i in range(10, 30)]  # a backlog: no drain tail
    old = job(9, submit=0.0, dur=600.0, mem_gib=60)
    req = PackingRequest(jobs=(old, *early), gpu_models=(H100,), nodes=(NodeShape("h100", 1, 64, 512 * GIB, name="n"),),
                         fair=FAIR, now_s=now)
    assert 9 in plan(req, policy).placed_job_ids
    if policy == "complementary":  # before: shortest first within a priority
        assert 9 not in plan(replace(req, fair=None), policy).placed_job_ids


# ---------------------------------------------------------------- gang reservation

def _gang_request(fair: FairConfig | None, free_gpus: int = 0) -> PackingRequest:
    now = 4 * 3600.0
    # node n: four one-GPU packs (three end within an hour, one in 3 h) and maybe free GPUs
    pgs = (pack_gpu(1, 1800.0), pack_gpu(2, 2400.0), pack_gpu(3, 3600.0), pack_gpu(4, 3 * 3600.0))[:4 - free_gpus]
    gang = job(1, submit=0.0, dur=3600.0, world=4)  # waited 4 h: slowdown 5
    short = job(2, submit=now - 60, dur=900.0)
    long_ = job(3, submit=now - 60, dur=5 * 3600.0)
    nodes = (NodeShape("h100", free_gpus, 64, 512 * GIB, name="n"),) if free_gpus else ()
    return PackingRequest(jobs=(gang, short, long_), gpu_models=(H100,), nodes=nodes, open_gpus=pgs, fair=fair,
                          now_s=now)


def test_a_waiting_gang_reserves_the_packs_that_free_its_gpus_soonest():
    req = _gang_request(FAIR)
    hold = gang_hold(req, req.jobs[0], FAIR)
    assert hold is not None and hold.node_name == "n" and hold.gpus == 4
    assert hold.start_in_s == pytest.approx(3 * 3600.0) and len(hold.pack_ids) == 4
    for policy in ("mem-best-fit", "complementary"):
        p = plan(req, policy)
        joined = {j.member.job_id for j in p.joins}
        assert 3 not in joined, policy  # would keep a reserved pack alive past the reservation
        assert 2 in joined, policy  # backfill: ends before the reservation
        assert "reserved 4 GPUs on n" in {d.job_id: d.reason for d in p.deferred}[1]
        # without the bound the long job joins (and the packs live on)
        assert 3 in {j.member.job_id for j in plan(replace(req, fair=None), policy).joins}


def test_held_free_gpus_take_only_jobs_that_end_before_the_reservation():
    req = _gang_request(FAIR, free_gpus=1)
    for policy in POLICY_NAMES:
        p = plan(req, policy)
        on_free = {m.job_id for pk in p.packs for m in pk.members}
        assert 3 not in on_free, policy
        if policy in ("exclusive", "first-fit"):  # they do not refill: the short job backfills the free GPU
            assert on_free == {2}, policy
        if policy in ("mem-best-fit", "complementary"):
            before = plan(replace(req, fair=None), policy)
            assert 3 in {m.job_id for pk in before.packs for m in pk.members} | {j.member.job_id for j in before.joins}


def test_no_reservation_while_a_node_can_take_the_gang():
    req = _gang_request(FAIR, free_gpus=4)
    assert plan(req, "complementary").packs[0].members[0].job_id == 1  # placed at once


def test_the_services_view_reserves_too_and_new_packs_only_backfill():
    # The service names the site's node groups at full size (count 2, 4 GPUs each) and
    # says how many GPUs are free in all (`max_gpus`), not where. Every GPU of node n1
    # is a one-GPU pack; one GPU is free somewhere. Before, a node "of 4 GPUs" counted as
    # room for the gang: no reservation was ever made there, and refill kept the packs
    # alive for good (tests/test_fair_live.py). Now the gang reserves two packs of n1;
    # the free GPU (it may be on n1) takes only a new pack that ends before them.
    base = _gang_request(FAIR)
    gang = replace(base.jobs[0], world_size=2)
    req = replace(base, jobs=(gang, *base.jobs[1:]), max_gpus=1,
                  open_gpus=tuple(replace(og, node_name="n1") for og in base.open_gpus),
                  nodes=(NodeShape("h100", 4, 64, 512 * GIB, count=2, name="n[1-2]"),))
    for policy in ("mem-best-fit", "complementary"):
        p = plan(req, policy)
        assert "reserved 2 GPUs on n1" in {d.job_id: d.reason for d in p.deferred}[1], policy
        on_new = {m.job_id for pk in p.packs for m in pk.members}
        joined = {j.member.job_id for j in p.joins}
        assert 3 not in on_new, policy  # would hold the free GPU past the reservation
        assert 2 in on_new | joined, policy  # short: backfills
        assert 3 in joined or 3 in {d.job_id for d in p.deferred}, policy
    # two GPUs free in all, on n2 (no pack of ours there): the gang's pack is planned
    assert 1 in plan(replace(req, max_gpus=2), "complementary").placed_job_ids
    # two GPUs free in all, one on each node (each runs three packs of ours): still held,
    # or Slurm would queue the gang's pack while refill kept both nodes busy for good
    split = tuple(replace(og, node_name=f"n{1 + k % 2}") for k, og in enumerate(base.open_gpus[:3] * 2))
    split = tuple(replace(og, key=f"{10 + k}:0:0") for k, og in enumerate(split))
    p = plan(replace(req, max_gpus=2, open_gpus=split), "complementary")
    assert 1 not in p.placed_job_ids and "reserved 2 GPUs on n" in {d.job_id: d.reason for d in p.deferred}[1]


# ---------------------------------------------------------------- simulator: no starvation

CLUSTER = {"name": "c", "gpu_models": {"h100": {"memory_gib": 80, "cuda_context_mib": 512, "cublas_workspace_mib": 0}},
           "nodes": [{"name": "n", "gpu_model": "h100", "gpus": 2, "cpus": 64, "memory_gib": 512}],
           "slurm": {"submit_to_start_s": 2, "member_startup_s": 20},
           "packing": {"round_seconds": 10, "max_members_per_gpu": 2}}


def _stream() -> list[dict[str, object]]:
    # A one-GPU job every 10 minutes for 20 h, each 1 h and 40 GiB (two fill a GPU), and a
    # two-rank job submitted after the first hour.
    jobs: list[dict[str, object]] = [
        {"name": f"s{i}", "arrival_s": 600.0 * i, "solo_duration_s": 3600.0,
         "profile": {"sm_util_pct": 10, "membw_util_pct": 10, "gpu_mem_gib": 36, "host_mem_gib": 4,
                     "host_cpu_cores": 2}} for i in range(120)]
    jobs.append({"name": "gang", "arrival_s": 3600.0, "solo_duration_s": 3600.0, "world_size": 2,
                 "profile": {"sm_util_pct": 10, "membw_util_pct": 10, "gpu_mem_gib": 36, "host_mem_gib": 4,
                             "host_cpu_cores": 2}})
    return jobs


@pytest.mark.parametrize("policy", ("mem-best-fit", "complementary"))
def test_a_gang_behind_a_stream_of_one_gpu_jobs_starts_within_its_bound(policy: str):
    c = parse_cluster(CLUSTER)
    w = parse_workload({"name": "w", "jobs": _stream()}, {g.name: g for g in c.gpu_models})
    gang_id = next(j.job_id for j in w.jobs if j.world_size == 2)

    def slowdowns(rule: str) -> tuple[float, float]:
        """The gang's slowdown and the one-GPU jobs' median."""
        r = simulate(w, c, policy, fairness=rule)
        assert all(o.state == "COMPLETED" for o in r.jobs)
        sd = {o.job_id: (o.end_s - o.arrival_s) / o.solo_duration_s for o in r.jobs}  # type: ignore[operator]
        singles = sorted(v for k, v in sd.items() if k != gang_id)
        return sd[gang_id], singles[len(singles) // 2]

    before, singles_before = slowdowns("rounds")
    after, singles_after = slowdowns("slowdown")
    assert before > 10 and before > 1.5 * singles_before  # refill kept both GPUs busy until the stream ended
    # reserved once its slowdown passed 3 x the waiting one-GPU jobs' median
    # (FairConfig.gang_vs_single), started once the packs it waits for drained: it ends
    # about as late, relative to its run, as a typical one-GPU job (the 1.5)
    assert after <= 1.5 * singles_after and after < before / 2


# ---------------------------------------------------------------- queue --start's forward run

def test_expected_starts_from_a_snapshot_match_the_run_when_estimates_are_right():
    from slurm_dlrm.sim.start_estimate import expected_starts, within_share

    c = parse_cluster({**CLUSTER, "nodes": [{"name": "n", "gpu_model": "h100", "gpus": 1, "cpus": 64,
                                            "memory_gib": 512}]})
    big = {"sm_util_pct": 10, "membw_util_pct": 10, "gpu_mem_gib": 60, "host_mem_gib": 4, "host_cpu_cores": 2}
    jobs = [{"name": f"j{i}", "arrival_s": 0.0, "solo_duration_s": 1000.0 * (i + 1), "profile": big}
            for i in range(4)]  # one at a time: each waits for the ones before it
    w = parse_workload({"name": "w", "jobs": jobs}, {g.name: g for g in c.gpu_models})
    r = simulate(w, c, "complementary", snapshot_at_s=(500.0,))
    (snap,) = r.snapshots
    assert len(snap.running) == 1 and len(snap.pending) == 3
    pred = expected_starts(snap, {j.job_id: j for j in w.jobs}, c, "complementary")
    actual = {o.job_id: o.start_s for o in r.jobs if o.job_id in pred}
    assert set(pred) == {jid for jid, _, _ in snap.pending}
    assert sorted(pred, key=pred.__getitem__) == sorted(actual, key=actual.__getitem__)
    assert within_share(pred, actual, snap.now_s) == (3, 3)  # type: ignore[arg-type]


def test_the_rule_is_a_site_and_cluster_key(tmp_path):
    from service_harness import make_site

    from slurm_dlrm.errors import BadInput
    from slurm_dlrm.packing.dispatch import DispatchConfig

    # The default is the slowdown rule (issue 40); round-based aging is a site choice.
    assert DispatchConfig.from_site(make_site(tmp_path)).fair == FairConfig()
    assert DispatchConfig.from_site(make_site(tmp_path, fairness="rounds")).fair is None
    assert DispatchConfig().fairness == "slowdown"
    assert parse_cluster(CLUSTER).dispatch.fairness == "slowdown"
    assert parse_cluster(CLUSTER).dispatch.fair == FairConfig()
    assert parse_cluster({**CLUSTER, "packing": {"fairness": "rounds"}}).dispatch.fairness == "rounds"
    with pytest.raises(BadInput, match="fairness"):
        parse_cluster({**CLUSTER, "packing": {"fairness": "fifo"}})


def test_the_rules_tuning_is_a_site_and_cluster_key(tmp_path):
    # (so a live test can use a small bound and wait)
    from service_harness import make_site

    from slurm_dlrm.errors import BadInput, ConfigError
    from slurm_dlrm.packing.dispatch import DispatchConfig

    site = make_site(tmp_path, fairness="slowdown", overdue_slowdown=3.0, gang_reserve_slowdown=1.5,
                     overdue_min_wait_s=20.0)
    assert DispatchConfig.from_site(site).fair == FairConfig(overdue_slowdown=3.0, gang_reserve_slowdown=1.5,
                                                             min_wait_s=20.0)
    packing = {"fairness": "slowdown", "overdue_slowdown": 3, "gang_reserve_slowdown": 1.5, "overdue_min_wait_s": 20}
    assert parse_cluster({**CLUSTER, "packing": packing}).dispatch.fair == FairConfig(
        overdue_slowdown=3.0, gang_reserve_slowdown=1.5, min_wait_s=20.0)
    with pytest.raises(BadInput, match="overdue_slowdown"):
        parse_cluster({**CLUSTER, "packing": {"overdue_slowdown": 0.5}})
    with pytest.raises(ConfigError, match="overdue_min_wait_s"):
        make_site(tmp_path, overdue_min_wait_s=-1.0)


def test_under_the_bound_only_a_gang_past_its_reservation_point_reserves_pack_gpus():
    # A two-GPU pack: GPU 0 has room for a rank, GPU 1 is full of memory for another
    # hour, so a 2-rank gang cannot join yet. Before it is past its reservation point
    # (slowdown max(2, 3 x the waiting one-GPU jobs' median)) a one-GPU job joins GPU 0;
    # past it, both GPUs are the gang's for this round: nothing joins them (before, the
    # long job joined GPU 0 beside the rank's room it held there, issue 31's second pass:
    # measured to cost more throughput, docs/packing.md).
    now = 4 * 3600.0
    light = OpenGpu("5:0:0", "n", 1, pack=True, gpu_model="h100", free_cpus=32, free_host_mem_bytes=128 * GIB,
                    live=(replace(job(9001, dur=3 * 3600.0), rank=0),))
    full = OpenGpu("5:0:1", "n", 1, pack=True, gpu_model="h100", free_cpus=32, free_host_mem_bytes=128 * GIB,
                   live=(replace(job(9002, dur=3600.0, mem_gib=74), rank=0),))
    single = job(2, submit=now - 60, dur=5 * 3600.0)
    fresh_gang = job(1, submit=now - 600, dur=3600.0, world=2)  # slowdown 1.17
    old_gang = job(1, submit=0.0, dur=3600.0, world=2)  # slowdown 5 (the one-GPU job's is 1.0)
    for gang, joins in ((fresh_gang, True), (old_gang, False)):
        req = PackingRequest(jobs=(gang, single), gpu_models=(H100,), nodes=(), open_gpus=(light, full),
                             fair=FAIR, now_s=now)
        for policy in ("mem-best-fit", "complementary"):
            joined = {j.member.job_id: j.gpu_key for j in plan(req, policy).joins}
            assert 1 not in joined, policy
            assert (joined.get(2) == "5:0:0") is joins, (policy, gang.submit_time_s, joined)


def test_a_reserved_gpu_takes_a_long_joiner_that_leaves_the_gang_its_rank_room(monkeypatch):
    # (Issue 31's second pass, off since its third: refill._GANG_HOLDS.)
    monkeypatch.setattr(refill, "_GANG_HOLDS", True)
    # A two-GPU pack: GPU 0 has room for a rank, GPU 1 is full of memory for another
    # hour, so the waiting 2-rank gang reserves both. It needs one rank's room on each,
    # not the GPUs drained: a long light job may join GPU 0 beside the room (before
    # issue 31's second pass it could not: it ends after GPU 0's live member), a long
    # job that would take the room may not.
    now = 4 * 3600.0
    light = OpenGpu("5:0:0", "n", 1, pack=True, gpu_model="h100", free_cpus=32, free_host_mem_bytes=128 * GIB,
                    live=(replace(job(9001, dur=3 * 3600.0), rank=0),))
    full = OpenGpu("5:0:1", "n", 1, pack=True, gpu_model="h100", free_cpus=32, free_host_mem_bytes=128 * GIB,
                   live=(replace(job(9002, dur=3600.0, mem_gib=74), rank=0),))
    gang = job(1, submit=0.0, dur=3600.0, world=2)  # waited 4 h: slowdown 5, past the reservation point
    long_light = job(2, submit=now - 60, dur=5 * 3600.0)
    long_heavy = job(3, submit=now - 60, dur=5 * 3600.0, mem_gib=68)  # fits beside the live member, not the rank too
    req = PackingRequest(jobs=(gang, long_light, long_heavy), gpu_models=(H100,), nodes=(), open_gpus=(light, full),
                         fair=FAIR, now_s=now)
    p = plan(req, "complementary")
    joined = {j.member.job_id: j.gpu_key for j in p.joins}
    assert 1 not in joined  # the gang cannot join yet (GPU 1's memory)
    assert joined.get(2) == "5:0:0"
    assert 3 not in joined
    assert 3 in {j.member.job_id for j in plan(replace(req, jobs=(long_heavy,), fair=None), "complementary").joins}
    # the joiner left the rank its room: once GPU 1's member ends, the gang joins both
    later = replace(req, jobs=(gang,), now_s=now + 3600.0,
                    open_gpus=(replace(light, members=2, live=light.live + (replace(long_light, rank=0),)),
                               replace(full, members=0, live=())))
    assert {j.member.job_id for j in plan(later, "complementary").joins} == {1}


def test_the_simulator_is_causal_so_a_run_without_later_arrivals_is_the_same_until_then():
    # policy_compare.py measures queue --start against the run with the jobs submitted
    # after the question left out ("given the queue"): that run must be the same run up
    # to that moment, or the comparison measures something else.
    c = parse_cluster(CLUSTER)
    w = parse_workload({"name": "w", "jobs": _stream()}, {g.name: g for g in c.gpu_models})
    full = simulate(w, c, "complementary", fairness="slowdown")
    for cut_s in (2 * 3600.0, 5 * 3600.0):
        part = simulate(replace(w, jobs=tuple(j for j in w.jobs if j.arrival_s <= cut_s)), c, "complementary",
                        fairness="slowdown")
        a = {o.job_id: o.start_s for o in full.jobs if o.start_s is not None and o.start_s <= cut_s}
        b = {o.job_id: o.start_s for o in part.jobs if o.start_s is not None and o.start_s <= cut_s}
        assert a == b and len(a) > 5
        assert any(o.start_s is None or o.start_s > cut_s for o in part.jobs)  # some were still waiting then


def test_joiners_on_any_reserved_gpu_leave_the_gang_its_cpus_on_the_node(monkeypatch):
    monkeypatch.setattr(refill, "_GANG_HOLDS", True)  # (second pass, as above)
    # A 3-rank gang reserved three GPUs of one pack node (GPU 2 is full for an hour).
    # The allocation's CPUs are the node's, shared by its GPUs: long joiners that leave
    # the ranks' room must leave their CPUs too, wherever they join. 8 free CPUs, the
    # ranks take 6: one long 2-CPU joiner, not two (one per GPU would each fit alone).
    now = 4 * 3600.0

    def gpu(k: int, mem_gib: float, rest_s: float) -> OpenGpu:
        return OpenGpu(f"5:0:{k}", "n", 1, pack=True, gpu_model="h100", free_cpus=8, free_host_mem_bytes=128 * GIB,
                       live=(replace(job(9000 + k, dur=rest_s, mem_gib=mem_gib), rank=0),))

    gang = job(1, submit=0.0, dur=3600.0, world=3)
    longs = (job(2, submit=now - 60, dur=5 * 3600.0), job(3, submit=now - 60, dur=5 * 3600.0))
    assert gang.cpus * 3 == 6 and all(j.cpus == 2 for j in longs)
    req = PackingRequest(jobs=(gang, *longs), gpu_models=(H100,), nodes=(),
                         open_gpus=(gpu(0, 4, 3 * 3600.0), gpu(1, 4, 3 * 3600.0), gpu(2, 74, 3600.0)),
                         fair=FAIR, now_s=now)
    joined = {j.member.job_id for j in plan(req, "complementary").joins}
    assert 1 not in joined and len(joined & {2, 3}) == 1
