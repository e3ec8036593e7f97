"""Run-time adaptation in the service (slurm_dlrm/service/recovery.py) on FakeSlurm with
a fake clock: run-time re-pack (stage 3), the warm-up's re-plan acted on, and the
interference model refitted from measured co-locations."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from service_harness import FakeClock, FakeCluster, estimate_dict, make_site, spec_dict
from service_harness import start_pack as start

from slurm_dlrm.packing.interference import InterferenceParams, predict_speeds_from_fractions
from slurm_dlrm.service.core import PackingService, ServiceSettings

FakeSlurm = pytest.importorskip("slurm_dlrm.slurm.fake").FakeSlurm
_states = pytest.importorskip("slurm_dlrm.store.states")
Store = pytest.importorskip("slurm_dlrm.store.store").Store
JobState, PackState = _states.JobState, _states.PackState

USER = "root"
LONG = 10**7  # steps: a long job, where a faster placement repays the restart


def _world(tmp_path, **adapt):
    clock = FakeClock()
    site = make_site(tmp_path)
    site = dataclasses.replace(site, adapt=dataclasses.replace(site.adapt, **adapt))
    store = Store(tmp_path / "store.sqlite", clock=clock)
    slurm = FakeSlurm(clock=clock, user=USER)
    svc = PackingService(store, slurm, site, ServiceSettings(user=USER, python="/venv/bin/python"), clock=clock)
    return svc, store, slurm, clock, FakeCluster(slurm, clock)


@pytest.fixture
def world(tmp_path):
    w = _world(tmp_path)
    yield w
    w[1].close()


def add(store, name: str, steps: int = LONG, fp: str | None = None, **est) -> int:
    spec = spec_dict(name, steps=steps)
    return int(store.add_job(user=USER, name=name, spec=spec, spec_fingerprint=fp or f"fp-{name}",
                             estimate=estimate_dict(**est), gpu_model="h100"))




def samples(p, job_id, t0, t1, sps, sm, every=10.0):
    recs = []
    t = t0
    while t <= t1:
        recs.append({"type": "sample", "job_id": job_id, "gpu_index": 0, "sm_util_pct": sm, "samples_per_s": sps,
                     "t": t})
        recs.append({"type": "heartbeat", "t": t})
        t += every
    reports = Path(p["pack_dir"]) / "reports"
    reports.mkdir(exist_ok=True)
    with open(reports / "node1.jsonl", "a") as f:
        for r in recs:
            f.write(json.dumps({"pack_id": p["pack_id"], "node": "node1", **r}) + "\n")


def reasons(store, job_id, kind=None):
    return [e["reason"] for e in store.events(job_id=job_id, kind=kind)]


def asked_to_move(p, job_id) -> bool:
    return (Path(p["pack_dir"]) / "cancel" / str(job_id)).exists()


# ---------------------------------------------------------------- run-time re-pack


def _neighbour_finished(svc, store, slurm, clock, cluster, monkeypatch, steps=LONG):
    """a and b share a GPU; b finishes; a stays at its co-located speed, capped by its
    MPS share, while its fitted perf model says a whole GPU would run it much faster."""
    from slurm_dlrm.adapt import PerfModel

    a = add(store, "a", steps=steps, sm=20, bw=20)
    b = add(store, "b", sm=20, bw=20)
    # Fitted models for both (seconds/sample ~ 1/share: GPU-bound): their shares are split.
    model = PerfModel(0.0, 1e-5, 0.0, 5)
    monkeypatch.setattr(svc.recovery, "perf_model", lambda fp: model if fp in ("fp-a", "fp-b") else None)
    pack, sid, p = start(svc, slurm, cluster)
    assert {(m["node_index"], m["gpu_index"]) for m in p["members"]} == {(0, 0)}
    share = {m["job_id"]: m["mps_thread_pct"] for m in p["members"]}[a]
    assert share < 100  # it shares the SMs, so it runs capped
    t0 = clock()
    samples(p, a, t0, t0 + 200, 1000.0, 20.0)
    samples(p, b, t0, t0 + 60, 1000.0, 20.0)
    clock.advance(65)
    cluster.member(p, b, "COMPLETED", 0)
    svc.run_round()  # b ends; a's first judgement (alone on the GPU now)
    clock.advance(140)
    return a, b, p, share


def test_member_left_alone_at_a_capped_share_is_repacked(world, monkeypatch):
    svc, store, slurm, clock, cluster = world
    a, b, p, share = _neighbour_finished(svc, store, slurm, clock, cluster, monkeypatch)
    svc.run_round()
    assert asked_to_move(p, a)
    (move,) = reasons(store, a, "move")
    assert move.startswith("re-pack:") and "alone on a GPU" in move and "repays the restart" in move
    cluster.member(p, a, "CANCELLED", None, "stopped on request")
    svc.run_round()
    ja = store.get_job(a)
    assert ja.attempt == 1 and ja.state in (JobState.PENDING, JobState.PLANNED)
    assert any(r.startswith("moved: re-pack") for r in reasons(store, a, "job_state"))
    assert store.get_job(b).attempt == 0


def test_no_repack_when_the_restart_does_not_pay_off(world, monkeypatch):
    svc, store, slurm, clock, cluster = world
    # ~200 s of work left at 1000 samples/s (64 per step): a 120 s restart is not repaid.
    steps = (200 * 1000 + 200 * 1000) // 64
    a, b, p, share = _neighbour_finished(svc, store, slurm, clock, cluster, monkeypatch, steps=steps)
    svc.run_round()
    assert not asked_to_move(p, a) and not reasons(store, a, "move")
    assert store.get_job(a).state == JobState.RUNNING


def test_no_repack_that_would_spend_the_last_retry(world, monkeypatch):
    svc, store, slurm, clock, cluster = world
    svc.settings = ServiceSettings(user=USER, python="/venv/bin/python", max_attempts=2)
    a, b, p, share = _neighbour_finished(svc, store, slurm, clock, cluster, monkeypatch)
    svc.run_round()
    assert not asked_to_move(p, a) and store.get_job(a).state == JobState.RUNNING


def test_no_repack_below_the_site_threshold(tmp_path, monkeypatch):
    svc, store, slurm, clock, cluster = _world(tmp_path, repack_threshold_pct=10_000.0)
    try:
        a, b, p, share = _neighbour_finished(svc, store, slurm, clock, cluster, monkeypatch)
        svc.run_round()
        assert not asked_to_move(p, a)
    finally:
        store.close()


def test_a_member_is_judged_at_most_once_per_interval(world, monkeypatch):
    svc, store, slurm, clock, cluster = world
    a = add(store, "a", sm=20, bw=20)
    b = add(store, "b", sm=20, bw=20)
    pack, sid, p = start(svc, slurm, cluster)
    t0 = clock()
    samples(p, a, t0, t0 + 900, 1000.0, 20.0)
    samples(p, b, t0, t0 + 900, 1000.0, 20.0)
    calls = []
    real = svc.recovery._remaining_s
    monkeypatch.setattr(svc.recovery, "_remaining_s", lambda job, sps: calls.append(job.id) or real(job, sps))
    for _ in range(20):  # 200 s of rounds: within one interval
        clock.advance(10)
        svc.run_round()
    assert sorted(calls) == [a, b]  # each judged once (and not moved: the model sees no gain)
    clock.advance(svc.site.adapt.repack_interval_s)
    svc.run_round()
    assert sorted(calls) == [a, a, b, b]
    assert not asked_to_move(p, a) and not asked_to_move(p, b)


# ---------------------------------------------------------------- warm-up re-plan


def _warmup(world, measured_sm_a: float, before_judgement=None):
    """a and b planned on one GPU from their estimates; a's warm-up measures `measured_sm_a`."""
    svc, store, slurm, clock, cluster = world
    a = add(store, "a", sm=20, bw=20)
    b = add(store, "b", sm=20, bw=20)
    pack, sid, p = start(svc, slurm, cluster)
    assert {(m["node_index"], m["gpu_index"]) for m in p["members"]} == {(0, 0)}
    t0 = clock()
    samples(p, a, t0, t0 + 120, 1000.0, measured_sm_a)
    samples(p, b, t0, t0 + 120, 1000.0, 20.0)
    clock.advance(125)
    if before_judgement:
        before_judgement(svc)
    svc.run_round()
    return svc, store, p, a, b


