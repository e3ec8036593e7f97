"""The simulator's two measured-memory mechanisms, run by the live service on FakeSlurm
(issue 29 item 3, docs/simulate.md "Simulator and service"): refill counts a live
member past its warm-up at its measured peak, not its fence; and each round's fence
margin is learned from the estimate's error at measured peaks."""

from __future__ import annotations

from dataclasses import replace

import pytest
from service_harness import FakeCluster, add_job, fake_service

import slurm_dlrm.packing.policies as policies
from slurm_dlrm.adapt.margin import learned_margin_pct, peak_error
from slurm_dlrm.packing.model import live_gpu_bytes, member_fence_bytes
from slurm_dlrm.store import JobState, PackState

USER = "root"
REAL_PLAN = policies.plan  # the fixture below records each request
GIB = 1 << 30
MIB = 1 << 20
CTX = (520 + 32) * MIB  # the repo site's h100: CUDA context + cuBLAS workspace, in NVML's per-process bytes
EST_CTX = 600 * MIB  # the harness estimate's context


@pytest.fixture
def world(tmp_path, monkeypatch):
    svc, store, slurm, clock = fake_service(tmp_path, USER)
    requests: list = []
    real_plan = policies.plan

    def recording_plan(request, name=None, params=None):
        requests.append(request)
        return real_plan(request, name, params)

    monkeypatch.setattr(policies, "plan", recording_plan)
    yield svc, store, slurm, clock, FakeCluster(slurm, clock), requests
    store.close()


def _start(svc, store, slurm, cluster, ids):
    svc.run_round()
    (pack,) = store.packs()
    slurm.start(int(pack.slurm_job_id))
    p = cluster.placement_of(int(pack.slurm_job_id))
    for m in p["members"]:
        cluster.member(p, m["job_id"], "RUNNING")
    cluster.report(p, [{"type": "heartbeat"}])
    svc.run_round()
    assert all(store.get_job(i).state == JobState.RUNNING for i in ids)
    return store.get_pack(pack.id), p


def _sample(cluster, p, job_id, gpu_mem_bytes):
    gpu = next(m["gpu_index"] for m in p["members"] if m["job_id"] == job_id)
    cluster.report(p, [{"type": "heartbeat"},
                       {"type": "sample", "job_id": job_id, "gpu_index": gpu, "sm_util_pct": 30.0,
                        "gpu_mem_bytes": gpu_mem_bytes, "rss_bytes": GIB, "samples_per_s": 1000.0}])


def test_refill_counts_a_live_members_measured_peak_not_its_fence(world):
    svc, store, slurm, clock, cluster, requests = world
    # a: 40 GiB without the context, measured at exactly that once warm (no estimate
    # error, so the learned margin stays 5%): its fence is 40 GiB + 5%, its peak + 2%.
    own_a = 40 * GIB
    a = add_job(store, "a", gpu_gib=(own_a + EST_CTX) / GIB, sps=1.0)
    pack, p = _start(svc, store, slurm, cluster, [a])
    assert pack.state == PackState.RUNNING and pack.n_gpus == 1
    gpu_a = p["members"][0]["gpu_index"]
    _sample(cluster, p, a, own_a + CTX)
    # 35.2 GiB + 5%: beside a's fence the GPU's 80 GiB overflow, beside its peak + 2% they do not.
    joiner_gib = (int(35.2 * GIB) + EST_CTX) / GIB
    c = add_job(store, "c", gpu_gib=joiner_gib, sps=1.0)
    clock.advance(1.0)
    requests.clear()
    svc.run_round()
    (live,) = [d for g in requests[-1].open_gpus if g.pack for d in g.live]
    assert live.observed_gpu_mem_bytes is None  # its samples span less than the warm-up: not past its peak
    assert not store.placements(pack_id=pack.id, job_id=c)  # counted at its fence: c does not join
    assert store.get_job(c).pack_id != pack.id  # (c gets a pack of its own on another GPU)

    clock.advance(svc.recovery.config.warmup_s)
    _sample(cluster, p, a, own_a + CTX - GIB)
    d = add_job(store, "d", gpu_gib=joiner_gib, host_gib=0.5, sps=1.0)  # (a twin of a by host memory does not fit: MiB rounding)
    requests.clear()
    svc.run_round()
    request = requests[-1]
    assert request.limits.memory_margin_pct == svc.site.packing.memory_margin_pct
    (live,) = [m for g in request.open_gpus if g.pack and g.key.startswith(f"{pack.id}:") for m in g.live]
    assert live.job_id == a and live.observed_gpu_mem_bytes == own_a  # its peak in this pack, no context
    h100 = svc.site.gpu_models["h100"]
    assert live_gpu_bytes(live, h100, request.limits) < member_fence_bytes(live, h100, request.limits)
    # d joined a's GPU: refill counted a at its peak + 2% + context instead of its fence ...
    (joined,) = store.placements(pack_id=pack.id, job_id=d)
    assert joined.gpu_index == gpu_a and store.get_job(d).state == JobState.PLANNED
    # ... and the same request with a counted at its fence (the old code) joins nothing.
    fenced = replace(request, open_gpus=tuple(
        replace(g, live=tuple(replace(m, observed_gpu_mem_bytes=None) for m in g.live)) for g in request.open_gpus))
    assert [j.member.job_id for j in REAL_PLAN(request, "complementary").joins] == [d]
    assert REAL_PLAN(fenced, "complementary").joins == ()


