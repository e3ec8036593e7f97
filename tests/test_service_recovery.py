"""The service's recovery and adaptation (slurm_dlrm/service/recovery.py) on FakeSlurm
with a fake clock: OOM retry and learning, heartbeat deadline, stragglers, warm start,
share tuning from perf models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from service_harness import (
    GIB,
    FakeClock,
    FakeCluster,
    add_job,
    estimate_dict,
    make_site,
    spec_dict,
)
from service_harness import (
    start_pack as start,
)

from slurm_dlrm.service.core import PackingService, ServiceSettings

FakeSlurm = pytest.importorskip("slurm_dlrm.slurm.fake").FakeSlurm
_states = pytest.importorskip("slurm_dlrm.store.states")
Store = pytest.importorskip("slurm_dlrm.store.store").Store
JobState, PackState = _states.JobState, _states.PackState

USER = "root"


@pytest.fixture
def world(tmp_path):
    clock = FakeClock()
    site = make_site(tmp_path)
    store = Store(tmp_path / "store.sqlite", clock=clock)
    slurm = FakeSlurm(clock=clock, user=USER)
    svc = PackingService(store, slurm, site, ServiceSettings(user=USER, python="/venv/bin/python"), clock=clock)
    yield svc, store, slurm, clock, FakeCluster(slurm, clock)
    store.close()


def add_fp_job(store, name: str, fingerprint: str, **est) -> int:
    return int(store.add_job(user=USER, name=name, spec=spec_dict(name), spec_fingerprint=fingerprint,
                             estimate=estimate_dict(**est), gpu_model="h100"))




def events(store, job_id, kind=None):
    return [e["reason"] for e in store.events(job_id=job_id, kind=kind)]


def test_oom_requeues_with_measured_raise_and_learns_for_the_fingerprint(world):
    svc, store, slurm, clock, cluster = world
    a = add_fp_job(store, "a", "fp-x", gpu_gib=4)
    pack, sid, p = start(svc, slurm, cluster)
    fence = p["members"][0]["gpu_mem_limit_mib"] << 20
    cluster.report(p, [{"type": "sample", "job_id": a, "gpu_index": 0, "gpu_mem_bytes": fence - (1 << 20),
                        "sm_util_pct": 30.0, "samples_per_s": 100.0}])
    cluster.member(p, a, "OOM_GPU", 3, "CUDA out of memory")
    slurm.finish(sid)
    svc.run_round()
    job = store.get_job(a)
    assert job.attempt == 1 and job.gpu_mem_request_bytes > fence  # from the fence, not the old estimate
    assert job.gpu_mem_request_bytes < 2 * 4 * GIB  # not a blind doubling
    assert any("retry 2" in r and "resumes from its checkpoint" in r for r in events(store, a, "job_state"))
    learned = store.events(kind="learned")
    assert learned and learned[0]["data"]["fingerprint"] == "fp-x" and learned[0]["data"]["gpu_factor"] > 1.0
    # A later job of the same spec starts with the learned figure; another spec does not.
    b = add_fp_job(store, "b", "fp-x", gpu_gib=4)
    c = add_fp_job(store, "c", "fp-other", gpu_gib=4)
    db = svc.demand_of(store.get_job(b))
    dc = svc.demand_of(store.get_job(c))
    assert db.gpu_mem_bytes > dc.gpu_mem_bytes
    assert any(r.startswith("warm start") and "GPU x" in r for r in events(store, b, "adapt"))
    assert not events(store, c, "adapt")


def test_oom_past_the_retry_limit_is_not_retried_and_says_why(world):
    svc, store, slurm, clock, cluster = world
    svc.settings = ServiceSettings(user=USER, python="/venv/bin/python", max_attempts=1)
    a = add_fp_job(store, "a", "fp-y", gpu_gib=4)
    pack, sid, p = start(svc, slurm, cluster)
    cluster.member(p, a, "OOM_GPU", 3, "CUDA out of memory")
    slurm.finish(sid)
    svc.run_round()
    assert store.get_job(a).state == JobState.OOM
    assert any("not retried" in r and "limit 1" in r for r in events(store, a, "decision"))


def test_silent_agents_end_the_pack_lost_and_only_unfinished_members_rerun(world):
    svc, store, slurm, clock, cluster = world
    a = add_job(store, "a")
    b = add_job(store, "b")
    pack, sid, p = start(svc, slurm, cluster)
    assert {m["job_id"] for m in p["members"]} == {a, b}
    cluster.member(p, b, "COMPLETED", 0)
    cluster.report(p, [{"type": "heartbeat"}])
    clock.advance(svc.site.agent.heartbeat_timeout_s - 5)
    svc.run_round()
    assert store.get_pack(pack.id).state == PackState.RUNNING  # not yet past the deadline
    clock.advance(10)
    svc.run_round()
    assert store.get_pack(pack.id).state == PackState.LOST
    assert slurm.job(sid).state.name == "CANCELLED"  # the half-dead allocation is released
    ja, jb = store.get_job(a), store.get_job(b)
    assert jb.state == JobState.COMPLETED and jb.attempt == 0  # finished: not rerun
    assert ja.attempt == 1 and ja.state == JobState.PLANNED and ja.pack_id != pack.id
    assert any("no agent heartbeat" in e["reason"] for e in store.events(pack_id=pack.id))


def test_heartbeats_keep_a_pack_alive(world):
    svc, store, slurm, clock, cluster = world
    add_job(store, "a")
    pack, sid, p = start(svc, slurm, cluster)
    for _ in range(6):
        clock.advance(svc.site.agent.heartbeat_timeout_s / 2)
        cluster.report(p, [{"type": "heartbeat"}])
        svc.run_round()
    assert store.get_pack(pack.id).state == PackState.RUNNING


def _samples(cluster, p, job_id, t0, t1, sps, sm, every=10.0):
    t = t0
    recs = []
    while t <= t1:
        recs.append({"type": "sample", "job_id": job_id, "gpu_index": 0, "sm_util_pct": sm,
                     "samples_per_s": sps, "t": t})
        recs.append({"type": "heartbeat", "t": t})
        t += every
    reports = Path(p["pack_dir"]) / "reports"
    reports.mkdir(exist_ok=True)
    with open(reports / "node1.jsonl", "a") as f:
        for r in recs:
            f.write(json.dumps({"pack_id": p["pack_id"], "node": "node1", **r}) + "\n")


def test_straggler_is_checkpointed_and_moved_neighbour_untouched(world):
    svc, store, slurm, clock, cluster = world
    a = add_job(store, "a", sm=20, bw=20)
    b = add_job(store, "b", sm=20, bw=20)
    pack, sid, p = start(svc, slurm, cluster)
    assert {(m["node_index"], m["gpu_index"]) for m in p["members"]} == {(0, 0)}  # one GPU
    t0 = clock()
    # Warm-up: both at 1000 samples/s; then a falls to 400 for 200 s while b holds (a slow
    # device: no member uses more than planned, so the straggler itself moves).
    _samples(cluster, p, a, t0, t0 + 60, 1000.0, 20.0)
    _samples(cluster, p, b, t0, t0 + 260, 1000.0, 20.0)
    _samples(cluster, p, a, t0 + 70, t0 + 260, 400.0, 20.0)
    clock.advance(265)
    svc.run_round()
    cancel = Path(p["pack_dir"]) / "cancel"
    assert (cancel / str(a)).exists() and not (cancel / str(b)).exists()
    assert any("checkpoint and move" in r for r in events(store, a, "move"))
    assert any("warm-up" in r for r in events(store, b, "adapt"))
    svc.run_round()  # asked once only
    assert len(events(store, a, "move")) == 1
    cluster.member(p, a, "CANCELLED", None, "stopped on request")
    svc.run_round()
    ja, jb = store.get_job(a), store.get_job(b)
    assert ja.attempt == 1 and ja.state in (JobState.PENDING, JobState.PLANNED)
    assert any(r.startswith("moved:") for r in events(store, a, "job_state"))
    assert jb.state == JobState.RUNNING and jb.attempt == 0


def test_user_cancel_is_still_a_cancel(world):
    svc, store, slurm, clock, cluster = world
    a = add_job(store, "a")
    pack, sid, p = start(svc, slurm, cluster)
    cluster.member(p, a, "CANCELLED", None, "cancelled by the user")
    svc.run_round()
    assert store.get_job(a).state == JobState.CANCELLED


def test_similar_finished_jobs_warm_start_the_profile(world):
    svc, store, slurm, clock, cluster = world
    a = add_fp_job(store, "a", "fp-z", sm=60, cores=1.0)
    pack, sid, p = start(svc, slurm, cluster)
    t0 = clock()
    _samples(cluster, p, a, t0, t0 + 50, 500.0, 15.0)
    clock.advance(55)
    cluster.member(p, a, "COMPLETED", 0)
    slurm.finish(sid)
    svc.run_round()
    assert store.get_job(a).state == JobState.COMPLETED
    b = add_fp_job(store, "b", "fp-z", sm=60, cores=1.0)
    d = svc.demand_of(store.get_job(b))
    assert d.sm_util_pct == pytest.approx(15.0)  # measured, not the analytic 60%
    assert any("similar finished job" in r for r in events(store, b, "adapt"))


def test_tune_shares_uses_perf_models_where_every_member_has_one(world, monkeypatch):
    from slurm_dlrm.adapt import PerfModel

    svc, store, slurm, clock, cluster = world
    a = add_fp_job(store, "a", "fp-gpu-heavy")
    b = add_fp_job(store, "b", "fp-host-heavy")
    models = {"fp-gpu-heavy": PerfModel(0.0, 1e-3, 1e-5, 5), "fp-host-heavy": PerfModel(0.0, 1e-5, 4e-3, 5)}
    monkeypatch.setattr(svc.recovery, "perf_model", lambda fp: models.get(fp))
    svc.run_round()
    pl = {x.job_id: x for x in store.placements()}
    assert pl[a].mps_thread_pct > pl[b].mps_thread_pct  # the GPU-bound member gets the SMs
    assert pl[a].cpus <= pl[b].cpus
    assert any("resource-performance model" in r for r in events(store, a, "adapt"))


def test_the_member_using_more_than_planned_is_moved_not_its_slowed_neighbour(world):
    svc, store, slurm, clock, cluster = world
    a = add_job(store, "a", sm=20, bw=20)
    b = add_job(store, "b", sm=20, bw=20)
    pack, sid, p = start(svc, slurm, cluster)
    t0 = clock()
    # After the warm-up a starts using 3x its planned SMs; b slows to 40% of its warm-up speed.
    _samples(cluster, p, a, t0, t0 + 60, 1000.0, 20.0)
    _samples(cluster, p, a, t0 + 70, t0 + 260, 900.0, 60.0)
    _samples(cluster, p, b, t0, t0 + 60, 1000.0, 20.0)
    _samples(cluster, p, b, t0 + 70, t0 + 260, 400.0, 20.0)
    clock.advance(265)
    svc.run_round()
    cancel = Path(p["pack_dir"]) / "cancel"
    assert (cancel / str(a)).exists() and not (cancel / str(b)).exists()
    assert any("3.0x its planned share" in r for r in events(store, a, "move"))


def test_perf_model_fitted_from_runs_at_different_shares(world):
    from slurm_dlrm.store.records import NewPlacement

    svc, store, slurm, clock, cluster = world
    # Truth: seconds/sample = 1e-3 * 100/share + 2e-3 / cpus; four runs of one spec.
    for i, (share, cpus) in enumerate([(25, 1), (50, 2), (100, 4), (50, 1)]):
        j = add_fp_job(store, f"r{i}", "fp-perf")
        pid = store.add_pack(name=f"p{i}", user=USER, policy="complementary", n_gpus=1,
                             placements=[NewPlacement(job_id=j, node_index=0, gpu_index=0, mps_thread_pct=share,
                                                      cpus=cpus)])
        sps = 1.0 / (1e-3 * 100 / share + 2e-3 / cpus)
        store.add_samples([{"t": clock() + k, "pack_id": pid, "job_id": j, "node": "node1", "gpu_index": 0,
                            "samples_per_s": sps} for k in range(3)])
    model = svc.recovery.perf_model("fp-perf")
    assert model is not None and model.points == 4
    assert model.samples_per_s(75, 3) == pytest.approx(1.0 / (1e-3 * 100 / 75 + 2e-3 / 3), rel=0.02)
    assert svc.recovery.perf_model("fp-unknown") is None


def test_node_fail_fences_the_old_run_before_the_rerun(world):
    svc, store, slurm, clock, cluster = world
    a = add_job(store, "a")
    pack, sid, p = start(svc, slurm, cluster)
    slurm.set_state(sid, "NODE_FAIL")
    svc.run_round()
    assert (Path(p["pack_dir"]) / "cancel" / str(a)).exists()  # a surviving agent stops it
    job = store.get_job(a)
    assert job.attempt == 1 and job.state in (JobState.PENDING, JobState.PLANNED)


def _cuda_estimate(host_mib: int) -> dict:
    """An estimate dict whose host breakdown took the CUDA runtime term (as the analytic one does)."""
    d = estimate_dict()
    d["host_peak_bytes"] = host_mib << 20
    d["host_breakdown"] = {"runtime": 1536 << 20, "pinned_staging": (host_mib - 1536) << 20}
    return d


def test_a_new_spec_takes_its_host_demand_and_pack_mem_from_the_sites_measured_runs(world):
    """Issue 43 item 13: the host runtime term's resident share depends on the site, so a
    spec with no run of its own is sized from what the site's finished runs of any spec
    measured (the largest measured - estimated), which lowers an over-estimate."""
    import math

    from slurm_dlrm.service.refill import pack_allocation

    svc, store, slurm, clock, cluster = world
    old = [int(store.add_job(user=USER, name=f"old{i}", spec=spec_dict(f"old{i}"), spec_fingerprint=f"fp-old{i}",
                             estimate=_cuda_estimate(2048), gpu_model="h100")) for i in range(4)]
    pack, sid, p = start(svc, slurm, cluster)
    assert {m["job_id"] for m in p["members"]} == set(old)
    assert all(m["host_mem_limit_bytes"] >= 2048 << 20 for m in p["members"])  # the analytic estimate
    # The 4th trained on the CPU (its runner's metrics say so): its tables were in host
    # memory, which a GPU-run estimate does not count; it says nothing about the runtime.
    metrics = Path(p["pack_dir"]).parent / "jobs" / str(old[3]) / "metrics.jsonl"
    metrics.parent.mkdir(parents=True, exist_ok=True)
    metrics.write_text(json.dumps({"step": 10, "device": "cpu"}) + "\n")
    # measured 300, 260 and 280 MiB below their estimates: the site's runtime term is smaller
    for job_id, rss_mib in zip(old, (1748, 1788, 1768, 2548), strict=True):
        cluster.report(p, [{"type": "sample", "job_id": job_id, "gpu_index": 0, "rss_bytes": rss_mib << 20,
                            "sm_util_pct": 20.0, "samples_per_s": 100.0}])
        cluster.member(p, job_id, "COMPLETED", 0)
    slurm.finish(sid)
    svc.run_round()
    assert all(store.get_job(j).state == JobState.COMPLETED for j in old)
    new = int(store.add_job(user=USER, name="new", spec=spec_dict("new"), spec_fingerprint="fp-new",
                            estimate=_cuda_estimate(3072), gpu_model="h100"))
    again = int(store.add_job(user=USER, name="again", spec=spec_dict("again"), spec_fingerprint="fp-old0",
                              estimate=_cuda_estimate(2048), gpu_model="h100"))
    clock.advance(60)
    svc.run_round()
    placed = {m["job_id"]: (x, pl) for x in store.packs() if x.id != pack.id
              for pl in [cluster.placement_of(int(x.slurm_job_id))] for m in pl["members"]}
    limits = {j: m["host_mem_limit_bytes"] for j, (_, pl) in placed.items() for m in pl["members"] if m["job_id"] == j}
    margin = 1.0 + svc.site.packing.memory_margin_pct / 100.0
    # the largest measured - estimated of the three runs: -260 MiB (it covers each of them)
    assert limits[new] == math.ceil(((3072 - 260) << 20) * margin)
    # a spec with runs of its own keeps its own calibration (it wins): not lowered
    assert limits[again] == math.ceil((2048 << 20) * margin)
    pack2, p2 = placed[new]  # its pack's --mem is sized from the lowered limit
    _, mem_mib = pack_allocation(p2["members"], pack2.n_nodes, *svc.node_limits(), 512,
                                 p2.get("reserve_cpus", 0), p2.get("reserve_host_mem_bytes", 0))
    assert f"--mem={mem_mib}M" in slurm.job(int(pack2.slurm_job_id)).script
    ev = [e for e in store.events(job_id=new, kind="adapt") if "site's host calibration" in e["reason"]]
    assert len(ev) == 1 and "3072 -> 2812 MiB" in ev[0]["reason"] and ev[0]["data"]["runs"] == 3  # not the CPU one
    assert ev[0]["data"]["site_host_correction_bytes"] == -(260 << 20)
    assert not [e for e in store.events(job_id=again, kind="adapt") if "site's host" in e["reason"]]