def test_warmup_replan_moves_the_member_when_a_fresh_plan_pays(world):
    svc, store, p, a, b = _warmup(world, measured_sm_a=100.0)
    assert any("(re-plan)" in r for r in reasons(store, a, "adapt"))
    assert asked_to_move(p, a) and not asked_to_move(p, b)
    (move,) = reasons(store, a, "move")
    assert move.startswith("warm-up re-plan:") and "clears the threshold" in move


def test_warmup_replan_kept_in_place_says_why(world):
    svc, store, p, a, b = _warmup(world, measured_sm_a=45.0)  # 50% more SMs: a re-plan, small gain
    assert any("(re-plan)" in r for r in reasons(store, a, "adapt"))
    assert not asked_to_move(p, a) and not asked_to_move(p, b)
    kept = [r for r in reasons(store, a, "adapt") if r.startswith("warm-up asked for a re-plan; kept in place")]
    assert len(kept) == 1 and "below the 10% threshold" in kept[0]


def test_warmup_replan_without_a_free_gpu_is_kept(world, monkeypatch):
    def cluster_full(svc):
        monkeypatch.setattr(svc, "busy_gpus", lambda partition: 8)  # every GPU of the site is held

    svc, store, p, a, b = _warmup(world, measured_sm_a=100.0, before_judgement=cluster_full)
    assert not asked_to_move(p, a)
    assert any(r.endswith("kept in place: no free GPU for a fresh plan") for r in reasons(store, a, "adapt"))


