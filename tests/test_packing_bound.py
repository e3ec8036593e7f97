"""Issue 19's mechanisms (docs/packing.md "Closer to the bound"): a live member counted
at its measured peak, priced joins, drain-tail jobs first with a backfill reservation,
fences from the estimate's observed error."""

from __future__ import annotations

from dataclasses import replace

from slurm_dlrm.packing import JobDemand, PackingLimits, PackingRequest, member_fence_bytes, plan
from slurm_dlrm.packing.common import drain_tail
from slurm_dlrm.packing.model import NodeShape, OpenGpu, live_gpu_bytes, usable_gpu_bytes
from slurm_dlrm.sim import parse_cluster, parse_workload, simulate
from slurm_dlrm.site import GIB, GpuModel

H100 = GpuModel("h100", 80, 132, 3350, 67, 494, 520, 32)


def _d(job_id: int, mem_gib: float = 4, sm: float = 10, bw: float = 10, cpus: float = 2,
       dur: float | None = 600.0, observed_gib: float | None = None) -> JobDemand:
    return JobDemand(job_id=job_id, user="u", submit_time_s=float(job_id), priority=0.0,
                     gpu_mem_bytes=int(mem_gib * GIB), host_mem_bytes=4 * GIB, sm_util_pct=sm, membw_util_pct=bw,
                     host_cpu_cores=cpus, est_duration_s=dur,
                     observed_gpu_mem_bytes=None if observed_gib is None else int(observed_gib * GIB))


def _pack(live: tuple[JobDemand, ...], key: str = "7:0:0", free_cpus: int = 16) -> OpenGpu:
    return OpenGpu(key, "busy", len(live), pack=True, gpu_model="h100", live=live, free_cpus=free_cpus,
                   free_host_mem_bytes=128 * GIB)


def test_a_live_member_past_its_peak_counts_at_its_measured_peak_never_above_its_fence():
    lim = PackingLimits()
    fence = member_fence_bytes(_d(1, 40), H100, lim)
    assert live_gpu_bytes(_d(1, 40), H100, lim) == fence  # not measured yet: the fence
    below = live_gpu_bytes(_d(1, 40, observed_gib=36), H100, lim)
    assert below < fence and below >= 36 * GIB * 1.02
    assert live_gpu_bytes(_d(1, 40, observed_gib=60), H100, lim) == fence  # the fence caps it


def test_refill_uses_the_memory_a_measured_member_does_not_take():
    # Two 36 GiB members fenced at 36 * 1.05 + context: a 6.5 GiB joiner does not fit
    # beside their fences, but does once both are measured at 33 GiB.
    joiner = _d(3, 6.5, sm=5, bw=5)
    lim = PackingLimits(max_members_per_gpu=4)
    fenced = (_d(1, 36), _d(2, 36))
    assert sum(member_fence_bytes(j, H100, lim) for j in fenced) + member_fence_bytes(joiner, H100, lim) > usable_gpu_bytes(H100)
    req = PackingRequest(jobs=(joiner,), gpu_models=(H100,), nodes=(), limits=lim, open_gpus=(_pack(fenced),))
    assert plan(req, "complementary").joins == ()
    measured = tuple(replace(j, observed_gpu_mem_bytes=33 * GIB) for j in fenced)
    p = plan(replace(req, open_gpus=(_pack(measured),)), "complementary")
    assert [j.member.job_id for j in p.joins] == [3]
    # The joiner's own fence is still estimate + margin + context.
    assert p.joins[0].member.gpu_mem_limit_mib * 2**20 >= member_fence_bytes(joiner, H100, lim)


def test_priced_refill_takes_the_job_the_backlog_is_heaviest_on():
    # The backlog is mostly bandwidth-heavy work: a bandwidth-heavy joiner drains it,
    # where summed speed alone prefers the light, nearly free host-bound job.
    live = (_d(100, 10, sm=30, bw=5),)
    light = _d(1, 2, sm=4, bw=3, dur=600.0)
    heavy = [_d(i, 16, sm=10, bw=35, dur=600.0) for i in range(2, 8)]
    req = PackingRequest(jobs=(light, *heavy), gpu_models=(H100,), nodes=(),
                         limits=PackingLimits(max_members_per_gpu=2), open_gpus=(_pack(live),))
    p = plan(req, "complementary")
    assert [j.member.job_id for j in p.joins] == [2]


def test_drain_tail_names_the_long_jobs_only_when_the_backlog_is_short():
    short = [_d(i, 30, dur=600.0) for i in range(1, 5)]
    long_job = _d(9, 30, dur=6 * 3600.0)
    nodes = (NodeShape("h100", 1, 26, 200 * GIB, name="n"),)
    req = PackingRequest(jobs=(*short, long_job), gpu_models=(H100,), nodes=nodes)
    assert drain_tail(req, 0.5) == frozenset({9})
    # A long backlog: 400 jobs of 30 min (8.5 of 80 GiB each) keep the GPU busy ~21 h.
    busy = replace(req, jobs=(*[_d(i, 8, dur=1800.0) for i in range(10, 410)], long_job))
    assert drain_tail(busy, 0.5) == frozenset()
    # Two 30 GiB jobs fit a GPU: the tail job seeds it, though shortest-first would
    # leave it for last.
    p = plan(req, "complementary")
    assert 9 in {m.job_id for m in p.packs[0].members}