def test_margin_learned_from_measured_peaks_widens_the_next_fences(world):
    svc, store, slurm, clock, cluster, requests = world
    a = add_job(store, "a", gpu_gib=10.0, sps=100.0)
    pack, p = _start(svc, store, slurm, cluster, [a])
    assert requests[-1].limits.memory_margin_pct == svc.site.packing.memory_margin_pct
    own_est = 10 * GIB - EST_CTX
    measured = int(own_est * 1.2)  # 20% above its estimate
    _sample(cluster, p, a, measured + CTX)
    clock.advance(svc.recovery.config.warmup_s)
    _sample(cluster, p, a, measured + CTX)
    svc.run_round()
    b = add_job(store, "b", gpu_gib=10.0, sps=100.0)
    svc.refill.open_gpus = lambda *a, **k: ((), {})  # b gets a pack of its own: its fence shows the margin
    clock.advance(1.0)
    requests.clear()
    svc.run_round()
    # one error of 0.2 -> 0.2 * (1 + 1) / 1 = 40% (the simulator's rule, adapt/margin.py)
    assert requests[-1].limits.memory_margin_pct == pytest.approx(40.0, rel=1e-3)
    (pb,) = store.placements(job_id=b)
    own_b = 10 * GIB - EST_CTX
    assert pb.gpu_mem_limit_bytes >= int(own_b * 1.4)
    assert pb.gpu_mem_limit_bytes < int(own_b * 1.4) + 2 * GIB


def test_margin_stays_configured_before_a_peak_is_past_its_warm_up(world):
    svc, store, slurm, clock, cluster, requests = world
    a = add_job(store, "a", gpu_gib=10.0, sps=100.0)
    pack, p = _start(svc, store, slurm, cluster, [a])
    _sample(cluster, p, a, 3 * (10 * GIB))  # far above, but only one sample: not past its peak yet
    add_job(store, "b", gpu_gib=10.0, sps=100.0)
    clock.advance(1.0)
    requests.clear()
    svc.run_round()
    assert requests[-1].limits.memory_margin_pct == svc.site.packing.memory_margin_pct


def test_margin_rule_is_the_simulators():
    assert learned_margin_pct([], 5.0) == 5.0
    assert learned_margin_pct([0.01, 0.02], 5.0) == 5.0
    assert learned_margin_pct([0.1, 0.2, 0.05], 5.0) == pytest.approx(100 * 0.2 * 4 / 3)
    assert peak_error(12.0, 10.0) == pytest.approx(0.2)
    assert peak_error(8.0, 10.0) == pytest.approx(0.2)
    assert peak_error(13.0, 10.0, fence_bytes=10.5) == pytest.approx(0.06)  # killed at its fence
    assert peak_error(5.0, 0.0) is None


def test_a_member_that_never_used_gpu_memory_teaches_the_margin_nothing(world):
    """NVML's 0 bytes for a member without a CUDA context says nothing about the
    estimate; taken as an error of 100% it would triple every later fence."""
    svc, store, slurm, clock, cluster, requests = world
    a = add_job(store, "a", gpu_gib=10.0, sps=100.0)
    pack, p = _start(svc, store, slurm, cluster, [a])
    _sample(cluster, p, a, 0)
    clock.advance(svc.recovery.config.warmup_s)
    _sample(cluster, p, a, 0)
    svc.run_round()
    add_job(store, "b", gpu_gib=10.0, sps=100.0)
    clock.advance(1.0)
    requests.clear()
    svc.run_round()
    assert requests[-1].limits.memory_margin_pct == svc.site.packing.memory_margin_pct