# ---------------------------------------------------------------- interference refit

TRUE = InterferenceParams(sm_contention=1.2, membw_contention=0.2, per_client_overhead=0.08)
PROFILES = {"fp-c": (70.0, 20.0), "fp-m": (20.0, 70.0), "fp-x": (50.0, 50.0), "fp-y": (35.0, 10.0)}
SOLO_SPS = {"fp-c": 2000.0, "fp-m": 800.0, "fp-x": 1200.0, "fp-y": 3000.0}


def _history(store, clock, solo_share=100, truth=TRUE):
    """Packs already run: each spec alone on a GPU, and pairs co-located, with samples/s
    from the TRUE interference constants."""
    from slurm_dlrm.store.records import NewPlacement

    n = 0

    def run(fps):
        nonlocal n
        ids = [int(store.add_job(user=USER, name=f"j{n}-{i}", spec=spec_dict(f"j{n}-{i}"), spec_fingerprint=fp,
                                 estimate=estimate_dict(sm=PROFILES[fp][0], bw=PROFILES[fp][1]), gpu_model="h100"))
               for i, fp in enumerate(fps)]
        pid = store.add_pack(name=f"h{n}", user=USER, policy="complementary", n_gpus=1,
                             placements=[NewPlacement(job_id=j, node_index=0, gpu_index=0, cpus=2,
                                                      mps_thread_pct=solo_share if len(ids) == 1 else 100)
                                         for j in ids])
        store.transition_pack(pid, PackState.CANCELLED, "test history")  # over: not the service's to run
        for j in ids:
            store.transition_job(j, JobState.CANCELLED, "test history")
        rel = predict_speeds_from_fractions([PROFILES[fp][0] / 100 for fp in fps],
                                            [PROFILES[fp][1] / 100 for fp in fps], truth) if len(fps) > 1 else [1.0]
        t0 = clock() + 1000 * n
        store.add_samples([{"t": t0 + k, "pack_id": pid, "job_id": j, "node": "node1", "gpu_index": 0,
                            "samples_per_s": SOLO_SPS[fp] * r} for k in range(3)
                           for j, fp, r in zip(ids, fps, rel, strict=True)])
        n += 1

    for fp in PROFILES:
        run([fp])
    for pair in [("fp-c", "fp-m"), ("fp-c", "fp-x"), ("fp-m", "fp-x"), ("fp-x", "fp-x"), ("fp-c", "fp-c"),
                 ("fp-y", "fp-m"), ("fp-y", "fp-c", "fp-x")]:
        run(list(pair))


def test_interference_model_is_refitted_from_live_samples_and_used_by_the_policy(world, monkeypatch):
    from slurm_dlrm.packing import policies

    svc, store, slurm, clock, cluster = world
    _history(store, clock)
    every = svc.site.adapt.refit_every_rounds
    for _ in range(every - 1):
        svc.run_round()
    assert not store.events(kind="adapt")  # not before N rounds
    svc.run_round()
    (ev,) = [e for e in store.events(kind="adapt") if "interference model" in e["reason"]]
    assert ev["reason"].startswith("interference model refit from 7 co-located GPU(s)")
    got = svc.recovery.interference_params
    assert got.as_tuple() == pytest.approx(TRUE.as_tuple(), abs=0.02)
    assert ev["data"]["error_after"] < 0.01 < ev["data"]["error_before"]
    assert ev["data"]["interference"]["sm_contention"] == pytest.approx(got.sm_contention)
    # The same samples again: no second refit, no second event.
    for _ in range(every):
        svc.run_round()
    assert len([e for e in store.events(kind="adapt") if "interference" in e["reason"]]) == 1
    # The policy plans with the refitted constants, and a restarted service keeps them.
    seen = []
    real_plan = policies.plan
    monkeypatch.setattr(policies, "plan", lambda req, pol="complementary", params=None:
                        seen.append(params) or real_plan(req, pol, params))
    add(store, "new", sm=30, bw=30)
    svc.run_round()
    assert seen and seen[-1] == got
    again = PackingService(store, slurm, svc.site, svc.settings, clock=clock)
    assert again.recovery.interference_params == got