def test_a_reservation_keeps_long_joiners_off_the_gpu_a_tail_job_waits_for():
    # Live: a 40 GiB member ending in 10 min. Pending: a 6 h, 45 GiB tail job that fits
    # only once it ends; a 33 GiB job of 1 h that fits now but would keep it out, and a
    # 2 GiB job of 5 min that ends before (backfill); the two do not fit together.
    live = (_d(100, 40, dur=600.0),)
    tail = _d(1, 45, dur=6 * 3600.0)
    long_big = _d(2, 33, dur=3600.0)
    short_small = _d(3, 2, dur=300.0)
    req = PackingRequest(jobs=(tail, long_big, short_small), gpu_models=(H100,), nodes=(),
                         limits=PackingLimits(max_members_per_gpu=4), open_gpus=(_pack(live),))
    assert 1 in drain_tail(req, 0.5)
    joined = {j.member.job_id for j in plan(req, "complementary").joins}
    assert joined == {3}


def _sim(jobs: list[dict], margin_from_errors: bool = True, policy: str = "complementary"):
    cluster = parse_cluster({"name": "c", "gpu_models": {"h100": {"memory_gib": 80, "cuda_context_mib": 512,
                                                                  "cublas_workspace_mib": 0}},
                             "nodes": [{"name": "n", "gpu_model": "h100", "gpus": 1, "cpus": 32, "memory_gib": 256}],
                             "slurm": {"submit_to_start_s": 2, "member_startup_s": 20},
                             # the later jobs join the first one's pack: its GPU's share as headroom
                             "packing": {"round_seconds": 10, "refill_headroom_pct": 1000}})
    w = parse_workload({"name": "w", "jobs": jobs}, {g.name: g for g in cluster.gpu_models})
    return simulate(w, cluster, policy, margin_from_errors=margin_from_errors)


def _job(name: str, arrival: float, mem: float, true_mem: float) -> dict:
    return {"name": name, "arrival_s": arrival, "solo_duration_s": 1000,
            "profile": {"sm_util_pct": 5, "membw_util_pct": 5, "gpu_mem_gib": mem, "host_mem_gib": 4, "host_cpu_cores": 2},
            "true": {"gpu_mem_gib": true_mem}}


def test_fences_follow_the_observed_error_of_the_estimates():
    # Every estimate is 15% low. The first job OOMs at its 5% fence; the ones that come
    # after its peak was seen are fenced from that error and do not.
    jobs = [_job("a", 0, 10, 11.5)] + [_job(f"b{i}", 600 + 60 * i, 10, 11.5) for i in range(5)]
    learned = _sim(jobs)
    flat = _sim(jobs, margin_from_errors=False)
    assert learned.completion_rate == 1.0 and flat.completion_rate == 1.0
    assert flat.ooms >= 6  # every job once
    assert 1 <= learned.ooms <= 2



class _FlatContention:
    """A speed model where every member of an n-member group runs at speeds[n]."""

    name = "flat-contention"

    def __init__(self, speeds: dict[int, float]) -> None:
        self.speeds = speeds

    def speeds_from_fractions(self, sm, bw):  # type: ignore[no-untyped-def]
        return [self.speeds[len(sm)]] * len(sm)


def test_the_join_floor_is_relative_to_what_the_live_members_get():
    # Four like members at 0.6 of solo speed; a like joiner takes them to 0.55 each:
    # +0.35 solo jobs of work (5 x 0.55 - 4 x 0.6). An absolute floor (0.4 per unit of
    # weight) turned it away, leaving the room idle; relative to the members' 0.6, the
    # floor is 0.24 and it joins. At 0.5 each the join adds 0.1 < 0.24: refused.
    from slurm_dlrm.packing.interference import InterferenceParams

    live = tuple(_d(100 + k, 10, sm=10, bw=10) for k in range(4))
    req = PackingRequest(jobs=(_d(1, 10, sm=10, bw=10),), gpu_models=(H100,), nodes=(),
                         limits=PackingLimits(max_members_per_gpu=8), open_gpus=(_pack(live),))
    pays = InterferenceParams(speed_model=_FlatContention({2: 0.9, 3: 0.8, 4: 0.6, 5: 0.55}))
    assert [j.member.job_id for j in plan(req, "complementary", pays).joins] == [1]
    costs = InterferenceParams(speed_model=_FlatContention({2: 0.9, 3: 0.8, 4: 0.6, 5: 0.5}))
    assert plan(req, "complementary", costs).joins == ()