def test_the_planner_takes_the_model_that_beats_the_naive_rule_on_the_sites_samples(world):
    """Issue 37: co-locations where the neighbour's SM share decides (as on the H100):
    the refit analytic constants cannot follow it, the neighbour model (held out) can;
    it plans, an event says why, and a restarted service keeps it."""
    from slurm_dlrm.packing.pairwise import NeighbourModel

    svc, store, slurm, clock, cluster = world
    _history(store, clock, truth=InterferenceParams(speed_model=NeighbourModel(0.7, 3.0)))
    svc.rounds = svc.site.adapt.refit_every_rounds - 1
    svc.run_round()
    (ev,) = [e for e in store.events(kind="adapt") if "planner_model" in (e.get("data") or {})]
    assert ev["reason"].startswith("interference: neighbour plans") and ev["data"]["how"] == "leave-one-job-out"
    assert ev["data"]["held_out_mae"]["neighbour"] <= 0.9 * ev["data"]["held_out_mae"]["naive"]
    got = svc.recovery.interference_params
    assert got.model_name == "neighbour"
    again = PackingService(store, slurm, svc.site, svc.settings, clock=clock)
    assert again.recovery.interference_params.speed_model == got.speed_model


def test_a_capped_lone_member_is_no_solo_rate(world):
    from slurm_dlrm.packing.interference import DEFAULT_PARAMS

    svc, store, slurm, clock, cluster = world
    _history(store, clock, solo_share=50)
    svc.rounds = svc.site.adapt.refit_every_rounds - 1
    svc.run_round()
    assert svc.recovery.interference_params == DEFAULT_PARAMS
    assert not store.events(kind="adapt")


def test_refit_needs_enough_co_locations(world):
    svc, store, slurm, clock, cluster = world
    from slurm_dlrm.packing.interference import DEFAULT_PARAMS

    svc.site = dataclasses.replace(svc.site, adapt=dataclasses.replace(svc.site.adapt, refit_min_samples=8))
    _history(store, clock)
    svc.rounds = svc.site.adapt.refit_every_rounds - 1
    svc.run_round()
    assert svc.recovery.interference_params == DEFAULT_PARAMS
    assert not store.events(kind="adapt")


@pytest.mark.parametrize("key, value", [("repack_threshold_pct", -1.0), ("repack_restart_cost_s", "soon"),
                                        ("refit_every_rounds", 0), ("no_such_key", 1)])
def test_adapt_site_keys_are_validated(tmp_path, key, value):
    import tomllib

    from slurm_dlrm.errors import ConfigError
    from slurm_dlrm.site import REPO_SITE_FILE, parse_site

    data = tomllib.loads(REPO_SITE_FILE.read_text())
    assert parse_site(data).adapt.repack_threshold_pct == 10.0  # the documented default
    data["adapt"][key] = value
    with pytest.raises(ConfigError, match=f"adapt.{key}"):
        parse_site(data)


# ---------------------------------------------------------------- the learned model, live

SPECS = {f"fq-{i}": (sm, bw) for i, (sm, bw) in enumerate(
    [(70, 20), (20, 70), (50, 50), (35, 10), (10, 35), (85, 30), (25, 25), (60, 60), (15, 80), (45, 15)])}


def _synthetic_history(store, clock, groups: int = 60, seed: int = 3):
    """Solo runs of every spec and `groups` random co-locations, with samples/s from the
    synthetic generator (not the analytic shape, so the learned model can win)."""
    import random

    from slurm_dlrm.store.records import NewPlacement
    from slurm_dlrm.truth import SyntheticColocation

    truth = SyntheticColocation(noise_pct=1.0)
    rng = random.Random(seed)
    n = 0

    def run(fps):
        nonlocal n
        ids = [int(store.add_job(user=USER, name=f"k{n}-{i}", spec=spec_dict(f"k{n}-{i}"), spec_fingerprint=fp,
                                 estimate=estimate_dict(sm=SPECS[fp][0], bw=SPECS[fp][1]), gpu_model="h100"))
               for i, fp in enumerate(fps)]
        pid = store.add_pack(name=f"k{n}", user=USER, policy="complementary", n_gpus=1,
                             placements=[NewPlacement(job_id=j, node_index=0, gpu_index=0, cpus=2, mps_thread_pct=100)
                                         for j in ids])
        store.transition_pack(pid, PackState.CANCELLED, "test history")
        for j in ids:
            store.transition_job(j, JobState.CANCELLED, "test history")
        rel = truth.speeds_from_fractions([SPECS[fp][0] / 100 for fp in fps], [SPECS[fp][1] / 100 for fp in fps])
        t0 = clock() + 1000 * n
        store.add_samples([{"t": t0 + k, "pack_id": pid, "job_id": j, "node": "node1", "gpu_index": 0,
                            "samples_per_s": 1000.0 * r} for k in range(3) for j, r in zip(ids, rel, strict=True)])
        n += 1

    for fp in SPECS:
        run([fp])
    for _ in range(groups):
        run(rng.sample(sorted(SPECS), rng.randint(2, 5)))


def test_the_learned_model_plans_only_when_its_cv_error_beats_the_analytic_one(tmp_path, monkeypatch):
    from slurm_dlrm.packing import policies

    svc, store, slurm, clock, cluster = _world(tmp_path, learned_min_groups=30, learned_refit_every_groups=50)
    try:
        _synthetic_history(store, clock)
        svc.rounds = svc.site.adapt.refit_every_rounds - 1
        svc.run_round()
        (ev,) = [e for e in store.events(kind="adapt") if "learned model" in e["reason"]]
        assert "the learned model plans" in ev["reason"]
        assert ev["data"]["learned_cv_mae"] < ev["data"]["analytic_mae"]
        assert f"{ev['data']['learned_cv_mae']:.3f}" in ev["reason"] and f"{ev['data']['analytic_mae']:.3f}" in ev["reason"]
        got = svc.recovery.interference_params
        assert got.model_name == "learned"
        assert svc.status()["interference_model"].startswith("learned")
        model_file = svc.recovery.learned_model_path()
        assert model_file.parent == tmp_path and (model_file.stat().st_mode & 0o777) == 0o600
        seen = []
        real_plan = policies.plan
        monkeypatch.setattr(policies, "plan", lambda req, pol="complementary", params=None:
                            seen.append(params) or real_plan(req, pol, params))
        add(store, "new", sm=30, bw=30)
        svc.run_round()
        assert seen and seen[-1].speed_model is got.speed_model
        # A restarted service plans with the model it learnt.
        again = PackingService(store, slurm, svc.site, svc.settings, clock=clock)
        assert again.recovery.interference_params.model_name == "learned"
        # A corrupt file: the restarted service plans with the analytic model and says why.
        model_file.write_text("{garbage")
        third = PackingService(store, slurm, svc.site, svc.settings, clock=clock)
        assert third.recovery.interference_params.speed_model is None
        assert any("interference model not used" in e["reason"] and "corrupt" in e["reason"]
                   for e in store.events(kind="adapt"))
    finally:
        store.close()


def test_the_learned_model_is_not_adopted_when_the_analytic_one_is_as_good(tmp_path):
    svc, store, slurm, clock, cluster = _world(tmp_path, learned_min_groups=5)
    try:
        _history(store, clock)  # 7 co-locations made by the analytic model itself
        svc.rounds = svc.site.adapt.refit_every_rounds - 1
        svc.run_round()
        (ev,) = [e for e in store.events(kind="adapt") if "learned model" in e["reason"]]
        assert "does not plan" in ev["reason"]
        assert ev["data"]["learned_cv_mae"] >= ev["data"]["analytic_mae"]
        assert svc.recovery.interference_params.speed_model is None
        assert not svc.recovery.learned_model_path().exists()
    finally:
        store.close()


def test_a_site_model_file_others_can_write_is_refused(tmp_path):
    from slurm_dlrm.interference_io import save_model
    from slurm_dlrm.packing.learned import fit_learned
    from slurm_dlrm.truth import synthetic_groups

    path = tmp_path / "site-model.json"
    save_model(fit_learned(synthetic_groups(200, seed=1)[0]), path)
    path.chmod(0o666)
    svc, store, slurm, clock, cluster = _world(tmp_path, interference_model=str(path))
    try:
        assert svc.recovery.interference_params.speed_model is None
        assert any("writable by group or others" in e["reason"] for e in store.events(kind="adapt"))
        path.chmod(0o600)
        ok = PackingService(store, slurm, svc.site, svc.settings, clock=clock)
        assert ok.recovery.interference_params.model_name == "learned"
        assert "site adapt.interference_model" in ok.status()["interference_model"]
    finally:
        store.close()
